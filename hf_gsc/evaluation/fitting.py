"""Fitting the detectors that need ID data (ReAct, KNN, Mahalanobis, ..., GSC's Fisher / adaptive mass), and reusing fits.

The main process fits every detector of one ``fit_split`` from one backbone pass per batch over that split's data
(:func:`hf_gsc.backbone_pass.fit_together`), and saves each fitted state to ``detectors/{method}/`` with a ``fit.json``
holding the fit's fingerprint; the other processes wait and load it. A rerun reuses a saved fit whose fingerprint
still matches. Batches reach the model's device and run under the accelerator's autocast, like the scoring batches;
unreadable images raise or are left out (``on_error``) and ``fit.json`` records how many were.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import STATE_FILE
from ..data.decoding import OnError
from ..safe_files import atomic_write_text, make_dirs
from ..saved_files import read_state, save_state
from .loaders import device_batches, make_dataloader
from .score_cache import NUM_SKIPPED_KEY

DETECTORS_DIR = "detectors"
FIT_INFO = "fit.json"


def fit_dir(output_dir: Path, method: str) -> Path:
    return Path(output_dir) / DETECTORS_DIR / method


def _load_fit(directory: Path, expected: str) -> dict[str, torch.Tensor] | None:
    """The fitted state saved with fingerprint ``expected``, else ``None`` (missing, stale, truncated or
    unreadable: fit again)."""
    try:
        with open(directory / FIT_INFO) as handle:
            info = json.load(handle)
        if info.get("fingerprint") != expected:
            return None
        return read_state(directory / STATE_FILE)
    except (OSError, ValueError):
        return None


def saved_fit_info(output_dir: Path, method: str) -> dict[str, int]:
    """``num_samples`` and ``num_skipped`` (unreadable images) of the saved fit of ``method`` (``fit.json``);
    ``{}`` without one."""
    try:
        info = json.loads((fit_dir(output_dir, method) / FIT_INFO).read_text())
        return {"num_samples": int(info["num_samples"]), NUM_SKIPPED_KEY: int(info.get(NUM_SKIPPED_KEY, 0))}
    except (OSError, ValueError, KeyError):
        return {}


class _Counted:
    """Iterates a loader's batches and counts the decoded and the unreadable images (a streamed split has no ``len``)."""

    def __init__(self, batches: Any) -> None:
        self.batches, self.count, self.skipped = batches, 0, 0

    def __iter__(self):
        for batch in self.batches:
            decoded = int(batch["decoded"].sum())
            self.count += decoded
            self.skipped += len(batch["decoded"]) - decoded
            yield batch


def fit_groups(detectors: Mapping[str, Any], to_fit: Sequence[str], fit_data: Mapping[str, Any]) -> list[list[str]]:
    """The methods of ``to_fit`` grouped by the data they fit on (the same split, subset and seed: the same
    dataset object), so that each group costs one pass over its data."""
    groups: dict[int, list[str]] = {}
    for name in to_fit:
        groups.setdefault(id(fit_data[name]), []).append(name)
    return list(groups.values())


def fit_detectors(
    accelerator: Any,
    detectors: Mapping[str, Any],
    to_fit: Sequence[str],
    fit_data: Mapping[str, Any],
    fit_fingerprints: Mapping[str, str],
    transform: Callable[[list], torch.Tensor],
    batch_size: int,
    output_dir: Path,
    seed: int,
    overwrite: bool,
    num_workers: int = 0,
    on_error: OnError = "raise",
    source: str = "",
) -> dict[str, str]:
    """Main process: load each valid saved fit; fit the others, one backbone pass per batch for every method of a
    fit split, and save them; then every other process loads them.

    A method whose fit fails (too few samples, a class without samples, ...) is not saved: it is returned, mapped to
    the reason, on every process, and the others are fitted and saved as usual.
    ``on_error``: an unreadable image raises, naming ``ID {split} ({source})``, its row and file, or is left out.
    """
    from tqdm.auto import tqdm

    from ..detectors import fit_together

    failed: dict[str, str] = {}
    if accelerator.is_main_process:
        pending = []
        for name in to_fit:
            state = None if overwrite else _load_fit(fit_dir(output_dir, name), fit_fingerprints[name])
            if state is not None:
                detectors[name].load_fitted_state(state, source=str(fit_dir(output_dir, name) / STATE_FILE))
            else:
                pending.append(name)
        for group in fit_groups(detectors, pending, fit_data):
            torch.manual_seed(seed)
            np.random.seed(seed)
            split = detectors[group[0]].fit_split
            loader = make_dataloader(fit_data[group[0]], transform, batch_size, num_workers,
                                     accelerator.device, dataset_name=f"ID {split} ({source})")
            counted = _Counted(tqdm(loader, desc=f"fit {', '.join(group)}", leave=False))
            with accelerator.autocast():
                fit_together([detectors[name] for name in group], device_batches(counted, accelerator.device, on_error),
                             name=f"ID {split} data", errors=failed)
            for name in [name for name in group if name not in failed]:
                directory = fit_dir(output_dir, name)
                make_dirs(output_dir, Path(DETECTORS_DIR) / name)  # refuses a link on the way leading out of output_dir
                save_state(detectors[name].fitted_state(), directory / STATE_FILE)
                atomic_write_text(directory / FIT_INFO, json.dumps({"fingerprint": fit_fingerprints[name],
                                                                   "num_samples": counted.count,
                                                                   NUM_SKIPPED_KEY: counted.skipped}))
    accelerator.wait_for_everyone()
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        holder = [failed]
        broadcast_object_list(holder, from_process=0)
        failed = holder[0]
    if not accelerator.is_main_process:
        for name in to_fit:
            if name not in failed:
                path = fit_dir(output_dir, name) / STATE_FILE
                detectors[name].load_fitted_state(read_state(path), source=str(path))
    return failed


__all__ = ["DETECTORS_DIR", "fit_detectors", "fit_dir", "fit_groups", "saved_fit_info"]
