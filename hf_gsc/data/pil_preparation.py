"""The PIL backend's resize + center crop straight on PIL images: the processor's uint8 pixels, less work per image.

transformers' PIL backend (``PilBackend``) turns each decoded image into a channels-first numpy array, back into a
PIL image to resize it (``image_transforms.resize``: ``to_pil_image``, ``Image.resize``, ``np.array``), crops the
numpy array, then stacks the batch. With rescale + normalize deferred (:mod:`hf_gsc.data.normalization`) the
output is uint8, and only ``Image.resize`` and the crop decide its values: the conversions around them are copies.
On a 500x375 JPEG resized to 224 px they are about a third of a DataLoader worker's time
(``scripts/benchmark_data_loading.py``: ``processor_single_core_without_normalization`` against
``floor_single_core``).

:class:`PilPreparation` calls ``Image.resize`` itself, with the processor's resolved size, filter and crop, and
stacks the batch once. :func:`pil_preparation` builds it only for a processor whose resize, crop, per-image
conversion and batch steps are ``PilBackend``'s own, and only when its output equals the processor's bit for bit
on probe images (landscape, portrait, odd sizes, a crop that needs padding); otherwise it returns ``None`` and the
processor runs as it is. A batch the shortcut does not cover (an image smaller than the crop, which the processor
pads; an RGB image with a transparency colour, which the processor composites on white) goes through the
processor too.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


__all__ = ["PilPreparation", "pil_preparation"]

#: (width, height) of the probe images: landscape, portrait, square, odd, larger and smaller than common crops.
PROBE_SIZES = ((61, 47), (47, 61), (500, 375), (375, 500), (224, 224), (257, 193), (9, 13))


def _pair(size: Sequence[int]) -> tuple[int, int]:
    """``(height, width)`` of a transformers helper's answer (declared ``tuple`` or ``tuple[int, int]``)."""
    height, width = size
    return (height, width)


def output_size(size: Any, height: int, width: int) -> tuple[int, int]:
    """``(height, width)`` after ``PilBackend.resize`` with the resolved ``size`` (a ``SizeDict``), by its branches."""
    from transformers.image_processing_backends import (
        get_image_size_for_max_height_width,
        get_resize_output_image_size,
        get_size_with_aspect_ratio,
    )
    from transformers.image_utils import ChannelDimension

    if size.shortest_edge and size.longest_edge:
        return _pair(get_size_with_aspect_ratio((height, width), size.shortest_edge, size.longest_edge))
    if size.shortest_edge:
        # a zero-stride stand-in: the helper reads only the image's shape
        shape_only = np.broadcast_to(np.uint8(0), (1, height, width))
        return _pair(get_resize_output_image_size(shape_only, size=size.shortest_edge, default_to_square=False,
                                                  input_data_format=ChannelDimension.FIRST))
    if size.max_height and size.max_width:
        return _pair(get_image_size_for_max_height_width((height, width), size.max_height, size.max_width))
    if size.height and size.width:
        return (size.height, size.width)
    raise ValueError(f"unsupported size {size}")


@dataclass(frozen=True)
class PilPreparation:
    """PIL images -> ``(B, C, H, W)`` uint8: a PIL-backend processor's resize and center crop, without normalizing.

    Built by :func:`pil_preparation`; picklable, as it travels to the DataLoader workers inside the transform.
    """

    size: Any  # transformers' SizeDict, or None without resizing
    resample: int
    crop: tuple[int, int] | None  # (height, width)
    convert_rgb: bool

    def __call__(self, images: Sequence[Any]) -> torch.Tensor | None:
        """The batch, or ``None`` where the processor must run (see the module docstring)."""
        arrays = []
        for image in images:
            if self.convert_rgb and image.info.get("transparency") is not None:
                return None  # the processor composites it on white
            if self.size is not None:
                height, width = output_size(self.size, image.height, image.width)
                image = image.resize((width, height), resample=self.resample)
            array = np.asarray(image)
            if self.crop is not None:
                crop_height, crop_width = self.crop
                # as image_transforms.center_crop: the floor of half the margin, padding when it is negative
                top, left = (array.shape[0] - crop_height) // 2, (array.shape[1] - crop_width) // 2
                if top < 0 or left < 0:
                    return None
                array = array[top: top + crop_height, left: left + crop_width]
            arrays.append(array)
        if len({array.shape for array in arrays}) > 1:
            return None  # the processor's own error about a ragged batch
        height, width = arrays[0].shape[:2]
        batch = _batch_tensor((len(arrays), 1 if arrays[0].ndim == 2 else arrays[0].shape[2], height, width))
        out = batch.numpy()
        for index, array in enumerate(arrays):  # channels last -> the processor's channels first, in one copy
            out[index] = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)
        return batch


def _batch_tensor(shape: tuple[int, ...]) -> torch.Tensor:
    """An empty uint8 tensor; in a DataLoader worker, in shared memory, as ``default_collate`` allocates its batches.

    A worker's batch reaches the main process through shared memory: a tensor made elsewhere is copied there when
    it is sent, which costs about as much as stacking the batch (``scripts/benchmark_data_loading.py``).
    """
    from torch.utils.data import get_worker_info

    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)  # what default_collate calls
    if get_worker_info() is None or new_shared is None:
        return torch.empty(shape, dtype=torch.uint8)
    storage = new_shared(int(np.prod(shape)))
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


def _own_steps(image_processor: Any) -> bool:
    """Whether every step between a PIL image and the stacked batch is ``PilBackend``'s own (not a model's)."""
    from transformers.image_processing_backends import PilBackend
    from transformers.image_processing_utils import BaseImageProcessor

    if not isinstance(image_processor, PilBackend):
        return False
    kind = type(image_processor)
    return all(getattr(kind, name) is getattr(PilBackend, name)
               for name in ("_preprocess", "resize", "center_crop", "process_image", "convert_to_rgb")) and all(
        getattr(kind, name) is getattr(BaseImageProcessor, name)
        for name in ("preprocess", "_preprocess_image_like_inputs", "_prepare_image_like_inputs"))


def pil_preparation(image_processor: Any, mode: str = "RGB") -> PilPreparation | None:
    """A :class:`PilPreparation` equal to ``image_processor(images, do_rescale=False, do_normalize=False)`` on images
    of PIL ``mode``, or ``None`` where it cannot be (see the module docstring)."""
    from .normalization import _probe_images

    if not _own_steps(image_processor):
        return None
    try:
        settings = {name: getattr(image_processor, name, None) for name in image_processor._valid_kwargs_names}
        settings = image_processor._standardize_kwargs(**settings)
        if settings.get("do_pad") or (settings.get("resample") is not None
                                      and not isinstance(settings["resample"], int)):
            return None
        crop = settings["crop_size"] if settings.get("do_center_crop") else None
        preparation = PilPreparation(
            size=settings["size"] if settings.get("do_resize") else None,
            resample=int(settings["resample"]) if settings.get("resample") is not None else 2,  # PIL's BILINEAR
            crop=(int(crop.height), int(crop.width)) if crop is not None else None,
            convert_rgb=bool(settings.get("do_convert_rgb")))
        covered = 0
        for width, height in PROBE_SIZES:
            images = _probe_images(mode, [(width, height)] * 2)
            expected = image_processor(images, do_rescale=False, do_normalize=False, return_tensors="pt")["pixel_values"]
            got = preparation(images)
            if got is None:
                continue  # a size the processor handles itself (padding); the shortcut stands aside there
            if not torch.equal(got.to(expected.dtype), expected):  # ImageTransform casts an integral float to uint8
                return None
            covered += 1
    except (TypeError, ValueError, AttributeError, KeyError):  # settings this shortcut does not know
        return None
    return preparation if covered else None
