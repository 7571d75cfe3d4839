"""OOD evaluation as a library plus a thin command line.

* :mod:`.metrics`, :mod:`.calibration`: FPR@95%TPR, AUROC, AUPR-In/Out (and the offline ``evaluate``
  module), thresholds calibrated on ID validation data.
* :mod:`.options` (flags and their validation), :mod:`.models` (model, image processor, detectors),
  :mod:`.plan` (splits, subsets, fingerprints), :mod:`.fitting`, :mod:`.loop` (the ``accelerate``
  scoring loop and score cache), :mod:`.scoring`, :mod:`.report` / :mod:`.plots`, tied together by
  :func:`run_evaluation` (:mod:`.runner`); :func:`main` (:mod:`.cli`) is the command line.

>>> from hf_gsc.evaluation import run_evaluation
>>> results = run_evaluation(["--model", "hf_gsc/reference_models/resnet", "--benchmark", "fmnist-ood",
...                           "--methods", "gsc,msp,energy", "--output-dir", "outputs/run", "--max-samples", "500"])  # doctest: +SKIP
"""

from .calibration import calibrate_threshold, calibration_record, true_positive_rate
from .cli import main
from .loop import ScoreCache, make_dataloader, score_split
from .metrics import METRIC_NAMES, fpr_at_tpr, load_ood_metric, ood_metrics, threshold_at_tpr
from .options import DEFAULT_METHODS, InputError, build_parser
from .report import markdown_table, method_results, write_report
from .runner import run_evaluation

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
    "main",
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
