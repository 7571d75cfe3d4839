"""OOD detection methods behind one interface; importing this package registers all of them."""

from .base import DETECTORS, Detector, get_detector, register_detector
from . import gsc  # noqa: F401  (registers "gsc")

__all__ = ["DETECTORS", "Detector", "get_detector", "register_detector"]
