"""OOD detection methods behind one interface; importing this package registers all of them."""

from .base import DETECTORS, Detector, get_detector, register_detector
from . import gsc  # noqa: F401  (registers "gsc")
from . import (  # noqa: F401  (each module registers its method(s))
    ash,
    conjnorm,
    dice,
    energy,
    gem,
    gradnorm,
    gsc_ash,
    knn,
    mahalanobis,
    max_logit,
    msp,
    odin,
    react,
    she,
    vim,
)

__all__ = ["DETECTORS", "Detector", "get_detector", "register_detector"]
