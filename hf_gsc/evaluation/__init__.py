"""Evaluation utilities for OOD detection: metrics (FPR@95%TPR, AUROC, AUPR-In/Out) and the `evaluate` metric module,
threshold calibration on ID validation data, the (``accelerate``) evaluation run with its score cache, the
``results.json`` / ``results.md`` report and the plots.

>>> from hf_gsc.evaluation import run_evaluation
>>> results = run_evaluation(["--model", "hf_gsc/reference_models/resnet", "--benchmark", "fmnist-ood",
...                           "--methods", "gsc,msp,energy", "--output-dir", "outputs/run", "--max-samples", "500"])  # doctest: +SKIP
"""

from .calibration import calibrate_threshold, calibration_record, true_positive_rate
from .loop import ScoreCache, make_dataloader, score_split
from .metrics import METRIC_NAMES, fpr_at_tpr, load_ood_metric, ood_metrics, threshold_at_tpr
from .report import markdown_table, method_results, write_report
from .runner import DEFAULT_METHODS, InputError, build_parser, run_evaluation

__all__ = [
    "DEFAULT_METHODS",
    "METRIC_NAMES",
    "InputError",
    "ScoreCache",
    "build_parser",
    "calibrate_threshold",
    "calibration_record",
    "fpr_at_tpr",
    "load_ood_metric",
    "make_dataloader",
    "markdown_table",
    "method_results",
    "ood_metrics",
    "run_evaluation",
    "score_split",
    "threshold_at_tpr",
    "true_positive_rate",
    "write_report",
]
