"""Scoring the planned splits: one pass over each split with every method whose score file is missing.

The main process writes each split's score files as soon as the split is done (so a crash, or an image
that cannot be decoded, loses only the split in progress) and records the split's wall time and images
per second. A score file also holds how many unreadable images were left out of its split
(:data:`~hf_gsc.evaluation.loop.NUM_SKIPPED_KEY`, with ``on_error="skip"``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from . import loop
from ..data.decoding import OnError
from .loop import NUM_SKIPPED_KEY, PREDICTIONS_KEY, SCORE_KEY, ScoreCache, make_dataloader
from .metrics import check_finite_scores
from .plan import BASE_MODEL, EvaluationPlan, num_rows


def score_missing(
    accelerator: Any,
    plan: EvaluationPlan,
    missing: Mapping[str, Sequence[str]],
    detectors: Mapping[str, Any],
    model: torch.nn.Module,
    transform: Callable[[list], torch.Tensor],
    cache: ScoreCache,
    batch_size: int,
    num_workers: int = 0,
    on_error: OnError = "raise",
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Score each split with its missing methods (one pass over the split) and save the files (main process).

    ``on_error``: what an image that cannot be decoded does (see :func:`~hf_gsc.evaluation.loop.score_split`).

    Returns ``(method -> split -> scoring seconds of that method on this process,
    split -> {"seconds", "num_samples", "images_per_second"})``: the split's wall time covers loading,
    preprocessing, every method and the gathering across processes.
    """

    def predictions(pixel_values: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(pixel_values=pixel_values).logits.argmax(dim=-1)

    seconds: dict[str, dict[str, float]] = {name: {} for name in detectors}
    throughput: dict[str, dict[str, float]] = {}
    for split, dataset in plan.splits.items():
        names = missing[split]
        if not names:
            continue
        scorers = {name: predictions if name == BASE_MODEL else detectors[name].score for name in names}
        dataloader = make_dataloader(dataset, transform, batch_size, num_workers, accelerator.device,
                                     accelerator.process_index, accelerator.num_processes,
                                     dataset_name=f"{split} ({plan.sources[split]})")
        size = num_rows(dataset) or "streamed"
        begin = time.perf_counter()
        outputs = loop.score_split(accelerator, dataloader, _timed(scorers, seconds, split),
                                   description=f"{split} ({size})", on_error=on_error)
        elapsed = time.perf_counter() - begin
        count = int(outputs["labels"].shape[0])
        throughput[split] = {"seconds": round(elapsed, 3), "num_samples": count,
                             "images_per_second": round(count / elapsed, 2) if elapsed > 0 else None}
        for name in names:  # on every process (they hold the same gathered scores), before any file is written
            if name != BASE_MODEL:
                check_finite_scores(outputs[name], name, split)
        if accelerator.is_main_process:
            for name in names:
                key = PREDICTIONS_KEY if name == BASE_MODEL else SCORE_KEY
                cache.save(name, split, {key: outputs[name], "labels": outputs["labels"],
                                         NUM_SKIPPED_KEY: outputs[NUM_SKIPPED_KEY]},
                           plan.score_fingerprints[(name, split)])
        accelerator.wait_for_everyone()
    return seconds, throughput


def _timed(
    scorers: Mapping[str, Callable[[torch.Tensor], torch.Tensor]], seconds: dict[str, dict[str, float]], split: str
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Wrap each scorer to add its wall time to ``seconds[name][split]`` (host time: on CUDA, launch time
    unless the scorer itself waits for the device)."""

    def wrap(name: str, scorer: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def timed(pixel_values: torch.Tensor) -> torch.Tensor:
            begin = time.perf_counter()
            value = scorer(pixel_values)
            if name in seconds:
                seconds[name][split] = seconds[name].get(split, 0.0) + time.perf_counter() - begin
            return value

        return timed

    return {name: wrap(name, scorer) for name, scorer in scorers.items()}


__all__ = ["PREDICTIONS_KEY", "score_missing"]
