"""The model side of an evaluation: the classifier (or saved GSC detector), its image processor and the detectors.

Everything here runs right after the arguments are checked and before any data is read, so an unknown
split point or a model that cannot be loaded fails in seconds with a message naming the argument.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .errors import InputError



def load_model(
    model_id: str, revision: str | None = None, image_backend: str = "auto"
) -> tuple[torch.nn.Module, Any, dict[str, Any], str]:
    """Load a classifier or a saved GSC detector (local folder or Hub repo).

    ``image_backend``: ``auto`` leaves the choice to transformers (torchvision-backed when torchvision is
    installed, else PIL), or ``pil`` / ``torchvision``.

    Returns ``(base model, image processor, method -> hyperparameters of a saved detector (empty for a plain
    classifier), path the image processor came from)``.
    """
    from ..data import load_image_processor
    from ..loading import load_detector_or_classifier

    try:
        model, detector, processor_source, hub = load_detector_or_classifier(model_id, revision=revision)
        backend = None if image_backend == "auto" else image_backend  # None: transformers' own default
        processor = load_image_processor(processor_source, backend=backend, **hub)
    except (OSError, ValueError, KeyError) as error:
        raise InputError(f"--model {model_id!r}: could not load an image classifier and its image processor: {error}") from None
    saved = {} if detector is None else {detector.method: detector.config.score_hyperparameters()}
    model.eval().requires_grad_(False)
    return model, processor, saved, processor_source


def load_shipped(spec: str, revision: str | None = None, image_backend: str = "auto") -> tuple[Any, Any]:
    """``(the saved detector of --detector, its image processor)``: the detector as it was saved (method, settings,
    fitted state, threshold) on its base model. A classifier, or a detector without a threshold, is refused here."""
    from ..data import load_image_processor
    from ..loading import load_detector_or_classifier

    try:
        model, detector, processor_source, hub = load_detector_or_classifier(spec, revision=revision)
        if detector is None:
            raise InputError(f"--detector {spec!r} is an image classifier, not a saved detector; evaluate methods on "
                             "it with --model")
        backend = None if image_backend == "auto" else image_backend
        processor = detector.image_processor or load_image_processor(processor_source, backend=backend, **hub)
    except (OSError, ValueError, KeyError) as error:
        if isinstance(error, InputError):
            raise
        raise InputError(f"--detector {spec!r}: could not load the saved detector and its image processor: {error}") from None
    if detector.config.threshold is None:
        raise InputError(f"--detector {spec!r}: the saved {detector.method!r} detector has no threshold, so it makes no "
                         "decision to check; calibrate it (detector.calibrate(...)) and save it again")
    model.eval().requires_grad_(False)
    return detector, processor


def image_backend_of(processor: Any) -> str:
    """``"torchvision"`` or ``"pil"``: the backend a transformers image processor runs on (for ``results.json``)."""
    return "pil" if type(processor).__name__.endswith("Pil") else "torchvision"


def image_transform(processor: Any, model: torch.nn.Module) -> Any:
    """A list of PIL images -> ``pixel_values`` ``(B, C, H, W)`` as the model expects: an
    :class:`~hf_gsc.data.ImageTransform`, whose rescale + normalize runs on the model's device when it can."""
    from ..data import ImageTransform, num_channels

    return ImageTransform(processor, num_channels(model.config))


def build_detectors(
    model: torch.nn.Module, methods: Sequence[str], hyperparameters: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """Construct every detector right after the model is loaded (resolves split points early)."""
    from ..detectors import get_detector

    detectors = {}
    for name in methods:
        try:
            detectors[name] = get_detector(name, model, **hyperparameters.get(name, {}))
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise InputError(f"--methods {name}: cannot build this detector on this model: {error}") from None
    return detectors


def effective_hyperparameters(detector: Any) -> dict[str, Any]:
    """Every setting that changes the detector's scores, defaults filled in (what the cache is keyed on)."""
    from .report import jsonable

    return jsonable(detector.config.score_hyperparameters())


__all__ = [
    "build_detectors",
    "effective_hyperparameters",
    "image_backend_of",
    "image_transform",
    "load_model",
]
