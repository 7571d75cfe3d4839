"""Gradient Short-Circuit and baseline OOD detection for Hugging Face image classifiers."""
from .utils.version import __version__

from .settings.config import DetectorConfig  # noqa: E402
from .detectors.interface import OODDetector, OODDetectorOutput  # noqa: E402
from .detectors.gsc import GSCConfig, GSCDetector, GSCForImageClassification, GSCOutput  # noqa: E402
from .auto import AutoOODDetector  # noqa: E402
from .detectors import DETECTORS, DetectorBundle  # noqa: E402  (registers every method)

#: Every registered method's config class by its name (``hf_gsc.KNNConfig``, ``hf_gsc.GSCConfig``, ...), taken from
#: the registry so that a new method file needs no line here.
_CONFIG_EXPORTS = sorted({cls.config_class.__name__: cls.config_class for cls in DETECTORS.values()}.items())
globals().update(_CONFIG_EXPORTS)
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
    *(name for name, _ in _CONFIG_EXPORTS if name != "GSCConfig"),
    "AutoOODDetector",
    "DETECTORS",
    "DetectorBundle",
    "DetectorConfig",
    "EvaluationArguments",
    "EvaluationResult",
    "GSCConfig",
    "GSCDetector",
    "GSCForImageClassification",
    "GSCOutput",
    "OODDetector",
    "OODDetectorOutput",
    "OODEvaluator",
    "OODImageClassificationPipeline",
    "__version__",
]
