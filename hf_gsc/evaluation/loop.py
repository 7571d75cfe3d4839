"""The scoring loop: batches of one split through every method, sharded with ``accelerate``, cached.

* :func:`make_accelerator`: the ``Accelerator`` (device, processes, mixed precision); a precision the
  device cannot run is an error, not a silent fp32 run.
* :func:`make_dataloader`: a ``DataLoader`` whose collate function decodes the images of a batch
  (:mod:`hf_gsc.data.decoding`, so a failure names the dataset, row and file) and turns them into
  ``pixel_values`` in one image-processor call, optionally in worker processes. A map-style dataset is
  read by *index* (``accelerator.prepare`` shards the indices over the processes); a streamed
  ``datasets.IterableDataset`` is first split over the processes with ``split_dataset_by_node``.
  With an :class:`~hf_gsc.data.ImageTransform` the workers stop before the processor's rescale + normalize and
  send uint8 batches, which :func:`model_pixel_values` normalizes on the model's device
  (:mod:`hf_gsc.data.normalization`: same numbers, a quarter of the bytes, less work per image in the workers).
* :func:`device_batches`: ``(pixel_values, labels)`` batches moved to the model's device (fitting, analyses).
* :func:`score_split`: runs several scoring functions on each batch (under ``accelerator.autocast()``)
  and collects their outputs across processes: ``gather_for_metrics`` drops the duplicates
  ``accelerate`` pads an uneven last batch with, so every process returns exactly one value per
  sample, in dataset order. Outputs stay on the device until the split ends: no host synchronisation per batch.
* Unreadable images (``on_error`` as in :mod:`hf_gsc.data.decoding`): the collate function puts a blank
  placeholder in the place of an image it cannot decode and marks the row as not decoded, so every
  process keeps equal batches and the gathering above stays exact; the consumer then raises
  :class:`~hf_gsc.data.decoding.UndecodableImageError` (``"raise"``; with several processes on every process at
  once, after the split's last gathering) or drops the
  marked rows after gathering and counts them (``"skip"``).
* :class:`ScoreCache`: ``scores/{method}/{split}.safetensors`` under the output dir, written
  atomically (temporary file, then ``os.replace``, never through a link) by the main process as soon as a
  split is done, and tagged with a fingerprint of everything the scores depend on, so a rerun reuses exactly
  the files that are still valid and a crash loses only the split in progress. A file whose fingerprint
  matches but whose content does not fit its split (rows, dtypes, finite scores, keys) is computed again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from PIL import Image
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..data.decoding import OnError, UndecodableImageError, check_on_error, decode_images, without_decoding
from ..safe_files import save_file
from .fingerprints import fingerprint, is_streamed
from .errors import InputError

logger = logging.getLogger(__name__)

#: Subfolder of the output dir holding ``{method}/{split}.safetensors``.
SCORES_DIR = "scores"
#: Key of the score tensor inside a score file.
SCORE_KEY = "ood_score"
FINGERPRINT_KEY = "fingerprint"
#: Key of the base model's predicted classes in its score file.
PREDICTIONS_KEY = "predictions"
#: Pseudo-method whose score file holds the base model's predictions on ID test (for ``id_accuracy``).
BASE_MODEL = "_base_model"
#: Key of the number of images left out as unreadable, in :func:`score_split`'s output and in a score file.
NUM_SKIPPED_KEY = "num_skipped"
#: Size of the blank image standing in for an unreadable one when no image of its batch could be decoded.
PLACEHOLDER_SIZE = (32, 32)
#: Batches each worker prepares ahead on CUDA (DataLoader's default is 2): decoding a batch of photos
#: takes longer than scoring it, so a deeper queue absorbs the variation of decode times.
CUDA_PREFETCH_FACTOR = 4


def make_accelerator(mixed_precision: str | None = None) -> Any:
    """An ``Accelerator`` with ``mixed_precision`` (``None``: accelerate's config / ``ACCELERATE_MIXED_PRECISION``).

    Raises :class:`InputError` for a precision the device cannot run: accelerate itself refuses bf16 on a
    GPU without it, and accepts fp16 on a CPU while running it as fp32 (no autocast), which would
    silently report fp32 numbers as fp16.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from accelerate.state import AcceleratorState

    flag = "--mixed-precision" if mixed_precision is not None else "ACCELERATE_MIXED_PRECISION (or accelerate config)"
    if mixed_precision is None:  # what accelerate reads itself (`accelerate launch` puts its config there)
        mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    # Fitting runs on the main process while the others wait at a barrier: allow for a long fit.
    options = {"mixed_precision": mixed_precision, "kwargs_handlers": [InitProcessGroupKwargs(timeout=timedelta(hours=3))]}
    try:
        try:
            accelerator = Accelerator(**options)
        except ValueError as error:
            if "already been initialized" not in str(error):
                raise
            # An earlier evaluation in this Python process fixed another precision in accelerate's shared
            # state; the process group (PartialState) is kept, only the precision settings are reset.
            AcceleratorState._reset_state(reset_partial_state=False)
            accelerator = Accelerator(**options)
    except ValueError as error:
        raise InputError(f"{flag}: {error}") from None
    if accelerator.mixed_precision not in ("no", "fp16", "bf16"):
        raise InputError(f"{flag}: {accelerator.mixed_precision!r} is not supported here; use no, fp16 or bf16")
    if accelerator.mixed_precision != "no" and not accelerator.native_amp:
        raise InputError(f"{flag} {accelerator.mixed_precision}: not available on device {accelerator.device.type} "
                         "(accelerate would run it as fp32); use bf16 or no on a CPU")
    return accelerator


def default_num_workers(device: torch.device | str) -> int:
    """Worker processes for a device: ``min(4, CPU count)`` on CUDA, else 0.

    On CUDA, decoding and preprocessing on the host is the bottleneck (about 6 ms per 500x375 JPEG
    against about 1 ms of GPU time per image for ViT-B/16), so workers pay. On a CPU the model competes
    with the workers for the same cores: the measurement in ``docs/evaluation.md`` decides the default.
    """
    if torch.device(device).type == "cuda":
        return min(4, os.cpu_count() or 1)
    return 0


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
    normalization = getattr(transform, "normalization", None)
    pixel_values = transform.prepare(images) if normalization is not None else transform(images)
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
    return DataLoader(range(len(dataset)), shuffle=False, collate_fn=IndexedImages(dataset, transform, dataset_name),
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
            _handle_unreadable(batch["errors"], on_error)
        pixel_values, labels = model_pixel_values(batch, device), batch["labels"].to(device, non_blocking=True)
        if batch.get("errors"):
            kept = batch["decoded"].to(device)
            pixel_values, labels = pixel_values[kept], labels[kept]
            if not len(labels):
                continue
        yield pixel_values, labels


def _handle_unreadable(errors: Sequence[str], on_error: OnError) -> None:
    """Raise the first error (``"raise"``) or log each skipped image (``"skip"``)."""
    if on_error == "raise":
        raise UndecodableImageError(errors[0])
    for message in errors:
        logger.warning("skipped: %s", message)


def _as_output(name: str, value: torch.Tensor, batch_size: int) -> torch.Tensor:
    """A scorer's output ``(B, ...)`` as float64 (floating) or int64, checked for its leading size."""
    if value.ndim == 0 or value.shape[0] != batch_size:
        raise RuntimeError(f"{name} returned shape {tuple(value.shape)} for a batch of {batch_size}; expected (B, ...)")
    value = value.detach()
    return value.double() if value.is_floating_point() else value.long()


def score_split(
    accelerator: Any,
    dataloader: DataLoader,
    scorers: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
    description: str = "",
    on_error: OnError = "raise",
) -> dict[str, torch.Tensor]:
    """Run every scorer on each batch of ``dataloader`` on all processes; gather across processes.

    Args:
        accelerator: an ``accelerate.Accelerator``; the scorers run under its ``autocast()`` (its mixed precision).
        dataloader: from :func:`make_dataloader` (not yet prepared: a map-style one is prepared here).
        scorers: name -> ``pixel_values -> (B, ...)`` tensor (an ``ood_score``, a prediction...), or a
            mapping ``key -> (B, ...)`` tensor, returned as ``(name, key)``. They are called in order on
            each batch, with the same ``pixel_values`` object, so a later one may reuse an earlier one's work.
        description: progress bar label (the bar shows on the local main process only).
        on_error: an image that cannot be decoded raises :class:`UndecodableImageError` naming dataset, row
            and file on every process (``"raise"``; with one process before its batch is scored, with several
            once the split is scored, so that no process waits for the others forever), or is left out (``"skip"``).

    Returns:
        name -> ``(N, ...)`` CPU tensor with one row per decoded sample of the split, on every process, plus
        ``"labels"`` and :data:`NUM_SKIPPED_KEY` (int64 ``()``: the images left out). Floating outputs are
        stored as float64, integer ones as int64. Map-style data comes back in dataset order; streamed data
        in the order of ``split_dataset_by_node``'s shards.
    """
    check_on_error(on_error)
    streamed = is_streamed(dataloader.dataset)
    loader = dataloader if streamed else accelerator.prepare(dataloader)
    device = accelerator.device
    outputs: dict[Any, list[torch.Tensor]] = {}
    bar = tqdm(loader, desc=description, disable=not accelerator.is_local_main_process, leave=False)
    errors: list[str] = []  # this process's unreadable images
    # Several processes, "raise": whether every gathered image was read, kept on the device and checked once after
    # the split, since a check per batch would wait for the device at every batch.
    all_read: torch.Tensor | None = None
    for batch in bar:
        if batch.get("errors"):
            errors += batch["errors"]
            if accelerator.num_processes == 1:
                _handle_unreadable(batch["errors"], on_error)
        pixel_values = model_pixel_values(batch, device)
        # A loader not made by make_dataloader has no decoded flags: all its images count as read.
        decoded = batch.get("decoded")
        if decoded is None:
            decoded = torch.ones(pixel_values.shape[0], dtype=torch.bool)
        results = {"labels": batch["labels"].to(device, non_blocking=True),
                   # int64, not bool: every collective backend gathers it
                   "decoded": decoded.to(device, dtype=torch.long, non_blocking=True)}
        with accelerator.autocast():
            for name, scorer in scorers.items():
                value = scorer(pixel_values)
                parts = value.items() if isinstance(value, Mapping) else [(None, value)]
                for key, part in parts:
                    label = name if key is None else (name, key)
                    results[label] = _as_output(str(label), part, pixel_values.shape[0])
        if not streamed:
            results = accelerator.gather_for_metrics(results)
            if on_error == "raise" and accelerator.num_processes > 1:
                read = results["decoded"].bool().all()
                all_read = read if all_read is None else all_read & read
        for name, value in results.items():
            outputs.setdefault(name, []).append(value)
    if all_read is not None:  # every process holds the same gathered flags: all raise, or none
        _raise_if_any_unreadable(accelerator, all_read, errors)
    if not outputs:  # this process got no batch
        outputs = {name: [] for name in (*scorers, "labels", "decoded")}
    local = {name: torch.cat(values) if values else torch.empty(0) for name, values in outputs.items()}
    if streamed:
        local = _gather_unequal(accelerator, local)
        if on_error == "raise" and accelerator.num_processes > 1:
            _raise_if_any_unreadable(accelerator, local["decoded"], errors)
    if on_error == "skip" and accelerator.num_processes > 1:
        for message in errors:  # each process logs its own
            logger.warning("skipped: %s", message)
    decoded = local.pop("decoded").bool()
    kept = {name: value[decoded].cpu() for name, value in local.items()}
    kept[NUM_SKIPPED_KEY] = (~decoded).sum().cpu()
    return kept


def _raise_if_any_unreadable(accelerator: Any, decoded: torch.Tensor, errors: Sequence[str]) -> None:
    """With several processes: every process raises the same :class:`UndecodableImageError` once the gathered
    ``decoded`` flags show an unreadable image on any of them (the message comes from the process that read it)."""
    if bool(decoded.all()):
        return
    from accelerate.utils import gather_object

    messages = [message for per_process in gather_object([list(errors)]) for message in per_process]
    raise UndecodableImageError(messages[0] if messages else "an image could not be decoded")


def _gather_unequal(accelerator: Any, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate every process's rows (each may hold a different number, as streamed shards do), by rank."""
    if accelerator.num_processes == 1:
        return local
    count = torch.tensor([local["labels"].shape[0]], device=accelerator.device)
    counts = accelerator.gather(count).tolist()
    gathered = {}
    for name, value in local.items():
        padded = accelerator.pad_across_processes(value.to(accelerator.device), dim=0)
        rows = padded.shape[0]
        everything = accelerator.gather(padded)
        gathered[name] = torch.cat([everything[rank * rows: rank * rows + n] for rank, n in enumerate(counts)])
    return gathered


class ScoreCache:
    """Per-method, per-split score files under ``{output_dir}/scores``.

    A file is used for a request only if its stored fingerprint equals the requested one *and* its content is
    what such a file holds (:func:`score_file_problem`: the keys, dtypes, finite scores and, where the split's
    size is known, one row per image of the split). Anything else (missing, other fingerprint, unreadable after a
    crash, inconsistent content) reads as "not cached" and is computed again.
    """

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.output_dir = Path(output_dir)
        self.root = self.output_dir / SCORES_DIR

    def path(self, method: str, split: str) -> Path:
        return self.root / method / f"{split}.safetensors"

    def load(
        self, method: str, split: str, expected_fingerprint: str, expected_rows: int | None = None
    ) -> dict[str, torch.Tensor] | None:
        """The tensors of a valid file, else ``None``; ``expected_rows``: the split's size, ``None`` if unknown
        (streamed)."""
        path = self.path(method, split)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                if metadata.get(FINGERPRINT_KEY) != expected_fingerprint:
                    logger.info("ignoring %s: computed with other settings", path)
                    return None
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        except Exception as error:  # a truncated or foreign file is recomputed, not fatal
            logger.warning("ignoring unreadable score file %s: %s", path, error)
            return None
        problem = score_file_problem(method, tensors, expected_rows)
        if problem is not None:
            logger.warning("ignoring score file %s, its fingerprint matches but %s; computing it again", path, problem)
            return None
        return tensors

    def is_cached(self, method: str, split: str, expected_fingerprint: str, expected_rows: int | None = None) -> bool:
        return self.load(method, split, expected_fingerprint, expected_rows) is not None

    def save(self, method: str, split: str, tensors: Mapping[str, torch.Tensor], fp: str) -> Path:
        """Write atomically and never through a link (:func:`hf_gsc.safe_files.save_file`)."""
        return save_file(tensors, self.path(method, split), {FINGERPRINT_KEY: fp}, root=self.output_dir)


def score_file_problem(method: str, tensors: Mapping[str, torch.Tensor], expected_rows: int | None) -> str | None:
    """What is wrong with the content of ``method``'s score file (``None``: nothing).

    A score file holds ``labels`` (int64, one per image scored), the method's output (``ood_score``: float64 and
    finite; the base model's ``predictions``: int64), one row per image, and optionally ``num_skipped`` (int64
    ``()``, images left out as unreadable); rows plus skipped images make the split's size ``expected_rows``.
    """
    output = PREDICTIONS_KEY if method == BASE_MODEL else SCORE_KEY
    required, allowed = {output, "labels"}, {output, "labels", NUM_SKIPPED_KEY}
    if not required <= set(tensors) <= allowed:
        return f"it holds {sorted(tensors)} instead of {sorted(required)} (and optionally {NUM_SKIPPED_KEY!r})"
    expected_dtypes = {output: torch.int64 if output == PREDICTIONS_KEY else torch.float64, "labels": torch.int64}
    for key, dtype in expected_dtypes.items():
        value = tensors[key]
        if value.dtype != dtype or value.ndim != 1:
            return f"{key!r} is {value.dtype} of shape {tuple(value.shape)} instead of a 1-D {dtype}"
    rows = tensors["labels"].shape[0]
    if tensors[output].shape[0] != rows:
        return f"it holds {tensors[output].shape[0]} {output!r} values for {rows} labels"
    if output == SCORE_KEY and not bool(torch.isfinite(tensors[output]).all()):
        return f"{output!r} holds NaN or infinite values"
    skipped = tensors.get(NUM_SKIPPED_KEY, torch.tensor(0))
    if skipped.dtype != torch.int64 or skipped.ndim != 0 or int(skipped) < 0:
        return f"{NUM_SKIPPED_KEY!r} is not a non-negative int64 number"
    if expected_rows is not None and rows + int(skipped) != expected_rows:
        return f"it holds {rows} rows (+{int(skipped)} skipped images) but the split has {expected_rows} images"
    return None


__all__ = [
    "BASE_MODEL",
    "PREDICTIONS_KEY",
    "SCORES_DIR",
    "SCORE_KEY",
    "NUM_SKIPPED_KEY",
    "IndexedImages",
    "ScoreCache",
    "StreamedImages",
    "decode_batch",
    "default_num_workers",
    "device_batches",
    "fingerprint",
    "make_accelerator",
    "make_dataloader",
    "model_pixel_values",
    "score_file_problem",
    "score_split",
]
