"""Fitting the detectors that need ID data (ReAct, KNN, Mahalanobis, GSC's Fisher / adaptive mass), and reusing fits.

The main process fits each detector on its ``fit_split`` data and saves the fitted state to
``detectors/{method}/`` with a ``fit.json`` holding the fit's fingerprint; the other processes wait and
load it. A rerun reuses a saved fit whose fingerprint still matches. Batches reach the model's device
and run under the accelerator's autocast, like the scoring batches.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .loop import device_batches, make_dataloader

DETECTORS_DIR = "detectors"
FIT_INFO = "fit.json"


def _fit_dir(output_dir: Path, method: str) -> Path:
    return output_dir / DETECTORS_DIR / method


def _load_fit(directory: Path, expected: str) -> dict[str, torch.Tensor] | None:
    """The fitted state saved with fingerprint ``expected``, else ``None``."""
    from safetensors.torch import load_file

    from ..detectors.base import STATE_FILE

    try:
        with open(directory / FIT_INFO) as handle:
            info = json.load(handle)
        if info.get("fingerprint") != expected:
            return None
        return load_file(str(directory / STATE_FILE))
    except (OSError, ValueError):
        return None


def saved_fit_size(output_dir: Path, method: str) -> int | None:
    """The number of samples the saved fit of ``method`` used (``fit.json``), or ``None``."""
    try:
        return int(json.loads((_fit_dir(output_dir, method) / FIT_INFO).read_text())["num_samples"])
    except (OSError, ValueError, KeyError):
        return None


class _Counted:
    """Iterates ``(pixel_values, labels)`` batches and counts the samples (a streamed split has no ``len``)."""

    def __init__(self, batches: Any) -> None:
        self.batches, self.count = batches, 0

    def __iter__(self):
        for pixel_values, labels in self.batches:
            self.count += pixel_values.shape[0]
            yield pixel_values, labels


def fit_detectors(
    accelerator: Any,
    detectors: Mapping[str, Any],
    to_fit: Sequence[str],
    fit_data: Mapping[str, Any],
    fit_fingerprints: Mapping[str, str],
    transform_for: Callable[[str], Callable[[list], torch.Tensor]],
    batch_size: int,
    output_dir: Path,
    seed: int,
    overwrite: bool,
    num_workers: int = 0,
) -> None:
    """Main process: load a valid saved fit or fit and save; then every other process loads it."""
    from tqdm.auto import tqdm

    from ..detectors.base import STATE_FILE

    if accelerator.is_main_process:
        for name in to_fit:
            directory = _fit_dir(output_dir, name)
            state = None if overwrite else _load_fit(directory, fit_fingerprints[name])
            if state is not None:
                detectors[name].load_state_dict(state)
                continue
            torch.manual_seed(seed)
            np.random.seed(seed)
            split = detectors[name].fit_split
            loader = make_dataloader(fit_data[name], transform_for(f"ID {split}"), batch_size, num_workers,
                                     accelerator.device)
            batches = _Counted(device_batches(tqdm(loader, desc=f"fit {name}", leave=False), accelerator.device))
            with accelerator.autocast():
                detectors[name].fit(batches)
            detectors[name].save(directory)
            tmp = directory / f".{FIT_INFO}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({"fingerprint": fit_fingerprints[name], "num_samples": batches.count}))
            os.replace(tmp, directory / FIT_INFO)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        from safetensors.torch import load_file

        for name in to_fit:
            detectors[name].load_state_dict(load_file(str(_fit_dir(output_dir, name) / STATE_FILE)))


__all__ = ["DETECTORS_DIR", "fit_detectors", "saved_fit_size"]
