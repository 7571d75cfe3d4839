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


__all__ = ["load_image_processor"]
