"""Hyperparameter selection on validation data only (``hf-gsc evaluate --tune``), as OpenOOD v1.5's automatic search.

Data (never the ID test split, never a test OOD split: :func:`tune_hyperparameters` is not given them):

* the evaluation's ID validation subset (``--max-samples``, ``--seed``: the rows the evaluation calibrates on), split
  once at random (``--seed``) into two halves: ``tune_fit`` and ``tune_select`` (:func:`split_halves`);
* ``tune_select`` is the ID side of every comparison;
* ``tune_fit`` fits the grid points of the methods fitted on ID validation (ReAct's clipping percentile) and is the
  source of the generated OOD validation sets, so no image of the ID side reappears, shuffled, on the OOD side;
* OOD validation sets (:func:`validation_ood_sets`), generated from ``tune_fit``, one image per source image:
  ``val_noise`` (uniform random pixels, the source image's size and mode) and ``val_jigsaw`` (the source image's
  4x4 grid of patches in a random non-identity order, seed :data:`VALIDATION_SEED`); plus ``val_heldout_classes``
  where a benchmark holds classes out of distribution with validation rows of their own (``fmnist-openset``: the
  Fashion-MNIST validation rows of its four OOD classes; :data:`HELDOUT_VALIDATION`);
* methods fitted on ID train fit every grid point on the evaluation's own fit data (``--max-fit-samples``).

Grid (:func:`search_spaces`: each method's class holds its ``search_space`` and says where it comes from in
``search_space_source``; values from OpenOOD's ``configs/postprocessors/*.yml`` ``postprocessor_sweep`` where OpenOOD
sweeps the method). A name given with ``--hyperparameter`` (or a GSC option for ``gsc``) is
fixed and not searched. Methods without a grid keep their settings; their ``search_space_source`` says why.

Rule (:func:`hf_gsc.evaluation.ranking.rank`): per method, the grid point with the highest AUROC of ``tune_select`` against the OOD
validation sets (the mean over the sets; ID = positive), ties broken by the lower mean FPR95, then by grid order.
OpenOOD keeps the highest AUROC against its one OOD validation set, the first grid point winning ties. A grid
point that cannot be built or fitted on this model and data, or whose scores are not all finite, is recorded with
the reason and not chosen; a method none of whose points is usable keeps its settings.

Cost: every grid point of every method is one more detector in one :class:`~hf_gsc.detectors.DetectorBundle`, so
the search costs one backbone pass per batch of ``tune_select`` and of each OOD validation set (the head-level work
of each grid point on top: cheap, except ODIN, which runs its own forward, backward and forward per grid point), plus
one backbone pass per batch of the fit data for every grid point fitted on it (:func:`hf_gsc.detectors.backbone_pass.fit_together`:
train, and ``tune_fit``). Its wall time is recorded as ``tuning.seconds`` in ``results.json``; it runs again on every
``--tune`` run (the choice is not cached; the scores computed with the chosen values are).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .context import RunContext
from .ranking import RANKING_RULE, best_index, validation_metrics
from .validation_sets import VALIDATION_SEED, split_halves, validation_ood_sets


#: The folder (under the output folder) of the grid points' fits, one per point (``detectors/knn[0]/``, ...).
TUNING_FITS = "tuning"

def search_spaces() -> dict[str, dict[str, tuple[Any, ...]]]:
    """method -> hyperparameter -> values searched, for every registered method with a grid: each method's class
    holds its own (``search_space``, with its source in ``search_space_source``)."""
    from ..settings.registry import DETECTORS

    return {method: dict(cls.search_space) for method, cls in DETECTORS.items() if cls.search_space}


def not_tuned_reason(method: str) -> str:
    """Why ``method`` has no grid (its class's ``search_space_source``)."""
    from ..settings.registry import detector_class

    cls = detector_class(method)
    return "no grid defined" if cls.search_space else cls.search_space_source


SELECTION_RULE = f"per method and vs tune_select, {RANKING_RULE} (grid order)"


# ------------------------------------------------------------------------------------------------------ the grid
def grid_points(method: str, fixed: Sequence[str] = (), grids: Mapping[str, Mapping[str, Sequence[Any]]] | None = None
                ) -> list[dict[str, Any]]:
    """Every point of ``method``'s grid (product of the values, first name slowest), without the ``fixed`` names;
    ``[]`` when nothing is left to search."""
    grid = {name: tuple(values) for name, values in ((grids if grids is not None else search_spaces()).get(method) or {}).items()
            if name not in fixed}
    if not grid:
        return []
    return [dict(zip(grid, combination)) for combination in itertools.product(*grid.values())]


# ---------------------------------------------------------------------------------------------------- the search
def tune_hyperparameters(
    context: RunContext,
    model: torch.nn.Module,
    hyperparameters: Mapping[str, Mapping[str, Any]],
    fixed: Mapping[str, Sequence[str]],
    id_splits: Mapping[str, Any],
    benchmark: str | None,
) -> dict[str, Any]:
    """Search every method's grid on validation data (see the module docstring) and return the record that
    ``results.json`` keeps as ``tuning``: ``methods[m]["chosen"]`` holds the values to evaluate ``m`` with. The
    methods searched are the keys of ``hyperparameters``.

    Reads ``id_splits["validation"]`` and the ``fit_split`` of the fitted methods (``"train"``), nothing else;
    runs on every process (scoring is sharded); the grid points are fitted like the evaluation's own detectors, by
    :func:`~hf_gsc.evaluation.fitting.fit_detectors`, and kept under ``OUTPUT/tuning/`` for a rerun
    (:data:`TUNING_FITS` in ``context.output_dir``); ``hyperparameters`` are each method's settings, which every
    grid point starts from; ``fixed`` names the settings not to search.
    """
    from ..detectors import get_detector
    from ..utils.version import __version__
    from .fingerprints import dataset_fingerprint, fingerprint, model_fingerprint
    from .fitting import fit_detectors, refuse_too_small
    from .json_files import jsonable
    from .loaders import make_dataloader
    from .loop import score_split
    from .plan import num_rows, subset
    from .scoring import batch_scorer

    start = time.perf_counter()
    accelerator, seed, max_samples = context.accelerator, context.seed, context.max_samples
    methods = list(hyperparameters)
    validation = subset(id_splits["validation"], max_samples, seed, "validation")
    fit_rows, select_rows = split_halves(len(validation), seed)
    tune_fit, tune_select = validation.select(fit_rows), validation.select(select_rows)
    ood_sets = validation_ood_sets(benchmark, tune_fit, len(tune_select), VALIDATION_SEED)

    # The search reads ID validation alone (its OOD sets are generated from one half of it).
    record: dict[str, Any] = {"rule": f"{SELECTION_RULE}; test splits are never read", "methods": {}, "not_tuned": {}}
    candidates: dict[str, Any] = {}  # "method[i]" -> detector of grid point i
    points: dict[str, list[dict[str, Any]]] = {}
    problems: dict[str, str] = {}
    for method in methods:
        grid = grid_points(method, fixed.get(method, ()))
        if not grid:
            record["not_tuned"][method] = (
                f"fixed by the command line ({', '.join(sorted(fixed.get(method, ())))})" if grid_points(method)
                else not_tuned_reason(method))
            continue
        points[method] = grid
        for index, point in enumerate(grid):
            key = f"{method}[{index}]"
            try:
                candidates[key] = get_detector(method, model, **{**hyperparameters.get(method, {}), **point})
            except (ValueError, TypeError, KeyError, AttributeError) as error:
                problems[key] = f"cannot be built: {error}"

    # Fit: one pass per batch of each fit set for all its grid points. ID validation fits use tune_fit only, so that
    # no selection score comes from a sample its detector was fitted on.
    fit_sizes: dict[str, int | None] = {}
    model_fp = model_fingerprint(model)
    groups: dict[str, list[str]] = {}  # fixed before fitting: a fit can change what a detector still needs
    for key, detector in candidates.items():
        if detector.needs_fit:
            groups.setdefault(detector.fit_split, []).append(key)
    for split, keys in groups.items():
        if split == "validation":
            data = tune_fit
        elif split in id_splits:
            data = subset(id_splits[split], context.max_fit_samples, seed, f"fit_{split}")
        else:
            problems.update({key: f"needs the ID {split!r} split, which is not loaded" for key in keys})
            continue
        size = num_rows(data)
        fit_sizes["tune_fit" if split == "validation" else split] = size
        keys = refuse_too_small(candidates, keys, dict.fromkeys(keys, data), problems,
                                 "tune_fit (half of the ID validation rows, at most --max-samples)"
                                 if split == "validation" else None)
        if not keys:
            continue
        prints = {key: fingerprint(jsonable({
            "model": model_fp, "method": key, "hf_gsc": __version__, "fit_split": split, "seed": seed,
            "hyperparameters": candidates[key].config.score_hyperparameters(), "content": dataset_fingerprint(data)}))
            for key in keys}
        assert context.output_dir is not None  # the grid's fits are kept for a rerun
        fits = context.replace(output_dir=Path(context.output_dir) / TUNING_FITS, overwrite=False,
                               source=f"tuning fit of ID {split}")
        problems.update(fit_detectors(fits, candidates, keys, dict.fromkeys(keys, data), prints).failed)
    for key in problems:
        candidates.pop(key, None)

    # Score: one bundle of every grid point, one backbone pass per batch of each set.
    scores: dict[str, dict[str, torch.Tensor]] = {}
    sizes: dict[str, int] = {}
    if candidates:
        for name, dataset in {"tune_select": tune_select, **ood_sets}.items():
            scorer = batch_scorer(model, candidates, False, {}, name)
            loader = make_dataloader(dataset, context.transform, context.batch_size, context.num_workers,
                                     accelerator.device, accelerator.process_index, accelerator.num_processes,
                                     dataset_name=f"{name} (tuning)")
            outputs = score_split(accelerator, loader, {"tune": scorer}, description=f"tune {name}",
                                  on_error=context.on_error)
            sizes[name] = int(outputs["labels"].shape[0])
            scores[name] = {key: outputs[("tune", key)] for key in candidates}

    for method, grid in points.items():
        entries, metrics = [], []
        for index, point in enumerate(grid):
            key = f"{method}[{index}]"
            result = None
            if key in candidates:
                result = validation_metrics(scores["tune_select"][key],
                                             {name: scores[name][key] for name in ood_sets})
                if result is None:
                    problems[key] = "scores that are not finite (NaN or infinite)"
            metrics.append(result)
            entries.append({"hyperparameters": point, **(result or {"error": problems[key]})})
        chosen = best_index(metrics)
        record["methods"][method] = {"chosen": None if chosen is None else dict(grid[chosen]), "grid": entries}
    record["num_grid_points"] = sum(map(len, points.values()))
    record["num_samples"] = {"tune_fit": len(tune_fit), "tune_select": sizes.get("tune_select", len(tune_select)),
                             "ood": {name: sizes.get(name, num_rows(dataset)) for name, dataset in ood_sets.items()},
                             "fit": fit_sizes}
    record["seconds"] = round(time.perf_counter() - start, 3)
    return record


def chosen_hyperparameters(record: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """method -> the values the search chose (methods with no usable grid point are left out)."""
    return {method: dict(entry["chosen"]) for method, entry in record["methods"].items() if entry["chosen"] is not None}


def markdown_lines(record: Mapping[str, Any]) -> list[str]:
    """The ``results.md`` paragraph on the search: cost, data, and each method's chosen values."""
    sizes = record["num_samples"]
    ood = ", ".join(f"{name} {n}" for name, n in sizes["ood"].items())
    lines = ["", f"Hyperparameters chosen on validation only (--tune, {record['num_grid_points']} grid points): ID tune_select {sizes['tune_select']} vs OOD validation {ood}; "
                 f"{record['rule']}.", ""]
    from .json_files import table_lines

    rows = []
    for method, entry in record["methods"].items():
        chosen = entry["chosen"]
        best = next((e for e in entry["grid"] if chosen is not None and e["hyperparameters"] == chosen), None)
        rows.append([method, "none usable" if chosen is None else ", ".join(f"{k}={v}" for k, v in chosen.items()),
                     "n/a" if best is None else f"{100 * best['auroc']:.2f}",
                     "n/a" if best is None else f"{100 * best['fpr95']:.2f}", str(len(entry["grid"]))])
    lines += table_lines(["Method", "chosen", "validation AUROC", "validation FPR95 (ID+)", "grid points"], rows)
    not_tuned = record.get("not_tuned", {})
    if not_tuned:
        lines += ["", *(f"- `{method}` not tuned: {reason}." for method, reason in not_tuned.items())]
    return lines


__all__ = [
    "SELECTION_RULE",
    "chosen_hyperparameters",
    "grid_points",
    "markdown_lines",
    "not_tuned_reason",
    "search_spaces",
    "tune_hyperparameters",
]
