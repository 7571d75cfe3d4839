"""Data loaders of the evaluation: batches of one split, decoded and preprocessed, optionally in worker processes.

* :func:`make_dataloader`: a ``DataLoader`` whose collate function decodes the images of a batch
  (:mod:`hf_gsc.data.decoding`, so a failure names the dataset, row and file) and turns them into
  ``pixel_values`` in one image-processor call, optionally in worker processes. A map-style dataset is
  read by *index* (``accelerator.prepare`` shards the indices over the processes); a streamed
  ``datasets.IterableDataset`` is first split over the processes with ``split_dataset_by_node``.
  With an :class:`~hf_gsc.data.ImageTransform` the workers stop before the processor's rescale + normalize and
  send uint8 batches, which :func:`model_pixel_values` normalizes on the model's device
  (:mod:`hf_gsc.data.normalization`: same numbers, a quarter of the bytes, less work per image in the workers).
* :func:`device_batches`: ``(pixel_values, labels)`` batches moved to the model's device (fitting, analyses).
* Unreadable images (``on_error`` as in :mod:`hf_gsc.data.decoding`): the collate function puts a blank
  placeholder in the place of an image it cannot decode and marks the row as not decoded, so every
  process keeps equal batches and the scoring loop's gathering stays exact (:mod:`hf_gsc.evaluation.loop`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from ..data.decoding import OnError, UndecodableImageError, check_on_error, decode_images, without_decoding
from ..data.normalization import PixelNormalization
from ..data.preprocessing import ImageTransform
from .fingerprints import is_streamed


logger = logging.getLogger(__name__)

#: Size of the blank image standing in for an unreadable one when no image of its batch could be decoded.
PLACEHOLDER_SIZE = (32, 32)
#: Batches each worker prepares ahead on CUDA (DataLoader's default is 2): decoding a batch of photos
#: takes longer than scoring it, so a deeper queue absorbs the variation of decode times.
CUDA_PREFETCH_FACTOR = 4


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a container or ``taskset`` narrows; the machine's
    count where the platform has no affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_num_workers(device: torch.device | str, local_processes: int | None = None) -> int:
    """Worker processes per evaluation process: on CUDA, this process's share of the CPUs available
    (:func:`available_cpus` over the processes on this machine, ``LOCAL_WORLD_SIZE`` by default, as ``accelerate
    launch`` and ``torchrun`` set it), less one for the process itself, at least 1; else 0.

    On CUDA, decoding and preprocessing on the host is the bottleneck (about 6 ms per 500x375 JPEG on a core
    against about 1 ms of GPU time per image for ViT-B/16 in fp32, several times less in bf16), so every core
    pays. On a CPU the model competes with the workers for the same cores: the measurement in
    ``docs/evaluation.md`` decides the default.
    """
    if torch.device(device).type != "cuda":
        return 0
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, available_cpus() // max(1, local_processes) - 1)


class IndexedImages:
    """Collate function: ``[indices]`` -> a batch (see :func:`decode_batch`).

    Args:
        dataset: a ``datasets.Dataset`` with an ``image`` column (``datasets.Image``) and a ``label``
            column (``-1`` or missing for OOD data).
        transform: a list of PIL images -> ``(B, C, H, W)`` float tensor (the model's preprocessing).
        dataset_name: named in the error about an unreadable image, with the row (the index in ``dataset``).
    """

    def __init__(self, dataset: Any, transform: Callable[[list], torch.Tensor], dataset_name: str = "dataset") -> None:
        self.dataset = without_decoding(dataset)  # decoded in decode_batch, where a failure can name the row
        self.transform = transform
        self.dataset_name = dataset_name
        self.has_labels = "label" in self.dataset.column_names

    def __call__(self, indices: Sequence[int]) -> dict[str, Any]:
        rows = self.dataset[list(indices)]
        labels = rows["label"] if self.has_labels else None
        return decode_batch(rows["image"], list(indices), labels, self.transform, self.dataset_name)


class StreamedImages:
    """Collate function of a streamed dataset: ``[rows]`` -> a batch (see :func:`decode_batch`).

    A stream has no row numbers: an error names the position in the batch and the file.
    """

    def __init__(self, transform: Callable[[list], torch.Tensor], dataset_name: str = "dataset") -> None:
        self.transform = transform
        self.dataset_name = dataset_name

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        labels = [row["label"] for row in rows] if rows and "label" in rows[0] else None
        positions = [f"? (position {i} of a streamed batch)" for i in range(len(rows))]
        return decode_batch([row["image"] for row in rows], positions, labels, self.transform, self.dataset_name)


def decode_batch(
    values: Sequence[Any],
    rows: Sequence[int | str],
    labels: Sequence[int] | None,
    transform: Callable[[list], torch.Tensor],
    dataset_name: str,
) -> dict[str, Any]:
    """Decode a batch's images and preprocess them; an unreadable image becomes a blank placeholder.

    Returns ``pixel_values`` ``(B, C, H, W)``, ``labels`` int64 ``(B,)`` (-1 without labels), ``decoded`` bool
    ``(B,)`` (False where the placeholder stands) and ``errors``: one :class:`UndecodableImageError` message per
    placeholder. When ``transform`` is an :class:`~hf_gsc.data.ImageTransform` that defers normalization,
    ``pixel_values`` is uint8 and ``pixel_normalization`` finishes it (:func:`model_pixel_values`). The batch
    keeps its size whatever fails, so that processes stay in step (see the module docstring).
    """
    # The one path that skips unreadable images (hf_gsc.data.decoding.decode_images); here a placeholder keeps
    # each skipped image's place, so that the batch keeps its size.
    result = decode_images(values, list(rows), dataset_name, on_error="skip")
    images: list[Any] = [None] * len(values)
    for position, image in zip(result.positions, result.images):
        images[position] = image
    decoded = [image is not None for image in images]
    errors = result.errors
    if errors:
        # A placeholder like a decoded image of the batch (mode, size), so that transforms that neither convert
        # nor resize still stack the batch.
        like = next((image for image in images if image is not None), None)
        mode, size = (like.mode, like.size) if like is not None else ("RGB", PLACEHOLDER_SIZE)
        images = [Image.new(mode, size) if image is None else image for image in images]
    # An ImageTransform that defers rescale + normalize sends uint8 (prepare); any other transform runs whole.
    normalization: PixelNormalization | None = None
    if isinstance(transform, ImageTransform) and transform.normalization is not None:
        normalization, pixel_values = transform.normalization, transform.prepare(images)
    else:
        pixel_values = transform(images)
    if labels is None:
        labels_tensor = torch.full((pixel_values.shape[0],), -1, dtype=torch.long)
    else:
        labels_tensor = torch.as_tensor(labels, dtype=torch.long)
    batch = {"pixel_values": pixel_values, "labels": labels_tensor,
             "decoded": torch.tensor(decoded, dtype=torch.bool), "errors": errors}
    if normalization is not None:
        batch["pixel_normalization"] = normalization
    return batch


def model_pixel_values(batch: Mapping[str, Any], device: torch.device | str) -> torch.Tensor:
    """A batch's float ``pixel_values`` on ``device``: a uint8 batch is moved first and normalized there."""
    pixel_values = batch["pixel_values"].to(device, non_blocking=True)
    normalization = batch.get("pixel_normalization")
    return pixel_values if normalization is None else normalization(pixel_values)


def make_dataloader(
    dataset: Any,
    transform: Callable[[list], torch.Tensor],
    batch_size: int,
    num_workers: int = 0,
    device: torch.device | str = "cpu",
    process_index: int = 0,
    num_processes: int = 1,
    dataset_name: str = "dataset",
) -> DataLoader:
    """An ordered (unshuffled) loader of ``dataset``; ``dataset_name`` is named in errors about unreadable images.

    A map-style ``dataset`` is sharded later (``accelerator.prepare`` in :func:`score_split`); a streamed
    one is split here over ``num_processes`` with ``datasets.distributed.split_dataset_by_node``. On CUDA
    the batches are pinned and workers prefetch :data:`CUDA_PREFETCH_FACTOR` batches each.
    """
    cuda = torch.device(device).type == "cuda"
    options: dict[str, Any] = {"batch_size": batch_size, "num_workers": num_workers, "pin_memory": cuda}
    if num_workers > 0:
        # Each loader reads its split once, so workers that outlive it (persistent_workers) would only hold memory.
        options.update(prefetch_factor=CUDA_PREFETCH_FACTOR if cuda else 2, persistent_workers=False)
    if is_streamed(dataset):
        from datasets.distributed import split_dataset_by_node

        dataset = without_decoding(dataset)
        if num_processes > 1:
            dataset = split_dataset_by_node(dataset, rank=process_index, world_size=num_processes)
        return DataLoader(dataset, collate_fn=StreamedImages(transform, dataset_name), **options)
    # torch declares ``Dataset``; a DataLoader reads any map-style sequence (``__getitem__`` and ``__len__``)
    indices = cast("Dataset[int]", range(len(dataset)))
    return DataLoader(indices, shuffle=False, collate_fn=IndexedImages(dataset, transform, dataset_name),
                      **options)


def device_batches(
    dataloader: Iterable[Mapping[str, Any]], device: torch.device | str, on_error: OnError = "raise"
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(pixel_values, labels)`` of each batch, on ``device`` (the model's), for ``Detector.fit`` and analyses.

    One process reads the whole loader, so unreadable images are dropped before the model sees them
    (``on_error="skip"``, logged) or raise :class:`UndecodableImageError` (``"raise"``).
    """
    check_on_error(on_error)
    for batch in dataloader:
        if batch.get("errors"):
            handle_unreadable(batch["errors"], on_error)
        pixel_values, labels = model_pixel_values(batch, device), batch["labels"].to(device, non_blocking=True)
        if batch.get("errors"):
            kept = batch["decoded"].to(device)
            pixel_values, labels = pixel_values[kept], labels[kept]
            if not len(labels):
                continue
        yield pixel_values, labels


def handle_unreadable(errors: Sequence[str], on_error: OnError) -> None:
    """Raise the first error (``"raise"``) or log each skipped image (``"skip"``)."""
    if on_error == "raise":
        raise UndecodableImageError(errors[0])
    for message in errors:
        logger.warning("skipped: %s", message)


__all__ = [
    "CUDA_PREFETCH_FACTOR",
    "IndexedImages",
    "StreamedImages",
    "available_cpus",
    "decode_batch",
    "default_num_workers",
    "device_batches",
    "handle_unreadable",
    "make_dataloader",
    "model_pixel_values",
]
