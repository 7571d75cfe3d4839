""":class:`RunContext`: what every phase of one evaluation shares, built once (by
:meth:`~hf_gsc.evaluation.evaluator.OODEvaluator.load`) and frozen, so that the phases' helpers
(:func:`~hf_gsc.evaluation.tuning.tune_hyperparameters`, :func:`~hf_gsc.evaluation.plan.make_plan`,
:func:`~hf_gsc.evaluation.fitting.fit_detectors`, :func:`~hf_gsc.evaluation.scoring.score_missing`) take it and
what is theirs alone, instead of the same seven values each by hand; and :class:`EvaluationState`, what the phases
build, declared up front.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import torch

from ..data.decoding import OnError


if TYPE_CHECKING:
    from accelerate import Accelerator
    from datasets import Dataset, IterableDataset
    from transformers.image_processing_utils import BaseImageProcessor

    from ..data.preprocessing import ImageTransform
    from ..detectors.interface import OODDetector
    from .plan import EvaluationPlan
    from .score_cache import ScoreCache
    from .selection import SelectionData

#: A split as the evaluation reads it: a loaded (or subsampled) dataset, or a stream (``--streaming``).
Split = Union["Dataset", "IterableDataset"]


@dataclass(frozen=True)
class RunContext:
    """The settings of one evaluation run that every phase reads (never changed once built).

    Attributes:
        accelerator: the ``accelerate.Accelerator`` (device, processes, mixed precision).
        transform: the images -> ``pixel_values`` transform of the model's image processor.
        batch_size: images per batch of every backbone pass, per process.
        num_workers: DataLoader worker processes.
        on_error: what an image that cannot be decoded does: ``"raise"`` or ``"skip"``.
        seed: the seed of every random choice (subsets, halves, fits that draw).
        output_dir: the run folder (fits, score files, records); ``None``: nothing is saved or reused.
        overwrite: recompute saved fits and score files instead of reusing the valid ones.
        max_samples: at most this many samples per split (``None``: all).
        max_fit_samples: at most this many samples per fit.
        source: how the data is named in messages and records (the benchmark or the ID dataset).
        ood_sources: the SPEC of each OOD split given by hand (name -> SPEC).
    """

    accelerator: Accelerator
    transform: ImageTransform  # its ``normalization`` says where rescale + normalize run
    batch_size: int
    num_workers: int = 0
    on_error: OnError = "raise"
    seed: int = 0
    output_dir: Path | None = None
    overwrite: bool = False
    max_samples: int | None = None
    max_fit_samples: int = 10000
    source: str = ""
    ood_sources: Mapping[str, str] = field(default_factory=dict)

    def replace(self, **changes: Any) -> RunContext:
        """A copy with ``changes`` (the tuning's fits: their own folder and source name)."""
        return dataclasses.replace(self, **changes)


@dataclass
class EvaluationState:
    """What the phases of one evaluation build, declared up front (as ``Trainer`` holds ``TrainerState``); the
    comment on each group says which phase sets it."""

    done: list[str] = field(default_factory=list)  # the phases run so far, in order
    seconds: dict[str, Any] = field(default_factory=dict)  # wall time per phase (results.json's seconds)
    skipped: dict[str, str] = field(default_factory=dict)  # method -> why it was left out (any phase)
    # 1. load
    model: torch.nn.Module | None = None  # the base classifier (the shipped detector's with --detector)
    processor: BaseImageProcessor | None = None
    shipped: OODDetector | None = None  # a saved detector evaluated as it is (--detector), else None
    methods: list[str] = field(default_factory=list)
    hyperparameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    detectors: dict[str, OODDetector] = field(default_factory=dict)
    id_splits: dict[str, Split] = field(default_factory=dict)
    ood_splits: dict[str, Split] = field(default_factory=dict)
    label_check: dict[str, Any] = field(default_factory=dict)
    same_as_test: list[str] = field(default_factory=list)  # OOD splits holding the ID test images
    # 2. tune
    tuning: dict[str, Any] | None = None
    # 3. plan
    selection_data: SelectionData | None = None  # None: no selection (--no-selection, --detector, no OOD sets)
    plan: EvaluationPlan | None = None
    cache: ScoreCache | None = None  # the score files of the output folder
    missing: dict[str, list[str]] = field(default_factory=dict)  # split -> methods whose score file is missing
    # 4. fit and 5. score (this run's passes)
    scoring_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    throughput: dict[str, dict[str, float | None]] = field(default_factory=dict)
    # 6. select
    selection: dict[str, Any] | None = None
    # 7. collect (main process)
    id_scores: dict[str, torch.Tensor] = field(default_factory=dict)
    ood_scores: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    correct: torch.Tensor | None = None  # per ID test sample: the base model's prediction is right


__all__ = ["EvaluationState", "RunContext"]
