"""Gradient Short-Circuit and baseline OOD detection for Hugging Face image classifiers.

The public names are imported on first use (PEP 562), all together: ``from hf_gsc import AutoOODDetector`` (or any
other) imports every method (registering each), as an eager import would. ``import hf_gsc`` alone imports no torch,
so that ``hf-gsc --help`` and ``hf-gsc --version`` answer at once. The ``ood-image-classification`` pipeline is
registered the moment transformers' pipelines module is imported (:func:`_register_with_pipelines`), so
``transformers.pipeline("ood-image-classification", ...)`` finds it after any import of hf_gsc, and a process that
builds no pipeline never imports ``transformers.pipelines`` (with its tokenizers and processors: a third of what
hf_gsc itself adds to the import of transformers' models).
"""
from __future__ import annotations

import importlib
import importlib.abc
import sys
import types
from typing import TYPE_CHECKING, Any

from .settings.registry import set_method_loader
from .utils.version import __version__


if TYPE_CHECKING:  # the same names for type checkers and the API reference, which read the source, not imports
    from .auto import AutoOODDetector
    from .detectors import DETECTORS, DetectorBundle
    from .detectors.gsc import GSCDetector, GSCForImageClassification, GSCOutput
    from .detectors.interface import OODDetector, OODDetectorOutput
    from .evaluation import EvaluationArguments, EvaluationResult, OODEvaluator
    from .gsc_math.explanation import GSCExplanation
    from .pipeline import OODImageClassificationPipeline
    from .settings.config import DetectorConfig
    from .settings.gsc import GSCConfig
    from .utils.calibration import Calibration

#: Public name -> the module that defines it.
_EXPORTS = {
    "DetectorConfig": "settings.config",
    "Calibration": "utils.calibration",
    "OODDetector": "detectors.interface", "OODDetectorOutput": "detectors.interface",
    "GSCDetector": "detectors.gsc", "GSCForImageClassification": "detectors.gsc", "GSCOutput": "detectors.gsc",
    "GSCExplanation": "gsc_math.explanation",
    "AutoOODDetector": "auto",
    "DETECTORS": "detectors", "DetectorBundle": "detectors",  # importing detectors registers every method
    "OODImageClassificationPipeline": "pipeline",  # registers "ood-image-classification"
}
#: The evaluation's entry points: they need the ``evaluation`` extra (datasets, accelerate), which a serving install
#: does not have, so they are imported only when asked for, not with the other names.
_EVALUATION_EXPORTS = ("EvaluationArguments", "EvaluationResult", "OODEvaluator")
#: The modules every public name brings with it (the registry full). Not the pipeline: it is registered when
#: transformers' pipelines are imported, by whoever imports them.
_EAGER = ("detectors", "auto")


def _import_all() -> None:
    for module in _EAGER:
        importlib.import_module(f".{module}", __name__)


def _config_classes() -> dict[str, type]:
    """Every registered method's config class by its name (``KNNConfig``, ``GSCConfig``, ...), read from the registry
    so that a new method's file needs no line here."""
    _import_all()
    from .settings.registry import DETECTORS

    return {cls.config_class.__name__: cls.config_class for cls in DETECTORS.values()}


def __getattr__(name: str) -> Any:
    if name.endswith("Config") and name not in _EXPORTS:
        configs = _config_classes()
        if name in configs:
            globals()[name] = configs[name]
            return configs[name]
    if name in _EVALUATION_EXPORTS:
        from . import evaluation

        return getattr(evaluation, name)
    if name in _EXPORTS:
        _import_all()
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value  # once imported, a plain attribute
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _RegisterWithPipelines(importlib.abc.MetaPathFinder):
    """Imports :mod:`hf_gsc.pipeline` (which registers the task) right after ``transformers.pipelines`` is imported:
    ``transformers.pipeline("ood-image-classification")`` after a bare ``import hf_gsc`` finds the task, and a
    process that never builds a pipeline never imports torch for it."""

    TARGET = "transformers.pipelines"

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.TARGET:
            return None
        for finder in sys.meta_path:  # the spec the other finders give; this finder only wraps its loader
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                exec_module = spec.loader.exec_module

                def exec_then_register(module: Any, exec_module: Any = exec_module) -> None:
                    exec_module(module)
                    _remove_finder()
                    importlib.import_module(".pipeline", __name__)

                # the ignore: replacing this loader's method is the point (the import then registers the task)
                spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
                return spec
        return None


def _remove_finder() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _RegisterWithPipelines)]


def _register_with_pipelines() -> None:
    if _RegisterWithPipelines.TARGET in sys.modules:  # already imported (torch with it): register now
        importlib.import_module(".pipeline", __name__)
    elif not any(isinstance(finder, _RegisterWithPipelines) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterWithPipelines())


_register_with_pipelines()
# A registry lookup from any floor (a saved config read by hf_gsc.storage alone) finds every method.
set_method_loader(lambda: importlib.import_module(".detectors", __name__))

#: The names every install has; ``hf_gsc.__all__`` adds every method's config class (:class:`_PublicNames`).
__all__ = [
    "DETECTORS",
    "AutoOODDetector",
    "Calibration",
    "DetectorBundle",
    "DetectorConfig",
    "EvaluationArguments",
    "EvaluationResult",
    "GSCConfig",
    "GSCDetector",
    "GSCExplanation",
    "GSCForImageClassification",
    "GSCOutput",
    "OODDetector",
    "OODDetectorOutput",
    "OODEvaluator",
    "OODImageClassificationPipeline",
    "__version__",
]


class _PublicNames(types.ModuleType):
    """``hf_gsc.__all__`` (and ``from hf_gsc import *``) lists every registered method's config class too; they are
    known once every method is imported, which ``import hf_gsc`` alone does not do (no torch for ``hf-gsc --help``)."""

    # the ignore: a property where ModuleType has a plain attribute, so that the list is made when it is read
    @property
    def __all__(self) -> list[str]:  # type: ignore[override]
        return sorted({*_CORE_NAMES, *_config_classes()})


_CORE_NAMES = tuple(__all__)
sys.modules[__name__].__class__ = _PublicNames
