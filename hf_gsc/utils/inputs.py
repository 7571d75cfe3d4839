"""Checking and normalising what users pass to a detector: ``pixel_values``, iterables of batches, and images
(which images a user's data holds is :mod:`hf_gsc.utils.image_data`'s job, how each is decoded :mod:`hf_gsc.utils.images`')."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .image_data import image_rows
from .image_processors import input_channels
from .images import array_to_image, load_image, model_mode


def check_pixel_values(
    pixel_values: Any, channels: int | None, expected: tuple[int, int] | None, dtype: torch.dtype,
    finite: bool = True,
) -> torch.Tensor:
    """``pixel_values`` ``(B, C, H, W)`` cast to ``dtype``, or a ``TypeError``/``ValueError`` saying what is wrong
    (not a tensor, wrong rank, empty, integer, ``channels`` or spatial size ``expected`` not matched, and with
    ``finite`` NaN/inf).

    Everything but ``finite`` reads shapes and dtypes only. ``finite`` reads the values, which makes the host wait for
    the device when they are on one: fitting and calibrating ask for it (a NaN there would spoil the fitted state or
    the threshold); a detector's forward does not, and fails closed instead (:func:`fail_closed`)."""
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
    if finite and not math.isfinite(pixel_values.sum().item()) and not torch.isfinite(pixel_values).all():
        bad = (~torch.isfinite(pixel_values)).flatten(1).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"pixel_values contains NaN or infinite values in batch rows {bad}")
    return pixel_values.to(dtype)


def nonfinite_marks(pixel_values: torch.Tensor) -> torch.Tensor:
    """``(B,)``: 0 for each row of ``pixel_values`` ``(B, ...)`` that is all finite, NaN for a row holding a NaN or an
    infinity (``x * 0`` is NaN exactly for those, and a sum of zeros cannot overflow). A device tensor, no host
    read, three ops."""
    return pixel_values.flatten(1).mul(0).sum(dim=1)


def fail_closed(ood_score: torch.Tensor, marks: torch.Tensor) -> torch.Tensor:
    """``ood_score`` ``(B,)`` with NaN in the rows whose input was not finite (``marks``, from
    :func:`nonfinite_marks`), so that such an input is decided OOD whatever the model made of it: the forward's check
    of the values, kept on the device (no host round trip, nothing for a compiler to break its graph on)."""
    return ood_score + marks.to(ood_score)


def batches(
    data: torch.Tensor | Iterable[Any], name: str, allow_empty: bool = False
) -> Iterable[tuple[torch.Tensor, torch.Tensor | None]]:
    """Normalise tensors, ``(pixel_values, labels)`` tuples and mappings into ``(pixel_values, labels)`` batches.
    No batch at all is an error unless ``allow_empty`` (a fit then says how many samples it needs)."""
    if data is None or not (isinstance(data, torch.Tensor) or hasattr(data, "__iter__")):
        # The one message for every entry that reads data (fit, calibrate): names the argument and what it takes.
        got = "is None" if data is None else f"must be data, got {type(data).__name__} {data!r:.60}"
        raise TypeError(
            f"{name} {got}; pass a (N, C, H, W) tensor of pixel_values, an iterable of batches (tensors, "
            "(pixel_values, labels) tuples or mappings with 'pixel_values'), or images (a folder, a file, a URL, a PIL "
            "or NumPy image or a list of them, a datasets.Dataset, a dataset root)"
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
            # A stacked (N, H, W, C) NumPy array is a batch of images, not of pixel_values: say how to pass it.
            images = (" (NumPy images: pass a list of H x W, H x W x 3 or H x W x 4 arrays)"
                      if type(batch).__name__ == "ndarray" else "")
            raise TypeError(
                f"{name} batch {index} must be a tensor, a (pixel_values, labels) tuple or a "
                f"mapping with 'pixel_values'; got {type(batch).__name__}{images}"
            )
        seen = True
        yield batch, labels
    if not seen and not allow_empty:
        raise ValueError(f"{name} is empty; it must hold at least one batch of images")


def labelled_batches(
    data: Any, name: str, image_processor: Any = None, batch_size: int = 32, allow_empty: bool = False,
    label2id: Mapping[str, int] | Sequence[str] | None = None, channels: int | None = None, need_labels: bool = False,
    split: str | None = None, image_column: str | None = None, label_column: str | None = None,
) -> Iterable[tuple[torch.Tensor, torch.Tensor | None]]:
    """:func:`batches`, and also images (:func:`hf_gsc.utils.image_data.image_rows`): a PIL or NumPy image, a file, URL or
    folder (a class-folder tree gives labels by folder name through ``label2id``), a list of those, a
    ``datasets.Dataset`` (``image_column``, and ``label_column`` mapped by name through ``label2id``), or a dataset
    root read at ``split``; each image decoded by :func:`hf_gsc.utils.images.load_image` (the rule of every entry point)
    in the mode a model of ``channels`` input channels takes (``None``: those ``image_processor`` normalises,
    :func:`hf_gsc.utils.image_processors.input_channels`), and prepared ``batch_size`` at a time by
    ``image_processor``."""
    rows = None if data is None else image_rows(data, name, label2id, need_labels, split, image_column, label_column)
    if rows is None:
        yield from batches(data, name, allow_empty)
        return
    if image_processor is None:
        raise ValueError(
            f"{name} holds images, but the detector has no image_processor to turn them into pixel_values; load it "
            "with from_pretrained (which loads the base model's processor), set detector.image_processor = "
            "AutoImageProcessor.from_pretrained(...), or pass pixel_values"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    mode = model_mode(input_channels(channels, image_processor))
    for start in range(0, len(rows), batch_size):
        chunk = [load_image(source, mode, name=source_name)
                 for source, source_name in rows.chunk(start, start + batch_size)]
        pixel_values = image_processor(images=chunk, return_tensors="pt")["pixel_values"]
        chunk_labels = None if rows.labels is None else torch.as_tensor(rows.labels[start : start + batch_size])
        yield pixel_values, chunk_labels


__all__ = ["array_to_image", "batches", "check_pixel_values", "fail_closed", "labelled_batches", "nonfinite_marks"]
