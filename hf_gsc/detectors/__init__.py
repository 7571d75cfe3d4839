"""The registered OOD detection methods; importing this package registers all of them.

The interface is :mod:`hf_gsc.detectors.interface`, the registry :mod:`hf_gsc.settings.registry`; GSC itself is :class:`hf_gsc.GSCDetector`
(:mod:`hf_gsc.detectors.gsc`); each other method has its own module here, found and imported
without a list (a method is one file).
"""

import importlib
import pkgutil

from . import gsc  # noqa: F401  (registers "gsc")
from .interface import DETECTORS, OODDetector, OODDetectorOutput, detector_class, get_detector, register_detector


# Every module of this package registers its method(s) on import: a new method is a new file, nothing else.
for _module in sorted(_info.name for _info in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
# After the registration loop, which imports these modules among the others.
from .backbone_pass import fit_together  # noqa: E402
from .bundle import BundleOutput, DetectorBundle  # noqa: E402


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
