"""The image processor's last step, rescale and normalize, run where the model runs.

A transformers image processor ends with ``pixels * rescale_factor`` and ``(pixels - mean) / std``. Up to that
step its output is still uint8-valued (decoded, converted, resized, cropped), so the DataLoader workers can stop
there and hand over uint8 batches: a quarter of the bytes through shared memory and to the GPU, and the float
arithmetic (about a quarter of a worker's time per 500x375 JPEG with the PIL backend, see ``docs/evaluation.md``)
runs vectorised over the batch on the model's device. timm's ``PrefetchLoader`` does the same.

:func:`normalize_pixels` repeats each backend's arithmetic operation for operation, in the same float types. A
uint8 input has only 256 values per channel, so :class:`PixelNormalization` applies it once to each of them and
looks the batch up in that table (:func:`normalization_table`, :func:`apply_table`): the same numbers, for much
less work on a CPU than the arithmetic itself (PIL's float64 rescale is the expensive part).
:func:`deferred_normalization` runs the processor both ways on probe images and defers only when the results are
equal bit for bit; otherwise (a processor that pads after normalizing, one outside transformers' two backends,
one whose intermediate output is not uint8-valued) it returns ``None`` and the workers run the whole processor.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch


__all__ = ["PixelNormalization", "apply_table", "deferred_normalization", "normalization_table", "normalize_pixels"]

Backend = Literal["pil", "torchvision"]

#: Sizes (width, height) of the probe images :func:`deferred_normalization` runs the processor on: neither
#: square nor a multiple of a patch size, so resizing and cropping both take part.
PROBE_SIZES = ((61, 47), (61, 47))


def _check_pixels(pixels: torch.Tensor) -> None:
    if pixels.dtype != torch.uint8 or pixels.ndim != 4:
        raise ValueError(f"pixels must be a (B, C, H, W) uint8 tensor, got {tuple(pixels.shape)} {pixels.dtype}")


def normalize_pixels(
    pixels: torch.Tensor,
    backend: Backend,
    rescale_factor: float | None,
    image_mean: tuple[float, ...] | None,
    image_std: tuple[float, ...] | None,
) -> torch.Tensor:
    """``(B, C, H, W)`` uint8 -> float32 ``(B, C, H, W)`` on the same device, as the backend's processor computes it.

    ``rescale_factor`` ``None``: no rescaling; ``image_mean``/``image_std`` ``None``: no normalization. Mean and
    std hold one value per channel (or one value for all).
    """
    _check_pixels(pixels)
    normalize = image_mean is not None
    if normalize:
        mean = torch.tensor(image_mean, dtype=torch.float32, device=pixels.device).view(-1, 1, 1)
        std = torch.tensor(image_std, dtype=torch.float32, device=pixels.device).view(-1, 1, 1)
    if backend == "pil":
        # PilBackend: ``image.astype(float64) * scale`` cast to float32, then ``(image - mean) / std`` in float32.
        values = (pixels.double() * rescale_factor).float() if rescale_factor is not None else pixels.float()
        return (values - mean) / std if normalize else values
    # TorchvisionBackend fuses the two: ``(image - mean / scale) / (std / scale)`` with float32 mean and std.
    if normalize:
        if rescale_factor is not None:
            mean, std = mean * (1.0 / rescale_factor), std * (1.0 / rescale_factor)
        return (pixels.float() - mean) / std
    return pixels * rescale_factor if rescale_factor is not None else pixels.float()


@functools.lru_cache(maxsize=16)  # built once per (normalization, device), not once per batch; only ever read
def normalization_table(
    backend: Backend,
    rescale_factor: float | None,
    image_mean: tuple[float, ...] | None,
    image_std: tuple[float, ...] | None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``(C, 256)`` float32: :func:`normalize_pixels` of every uint8 value, per channel (C = 1 without normalization)."""
    channels = len(image_mean) if image_mean is not None else 1
    values = torch.arange(256, dtype=torch.uint8, device=device).expand(1, channels, 1, 256)
    return normalize_pixels(values, backend, rescale_factor, image_mean, image_std).reshape(channels, 256)


def apply_table(pixels: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W)`` uint8 -> float32: each value looked up in its channel's row of ``table`` ``(C or 1, 256)``."""
    _check_pixels(pixels)
    if table.shape[0] not in (1, pixels.shape[1]):
        raise ValueError(f"a table for {table.shape[0]} channels cannot normalize {pixels.shape[1]}-channel pixels")
    out = torch.empty(pixels.shape, dtype=table.dtype, device=pixels.device)
    rows = [table[channel if table.shape[0] > 1 else 0] for channel in range(pixels.shape[1])]
    if pixels.device.type == "cpu":
        # One image plane at a time: its int32 indices (a plane's worth, reused) stay in cache, and the lookup
        # writes straight into the output, instead of converting the whole batch to indices first.
        indices = torch.empty(pixels.shape[2] * pixels.shape[3], dtype=torch.int32)
        for image in range(pixels.shape[0]):
            for channel, row in enumerate(rows):
                indices.copy_(pixels[image, channel].reshape(-1))
                torch.index_select(row, 0, indices, out=out[image, channel].view(-1))
        return out
    for channel, row in enumerate(rows):  # on an accelerator: one kernel per channel for the whole batch
        # int32 indices: a quarter of the memory traffic of the int64 ones advanced indexing would make
        out[:, channel] = row.index_select(0, pixels[:, channel].reshape(-1).int()).view(out[:, channel].shape)
    return out


@dataclass(frozen=True)
class PixelNormalization:
    """An image processor's rescale + normalize, to apply to its uint8 intermediate output (see module docstring).

    Small and picklable: it travels with each batch from the DataLoader workers to the consumer.
    """

    backend: Backend
    rescale_factor: float | None
    image_mean: tuple[float, ...] | None
    image_std: tuple[float, ...] | None

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` uint8 -> float32 ``(B, C, H, W)``: :func:`normalize_pixels`, by table lookup."""
        table = normalization_table(self.backend, self.rescale_factor, self.image_mean, self.image_std, pixels.device)
        return apply_table(pixels, table)


def _backend_of(image_processor: Any) -> Backend | None:
    from transformers.image_processing_backends import PilBackend, TorchvisionBackend

    if isinstance(image_processor, PilBackend):
        return "pil"
    if isinstance(image_processor, TorchvisionBackend):
        return "torchvision"
    return None


def _as_tuple(value: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else (float(value),)


def _probe_images(mode: str, sizes: Sequence[tuple[int, int]] = PROBE_SIZES) -> list:
    """Random images of PIL ``mode`` and ``sizes`` (width, height); the last holds both extremes of the uint8 range."""
    from PIL import Image

    rng = np.random.default_rng(0)
    channels = 1 if mode == "L" else 3
    images = []
    for width, height in sizes:
        array = rng.integers(0, 256, size=(height, width, channels), dtype=np.uint8)
        images.append(Image.fromarray(array[..., 0] if channels == 1 else array, mode))
    images[-1].putpixel((0, 0), 0 if channels == 1 else (0, 0, 0))  # both extremes of the uint8 range
    images[-1].putpixel((1, 0), 255 if channels == 1 else (255, 255, 255))
    return images


def deferred_normalization(image_processor: Any, mode: str = "RGB") -> PixelNormalization | None:
    """The processor's rescale + normalize as a :class:`PixelNormalization` if it can be deferred, else ``None``.

    ``mode``: the PIL mode the images reach the processor in (``"RGB"`` or ``"L"``). Deferring is allowed when the
    processor is one of transformers' two backends, does not pad, and on probe images of ``mode`` its output with
    ``do_rescale=False, do_normalize=False`` is uint8-valued and, passed through the returned normalization, equals
    its ordinary output exactly.
    """
    backend = _backend_of(image_processor)
    do_rescale = bool(getattr(image_processor, "do_rescale", False))
    do_normalize = bool(getattr(image_processor, "do_normalize", False))
    if backend is None or getattr(image_processor, "do_pad", False) or not (do_rescale or do_normalize):
        return None
    normalization = PixelNormalization(
        backend=backend,
        rescale_factor=float(image_processor.rescale_factor) if do_rescale else None,
        image_mean=_as_tuple(image_processor.image_mean) if do_normalize else None,
        image_std=_as_tuple(image_processor.image_std) if do_normalize else None,
    )
    images = _probe_images(mode)
    try:
        full = image_processor(images, return_tensors="pt")["pixel_values"]
        partial = image_processor(images, do_rescale=False, do_normalize=False, return_tensors="pt")["pixel_values"]
    except (TypeError, ValueError):  # a processor that does not take these switches
        return None
    if partial.is_floating_point():
        if not bool(((partial >= 0) & (partial <= 255) & (partial == partial.round())).all()):
            return None
        partial = partial.to(torch.uint8)
    if partial.dtype != torch.uint8 or partial.ndim != 4 or full.dtype != torch.float32:
        return None
    return normalization if torch.equal(normalization(partial), full) else None
