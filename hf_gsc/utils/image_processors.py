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


def converting_to_rgb(image_processor: Any, num_channels: int | None) -> Any:
    """``image_processor`` set to convert every image to RGB (``do_convert_rgb``, compositing transparency onto white
    as :func:`hf_gsc.utils.images.load_image` does) when its model takes 3 channels, so that a grey or RGBA PIL image
    passed straight to it (``det(**det.image_processor(images=pil_images, return_tensors="pt"))``) gets the
    channels the model takes instead of failing in normalisation. Unchanged for other models, or a processor
    without that setting."""
    if num_channels == 3 and hasattr(image_processor, "do_convert_rgb") and not image_processor.do_convert_rgb:
        image_processor.do_convert_rgb = True
    return image_processor


__all__ = ["converting_to_rgb", "load_image_processor"]
