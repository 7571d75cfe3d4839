"""Gradient Short-Circuit and baseline OOD detection for Hugging Face image classifiers."""
from .utils.version import __version__

from .settings.config import DetectorConfig, GSCConfig  # noqa: E402
from .detectors.interface import OODDetector, OODDetectorOutput  # noqa: E402
from .detectors.gsc import GSCForImageClassification, GSCOutput  # noqa: E402
from .auto import AutoOODDetector  # noqa: E402
from .detectors import DETECTORS, DetectorBundle  # noqa: E402  (registers every method)
from .pipeline import OODImageClassificationPipeline  # noqa: E402  (registers "ood-image-classification")

#: The evaluation's entry points, imported on first use (PEP 562): they need the ``evaluation`` extra (datasets,
#: accelerate), which a serving install does not have.
_EVALUATION_EXPORTS = ("EvaluationArguments", "EvaluationResult", "OODEvaluator")


def __getattr__(name: str) -> object:
    if name in _EVALUATION_EXPORTS:
        from . import evaluation

        return getattr(evaluation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AutoOODDetector",
    "DETECTORS",
    "DetectorBundle",
    "DetectorConfig",
    "EvaluationArguments",
    "EvaluationResult",
    "GSCConfig",
    "GSCForImageClassification",
    "GSCOutput",
    "OODDetector",
    "OODDetectorOutput",
    "OODEvaluator",
    "OODImageClassificationPipeline",
    "__version__",
]
