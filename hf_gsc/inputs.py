"""Checking and normalising what users pass to a detector: ``pixel_values`` and iterables of batches."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch


def check_pixel_values(
    pixel_values: Any, channels: int | None, expected: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """``pixel_values`` ``(B, C, H, W)`` cast to ``dtype``, or a ``TypeError``/``ValueError`` saying what is wrong
    (not a tensor, wrong rank, empty, integer, ``channels`` or spatial size ``expected`` not matched, NaN/inf)."""
    if not isinstance(pixel_values, torch.Tensor):
        raise TypeError(f"pixel_values must be a torch.Tensor of shape (B, C, H, W), got {type(pixel_values).__name__}")
    if pixel_values.ndim != 4:
        raise ValueError(f"pixel_values must have shape (B, C, H, W), got shape {tuple(pixel_values.shape)}")
    if pixel_values.shape[0] == 0:
        raise ValueError("pixel_values is an empty batch (B=0); pass at least one image")
    if not pixel_values.is_floating_point():
        raise ValueError(f"pixel_values must be floating point (the image processor's output), got {pixel_values.dtype}")
    if channels is not None and pixel_values.shape[1] != channels:
        raise ValueError(
            f"pixel_values has {pixel_values.shape[1]} channels but the base model expects {channels}; "
            "convert the images (e.g. grayscale to RGB) with the model's image processor"
        )
    if expected is not None and tuple(pixel_values.shape[2:]) != expected:
        raise ValueError(
            f"pixel_values has spatial size {tuple(pixel_values.shape[2:])} but the base model expects "
            f"{expected}; resize with the model's image processor"
        )
    # The sum of finite values is finite unless it overflows, so one reduction clears the common case.
    if not math.isfinite(pixel_values.sum().item()) and not torch.isfinite(pixel_values).all():
        bad = (~torch.isfinite(pixel_values)).flatten(1).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"pixel_values contains NaN or infinite values in batch rows {bad}")
    return pixel_values.to(dtype)


def batches(data: torch.Tensor | Iterable[Any], name: str) -> Iterable[tuple[torch.Tensor, torch.Tensor | None]]:
    """Normalise tensors, ``(pixel_values, labels)`` tuples and mappings into ``(pixel_values, labels)`` batches."""
    if data is None:
        raise TypeError(
            f"{name} is None; pass a (N, C, H, W) tensor of pixel_values or an iterable of batches "
            "(tensors, (pixel_values, labels) tuples or mappings with 'pixel_values')"
        )
    items = [data] if isinstance(data, torch.Tensor) else data
    seen = False
    for index, batch in enumerate(items):
        labels = None
        if isinstance(batch, Mapping):
            labels = batch.get("labels", batch.get("label"))
            batch = batch.get("pixel_values")
        elif isinstance(batch, (tuple, list)) and batch:
            batch, labels = batch[0], (batch[1] if len(batch) > 1 else None)
        if not isinstance(batch, torch.Tensor):
            raise TypeError(
                f"{name} batch {index} must be a tensor, a (pixel_values, labels) tuple or a "
                f"mapping with 'pixel_values'; got {type(batch).__name__}"
            )
        seen = True
        yield batch, labels
    if not seen:
        raise ValueError(f"{name} is empty; it must hold at least one batch of images")
