"""The base classifier as hf_gsc sees it: the per-architecture table, the head after a split point (as a
declared pool / norm / linear form or the model's own modules), that head's closed-form logits and
Jacobian products, and the split points where ``F`` is taken. Knows no detector; builds on
:mod:`hf_gsc.utils`.
"""
