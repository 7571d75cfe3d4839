"""Gradient Short-Circuit OOD detection for Hugging Face image classifiers."""
__version__ = "0.1.0"

from .config import GSCConfig  # noqa: E402
from .modeling import GSCForImageClassification, GSCOutput  # noqa: E402
from .pipeline import OODImageClassificationPipeline  # noqa: E402  (registers "ood-image-classification")

__all__ = ["GSCConfig", "GSCForImageClassification", "GSCOutput", "OODImageClassificationPipeline", "__version__"]
