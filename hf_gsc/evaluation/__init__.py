"""OOD evaluation as a library plus a thin command line.

* :mod:`.metrics`, :mod:`.calibration`: FPR@95%TPR, AUROC, AUPR-In/Out (and the offline ``evaluate``
  module), thresholds calibrated on ID validation data.
* :mod:`.arguments` (:class:`EvaluationArguments`, one field per flag, checked by :mod:`.validation`),
  :mod:`.models` (model, image processor, detectors), :mod:`.plan` (splits, subsets, fingerprints),
  :mod:`.fitting`, :mod:`.tuning`, :mod:`.loop` (the ``accelerate`` scoring loop and score cache), :mod:`.scoring`,
  :mod:`.selection`, :mod:`.report` / :mod:`.plots`, tied together by :class:`OODEvaluator` (:mod:`.evaluator`,
  sharing a :class:`~.context.RunContext`); :func:`main` (:mod:`.cli`) is the command line.

>>> from hf_gsc import EvaluationArguments, OODEvaluator
>>> args = EvaluationArguments(benchmark="fmnist-ood", methods="gsc,msp,energy", output_dir="outputs/run",
...                            max_samples=500)  # doctest: +SKIP
>>> result = OODEvaluator("hf_gsc/reference_models/resnet", args).evaluate()  # doctest: +SKIP
>>> result.selected_method  # doctest: +SKIP
"""

import importlib
from typing import TYPE_CHECKING, Any


# Imported on first use (PEP 562): a serving install has none of the evaluation extras (datasets, accelerate,
# scikit-learn) that most of these modules import.
_EXPORTS = {
    "calibration_record": "calibration", "true_positive_rate": "calibration",
    "conformal_threshold": "calibration", "fpr_at_tpr_ood_positive": "metrics", "aurc": "selective",
    "risk_coverage_curve": "selective", "selective_accuracy": "selective",
    "main": "cli",
    "ScoreCache": "score_cache", "make_dataloader": "loaders", "score_split": "loop",
    "METRIC_NAMES": "metrics", "fpr_at_tpr": "metrics", "load_ood_metric": "metrics", "ood_metrics": "metrics",
    "threshold_at_tpr": "metrics",
    "InputError": "errors", "default_methods": "options",
    "EvaluationArguments": "arguments", "EvaluationArgumentParser": "arguments",
    "OODEvaluator": "evaluator", "EvaluationResult": "result",
    "markdown_table": "report", "method_results": "report", "write_report": "report",
}


if TYPE_CHECKING:  # the names for type checkers and linters, as transformers' lazy modules declare them
    from .arguments import EvaluationArgumentParser, EvaluationArguments
    from .calibration import calibration_record, conformal_threshold, true_positive_rate
    from .cli import main
    from .errors import InputError
    from .evaluator import OODEvaluator
    from .loaders import make_dataloader
    from .loop import score_split
    from .metrics import (
        METRIC_NAMES,
        fpr_at_tpr,
        fpr_at_tpr_ood_positive,
        load_ood_metric,
        ood_metrics,
        threshold_at_tpr,
    )
    from .options import default_methods
    from .report import markdown_table, method_results, write_report
    from .result import EvaluationResult
    from .score_cache import ScoreCache
    from .selective import aurc, risk_coverage_curve, selective_accuracy


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


__all__ = [
    "METRIC_NAMES",
    "EvaluationArgumentParser",
    "EvaluationArguments",
    "EvaluationResult",
    "InputError",
    "OODEvaluator",
    "ScoreCache",
    "aurc",
    "calibration_record",
    "conformal_threshold",
    "default_methods",
    "fpr_at_tpr",
    "fpr_at_tpr_ood_positive",
    "load_ood_metric",
    "main",
    "make_dataloader",
    "markdown_table",
    "method_results",
    "ood_metrics",
    "risk_coverage_curve",
    "score_split",
    "selective_accuracy",
    "threshold_at_tpr",
    "true_positive_rate",
    "write_report",
]
