"""Gradient Short-Circuit and baseline OOD detection for Hugging Face image classifiers."""
from .version import __version__

from .config import DetectorConfig, GSCConfig  # noqa: E402
from .detector import OODDetector, OODDetectorOutput  # noqa: E402
from .modeling import GSCForImageClassification, GSCOutput  # noqa: E402
from .auto import AutoOODDetector  # noqa: E402
from .detectors import DETECTORS, DetectorBundle  # noqa: E402  (registers every method)
from .pipeline import OODImageClassificationPipeline  # noqa: E402  (registers "ood-image-classification")

__all__ = [
    "AutoOODDetector",
    "DETECTORS",
    "DetectorBundle",
    "DetectorConfig",
    "GSCConfig",
    "GSCForImageClassification",
    "GSCOutput",
    "OODDetector",
    "OODDetectorOutput",
    "OODImageClassificationPipeline",
    "__version__",
]
