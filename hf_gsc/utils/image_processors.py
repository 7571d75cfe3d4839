"""The one image-processor loader: what the evaluation, the detectors' ``from_pretrained`` and the pipeline use."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def load_image_processor(name_or_path: str | Path, missing_ok: bool = False, **kwargs: Any) -> Any:
    """``AutoImageProcessor.from_pretrained`` with the PIL backend unless ``backend=`` says otherwise (torchvision is
    not a dependency; ``backend=None`` leaves the choice to transformers); works for Hub ids and folders.

    ``missing_ok``: ``None`` instead of an error where the model ships no image processor (a detector can still
    score ``pixel_values``)."""
    from transformers import AutoImageProcessor

    kwargs.setdefault("backend", "pil")
    if kwargs["backend"] is None:
        del kwargs["backend"]
    try:
        return AutoImageProcessor.from_pretrained(str(name_or_path), **kwargs)
    except (OSError, ValueError):
        if missing_ok:
            return None
        raise


class ToModelImage:
    """A step of timm's transforms: a PIL image as :func:`hf_gsc.utils.images.to_model_image` turns it into ``mode``
    (grey or RGBA to RGB, transparency composited); anything else (a tensor) unchanged."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __call__(self, image: Any) -> Any:
        from PIL import Image

        from .images import to_model_image

        return to_model_image(image, self.mode) if isinstance(image, Image.Image) else image

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self.mode!r})"


def converting_to_rgb(image_processor: Any, num_channels: int | None) -> Any:
    """``image_processor`` set to convert every image to RGB when its model takes 3 channels (its config's
    ``num_channels``, or, where the config does not say, the channels the processor normalises:
    :func:`input_channels`), so that a grey or RGBA PIL image passed straight to it
    (``det(**det.image_processor(images=pil_images, return_tensors="pt"))``) gets the channels the model takes
    instead of failing in normalisation: ``do_convert_rgb`` for transformers' processors (compositing transparency
    onto white as :func:`hf_gsc.utils.images.load_image` does), a first step of the evaluation transforms for
    ``TimmWrapperImageProcessor`` (which has no such setting: :class:`ToModelImage`). Unchanged for other models, or
    a processor without either."""
    if input_channels(num_channels, image_processor) != 3:
        return image_processor
    if hasattr(image_processor, "do_convert_rgb"):
        if not image_processor.do_convert_rgb:
            image_processor.do_convert_rgb = True
        return image_processor
    steps = getattr(getattr(image_processor, "val_transforms", None), "transforms", None)
    if isinstance(steps, list) and not any(isinstance(step, ToModelImage) for step in steps):
        steps.insert(0, ToModelImage("RGB"))
    return image_processor


def normalization_std(image_processor: Any) -> list[float] | None:
    """The per-channel std ``image_processor`` divides pixels by (its ``image_std``, or timm's ``data_config["std"]``
    for transformers' ``TimmWrapperImageProcessor``); ``None`` when it does not normalise."""
    if not getattr(image_processor, "do_normalize", True):
        return None
    std = getattr(image_processor, "image_std", None)
    if std is None:
        std = (getattr(image_processor, "data_config", None) or {}).get("std")
    if std is None:
        return None
    return [float(value) for value in (std if isinstance(std, (list, tuple)) else [std])]


def processor_channels(image_processor: Any) -> int | None:
    """The channels ``image_processor`` normalises (its ``image_mean``, or timm's ``data_config["mean"]`` for
    transformers' ``TimmWrapperImageProcessor``): 1 or 3, else ``None``.

    Where a model's config does not say how many channels it takes (``TimmWrapperConfig`` has no ``num_channels``),
    this is what images are converted to before the processor (a grey image given to a 3-channel processor fails in
    its normalisation)."""
    mean = getattr(image_processor, "image_mean", None)
    if mean is None:
        mean = (getattr(image_processor, "data_config", None) or {}).get("mean")
    count = len(mean) if isinstance(mean, (list, tuple)) else None
    return count if count in (1, 3) else None


def input_channels(num_channels: int | None, image_processor: Any) -> int | None:
    """The channels images are converted to for a model: its config's ``num_channels``, else what its
    ``image_processor`` normalises (:func:`processor_channels`), else ``None`` (the image's own mode)."""
    return num_channels if num_channels is not None else processor_channels(image_processor)


__all__ = ["converting_to_rgb", "input_channels", "load_image_processor", "normalization_std", "processor_channels"]
