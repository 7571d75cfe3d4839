"""The registered OOD detection methods; importing this package registers all of them.

The interface and the registry are :mod:`hf_gsc.detector`; GSC itself is :class:`hf_gsc.GSCForImageClassification`
(:mod:`hf_gsc.modeling`); each baseline has its own module here.
"""

from ..detector import DETECTORS, OODDetector, OODDetectorOutput, detector_class, get_detector, register_detector
from .. import modeling  # noqa: F401  (registers "gsc")
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
from ..shared_pass import fit_together
from .bundle import BundleOutput, DetectorBundle

__all__ = [
    "DETECTORS",
    "BundleOutput",
    "DetectorBundle",
    "OODDetector",
    "OODDetectorOutput",
    "detector_class",
    "fit_together",
    "get_detector",
    "register_detector",
]
