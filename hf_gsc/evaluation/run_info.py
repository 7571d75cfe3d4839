"""What a run is about to do, said before it does it: the process-count check and the run header.

``accelerate launch`` has two ways of running fewer processes than asked without an error:

* without ``--multi_gpu`` (and no ``accelerate config``), ``--num_processes 2`` starts one process;
* with ``--multi_gpu`` on a machine without GPUs and without ``ACCELERATE_USE_CPU=1``, it starts the processes
  (``WORLD_SIZE=2``), but accelerate runs each as an independent single process: each would score everything.

The second is refused by :func:`check_process_count`; the first is visible in the header that
:func:`run_header` prints on the main process at the start of every run (model, device, processes, precision,
workers, methods, split sizes), before any fitting or scoring.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .errors import InputError
from .plan import ID_TEST, ID_VALIDATION, OOD_PREFIX, VAL_OOD_PREFIX, num_rows


if TYPE_CHECKING:
    from accelerate import Accelerator

    from .arguments import EvaluationArguments
    from .context import EvaluationState, RunContext
    from .plan import EvaluationPlan


def check_process_count(accelerator: Accelerator, environ: Mapping[str, str] | None = None) -> None:
    """Refuse a launch whose processes would each run alone (``WORLD_SIZE`` > 1 but one accelerate process), and warn
    when ``accelerate launch`` was asked for several processes but runs one: its simple launcher (``--cpu
    --num_processes 2`` without ``--multi_gpu``) sets ``MASTER_ADDR`` / ``MASTER_PORT`` for them and starts a single
    process, which would otherwise say nothing."""
    environ = os.environ if environ is None else environ
    if (accelerator.num_processes == 1 and "WORLD_SIZE" not in environ and "MASTER_PORT" in environ
            and "ACCELERATE_MIXED_PRECISION" in environ):
        warnings.warn(
            "accelerate launch was asked for several processes, but one runs: its simple launcher (e.g. --cpu "
            "--num_processes 2) starts a single process. On CPUs use: ACCELERATE_USE_CPU=1 accelerate launch "
            "--multi_gpu --num_processes N -m hf_gsc evaluate ...; on GPUs: accelerate launch --multi_gpu "
            "--num_processes N ... ('hf-gsc docs evaluation')", UserWarning, stacklevel=2)
    launched = int(environ.get("WORLD_SIZE", "1") or 1)
    if launched > 1 and accelerator.num_processes == 1:
        raise InputError(
            f"launched as {launched} processes (WORLD_SIZE={launched}), but accelerate runs each on its own "
            f"(device {accelerator.device}): each would score every split. On CPUs set ACCELERATE_USE_CPU=1 "
            "(ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N -m hf_gsc evaluate ...); "
            "see 'hf-gsc docs evaluation'"
        )


def _size(value: int | None) -> str:
    return "streamed" if value is None else str(value)


def run_header(info: Mapping[str, Any]) -> str:
    """The lines printed when a run starts, from ``info``: ``model``, ``data``, ``device``, ``num_processes``,
    ``mixed_precision``, ``num_workers``, ``image_backend``, ``methods``, ``split_sizes`` (split -> rows,
    ``None`` when streamed), ``fit_sizes`` (method -> rows), ``num_to_score`` / ``num_scores`` (score files
    to compute / in all) and ``visible_gpus``."""
    processes = info["num_processes"]
    lines = [
        f"hf-gsc evaluate: {info['model']} on {info['data']}",
        f"  device {info['device']}, {processes} process{'es' if processes != 1 else ''}, "
        f"mixed precision {info['mixed_precision']}, {info['num_workers']} data workers per process, "
        f"image backend {info['image_backend']}",
    ]
    gpus = info.get("visible_gpus") or 0
    if processes == 1 and gpus > 1:
        lines.append(f"  note: {gpus} GPUs visible but 1 process: "
                     f"accelerate launch --multi_gpu --num_processes {gpus} -m hf_gsc evaluate ... uses them all")
    lines.append(f"  methods: {', '.join(info['methods'])}")
    if info.get("shipped"):
        lines.append(f"  detector: {info['shipped']}")
    sizes = ", ".join(f"{split} {_size(rows)}" for split, rows in info["split_sizes"].items())
    lines.append(f"  samples: {sizes}")
    fits = info.get("fit_sizes") or {}
    if fits:
        lines.append("  fit: " + ", ".join(f"{name} on {_size(rows)}" for name, rows in fits.items()))
    if "num_to_score" in info:
        cached = info["num_scores"] - info["num_to_score"]
        lines.append(f"  score files: {info['num_to_score']} to compute, {cached} from the cache in the output dir")
    return "\n".join(lines)


def data_description(benchmark: str | None, id_dataset: str | None, extra_ood: Sequence[tuple[str, str]]) -> str:
    """``fmnist-ood`` / ``ID data/photos, OOD far=/data/far, ...``: what a run evaluates, with the user's names."""
    parts = [benchmark] if benchmark is not None else [f"ID {id_dataset}"]
    if extra_ood:
        parts.append("OOD " + ", ".join(f"{name}={spec}" for name, spec in extra_ood))
    return ", ".join(parts)


def validation_source(benchmark: str | None, id_dataset: str | None) -> str:
    """The calibration record's ``source`` of a run's thresholds: the ``validation`` split the evaluation itself read
    (of the benchmark, of a dataset root's folder as an absolute path, or of a Hub dataset)."""
    if benchmark:
        return f"split 'validation' of benchmark {benchmark!r}"
    where = (f"dataset root {os.path.abspath(id_dataset)}" if id_dataset and os.path.exists(id_dataset)
             else f"dataset {id_dataset!r}")
    return f"split 'validation' of {where}"


def split_label(split: str) -> str:
    """``id_test`` -> ``ID test``, ``ood_far`` -> ``OOD far``: the split names of the run header."""
    if split.startswith(OOD_PREFIX):
        return f"OOD {split[len(OOD_PREFIX):]}"
    if split.startswith(VAL_OOD_PREFIX):
        return f"OOD validation {split[len(VAL_OOD_PREFIX):]}"
    return {ID_TEST: "ID test", ID_VALIDATION: "ID validation"}.get(split, split)



def evaluation_header(args: EvaluationArguments, state: EvaluationState, context: RunContext, model_name: str,
                      plan: EvaluationPlan) -> str:
    """:func:`run_header` of an evaluation about to fit and score ``plan``: what ``args`` asked for, the ``state``
    the load phase built (detectors, processor, missing score files), the run's ``context`` (device, processes) and
    the evaluated model's ``model_name``."""
    import torch

    from .models import image_backend_of

    shipped = state.shipped
    return run_header({
        "model": model_name,
        "data": data_description(args.benchmark, args.id_dataset, args.named_ood_datasets),
        **({"shipped": f"the saved {shipped.method!r} detector as it is: its settings, fitted state and "
                       f"threshold {shipped.config.threshold:.6g} (no refit, no recalibration)"}
           if shipped is not None else {}),
        "device": context.accelerator.device, "num_processes": context.accelerator.num_processes,
        "mixed_precision": context.accelerator.mixed_precision, "num_workers": context.num_workers,
        "image_backend": image_backend_of(state.processor), "methods": state.methods,
        "split_sizes": {split_label(split): num_rows(dataset) for split, dataset in plan.splits.items()},
        "fit_sizes": {name: num_rows(dataset) for name, dataset in plan.fit_data.items()},
        "num_to_score": sum(map(len, state.missing.values())),
        "num_scores": sum(len(state.methods) + (split == ID_TEST) for split in plan.splits),
        "visible_gpus": torch.cuda.device_count(),
    })


__all__ = ["check_process_count", "data_description", "evaluation_header", "run_header", "split_label"]
