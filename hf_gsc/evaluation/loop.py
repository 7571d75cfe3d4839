"""The scoring loop: batches of one split through every method, sharded with ``accelerate``, cached.

* :class:`IndexedImages` + :func:`make_dataloader`: a ``DataLoader`` over sample *indices*, whose
  collate function reads the images of a batch and turns them into ``pixel_values`` in one image
  processor call. ``accelerator.prepare`` shards the indices over the processes.
* :func:`score_split`: runs several scoring functions on each batch and collects their outputs with
  ``accelerator.gather_for_metrics``, which drops the duplicates ``accelerate`` pads an uneven last
  batch with, so every process returns exactly one value per sample, in dataset order.
* :class:`ScoreCache`: ``scores/{method}/{split}.safetensors`` under the output dir, written
  atomically (temporary file, then ``os.replace``) by the main process as soon as a split is done,
  and tagged with a fingerprint of everything the scores depend on, so a rerun reuses exactly the
  files that are still valid and a crash loses only the split in progress.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

#: Subfolder of the output dir holding ``{method}/{split}.safetensors``.
SCORES_DIR = "scores"
#: Key of the score tensor inside a score file.
SCORE_KEY = "ood_score"
FINGERPRINT_KEY = "fingerprint"


def fingerprint(values: Mapping[str, Any]) -> str:
    """A short stable hash of a JSON-serialisable description (sorted keys)."""
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class IndexedImages:
    """Collate function: ``[indices]`` -> ``{"pixel_values": (B, C, H, W), "labels": (B,)}``.

    Args:
        dataset: a ``datasets.Dataset`` with an ``image`` column (``datasets.Image``) and a ``label``
            column (``-1`` or missing for OOD data).
        transform: a list of PIL images -> ``(B, C, H, W)`` float tensor (the model's preprocessing).
    """

    def __init__(self, dataset: Any, transform: Callable[[list], torch.Tensor]) -> None:
        self.dataset = dataset
        self.transform = transform
        self.has_labels = "label" in dataset.column_names

    def __call__(self, indices: Sequence[int]) -> dict[str, torch.Tensor]:
        rows = self.dataset[list(indices)]
        pixel_values = self.transform(rows["image"])
        if self.has_labels:
            labels = torch.as_tensor(rows["label"], dtype=torch.long)
        else:
            labels = torch.full((len(indices),), -1, dtype=torch.long)
        return {"pixel_values": pixel_values, "labels": labels}


def make_dataloader(dataset: Any, transform: Callable[[list], torch.Tensor], batch_size: int) -> DataLoader:
    """An ordered (unshuffled) loader of ``dataset``; wrap with ``accelerator.prepare`` to shard it."""
    return DataLoader(
        range(len(dataset)), batch_size=batch_size, shuffle=False, collate_fn=IndexedImages(dataset, transform)
    )


def score_split(
    accelerator: Any,
    dataloader: DataLoader,
    scorers: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
    description: str = "",
) -> dict[str, torch.Tensor]:
    """Run every scorer on each batch of ``dataloader`` on all processes; gather in dataset order.

    Args:
        accelerator: an ``accelerate.Accelerator``.
        dataloader: from :func:`make_dataloader` (not yet prepared: it is prepared here).
        scorers: name -> ``pixel_values -> (B,)`` tensor (an ``ood_score``, a prediction...).
        description: progress bar label (the bar shows on the local main process only).

    Returns:
        name -> ``(N,)`` CPU tensor with one value per sample of the split, on every process, plus
        ``"labels"``. Floating outputs are stored as float64, integer ones as int64.
    """
    prepared = accelerator.prepare(dataloader)
    outputs: dict[str, list[torch.Tensor]] = {name: [] for name in (*scorers, "labels")}
    bar = tqdm(prepared, desc=description, disable=not accelerator.is_local_main_process, leave=False)
    for batch in bar:
        pixel_values = batch["pixel_values"].to(accelerator.device)
        results = {"labels": batch["labels"].to(accelerator.device)}
        for name, scorer in scorers.items():
            value = scorer(pixel_values).detach()
            if value.ndim != 1 or value.shape[0] != pixel_values.shape[0]:
                raise RuntimeError(
                    f"{name} returned shape {tuple(value.shape)} for a batch of {pixel_values.shape[0]}; expected (B,)"
                )
            results[name] = value.double() if value.is_floating_point() else value.long()
        gathered = accelerator.gather_for_metrics(results)
        for name, value in gathered.items():
            outputs[name].append(value.cpu())
    return {name: torch.cat(values) if values else torch.empty(0) for name, values in outputs.items()}


class ScoreCache:
    """Per-method, per-split score files under ``{output_dir}/scores``.

    A file is valid for a request only if its stored fingerprint equals the requested one; anything
    else (missing, other fingerprint, unreadable after a crash) reads as "not cached".
    """

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.root = Path(output_dir) / SCORES_DIR

    def path(self, method: str, split: str) -> Path:
        return self.root / method / f"{split}.safetensors"

    def load(self, method: str, split: str, expected_fingerprint: str) -> dict[str, torch.Tensor] | None:
        path = self.path(method, split)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
                if metadata.get(FINGERPRINT_KEY) != expected_fingerprint:
                    logger.info("ignoring %s: computed with other settings", path)
                    return None
                return {key: handle.get_tensor(key) for key in handle.keys()}
        except Exception as error:  # a truncated or foreign file is recomputed, not fatal
            logger.warning("ignoring unreadable score file %s: %s", path, error)
            return None

    def is_cached(self, method: str, split: str, expected_fingerprint: str) -> bool:
        return self.load(method, split, expected_fingerprint) is not None

    def save(self, method: str, split: str, tensors: Mapping[str, torch.Tensor], fp: str) -> Path:
        """Write atomically: a temporary file in the same folder, then ``os.replace``."""
        path = self.path(method, split)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp), {FINGERPRINT_KEY: fp})
        os.replace(tmp, path)
        return path


__all__ = [
    "SCORES_DIR",
    "SCORE_KEY",
    "IndexedImages",
    "ScoreCache",
    "fingerprint",
    "make_dataloader",
    "score_split",
]
