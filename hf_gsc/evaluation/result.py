"""What an evaluation found: :class:`EvaluationResult` (``results.json``), and the records it is made of that are
not metrics (the package versions, the OOD groups, a saved detector at its own threshold)."""

from __future__ import annotations

import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..utils.version import __version__
from .json_files import jsonable
from .models import image_backend_of
from .plan import ID_TEST, ID_VALIDATION, OOD_PREFIX
from .score_cache import NUM_SKIPPED_KEY, PREDICTIONS_KEY, SCORE_KEY
from .scoring import BACKBONE_KEY, BACKBONE_SECONDS
from .timings import split_timings, update_timings


if TYPE_CHECKING:
    from ..detectors.interface import OODDetector
    from .arguments import EvaluationArguments
    from .context import EvaluationState, RunContext


class EverythingSkippedError(RuntimeError):
    """Every method was skipped (could not be built, fitted or scored): nothing to report. ``reasons``: method ->
    why."""

    def __init__(self, reasons: Mapping[str, str]) -> None:
        self.reasons = dict(reasons)
        super().__init__("every method was skipped: " + "; ".join(f"{name}: {why}" for name, why in reasons.items()))


@dataclass
class EvaluationResult:
    """What an evaluation found; :meth:`to_dict` is ``results.json``.

    Attributes:
        methods: method -> its metrics (threshold, calibration, per OOD split FPR95 / AUROC / AUPR, averages).
        selection: the method chosen on validation data and the validation table (``None`` with ``--no-selection``
            or a saved detector).
        skipped: method -> why it was left out (could not be built, fitted or scored).
        seconds: wall time of each phase (``fit``, ``tune``, ``selection``, ``score``, ``save``) and ``total``.
        details: every other ``results.json`` entry (model, data, split sizes, label check, config, versions, ...).
    """

    methods: dict[str, dict[str, Any]]
    selection: dict[str, Any] | None
    skipped: dict[str, str]
    seconds: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def selected_method(self) -> str | None:
        """The method the selection chose on validation data (``None`` without a selection)."""
        return None if self.selection is None else self.selection["method"]

    def to_dict(self) -> dict[str, Any]:
        """The ``results.json`` content."""
        out = {**self.details, "methods": self.methods, "skipped": self.skipped}
        if self.selection is not None:
            out["selection"] = self.selection
        out["seconds"] = self.seconds
        return out


def package_versions() -> dict[str, str]:
    import accelerate
    import datasets
    import sklearn
    import transformers

    return {
        "hf_gsc": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "datasets": datasets.__version__,
        "accelerate": accelerate.__version__,
        "numpy": np.__version__,
        "scikit-learn": sklearn.__version__,
        "python": platform.python_version(),
    }


def ood_groups_of(benchmark: str | None, ood_names: list[str],
                  given: Mapping[str, list[str]] | None = None) -> dict[str, list[str]]:
    """``{"near": [...], "far": [...]}``: the evaluated OOD splits in each OpenOOD v1.5 group of ``benchmark``, plus
    the OOD datasets given in a group (``given``: ``--near-ood-dataset``, ``--far-ood-dataset``); ``--ood-dataset``
    splits belong to no group."""
    groups: dict[str, list[str]] = {}
    if benchmark is not None:
        from ..data.benchmarks import ood_groups

        groups = {group: [name for name in names if name in ood_names] for group, names in ood_groups(benchmark).items()}
    for group, names in (given or {}).items():
        groups[group] = [*groups.get(group, []), *(name for name in names if name in ood_names)]
    return groups


def at_shipped_threshold(entry: dict[str, Any], detector: OODDetector, source: str,
                          ood_scores: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """A saved detector's entry at its shipped threshold: per OOD split ``fpr_at_threshold`` (the fraction of OOD
    accepted as ID); returns ``results.json``'s ``detector`` record."""
    from .calibration import accepted_fraction

    threshold = float(detector.config.threshold)
    entry["calibration"] = detector.config.calibration or {"split": None, "note": "threshold set by hand"}
    for name, scores in ood_scores.items():
        entry["ood"][name]["fpr_at_threshold"] = accepted_fraction(scores, threshold)
    return {"source": source, "method": detector.method, "threshold": threshold,
            "calibration": detector.config.calibration, "hyperparameters": dict(detector.hyperparameters),
            "evaluated_as": "saved: no refit, no recalibration",
            "id_tpr_at_threshold": entry["id_tpr_at_threshold"],
            "fpr_at_threshold": {name: values["fpr_at_threshold"] for name, values in entry["ood"].items()}}



def run_details(args: EvaluationArguments, state: EvaluationState, context: RunContext, model_name: str,
                base: Mapping[str, torch.Tensor], fits: Mapping[str, dict[str, Any]], calibrated: bool,
                groups: Mapping[str, list[str]], score_files: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, Any]:
    """Every ``results.json`` entry beside the methods, the selection and the timings: the run's model, data,
    split sizes, unreadable images, label check, configuration, device and versions, on the main process after the
    phases (``state``: what they built, its ``seconds`` completed here with the scoring's; ``model_name``: how the
    evaluated model is named; ``score_files``: the first method's score files, by split, as the collect phase loaded
    them)."""
    plan, cache = state.plan, state.cache
    assert plan is not None and cache is not None
    any_method = next(iter(state.detectors))

    def skipped(split: str) -> int:  # the same for every method: all read the split through the same decoding
        return int(score_files[split].get(NUM_SKIPPED_KEY, torch.tensor(0)))

    details: dict[str, Any] = {
        "model": model_name,
        "benchmark": args.benchmark,  # None with --id-dataset
        "id_dataset": args.id_dataset,
        "id_accuracy": float((base[PREDICTIONS_KEY] == base["labels"]).double().mean()),
        "split_sizes": {  # from the score files: a streamed split's size is known once it was read
            "id_test": int(state.id_scores[any_method].numel()),
            **({"id_validation": int(score_files[ID_VALIDATION][SCORE_KEY].numel())}
               if calibrated else {}),
            "ood": {ood: int(scores.numel()) for ood, scores in state.ood_scores[any_method].items()},
            "fit": {name: fit["num_samples"] for name, fit in fits.items()},
        },
        # Unreadable images left out (--skip-unreadable-images; without it, any one stops the run).
        NUM_SKIPPED_KEY: {
            "id_test": skipped(ID_TEST),
            **({"id_validation": skipped(ID_VALIDATION)} if calibrated else {}),
            "ood": {ood: skipped(OOD_PREFIX + ood) for ood in plan.ood_names},
            "fit": {name: fit[NUM_SKIPPED_KEY] for name, fit in fits.items()},
        },
        "calibration_split": "validation" if calibrated else None,
        "ood_groups": dict(groups),
        "ood_datasets": dict(args.named_ood_datasets),  # NAME -> SPEC of each OOD dataset given by hand
    }
    if state.tuning is not None:
        details["tuning"] = state.tuning
    details["label_check"] = state.label_check
    if state.same_as_test:
        details["ood_same_as_id_test"] = state.same_as_test
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    # Timings of the passes that computed the scores used, this run's or an earlier one's (cached splits).
    records = update_timings(cache.root, plan.score_fingerprints, state.missing, state.throughput,
                             state.scoring_seconds)
    splits_scored, method_seconds = split_timings(records, plan.score_fingerprints, state.throughput,
                                                  state.missing, created)
    details.update(
        num_processes=context.accelerator.num_processes,
        device=str(context.accelerator.device),
        mixed_precision=context.accelerator.mixed_precision,
        num_workers=context.num_workers,
        image_backend=image_backend_of(state.processor),
        # where the image processor's rescale + normalize ran: "device" (deferred, see hf_gsc.data.normalization)
        pixel_normalization="device" if context.transform.normalization is not None else "workers",
        config={**jsonable(args.to_dict()), "methods": ",".join(state.detectors)},
        versions=package_versions(),
        created=created,
    )
    # The shared backbone pass of each split's pass first, then each method's own work after it.
    backbone = {split: entry[BACKBONE_SECONDS] for split, entry in splits_scored.items() if BACKBONE_SECONDS in entry}
    state.seconds.update(splits_scored=splits_scored, scoring_main_process={
        **({BACKBONE_KEY: backbone} if backbone else {}),
        **{m: v for m, v in method_seconds.items() if m in state.detectors}})
    return details


__all__ = ["EvaluationResult", "EverythingSkippedError", "at_shipped_threshold", "ood_groups_of", "package_versions",
           "run_details"]
