"""Scoring the planned splits: one pass over each split with every method whose score file is missing.

The main process writes each split's score files as soon as the split is done (so a crash, or an image
that cannot be decoded, loses only the split in progress) and records the split's wall time and images
per second. A score file also holds how many unreadable images were left out of its split
(:data:`~hf_gsc.evaluation.score_cache.NUM_SKIPPED_KEY`, with ``on_error="skip"``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import loop
from .context import RunContext
from .loaders import make_dataloader
from .metrics import NonFiniteScoreError, check_finite_scores
from .plan import BASE_MODEL, EvaluationPlan, num_rows
from .score_cache import NUM_SKIPPED_KEY, PREDICTIONS_KEY, SCORE_KEY, ScoreCache


def score_missing(
    context: RunContext,
    plan: EvaluationPlan,
    missing: Mapping[str, Sequence[str]],
    detectors: Mapping[str, Any],
    model: torch.nn.Module,
    cache: ScoreCache,
    skipped: dict[str, str] | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float | None]]]:
    """Score each split with its missing methods (one backbone pass per batch for all of them, see
    :func:`batch_scorer`) and save the files (main process).

    ``context.on_error``: what an image that cannot be decoded does (see :func:`~hf_gsc.evaluation.loop.score_split`).
    ``skipped``: method -> reason. A method whose scoring raises, or whose scores on a split are not all finite, is
    added to it (the same on every process: the decision is taken on the gathered scores), its file for that split
    is not written, and it is not scored on the later splits; the other methods go on.

    Returns ``(method -> split -> scoring seconds of that method on this process (the shared backbone pass is
    :data:`BACKBONE_KEY`), split -> {"seconds", "num_samples", "images_per_second", "backbone_seconds"})``: the
    split's wall time covers loading, preprocessing, the backbone, every method and the gathering across processes;
    ``backbone_seconds`` is the shared backbone pass's part of it on this process.
    """
    accelerator = context.accelerator
    seconds: dict[str, dict[str, float]] = {name: {} for name in [BACKBONE_KEY, *detectors]}
    throughput: dict[str, dict[str, float | None]] = {}
    skipped = {} if skipped is None else skipped
    for split, dataset in plan.splits.items():
        names = [name for name in missing[split] if name not in skipped]
        if not names:
            continue
        errors: dict[str, str] = {}
        scorer = batch_scorer(model, {name: detectors[name] for name in names if name != BASE_MODEL},
                              BASE_MODEL in names, seconds, split, errors)
        dataloader = make_dataloader(dataset, context.transform, context.batch_size, context.num_workers,
                                     accelerator.device, accelerator.process_index, accelerator.num_processes,
                                     dataset_name=f"{split} ({plan.sources[split]})")
        size = num_rows(dataset) or "streamed"
        begin = time.perf_counter()
        outputs = loop.score_split(accelerator, dataloader, {SHARED: scorer},
                                   description=f"{split} ({size})", on_error=context.on_error)
        outputs = {key[1] if isinstance(key, tuple) else key: value for key, value in outputs.items()}
        elapsed = time.perf_counter() - begin
        count = int(outputs["labels"].shape[0])
        throughput[split] = {"seconds": round(elapsed, 3), "num_samples": count,
                             "images_per_second": round(count / elapsed, 2) if elapsed > 0 else None,
                             BACKBONE_SECONDS: round(seconds[BACKBONE_KEY].get(split, 0.0), 3)}
        for name in names:  # on every process (they hold the same gathered scores), before any file is written
            if name != BASE_MODEL:
                try:
                    check_finite_scores(outputs[name], name, split)
                except NonFiniteScoreError as error:
                    skipped[name] = f"scoring failed: {errors[name]}" if name in errors else str(error)
        names = [name for name in names if name not in skipped]
        if accelerator.is_main_process:
            for name in names:
                key = PREDICTIONS_KEY if name == BASE_MODEL else SCORE_KEY
                cache.save(name, split, {key: outputs[name], "labels": outputs["labels"],
                                         NUM_SKIPPED_KEY: outputs[NUM_SKIPPED_KEY]},
                           plan.score_fingerprints[(name, split)])
        accelerator.wait_for_everyone()
    return dict(seconds.items()), throughput


#: Name of the one scorer :func:`batch_scorer` makes (its outputs are ``(SHARED, method)``).
SHARED = "backbone_pass"
#: Key of the shared backbone pass in the per-method scoring seconds.
BACKBONE_KEY = "_backbone"
#: Key of the shared backbone pass's seconds in a split's timing (``seconds.splits_scored``).
BACKBONE_SECONDS = "backbone_seconds"


def batch_scorer(
    model: torch.nn.Module,
    detectors: Mapping[str, Any],
    predictions: bool,
    seconds: dict[str, dict[str, float]],
    split: str,
    errors: dict[str, str] | None = None,
) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    """``pixel_values -> {method: ood_score, ...}`` (and the base model's predicted classes under
    :data:`~hf_gsc.evaluation.plan.BASE_MODEL` when ``predictions``), from one backbone pass that captures what every
    detector reads (:func:`hf_gsc.detectors.backbone_pass.run_backbone_for`). Adds each part's wall time to ``seconds[name][split]``
    (host time: on CUDA, launch time unless the part itself waits for the device). ``errors``: where given, a method
    whose scoring raises gets NaN scores for the batch (the gathered NaN then skips it on every process) and its first
    error is kept there, method -> message."""
    from ..detectors.backbone_pass import run_backbone, run_backbone_for
    from ..utils.precision import parameter_dtype

    members = list(detectors.values())
    dtype = parameter_dtype(model)

    def add(name: str, begin: float) -> None:
        seconds.setdefault(name, {})
        seconds[name][split] = seconds[name].get(split, 0.0) + time.perf_counter() - begin

    def score(pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        pixel_values = pixel_values.to(dtype)
        begin = time.perf_counter()
        batch = (run_backbone_for(members, pixel_values, logits=predictions) if members
                 else run_backbone(model, pixel_values, (), logits=True))
        add(BACKBONE_KEY, begin)
        out = {}
        for name, detector in detectors.items():
            begin = time.perf_counter()
            if errors is None:
                out[name] = detector.score_batch(batch).to(pixel_values.device)
            else:
                try:
                    out[name] = detector.score_batch(batch).to(pixel_values.device)
                except Exception as error:  # noqa: BLE001  (one method's failure skips that method only)
                    errors.setdefault(name, f"{type(error).__name__}: {error}")
                    out[name] = torch.full((pixel_values.shape[0],), float("nan"), device=pixel_values.device)
            add(name, begin)
        if predictions:
            out[BASE_MODEL] = batch.model_logits().argmax(dim=-1)
        return out

    return score


__all__ = ["BACKBONE_KEY", "BACKBONE_SECONDS", "PREDICTIONS_KEY", "batch_scorer", "score_missing"]
