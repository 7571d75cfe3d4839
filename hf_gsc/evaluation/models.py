"""The model side of an evaluation: the classifier (or saved GSC detector), its image processor and the detectors.

Everything here runs right after the arguments are checked and before any data is read, so an unknown
split point or a model that cannot be loaded fails in seconds with a message naming the argument.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .options import InputError

#: ``GSCConfig`` fields a saved detector carries that are not method hyperparameters.
_GSC_NON_HYPERPARAMETERS = ("threshold", "calibration", "hf_gsc_version", "base_model_name_or_path", "base_model_revision")


def load_model(
    model_id: str, revision: str | None = None, image_backend: str = "auto"
) -> tuple[torch.nn.Module, Any, dict[str, Any], str]:
    """Load a classifier or a saved GSC detector.

    ``image_backend``: ``auto`` leaves the choice to transformers (torchvision-backed when torchvision is
    installed, else PIL), or ``pil`` / ``torchvision``.

    Returns ``(base model, image processor, saved GSC hyperparameters (empty for a plain
    classifier), path the image processor came from)``.
    """
    from transformers import AutoModelForImageClassification

    from ..data import load_image_processor
    from ..modeling import CONFIG_NAME, GSCForImageClassification

    saved: dict[str, Any] = {}
    processor_source = model_id
    try:
        if os.path.isfile(os.path.join(model_id, CONFIG_NAME)):
            wrapper = GSCForImageClassification.from_pretrained(model_id, revision=revision)
            model = wrapper.model
            saved = {k: v for k, v in wrapper.config.to_dict().items() if k not in _GSC_NON_HYPERPARAMETERS}
            if not os.path.isfile(os.path.join(model_id, "preprocessor_config.json")):
                processor_source = wrapper.config.base_model_name_or_path or model_id
        else:
            model = AutoModelForImageClassification.from_pretrained(model_id, revision=revision)
        backend = None if image_backend == "auto" else image_backend  # None: transformers' own default
        processor = load_image_processor(processor_source, revision=revision, backend=backend)
    except (OSError, ValueError, KeyError) as error:
        raise InputError(f"--model {model_id!r}: could not load an image classifier and its image processor: {error}") from None
    model.eval().requires_grad_(False)
    return model, processor, saved, processor_source


def image_backend_of(processor: Any) -> str:
    """``"torchvision"`` or ``"pil"``: the backend a transformers image processor runs on (for ``results.json``)."""
    return "pil" if type(processor).__name__.endswith("Pil") else "torchvision"


def image_transform(processor: Any, model: torch.nn.Module, dataset_name: str) -> Callable[[list], torch.Tensor]:
    """A list of PIL images -> ``pixel_values`` ``(B, C, H, W)`` as the model expects (``hf_gsc.data.make_transform``)."""
    from ..data import make_transform, num_channels

    batch_transform = make_transform(processor, num_channels(model.config), dataset_name)

    def transform(images: list) -> torch.Tensor:
        return batch_transform({"image": images})["pixel_values"]

    return transform


def processor_image_std(processor: Any) -> list[float]:
    """The normalisation std of ``processor`` per channel (``[1.0]`` when it does not normalise).

    ODIN's ``epsilon`` is a step in [0, 1] pixel units; on normalised ``pixel_values`` it is ``epsilon / std``,
    so the evaluation passes this unless ``--hyperparameter odin.image_std=...`` is given.
    """
    std = getattr(processor, "image_std", None)
    if std is None or not getattr(processor, "do_normalize", True):
        return [1.0]
    return [float(value) for value in (std if isinstance(std, (list, tuple)) else [std])]


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
    """The detector's settings; for GSC the full ``GSCConfig`` (defaults included), not only overrides."""
    from .report import jsonable

    wrapper = getattr(detector, "detector", None)
    config = getattr(wrapper, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        return {k: v for k, v in config.to_dict().items() if k not in _GSC_NON_HYPERPARAMETERS}
    return jsonable(detector.hyperparameters)


__all__ = [
    "build_detectors",
    "effective_hyperparameters",
    "image_backend_of",
    "image_transform",
    "load_model",
    "processor_image_std",
]
