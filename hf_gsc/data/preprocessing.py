"""From a dataset's ``image`` column to the ``pixel_values`` a model takes.

The model's own image processor does the work (``AutoImageProcessor`` with the PIL backend, so no
torchvision is needed); this module only adds what every benchmark needs around it: the channel
conversion the model wants (grayscale data -> RGB for 3-channel models, 'L' for 1-channel ones),
and decoding that names the dataset and row of an unreadable image.
"""
from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from PIL import Image
from transformers import AutoImageProcessor, PretrainedConfig
from transformers.image_processing_utils import BaseImageProcessor

#: Column holding each row's index in the un-transformed dataset, added by ``prepare_dataset`` so
#: that an error can name the row even inside a shuffled / batched DataLoader.
ROW_COLUMN = "row"


def load_image_processor(name_or_path: str | Path, **kwargs: Any) -> BaseImageProcessor:
    """``AutoImageProcessor.from_pretrained`` with the PIL backend (torchvision is not a
    dependency); works for Hub ids and for the reference model directories."""
    kwargs.setdefault("backend", "pil")
    return AutoImageProcessor.from_pretrained(str(name_or_path), **kwargs)


def num_channels(config: PretrainedConfig) -> int:
    """Input channels the model expects (``config.num_channels``; 3 when the config has none)."""
    return int(getattr(config, "num_channels", 3) or 3)


def decode_image(value: Any, dataset_name: str, row: int | str) -> Image.Image:
    """A PIL image from what a ``datasets.Image(decode=False)`` column holds (``{"bytes", "path"}``)
    or from an already decoded PIL image.

    Raises:
        ValueError: naming ``dataset_name`` and ``row`` when the image cannot be read.
    """
    if isinstance(value, Image.Image):
        return value
    try:
        if isinstance(value, Mapping):
            if value.get("bytes") is not None:
                image = Image.open(io.BytesIO(value["bytes"]))
            elif value.get("path"):
                image = Image.open(value["path"])
            else:
                raise ValueError("the row holds neither image bytes nor a path")
        else:
            image = Image.open(value)
        image.load()  # decode now, inside the try, rather than lazily in the processor
        return image
    except Exception as err:  # noqa: BLE001 -- PIL raises many types for bad files
        raise ValueError(f"cannot read the image of dataset {dataset_name!r}, row {row}: {err}") from err


def make_transform(
    image_processor: BaseImageProcessor,
    num_channels: int = 3,
    dataset_name: str = "dataset",
    image_column: str = "image",
    label_column: str = "label",
) -> Callable[[dict[str, list]], dict[str, torch.Tensor]]:
    """A batch transform for ``Dataset.with_transform``.

    Input: a batch dict with ``image_column`` (PIL images or ``{"bytes", "path"}`` dicts),
    optionally ``label_column`` and ``ROW_COLUMN``. Output: ``pixel_values`` float32
    (B, num_channels, H, W) as the processor makes them, and ``label`` int64 (B,) (-1 where the
    dataset has no label column).
    """
    if num_channels not in (1, 3):
        raise ValueError(f"num_channels must be 1 or 3, got {num_channels}")
    mode = "L" if num_channels == 1 else "RGB"

    def transform(batch: dict[str, list]) -> dict[str, torch.Tensor]:
        values = batch[image_column]
        rows = batch.get(ROW_COLUMN) or [f"? (position {i} of a batch)" for i in range(len(values))]
        images = [decode_image(v, dataset_name, r).convert(mode) for v, r in zip(values, rows)]
        pixel_values = image_processor(images, return_tensors="pt")["pixel_values"]
        if pixel_values.shape[1] != num_channels:
            raise ValueError(
                f"the image processor made {pixel_values.shape[1]}-channel images for a "
                f"{num_channels}-channel model (check its image_mean / do_convert_rgb)"
            )
        labels = batch.get(label_column, [-1] * len(values))
        return {"pixel_values": pixel_values.float(), "label": torch.as_tensor(labels, dtype=torch.long)}

    return transform


def prepare_dataset(
    dataset: datasets.Dataset,
    image_processor: BaseImageProcessor,
    num_channels: int = 3,
    dataset_name: str = "dataset",
    image_column: str = "image",
) -> datasets.Dataset:
    """``dataset`` with ``make_transform`` attached: items become ``{"pixel_values", "label"}``.

    The image column is switched to ``decode=False`` so that decoding happens in the transform,
    where a failure can be reported with the dataset name and row.
    """
    if image_column not in dataset.column_names:
        raise ValueError(f"dataset {dataset_name!r} has no column {image_column!r}: {dataset.column_names}")
    if isinstance(dataset.features[image_column], datasets.Image):
        dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
    if ROW_COLUMN not in dataset.column_names:
        dataset = dataset.add_column(ROW_COLUMN, list(range(len(dataset))))
    return dataset.with_transform(
        make_transform(image_processor, num_channels, dataset_name, image_column=image_column)
    )


def collate(items: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """DataLoader ``collate_fn``: stack per-item ``pixel_values`` (C, H, W) and ``label`` ()."""
    return {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        "label": torch.stack([torch.as_tensor(item["label"]) for item in items]),
    }
