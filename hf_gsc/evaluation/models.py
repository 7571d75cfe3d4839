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
    from ..storage.loading import load_detector_or_classifier

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
    from ..storage.loading import load_detector_or_classifier

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
) -> tuple[dict[str, Any], dict[str, str]]:
    """Construct every detector right after the model is loaded (resolves split points early).

    Returns ``(detectors, method -> why it cannot be built on this model)``; the reason names the flag that fixes it
    where one does (:func:`fixing_flag`).
    """
    from ..detectors import get_detector

    detectors, problems = {}, {}
    for name in methods:
        try:
            detectors[name] = get_detector(name, model, **hyperparameters.get(name, {}))
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            flag = fixing_flag(model, name, hyperparameters.get(name, {}))
            problems[name] = f"cannot build this detector on this model: {error}" + (
                f" (it can be built with {flag})" if flag else "")
    return detectors, problems


#: The split point every architecture has (the input of the classifier's last ``nn.Linear``).
FALLBACK_SPLIT_POINT = "penultimate"


def fixing_flag(model: torch.nn.Module, method: str, hyperparameters: Mapping[str, Any]) -> str | None:
    """The flag that lets ``method`` be built on ``model`` when its split point does not apply there: its own flag
    (GSC's ``--split-point penultimate``) or ``--hyperparameter METHOD.split_point=penultimate``; ``None`` when the
    split point is not what fails (or is set by hand)."""
    from ..detectors import get_detector
    from .arguments import METHOD_FLAGS
    from .options import registered_methods

    config_class = registered_methods()[method].config_class
    if "split_point" not in config_class.field_names() or "split_point" in hyperparameters:
        return None
    if getattr(config_class(), "split_point", None) == FALLBACK_SPLIT_POINT:
        return None
    try:
        get_detector(method, model, **{**hyperparameters, "split_point": FALLBACK_SPLIT_POINT})
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    own = {name: dest for dest, name in METHOD_FLAGS.get(method, {}).items()}
    if "split_point" in own:
        return f"--{own['split_point'].replace('_', '-')} {FALLBACK_SPLIT_POINT}"
    return f"--hyperparameter {method}.split_point={FALLBACK_SPLIT_POINT}"


def effective_hyperparameters(detector: Any) -> dict[str, Any]:
    """Every setting that changes the detector's scores, defaults filled in (what the cache is keyed on)."""
    from .json_files import jsonable

    return jsonable(detector.config.score_hyperparameters())


def processor_of(model: torch.nn.Module, args: Any) -> Any:
    """The image processor saved with a loaded model (from its ``name_or_path``)."""
    from ..data import load_image_processor

    source = getattr(model, "name_or_path", None)
    if not source:
        raise InputError("the model object has no name_or_path to load its image processor from: pass "
                         "image_processor= to OODEvaluator")
    try:
        return load_image_processor(source, backend=None if args.image_backend == "auto" else args.image_backend)
    except (OSError, ValueError) as error:
        raise InputError(f"no image processor for the model from {source!r}: {error}; pass image_processor= to "
                         "OODEvaluator") from None


def check_shipped(detector: Any, processor: Any) -> tuple[Any, Any]:
    """A saved detector object given to :class:`OODEvaluator`: it needs a threshold and an image processor."""
    if detector.config.threshold is None:
        raise InputError(f"the {detector.method!r} detector has no threshold, so it makes no decision to check; "
                         "calibrate it (detector.calibrate(...)) first")
    processor = processor or detector.image_processor
    if processor is None:
        raise InputError("the detector has no image processor: pass image_processor= to OODEvaluator")
    detector.model.eval().requires_grad_(False)
    return detector, processor


__all__ = [
    "FALLBACK_SPLIT_POINT",
    "build_detectors",
    "check_shipped",
    "effective_hyperparameters",
    "fixing_flag",
    "image_backend_of",
    "image_transform",
    "load_model",
    "processor_of",
]
