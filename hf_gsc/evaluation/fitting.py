"""Fitting the detectors that need ID data (ReAct, KNN, Mahalanobis, ..., GSC's Fisher / adaptive mass), and reusing fits.

Every process fits every detector of one ``fit_split`` from one backbone pass per batch over its share of that
split's data (:func:`hf_gsc.detectors.backbone_pass.fit_together`); the shares are combined, so that every process
holds the fit one process would compute (:mod:`hf_gsc.evaluation.distributed`). A method that the fit split's rows
(after ``--max-fit-samples``) cannot satisfy is refused before the pass (``FittedDetector.check_fit_size``). The main process saves each fitted
state to ``detectors/{method}/`` with a ``fit.json`` holding the fit's fingerprint, the images each process read, the
wall time of the pass and the methods fitted in it (``fitted_together``, which share that time); a rerun reuses a
saved fit whose fingerprint still matches (every process loads it). Batches reach the model's device and run under
the accelerator's autocast, like the scoring batches; unreadable images raise or are left out (``on_error``) and
``fit.json`` records how many were.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..settings.config import STATE_FILE
from ..storage.saved_format import read_state, save_state
from ..utils.confined_files import atomic_write_text, make_dirs
from .context import RunContext
from .loaders import make_dataloader
from .score_cache import NUM_SKIPPED_KEY


if TYPE_CHECKING:
    from ..detectors.interface import OODDetector

DETECTORS_DIR = "detectors"
FIT_INFO = "fit.json"
#: Keys of ``fit.json`` and of :class:`FitOutcome`'s passes: the images each process read in the fit's pass, by rank,
#: and the names fitted in that pass.
IMAGES_PER_PROCESS = "images_per_process"
FITTED_TOGETHER = "fitted_together"
#: Key of ``fit.json`` and of the passes: each process's peak resident memory since it started, in bytes, by rank, read
#: when the pass (gathering and ``fit_end`` included) is over: what a process held for the fit, beside its model.
PEAK_MEMORY_PER_PROCESS = "peak_memory_bytes_per_process"


def peak_memory_bytes() -> int | None:
    """This process's peak resident memory since it started (``getrusage``; ``None`` where the platform has none)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def fit_dir(output_dir: Path, method: str) -> Path:
    return Path(output_dir) / DETECTORS_DIR / method


def read_fit_info(directory: Path) -> dict[str, Any]:
    """The ``fit.json`` of the saved fit in ``directory`` (:func:`fit_dir`; the one reader of it); ``{}`` when it is
    missing, unreadable or not a JSON object."""
    try:
        info = json.loads((Path(directory) / FIT_INFO).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _load_fit(directory: Path, expected: str) -> dict[str, torch.Tensor] | None:
    """The fitted state saved with fingerprint ``expected``, else ``None`` (missing, stale, truncated or
    unreadable: fit again)."""
    if read_fit_info(directory).get("fingerprint") != expected:
        return None
    try:
        return read_state(directory / STATE_FILE)
    except (OSError, ValueError):
        return None


def saved_fit_info(output_dir: Path, method: str) -> dict[str, int]:
    """``num_samples`` and ``num_skipped`` (unreadable images) of the saved fit of ``method`` (``fit.json``);
    ``{}`` without one."""
    info = read_fit_info(fit_dir(output_dir, method))
    try:
        return {"num_samples": int(info["num_samples"]), NUM_SKIPPED_KEY: int(info.get(NUM_SKIPPED_KEY, 0))}
    except (ValueError, KeyError):
        return {}


@dataclass(frozen=True)
class FitOutcome:
    """What :func:`fit_detectors` returns, the same on every process.

    Attributes:
        failed: name -> why its fit failed (the fitted and the reused ones are not in it).
        passes: one entry per pass over fit data: ``fitted_together`` (the names fitted in it), ``split``,
            ``seconds`` (wall time of the pass, gathering and ``fit_end`` included), ``images_per_process`` (images
            each process decoded, by rank), ``peak_memory_bytes_per_process`` (:data:`PEAK_MEMORY_PER_PROCESS`),
            ``num_skipped`` (unreadable images left out, all processes).
        images_per_process: the images the fit passes read on each process, by rank, all passes together (a fit
            reused from an earlier run reads none).
    """

    failed: dict[str, str]
    passes: list[dict[str, Any]]
    images_per_process: list[int]

    @classmethod
    def of_passes(cls, failed: Mapping[str, str], passes: Sequence[Mapping[str, Any]],
                  num_processes: int) -> FitOutcome:
        """The outcome of ``passes`` on ``num_processes`` processes (their images summed per rank)."""
        kept = [dict(entry) for entry in passes]
        return cls(dict(failed), kept, [sum(entry[IMAGES_PER_PROCESS][rank] for entry in kept)
                                        for rank in range(num_processes)])

    @property
    def seconds(self) -> float:
        """Wall time of this call's fit passes."""
        return round(sum(entry["seconds"] for entry in self.passes), 3)


def fit_groups(to_fit: Sequence[str], fit_data: Mapping[str, Any]) -> list[list[str]]:
    """The methods of ``to_fit`` grouped by the data they fit on (the same split, subset and seed: the same
    dataset object), so that each group costs one pass over its data."""
    groups: dict[int, list[str]] = {}
    for name in to_fit:
        groups.setdefault(id(fit_data[name]), []).append(name)
    return list(groups.values())


def refuse_too_small(detectors: Mapping[str, OODDetector], pending: Sequence[str], fit_data: Mapping[str, Any],
                      failed: dict[str, str], source: str | None = None) -> list[str]:
    """The methods of ``pending`` whose fit data holds enough samples for them (``FittedDetector.check_fit_size``);
    the others go to ``failed`` with the reason before any image is read (the data's row count, where it is known).
    ``source``: what the rows are, for the reason (default: the method's ID fit split after ``--max-fit-samples``)."""
    from ..detectors.penultimate import NotEnoughSamplesError
    from .plan import num_rows

    kept = []
    for name in pending:
        rows, check = num_rows(fit_data[name]), getattr(detectors[name], "check_fit_size", None)
        try:
            if rows is not None and check is not None:
                check(rows, source or f"the ID {detectors[name].fit_split} split (its rows, at most --max-fit-samples)")
            kept.append(name)
        except NotEnoughSamplesError as error:
            failed[name] = f"fit failed: {type(error).__name__}: {error}"
    return kept


def fit_detectors(
    context: RunContext,
    detectors: Mapping[str, OODDetector],
    to_fit: Sequence[str],
    fit_data: Mapping[str, Any],
    fit_fingerprints: Mapping[str, str],
) -> FitOutcome:
    """Every process: load each valid saved fit; fit the others, one backbone pass per batch of its share of each
    fit split for every method fitted on it (see the module docstring); the main process saves them.

    ``detectors``, ``to_fit``, ``fit_data`` (name -> data) and ``fit_fingerprints`` are keyed by name (a method, or a
    tuning grid point). ``context.output_dir=None``: nothing is loaded or saved (``fit_fingerprints`` unused);
    ``context.overwrite``: saved fits are not reused. A fit that fails (too few samples, a class without samples,
    ...) is not saved: it is returned, mapped to the reason, on every process, and the others are fitted and saved as
    usual. ``context.on_error``: an unreadable image raises, naming ``ID {split} ({context.source})``, its row and
    file (on every process, with several), or is left out.
    """
    from tqdm.auto import tqdm

    from ..detectors import fit_together
    from .distributed import ProcessShards, shard_loader

    accelerator, output_dir, seed = context.accelerator, context.output_dir, context.seed
    pending = list(to_fit)
    if output_dir is not None and not context.overwrite:
        # The main process decides which saved fits are valid, so that all processes agree; each loads those.
        states = {}
        if accelerator.is_main_process:
            states = {name: _load_fit(fit_dir(output_dir, name), fit_fingerprints[name]) for name in to_fit}
        pending = [name for name in to_fit if states.get(name) is None]  # the main process's list replaces it
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            holder = [pending]
            broadcast_object_list(holder, from_process=0)
            pending = holder[0]
        for name in [name for name in to_fit if name not in pending]:
            path = fit_dir(output_dir, name) / STATE_FILE
            kept = states.get(name)  # not None on the main process: a name with no valid saved fit is pending
            state = kept if kept is not None else read_state(path)
            detectors[name].load_fitted_state(state, source=str(path))
    failed: dict[str, str] = {}
    passes = []
    pending = refuse_too_small(detectors, pending, fit_data, failed)
    for group in fit_groups(pending, fit_data):
        begin = time.perf_counter()
        torch.manual_seed(seed)
        np.random.seed(seed)
        dataset, split = fit_data[group[0]], detectors[group[0]].fit_split
        dataset_name = f"ID {split} ({context.source})"
        loader, keys = shard_loader(
            lambda rank, world: make_dataloader(dataset, context.transform, context.batch_size, context.num_workers,
                                                accelerator.device, rank, world, dataset_name=dataset_name),
            dataset, accelerator.process_index, accelerator.num_processes)
        shards = ProcessShards(accelerator, context.on_error)
        bar = tqdm(loader, desc=f"fit {', '.join(group)}", leave=False, disable=not accelerator.is_local_main_process)
        errors: dict[str, str] = {}
        with accelerator.autocast():
            fit_together([detectors[name] for name in group], shards.read(bar, keys, accelerator.device),
                         name=f"ID {split} data", errors=errors, shards=shards, names=group)
        failed.update(errors)
        counts = [(shards.count, shards.skipped, peak_memory_bytes())]
        if accelerator.num_processes > 1:
            from accelerate.utils import gather_object

            counts = gather_object(counts)
        images = [count for count, _, _ in counts]
        num_skipped = sum(skipped for _, skipped, _ in counts)
        peaks = [peak for _, _, peak in counts]
        seconds = round(time.perf_counter() - begin, 3)
        if output_dir is not None and accelerator.is_main_process:
            for name in [name for name in group if name not in errors]:
                directory = fit_dir(output_dir, name)
                make_dirs(output_dir, Path(DETECTORS_DIR) / name)  # refuses a link on the way leading out of output_dir
                save_state(detectors[name].fitted_state(), directory / STATE_FILE)
                atomic_write_text(directory / FIT_INFO, json.dumps({"fingerprint": fit_fingerprints[name],
                                                                   "num_samples": sum(images),
                                                                   NUM_SKIPPED_KEY: num_skipped,
                                                                   IMAGES_PER_PROCESS: images, "seconds": seconds,
                                                                   PEAK_MEMORY_PER_PROCESS: peaks,
                                                                   FITTED_TOGETHER: list(group)}))
        passes.append({FITTED_TOGETHER: list(group), "split": split, "seconds": seconds, IMAGES_PER_PROCESS: images,
                       PEAK_MEMORY_PER_PROCESS: peaks, NUM_SKIPPED_KEY: num_skipped})
    accelerator.wait_for_everyone()  # the saved fits are complete before any process goes on
    return FitOutcome.of_passes(failed, passes, accelerator.num_processes)


def fit_record(output_dir: Path, method: str, dataset: Any) -> dict[str, Any]:
    """``num_samples`` (images the fit used) and ``num_skipped`` (unreadable ones left out) of a method's fit."""
    from .plan import num_rows

    saved = saved_fit_info(output_dir, method)
    num_skipped = saved.get(NUM_SKIPPED_KEY, 0)
    rows = num_rows(dataset)
    return {"num_samples": rows - num_skipped if rows is not None else saved.get("num_samples"),
            NUM_SKIPPED_KEY: num_skipped}


__all__ = [
    "DETECTORS_DIR",
    "FITTED_TOGETHER",
    "IMAGES_PER_PROCESS",
    "PEAK_MEMORY_PER_PROCESS",
    "FitOutcome",
    "fit_detectors",
    "fit_dir",
    "fit_groups",
    "fit_record",
    "read_fit_info",
    "refuse_too_small",
    "saved_fit_info",
]
