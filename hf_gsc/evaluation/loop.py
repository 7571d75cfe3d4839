"""The scoring loop: batches of one split through every scoring function, sharded with ``accelerate``.

:func:`score_split` runs several scoring functions on each batch (under ``accelerator.autocast()``) and collects
their outputs across processes: ``gather_for_metrics`` drops the duplicates ``accelerate`` pads an uneven last batch
with, so every process returns exactly one value per sample, in dataset order. Outputs stay on the device until the
split ends: no host synchronisation per batch.

Unreadable images (``on_error`` as in :mod:`hf_gsc.data.decoding`) arrive as placeholders marked not decoded
(:mod:`hf_gsc.evaluation.loaders`), so that every process keeps equal batches; the loop then raises
:class:`~hf_gsc.data.decoding.UndecodableImageError` (``"raise"``; with several processes on every process at once,
after the split's last gathering) or drops the marked rows after gathering and counts them (``"skip"``). The
loaders are :mod:`hf_gsc.evaluation.loaders`, the accelerator :mod:`hf_gsc.evaluation.accelerator`, and the files
the scores are kept in :mod:`hf_gsc.evaluation.score_cache`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeAlias, TypeVar

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..data.decoding import OnError, UndecodableImageError, check_on_error
from .fingerprints import is_streamed
from .loaders import handle_unreadable, model_pixel_values
from .score_cache import NUM_SKIPPED_KEY


logger = logging.getLogger(__name__)

#: A scoring function: ``pixel_values`` -> ``(B, ...)`` tensor, or a mapping key -> ``(B, ...)`` tensor.
Scorer = Callable[[torch.Tensor], "torch.Tensor | Mapping[str, torch.Tensor]"]
#: A scorer's name: a string, or any hashable key (the ablations name theirs by tuples).
Name = TypeVar("Name", bound=Hashable)
#: A key of :func:`score_split`'s result: a scorer's name, ``(name, key)`` for each entry of a scorer's mapping, or
#: one of the strings ``"labels"``, ``"decoded"`` and :data:`~hf_gsc.evaluation.score_cache.NUM_SKIPPED_KEY`.
OutputKey: TypeAlias = Name | tuple[Name, str] | str


def _as_output(name: str, value: torch.Tensor, batch_size: int) -> torch.Tensor:
    """A scorer's output ``(B, ...)`` as float64 (floating) or int64, checked for its leading size."""
    if value.ndim == 0 or value.shape[0] != batch_size:
        raise RuntimeError(f"{name} returned shape {tuple(value.shape)} for a batch of {batch_size}; expected (B, ...)")
    value = value.detach()
    return value.double() if value.is_floating_point() else value.long()


def score_split(
    accelerator: Any,
    dataloader: DataLoader,
    scorers: Mapping[Name, Scorer],
    description: str = "",
    on_error: OnError = "raise",
) -> dict[OutputKey[Name], torch.Tensor]:
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
    outputs: dict[OutputKey[Name], list[torch.Tensor]] = {}
    bar = tqdm(loader, desc=description, disable=not accelerator.is_local_main_process, leave=False)
    errors: list[str] = []  # this process's unreadable images
    # Several processes, "raise": whether every gathered image was read, kept on the device and checked once after
    # the split, since a check per batch would wait for the device at every batch.
    all_read: torch.Tensor | None = None
    for batch in bar:
        if batch.get("errors"):
            errors += batch["errors"]
            if accelerator.num_processes == 1:
                handle_unreadable(batch["errors"], on_error)
        pixel_values = model_pixel_values(batch, device)
        # A loader not made by make_dataloader has no decoded flags: all its images count as read.
        decoded = batch.get("decoded")
        if decoded is None:
            decoded = torch.ones(pixel_values.shape[0], dtype=torch.bool)
        results: dict[OutputKey[Name], torch.Tensor] = {
            "labels": batch["labels"].to(device, non_blocking=True),
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
        for result_key, value in results.items():
            outputs.setdefault(result_key, []).append(value)
    if all_read is not None:  # every process holds the same gathered flags: all raise, or none
        _raise_if_any_unreadable(all_read, errors)
    if not outputs:  # this process got no batch
        names: list[OutputKey[Name]] = [*scorers, "labels", "decoded"]
        outputs = {name: [] for name in names}
    local = {name: torch.cat(values) if values else torch.empty(0) for name, values in outputs.items()}
    if streamed:
        local = _gather_unequal(accelerator, local)
        if on_error == "raise" and accelerator.num_processes > 1:
            _raise_if_any_unreadable(local["decoded"], errors)
    if on_error == "skip" and accelerator.num_processes > 1:
        for message in errors:  # each process logs its own
            logger.warning("skipped: %s", message)
    decoded = local.pop("decoded").bool()
    kept = {name: value[decoded].cpu() for name, value in local.items()}
    kept[NUM_SKIPPED_KEY] = (~decoded).sum().cpu()
    return kept


def _raise_if_any_unreadable(decoded: torch.Tensor, errors: Sequence[str]) -> None:
    """With several processes: every process raises the same :class:`UndecodableImageError` once the gathered
    ``decoded`` flags show an unreadable image on any of them (the message comes from the process that read it)."""
    if bool(decoded.all()):
        return
    from accelerate.utils import gather_object

    messages = [message for per_process in gather_object([list(errors)]) for message in per_process]
    raise UndecodableImageError(messages[0] if messages else "an image could not be decoded")


def _gather_unequal(
    accelerator: Any, local: dict[OutputKey[Name], torch.Tensor]
) -> dict[OutputKey[Name], torch.Tensor]:
    """Concatenate every process's rows (each may hold a different number, as streamed shards do), by rank."""
    if accelerator.num_processes == 1:
        return local
    count = torch.tensor([local["labels"].shape[0]], device=accelerator.device)
    counts = accelerator.gather(count).tolist()
    gathered: dict[OutputKey[Name], torch.Tensor] = {}
    for name, value in local.items():
        padded = accelerator.pad_across_processes(value.to(accelerator.device), dim=0)
        rows = padded.shape[0]
        everything = accelerator.gather(padded)
        gathered[name] = torch.cat([everything[rank * rows: rank * rows + n] for rank, n in enumerate(counts)])
    return gathered


__all__ = ["score_split"]
