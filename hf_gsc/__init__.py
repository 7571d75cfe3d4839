"""Gradient Short-Circuit OOD detection for Hugging Face image classifiers."""
__version__ = "0.1.0"

from .config import GSCConfig  # noqa: E402
from .modeling import GSCForImageClassification, GSCOutput  # noqa: E402

__all__ = ["GSCConfig", "GSCForImageClassification", "GSCOutput", "__version__"]
