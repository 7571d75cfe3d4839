"""Analyses of GSC (issue #7): ablation grid, approximation error, gradient concentration, iterative short-circuit.

Built on the public pieces of :mod:`hf_gsc.gsc_math.shortcircuit`, :mod:`hf_gsc.utils.scores` and
:class:`hf_gsc.classifier.split_points.SplitPoint`; data is scored through the evaluation's loop
(:func:`hf_gsc.evaluation.loop.score_split`) and reported with its helpers (:mod:`hf_gsc.evaluation.report`).
``scripts/run_ablations.py`` and ``scripts/compare_variants.py`` are the command lines.
"""

from .ablations import Variant, collect, markdown_tables, model_split_points, summarise, variant_grid
from .approximation_error import approximation_outputs, error_stats, summarise_errors
from .context import HeadContext, gsc_logits, head_context, logits_after
from .gradient_concentration import curve_summary, plot_curves, top_fraction_ratio, top_k_ratio
from .iterative import head_gradient, iterative_short_circuit, split_budget


__all__ = [
    "HeadContext",
    "Variant",
    "approximation_outputs",
    "collect",
    "curve_summary",
    "error_stats",
    "gsc_logits",
    "head_context",
    "head_gradient",
    "iterative_short_circuit",
    "logits_after",
    "markdown_tables",
    "model_split_points",
    "plot_curves",
    "split_budget",
    "summarise",
    "summarise_errors",
    "top_fraction_ratio",
    "top_k_ratio",
    "variant_grid",
]
