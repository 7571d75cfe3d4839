"""The evaluation's fits on several processes: each process passes its share of the fit data through the backbone,
and the fit combines the shares, so that a fit on ``N`` processes equals the one-process fit (to the last bit where
per-sample values are gathered, up to float64 rounding where sums are added).

Sharding (:func:`shard_loader`): the fit data is cut into the batches one process reads (``batch_size`` rows in
dataset order) and process ``r`` of ``N`` reads batches ``r, r + N, r + 2N, ...``. Nothing is padded and nothing read
twice: a fit needs no collective per batch (scoring's ``gather_for_metrics`` does, hence its padding), so an uneven
last share is simply shorter. A streamed split is split with ``split_dataset_by_node`` as for scoring, and its batches
are ordered by process (a stream has no dataset order to restore).

Combining (:class:`ProcessShards`, the evaluation's :class:`hf_gsc.detectors.backbone_pass.FitShards`): after the pass, each
detector's ``fit_gather`` swaps what it took from its process's batches for every process's batches, back in the
order of the data with the same batch boundaries, then the unchanged ``fit_end`` runs on every process. What is
gathered is what the fits took from the passes, not the passes: a pass holds ``F`` at every split point (a ViT's
tokens, hundreds of kB per image) and the pixel values, and fitting again from it would repeat on every process the
per-sample work some fits do after the pass (GSC's head gradients, AdaSCALE's gradient step). What detectors take
per sample is what a one-process fit already holds in memory:

* the penultimate-feature fits (``FittedDetector``): those that read every feature (KNN, ViM, ReAct, ConjNorm,
  NNGuide) gather the features and labels of each batch, one gathering shared by every detector of the pass, and
  compute their banks and percentiles by the same code from the same batches in the same order as on one process;
  those that keep statistics (the Gaussian family, DICE, NCI, fDBD, SHE) add every process's float64 sums
  (``ClassStatistics.gather``: moved to one shift, then ``shards.sum``), so that no process holds another's
  features for them: equal to the one-process sums up to float64 rounding;
* AdaSCALE: ``Q'`` per sample (gathered; its seeded subsample then draws the rows one process draws);
* GSC's diagonal Fisher: a ``(d,)`` float64 sum and a count per process, reduced (``d`` per process instead of
  ``(N, d)``), added in process order: equal to the one-process running sum up to float64 rounding; GSC's gradient
  mass: the per-sample ranking gradients, gathered.

Gathering moves the tensors' bytes (any dtype, bit for bit) in chunks of at most :data:`CHUNK_BYTES` per process
through the accelerator's device (NCCL gathers CUDA tensors; a bank never sits whole on the GPU). Every process then
fits on the same values with the same code, so the fitted state is the same on each (each scores its shard of the
splits later); the main process saves it. The processes agree on the failed methods before gathering and after
``fit_end`` (a collective per detector needs the same detectors everywhere), and an unreadable image raises on every
process once the pass is over (``on_error="raise"``; on one process, at once).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..data.decoding import OnError, UndecodableImageError, check_on_error
from .fingerprints import is_streamed
from .loaders import model_pixel_values


logger = logging.getLogger(__name__)

#: Most bytes one process sends in one gathering: a bank is gathered in chunks, so that it never sits whole on the
#: accelerator's device (once per process) on top of the model.
CHUNK_BYTES = 64 * 2**20

#: A batch's place in the order of the data: ``(batch number,)`` for map-style data, ``(process, batch on it)``
#: for a streamed split.
BatchKey = tuple[int, ...]


def shard_loader(make: Callable[[int, int], DataLoader], dataset: Any, process_index: int,
                 num_processes: int) -> tuple[DataLoader, Iterable[BatchKey]]:
    """``(this process's loader of ``dataset``, the key of each of its batches)``.

    ``make(process_index, num_processes)``: :func:`~hf_gsc.evaluation.loaders.make_dataloader` of ``dataset``. For
    map-style data the loader returned reads the batches of ``make(0, 1)`` numbered ``process_index``,
    ``process_index + num_processes``, ..., with its collate function and workers; a streamed ``dataset`` gets
    ``make(process_index, num_processes)`` (``split_dataset_by_node``), its keys ``(process, batch)``.
    """
    if is_streamed(dataset):
        return make(process_index, num_processes), ((process_index, j) for j in itertools.count())
    loader = make(0, 1)
    size, batch_size = len(dataset), loader.batch_size
    assert batch_size is not None, "make() gives a loader with a batch size, not a batch sampler"
    mine = range(process_index, math.ceil(size / batch_size), num_processes)
    batches = [list(range(k * batch_size, min((k + 1) * batch_size, size))) for k in mine]
    options: dict[str, Any] = {"num_workers": loader.num_workers, "pin_memory": loader.pin_memory}
    if loader.num_workers > 0:
        options.update(prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers)
    return (DataLoader(loader.dataset, batch_sampler=batches, collate_fn=loader.collate_fn, **options),
            [(k,) for k in mine])


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeError(f"cannot gather tensors of dtype {name!r}")
    return dtype


class ProcessShards:
    """How the processes' parts of one fit pass combine (see the module docstring); one per pass.

    Args:
        accelerator: the evaluation's ``accelerate.Accelerator`` (its processes and device).
        on_error: what an unreadable image does (:mod:`hf_gsc.data.decoding`).

    Attributes:
        count, skipped: the images this process decoded and left out as unreadable.
        keys: the key of each batch this process passed on, in order (one per ``fit_update``).
    """

    def __init__(self, accelerator: Any, on_error: OnError = "raise") -> None:
        check_on_error(on_error)
        self.accelerator = accelerator
        self.num_processes = accelerator.num_processes
        self.on_error = on_error
        self.count = self.skipped = 0
        self.keys: list[BatchKey] = []
        self.unreadable: list[str] = []  # this process's messages
        self._memo: dict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    # ------------------------------------------------------------------ reading this process's share
    def read(self, loader: Iterable[dict[str, Any]], keys: Iterable[BatchKey],
             device: torch.device | str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(pixel_values, labels)`` of each batch of ``loader`` on ``device``, unreadable images left out (a batch
        with none left is not passed on), each kept batch's key recorded. With several processes, a first unreadable
        image stops this process's pass when unreadable images raise: :meth:`agree` raises it on every process."""
        for key, batch in zip(keys, loader):
            decoded = batch["decoded"]
            kept = int(decoded.sum())
            self.count += kept
            self.skipped += len(decoded) - kept
            errors = batch.get("errors")
            if errors:
                self.unreadable += errors
                if self.on_error == "raise":
                    if self.num_processes == 1:
                        raise UndecodableImageError(errors[0])
                    return
                for message in errors:
                    logger.warning("skipped: %s", message)
            pixel_values = model_pixel_values(batch, device)
            labels = batch["labels"].to(device, non_blocking=True)
            if errors:
                rows = decoded.to(device)
                pixel_values, labels = pixel_values[rows], labels[rows]
                if not kept:
                    continue
            self.keys.append(key)
            yield pixel_values, labels

    # ------------------------------------------------------------------ FitShards
    def agree(self, errors: dict[str, str]) -> dict[str, str]:
        """See :meth:`hf_gsc.detectors.backbone_pass.FitShards.agree` (each failure keeps the reason of the lowest process)."""
        if self.num_processes == 1:
            return errors
        from accelerate.utils import gather_object

        everything = gather_object([(dict(errors), list(self.unreadable))])
        messages = [message for _, unreadable in everything for message in unreadable]
        if messages and self.on_error == "raise":
            raise UndecodableImageError(messages[0])
        union: dict[str, str] = {}
        for failed, _ in everything:
            for name, reason in failed.items():
                union.setdefault(name, reason)
        errors.update(union)  # every process's own failures are in the union: the same reasons everywhere
        return errors

    def batches(self, local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """See :meth:`hf_gsc.detectors.backbone_pass.FitShards.batches`."""
        local = list(local)
        if len(local) != len(self.keys):
            raise RuntimeError(f"fit_gather: {len(local)} tensors for the {len(self.keys)} batches this process "
                               "fitted on; a detector must keep one per fit_update")
        if self.num_processes == 1:
            return local
        memo_key = tuple(map(id, local))
        if memo_key not in self._memo:  # the memo holds ``local`` too, so that the ids stay its tensors'
            self._memo[memo_key] = (local, self._gather(local, self.keys))
        return self._memo[memo_key][1]

    def sum(self, local: torch.Tensor | None) -> torch.Tensor | None:
        """See :meth:`hf_gsc.detectors.backbone_pass.FitShards.sum`."""
        if self.num_processes == 1:
            return local
        mine = [] if local is None else [local.unsqueeze(0)]
        parts = self._gather(mine, [(self.accelerator.process_index,)] * len(mine))
        if not parts:
            return None
        total = parts[0][0]
        for part in parts[1:]:
            total = total + part[0]
        return total

    def _gather(self, local: list[torch.Tensor], keys: Sequence[BatchKey]) -> list[torch.Tensor]:
        """Every process's tensors (rows first, the same trailing shape and dtype), ordered by key."""
        from accelerate.utils import gather_object

        first = local[0] if local else None
        described = gather_object([(list(keys), [int(t.shape[0]) for t in local],
                                     None if first is None else (tuple(first.shape[1:]), str(first.dtype),
                                                                 first.device.type))])
        kinds = {entry[2] for entry in described if entry[2] is not None}
        if not kinds:
            return []
        if len(kinds) > 1:
            raise RuntimeError(f"fit_gather: the processes hold different kinds of tensors {sorted(kinds)}")
        row_shape, dtype_name, device_type = kinds.pop()
        dtype = _dtype(dtype_name)
        row_bytes = math.prod(row_shape) * torch.empty((), dtype=dtype).element_size()
        rows = [sum(sizes) for _, sizes, _ in described]
        mine = (torch.cat([t.detach().reshape(t.shape[0], -1).cpu() for t in local]).contiguous()
                if local else torch.empty(0, math.prod(row_shape), dtype=dtype))
        mine = mine.view(torch.uint8).reshape(mine.shape[0], row_bytes)
        received: list[list[torch.Tensor]] = [[] for _ in described]
        step = max(1, CHUNK_BYTES // max(row_bytes, 1))
        for start in range(0, max(rows), step):
            length = min(step, max(rows) - start)
            piece = torch.zeros(length, row_bytes, dtype=torch.uint8)
            part = mine[start:start + length]
            piece[: part.shape[0]] = part
            gathered = self.accelerator.gather(piece.to(self.accelerator.device)).cpu()
            for rank, count in enumerate(rows):
                received[rank].append(gathered[rank * length: rank * length + max(0, min(length, count - start))])
        device = self.accelerator.device if device_type != "cpu" else torch.device("cpu")
        ordered: list[tuple[BatchKey, torch.Tensor]] = []
        for (process_keys, sizes, _), chunks in zip(described, received):
            values = (torch.cat(chunks) if chunks else torch.empty(0, row_bytes, dtype=torch.uint8)).contiguous()
            values = values.view(dtype).reshape(-1, *row_shape)
            ordered += zip(process_keys, torch.split(values, sizes))
        ordered.sort(key=lambda item: item[0])
        return [tensor.to(device) for _, tensor in ordered]


def broadcast(accelerator: Any, value: Any) -> Any:
    """The main process's ``value`` on every process (a no-op with one process)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    holder = [value]
    broadcast_object_list(holder, from_process=0)
    return holder[0]


__all__ = ["CHUNK_BYTES", "ProcessShards", "broadcast", "shard_loader"]
