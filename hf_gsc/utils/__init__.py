"""Ground floor: helpers that know no detector. Files read and written without leaving their folder, the
version, class names compared and mapped, image size limits, the image-processor loader, float32 where
the backbone's precision must not be followed, forward hooks, OOD scores from logits, thresholds, and the
checks of what users pass (``pixel_values``, batches). Imports nothing else of hf_gsc.
"""
