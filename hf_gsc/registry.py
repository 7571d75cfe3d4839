"""The registry of OOD detection methods: method name -> detector class (the saved format's type field decides
the class here, in one place, like PEFT's ``PEFT_TYPE_TO_TUNER_MAPPING``).

Each method's module registers its class with :func:`register_detector`; ``import hf_gsc`` imports them all.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from .detector import OODDetector

DETECTORS: dict[str, type["OODDetector"]] = {}


def register_detector(cls: type["OODDetector"]) -> type["OODDetector"]:
    """Class decorator: make ``cls`` available by ``cls.method`` (the name used by the CLI, JSON and the Hub)."""
    if cls.method in DETECTORS:
        raise ValueError(f"detector method {cls.method!r} is registered twice")
    DETECTORS[cls.method] = cls
    return cls


def detector_class(method: str) -> type["OODDetector"]:
    """The registered class of ``method``; the error lists the registered methods and the nearest one."""
    try:
        return DETECTORS[method]
    except KeyError:
        close = difflib.get_close_matches(str(method), DETECTORS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"unknown method {method!r}{hint}; registered methods: {', '.join(sorted(DETECTORS))}"
        ) from None


def get_detector(method: str, model: nn.Module, **hyperparameters: Any) -> "OODDetector":
    """A new detector of the registered ``method`` on ``model``."""
    return detector_class(method)(model, **hyperparameters)


