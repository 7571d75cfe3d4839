"""The registry of OOD detection methods: method name -> detector class (the saved format's type field decides
the class here, in one place, like PEFT's ``PEFT_TYPE_TO_TUNER_MAPPING``).

Each method's module registers its class with :func:`register_detector`; the first lookup imports them all (through
the loader ``hf_gsc/__init__.py`` sets, :func:`set_method_loader`).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from torch import nn

    from ..detectors.interface import OODDetector

DETECTORS: dict[str, type[OODDetector]] = {}
#: What imports every method's module, set by the package's front door (``hf_gsc/__init__.py``, which imports
#: nothing heavy itself): run once before the first lookup, so that a registry reached through a lower floor alone
#: (``hf_gsc.storage``) is complete, while this floor never imports the detectors' floor.
_method_loader: Callable[[], Any] | None = None


def set_method_loader(loader: Callable[[], Any] | None) -> None:
    """Set what :func:`load_methods` runs (the package's ``__init__`` sets the import of ``hf_gsc.detectors``)."""
    global _method_loader
    _method_loader = loader


def load_methods() -> None:
    """Every method registered: runs the loader set by :func:`set_method_loader` once (cleared first, so that a
    lookup while the methods' modules are imported does not start it again)."""
    global _method_loader
    loader, _method_loader = _method_loader, None
    if loader is not None:
        loader()


def register_detector(cls: type[OODDetector]) -> type[OODDetector]:
    """Class decorator: make ``cls`` available by ``cls.method`` (the name used by the CLI, JSON and the Hub).

    ``cls.config_class`` must be the method's own config class (a ``DetectorConfig`` subclass whose ``method`` is
    ``cls.method``), written in the method's file: the saved format's type field maps to the class through it."""
    config_class = vars(cls).get("config_class")
    if config_class is None or getattr(config_class, "method", None) != getattr(cls, "method", None):
        raise TypeError(f"{cls.__name__} must set config_class to its method's own DetectorConfig subclass (a "
                        "dataclass in the method's file whose class attribute `method` names the method), got "
                        f"{config_class!r}")
    if cls.method in DETECTORS:
        raise ValueError(f"detector method {cls.method!r} is registered twice")
    DETECTORS[cls.method] = cls
    return cls


def suggest_names(unknown: Iterable[str], known: Collection[str]) -> str:
    """``" (did you mean 'x' instead of 'y'?)"`` for the first unknown name with a close known one (the same name in
    another case first: ``kNN`` -> ``knn``), else ``""``. The one did-you-mean of methods and hyperparameters."""
    for name in unknown:
        close = closest_name(name, known)
        if close is not None:
            return f" (did you mean {close!r} instead of {name!r}?)"
    return ""


def closest_name(name: str, known: Collection[str]) -> str | None:
    """The known name closest to ``name``: the same name in another case, else ``difflib``'s nearest (or ``None``)."""
    lowered = {candidate.lower(): candidate for candidate in known}
    if name.lower() in lowered:
        return lowered[name.lower()]
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return close[0] if close else None


def default_methods() -> list[str]:
    """The methods ``hf-gsc evaluate`` runs without ``--methods``: those whose class sets ``in_default_table``
    itself (a subclass such as ``gsc_ash`` does not inherit it), GSC first, then by name (one order whatever order
    their modules register in: a module that subclasses another method's class, as ``iodin`` ODIN's, registers it
    early)."""
    load_methods()
    names = [name for name, cls in DETECTORS.items() if vars(cls).get("in_default_table", False)]
    return sorted(names, key=lambda name: (name != "gsc", name))


def detector_class(method: str) -> type[OODDetector]:
    """The registered class of ``method``; the error lists the registered methods and the nearest one."""
    load_methods()
    try:
        return DETECTORS[method]
    except KeyError:
        raise ValueError(
            f"unknown method {method!r}{suggest_names([str(method)], DETECTORS)}; registered methods: "
            f"{', '.join(sorted(DETECTORS))}"
        ) from None


def get_detector(method: str, model: nn.Module, **hyperparameters: Any) -> OODDetector:
    """A new detector of the registered ``method`` on ``model``."""
    return detector_class(method)(model, **hyperparameters)


