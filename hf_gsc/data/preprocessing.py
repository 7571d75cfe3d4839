"""From a dataset's ``image`` column to the ``pixel_values`` a model takes.

The model's own image processor does the work (``load_image_processor`` defaults to the PIL backend, so no
torchvision is needed); this module only adds what every benchmark needs around it: the channel
conversion the model wants (grayscale data -> RGB for 3-channel models, 'L' for 1-channel ones),
decoding that names the dataset and row of an unreadable image, and (:class:`ImageTransform`) the split of
the processor into the part DataLoader workers run and the rescale + normalize the model's device runs.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import datasets
import torch
from transformers.image_processing_utils import BaseImageProcessor

from ..utils.dataset_columns import image_column_of, label_column_of
from ..utils.image_processors import load_image_processor  # noqa: F401  (re-exported)
from .decoding import ON_ERROR_CHOICES, OnError, decode_image, decode_images, without_decoding
from .normalization import PixelNormalization, deferred_normalization
from .pil_preparation import PilPreparation, pil_preparation


__all__ = [
    "ROW_COLUMN",
    "ImageTransform",
    "collate",
    "decode_image",
    "load_image_processor",
    "make_transform",
    "num_channels",
    "prepare_dataset",
]

#: Column holding each row's index in the un-transformed dataset, added by ``prepare_dataset`` so
#: that an error can name the row even inside a shuffled / batched DataLoader.
ROW_COLUMN = "row"


def num_channels(config: object) -> int:
    """Input channels the model expects (``config.num_channels`` of a transformers config; 3 when the config, or
    whatever a model holds as its ``config``, has none)."""
    return int(getattr(config, "num_channels", 3) or 3)


class ImageTransform:
    """Decoded PIL images -> ``pixel_values`` as the model's image processor makes them, in two stages.

    * :meth:`prepare` runs where the images are decoded (DataLoader workers): the channel conversion the model wants
      and the image processor, stopping before rescale + normalize when those can be deferred
      (:func:`~hf_gsc.data.normalization.deferred_normalization`); it returns ``(B, C, H, W)`` uint8 then, else the
      processor's float32 output. With a PIL-backend processor the uint8 batch is made by :attr:`pil_preparation`
      (:mod:`hf_gsc.data.pil_preparation`: the same pixels, without the processor's array conversions) when it
      applies.
    * :attr:`normalization` (``None`` when nothing is deferred) finishes a prepared batch on the model's device.

    Calling the transform runs both stages: float32 ``(B, C, H, W)``, equal to the processor's own output.

    Args:
        image_processor: a transformers image processor.
        num_channels: channels the model takes (1: images become ``"L"``, 3: ``"RGB"``).
        defer_normalization: ``False`` keeps the whole processor in :meth:`prepare`.
    """

    def __init__(self, image_processor: BaseImageProcessor, num_channels: int = 3, defer_normalization: bool = True):
        if num_channels not in (1, 3):
            raise ValueError(f"num_channels must be 1 or 3, got {num_channels}")
        self.image_processor = image_processor
        self.num_channels = num_channels
        self.mode = "L" if num_channels == 1 else "RGB"
        self.normalization: PixelNormalization | None = (
            deferred_normalization(image_processor, self.mode) if defer_normalization else None
        )
        self.pil_preparation: PilPreparation | None = (
            pil_preparation(image_processor, self.mode) if self.normalization is not None else None
        )

    def prepare(self, images: Sequence[Any]) -> torch.Tensor:
        """PIL images -> ``(B, C, H, W)``: uint8 if :attr:`normalization` is set, else float32."""
        # convert() to the same mode is a copy of the whole image; the processor only reads it
        images = [image if image.mode == self.mode else image.convert(self.mode) for image in images]
        if self.pil_preparation is not None and (pixels := self.pil_preparation(images)) is not None:
            return _check_channels(pixels, self.num_channels)
        if self.normalization is None:
            return _check_channels(self.image_processor(images, return_tensors="pt")["pixel_values"].float(),
                                   self.num_channels)
        pixels = self.image_processor(images, do_rescale=False, do_normalize=False, return_tensors="pt")["pixel_values"]
        return _check_channels(pixels.to(torch.uint8), self.num_channels)  # uint8-valued: checked on probes

    def __call__(self, images: Sequence[Any]) -> torch.Tensor:
        pixels = self.prepare(images)
        return pixels if self.normalization is None else self.normalization(pixels)


def _check_channels(pixel_values: torch.Tensor, num_channels: int) -> torch.Tensor:
    if pixel_values.shape[1] != num_channels:
        raise ValueError(
            f"the image processor made {pixel_values.shape[1]}-channel images for a "
            f"{num_channels}-channel model (check its image_mean / do_convert_rgb)"
        )
    return pixel_values


def make_transform(
    image_processor: BaseImageProcessor,
    num_channels: int = 3,
    dataset_name: str = "dataset",
    image_column: str = "image",
    label_column: str = "label",
    on_error: OnError = "raise",
) -> Callable[[dict[str, list]], dict[str, torch.Tensor]]:
    """A batch transform for ``Dataset.with_transform`` or a ``DataLoader`` collate function.

    Input: a batch dict with ``image_column`` (PIL images or ``{"bytes", "path"}`` dicts),
    optionally ``label_column`` and ``ROW_COLUMN`` (row numbers, used in error messages). Output: ``pixel_values``
    float32 (B, num_channels, H, W) as the processor makes them, and ``label`` int64 (B,) (-1 where the
    dataset has no label column).

    With ``on_error="skip"`` an image that cannot be decoded is left out instead of raising
    :class:`~hf_gsc.data.decoding.UndecodableImageError`: the output then holds the K <= B decodable images, their
    ``label`` (K,), their ``row`` int64 (K,) (the ``ROW_COLUMN`` values, or positions in the batch when it has
    none) and ``num_skipped`` int64 (). A batch whose every image is skipped gives ``pixel_values`` of shape
    (0, num_channels, 0, 0).
    """
    processor = ImageTransform(image_processor, num_channels, defer_normalization=False)  # checks num_channels
    if on_error not in ON_ERROR_CHOICES:
        raise ValueError(f"on_error must be one of {ON_ERROR_CHOICES}, got {on_error!r}")

    def transform(batch: dict[str, list]) -> dict[str, torch.Tensor]:
        values = batch[image_column]
        labels = list(batch.get(label_column, [-1] * len(values)))
        default_rows = list(range(len(values))) if on_error == "skip" else [
            f"? (position {i} of a batch)" for i in range(len(values))]
        decoded = decode_images(values, batch.get(ROW_COLUMN) or default_rows, dataset_name, on_error)
        labels = [labels[position] for position in decoded.positions]
        images = decoded.images
        pixel_values = processor(images) if images else torch.empty(0, num_channels, 0, 0)
        out = {"pixel_values": pixel_values, "label": torch.as_tensor(labels, dtype=torch.long)}
        if on_error == "skip":
            out["row"] = torch.as_tensor(decoded.rows, dtype=torch.long)
            out["num_skipped"] = torch.tensor(len(decoded.skipped_rows), dtype=torch.long)
        return out

    return transform


def prepare_dataset(
    dataset: datasets.Dataset,
    image_processor: BaseImageProcessor,
    num_channels: int = 3,
    dataset_name: str = "dataset",
    image_column: str | None = None,
    label_column: str | None = None,
) -> datasets.Dataset:
    """``dataset`` with ``make_transform`` attached: items become ``{"pixel_values", "label"}``.

    ``image_column`` / ``label_column``: the dataset's columns, by default found by type
    (:mod:`hf_gsc.utils.dataset_columns`: the one ``Image`` column, the one ``ClassLabel`` column; ``label`` is -1
    without one). The image column is switched to ``decode=False`` so that decoding happens in the transform,
    where a failure can be reported with the dataset name and row.
    """
    what = f"dataset {dataset_name!r}"
    image_column = image_column_of(dataset, image_column, what)
    label_column = label_column_of(dataset, label_column, what) or "label"
    dataset = without_decoding(dataset, image_column)
    if ROW_COLUMN not in dataset.column_names:
        dataset = dataset.add_column(ROW_COLUMN, list(range(len(dataset))))
    return dataset.with_transform(
        make_transform(image_processor, num_channels, dataset_name, image_column=image_column,
                       label_column=label_column)
    )


def collate(items: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """DataLoader ``collate_fn``: stack per-item ``pixel_values`` (C, H, W) and ``label`` ()."""
    return {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        "label": torch.stack([torch.as_tensor(item["label"]) for item in items]),
    }
