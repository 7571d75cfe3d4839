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

Rule (:func:`select_point`): per method, the grid point with the highest AUROC of ``tune_select`` against the OOD
validation sets (the mean over the sets; ID = positive), ties broken by the lower mean FPR95, then by grid order.
OpenOOD keeps the highest AUROC against its one OOD validation set, the first grid point winning ties. A grid
point that cannot be built or fitted on this model and data, or whose scores are not all finite, is recorded with
the reason and not chosen; a method none of whose points is usable keeps its settings.

Cost: every grid point of every method is one more detector in one :class:`~hf_gsc.detectors.DetectorBundle`, so
the search costs one backbone pass per batch of ``tune_select`` and of each OOD validation set (the head-level work
of each grid point on top: cheap, except ODIN, which runs its own forward, backward and forward per grid point), plus
one backbone pass per batch of the fit data for every grid point fitted on it (:func:`hf_gsc.backbone_pass.fit_together`:
train, and ``tune_fit``). Its wall time is recorded as ``tuning.seconds`` in ``results.json``; it runs again on every
``--tune`` run (the choice is not cached; the scores computed with the chosen values are).
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..data.decoding import OnError, decode_image, without_decoding

#: Seed of everything generated for the OOD validation sets (the generated test OOD splits use seed 0).
VALIDATION_SEED = 1001
#: Patches per side of the jigsaw OOD validation set.
JIGSAW_GRID = 4

def search_spaces() -> dict[str, dict[str, tuple[Any, ...]]]:
    """method -> hyperparameter -> values searched, for every registered method with a grid: each method's class
    holds its own (``search_space``, with its source in ``search_space_source``)."""
    from ..registry import DETECTORS

    return {method: dict(cls.search_space) for method, cls in DETECTORS.items() if cls.search_space}


def not_tuned_reason(method: str) -> str:
    """Why ``method`` has no grid (its class's ``search_space_source``)."""
    from ..registry import detector_class

    cls = detector_class(method)
    return "no grid defined" if cls.search_space else cls.search_space_source


SELECTION_RULE = ("per method, the grid point with the highest mean AUROC of tune_select vs the OOD validation sets "
                  "(ID positive), ties broken by the lower mean FPR95 (ID positive), then grid order")


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


def select_point(metrics: Sequence[Mapping[str, float] | None]) -> int | None:
    """Index of the chosen grid point (:data:`SELECTION_RULE`) among ``metrics`` (``{"auroc", "fpr95"}`` means, or
    ``None`` for an unusable point); ``None`` when no point is usable."""
    ranked = [(-entry["auroc"], entry["fpr95"], index) for index, entry in enumerate(metrics) if entry is not None]
    return min(ranked)[2] if ranked else None


# ------------------------------------------------------------------------------------------------------ the data
def split_halves(num_rows: int, seed: int) -> tuple[list[int], list[int]]:
    """``(tune_fit rows, tune_select rows)``: a random half of ``range(num_rows)`` and the rest (the larger half with
    an odd count), each sorted."""
    order = np.random.default_rng([seed, zlib.crc32(b"tune")]).permutation(num_rows)
    half = num_rows // 2
    return sorted(order[:half].tolist()), sorted(order[half:].tolist())


def _array_of(image: Any) -> np.ndarray:
    """uint8 ``(H, W)`` or ``(H, W, 3)`` pixels of a PIL image (other modes as RGB)."""
    return np.asarray(image if image.mode in ("L", "RGB") else image.convert("RGB"))


def jigsaw_image(pixels: np.ndarray, rng: np.random.Generator, grid: int = JIGSAW_GRID) -> np.ndarray:
    """``pixels`` ``(H, W[, C])`` cropped to a multiple of ``grid`` per side, its ``grid x grid`` patches in a random
    non-identity order."""
    height, width = pixels.shape[0] // grid, pixels.shape[1] // grid
    if height == 0 or width == 0:
        raise ValueError(f"an image of {pixels.shape[1]}x{pixels.shape[0]} pixels is too small for a {grid}x{grid} jigsaw")
    rest = pixels.shape[2:]
    cropped = pixels[: grid * height, : grid * width]
    patches = cropped.reshape(grid, height, grid, width, *rest).swapaxes(1, 2).reshape(grid * grid, height, width, *rest)
    order = rng.permutation(grid * grid)
    while np.array_equal(order, np.arange(grid * grid)):
        order = rng.permutation(grid * grid)
    shuffled = patches[order].reshape(grid, grid, height, width, *rest).swapaxes(1, 2)
    return np.ascontiguousarray(shuffled.reshape(grid * height, grid * width, *rest))


class GeneratedImages:
    """An OOD validation set generated on the fly from the images of ``source`` (one image per source row), read by
    :func:`~hf_gsc.evaluation.loaders.make_dataloader` like a ``datasets.Dataset`` (``image`` and ``label`` = -1).

    ``kind``: ``"noise"`` (uniform random pixels of the source image's size and mode) or ``"jigsaw"``
    (:func:`jigsaw_image`). Image ``i`` depends on ``(seed, i)`` only, not on the batch it is read in.
    """

    features = None  # no datasets.Image column to cast: the images are made here
    column_names = ("image", "label")
    KINDS = ("noise", "jigsaw")

    def __init__(self, source: Any, kind: str, seed: int = VALIDATION_SEED, source_name: str = "ID validation") -> None:
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        self.source, self.kind, self.seed, self.source_name = without_decoding(source), kind, seed, source_name

    def __len__(self) -> int:
        return len(self.source)

    def content_fingerprint(self) -> str:
        """What the images depend on (the source rows, the kind, the seed), for the score cache."""
        from .fingerprints import dataset_fingerprint, fingerprint

        return fingerprint({"generated": self.kind, "seed": self.seed, "source": dataset_fingerprint(self.source)})

    def _make(self, value: Any, row: int) -> Any:
        from PIL import Image

        image = decode_image(value, self.source_name, row, on_error="skip")
        if image is None:  # left as it is: the loader's own decoding reports (or skips) it like any unreadable image
            return value
        pixels = _array_of(image)
        rng = np.random.default_rng([self.seed, zlib.crc32(self.kind.encode()), row])
        if self.kind == "noise":
            return Image.fromarray(rng.integers(0, 256, size=pixels.shape, dtype=np.uint8))
        return Image.fromarray(jigsaw_image(pixels, rng))

    def __getitem__(self, rows: Any) -> dict[str, list[Any]]:
        rows = [int(rows)] if isinstance(rows, (int, np.integer)) else [int(row) for row in rows]
        values = self.source[rows]["image"]
        return {"image": [self._make(value, row) for value, row in zip(values, rows)], "label": [-1] * len(rows)}


def heldout_classes_validation(num_samples: int, seed: int = VALIDATION_SEED) -> Any:
    """``fmnist-openset``: at most ``num_samples`` Fashion-MNIST *validation* rows (never test images) of the classes
    the benchmark keeps out of distribution, drawn at random with ``seed``."""
    from ..data import fashion_mnist
    from ..data.arrays import to_dataset
    from ..data.benchmarks import OPENSET_OOD_CLASSES

    validation = fashion_mnist.load_arrays()["validation"]
    rows = np.flatnonzero(np.isin(validation.labels, OPENSET_OOD_CLASSES))
    rows = rows[:num_samples] if len(rows) <= num_samples else np.sort(
        np.random.default_rng(seed).choice(rows, size=num_samples, replace=False)
    )
    return to_dataset(validation.images[rows], [-1] * len(rows))


#: Benchmarks whose OOD classes have validation rows -> ``(num_samples, seed) -> dataset`` of them.
HELDOUT_VALIDATION: dict[str, Callable[[int, int], Any]] = {"fmnist-openset": heldout_classes_validation}


def validation_ood_sets(benchmark: str | None, source: Any, num_samples: int, seed: int = VALIDATION_SEED
                        ) -> dict[str, Any]:
    """The OOD validation sets: ``val_noise`` and ``val_jigsaw`` from the images of ``source`` (ID validation rows),
    and ``val_heldout_classes`` (``num_samples`` rows) where :data:`HELDOUT_VALIDATION` defines it for ``benchmark``."""
    sets = {f"val_{kind}": GeneratedImages(source, kind, seed) for kind in GeneratedImages.KINDS}
    if benchmark in HELDOUT_VALIDATION:
        sets["val_heldout_classes"] = HELDOUT_VALIDATION[benchmark](num_samples, seed)
    return sets


# ---------------------------------------------------------------------------------------------------- the search
def _validation_metrics(id_scores: torch.Tensor, ood_scores: Mapping[str, torch.Tensor]) -> dict[str, Any] | None:
    """``{"auroc", "fpr95", "ood": {set: {"auroc", "fpr95"}}}`` (means over the sets), or ``None`` when a score is
    not finite."""
    from .metrics import auroc, fpr_at_tpr

    if not all(bool(torch.isfinite(scores).all()) for scores in [id_scores, *ood_scores.values()]):
        return None
    per_set = {name: {"auroc": auroc(id_scores.numpy(), scores.numpy()), "fpr95": fpr_at_tpr(id_scores.numpy(), scores.numpy())}
               for name, scores in ood_scores.items()}
    return {"auroc": float(np.mean([m["auroc"] for m in per_set.values()])),
            "fpr95": float(np.mean([m["fpr95"] for m in per_set.values()])), "ood": per_set}


def tune_hyperparameters(
    accelerator: Any,
    model: torch.nn.Module,
    methods: Sequence[str],
    hyperparameters: Mapping[str, Mapping[str, Any]],
    fixed: Mapping[str, Sequence[str]],
    id_splits: Mapping[str, Any],
    transform: Callable[[list], torch.Tensor],
    *,
    benchmark: str | None,
    max_samples: int | None,
    max_fit_samples: int,
    seed: int,
    batch_size: int,
    num_workers: int = 0,
    on_error: OnError = "raise",
) -> dict[str, Any]:
    """Search every method's grid on validation data (see the module docstring) and return the record that
    ``results.json`` keeps as ``tuning``: ``methods[m]["chosen"]`` holds the values to evaluate ``m`` with.

    Reads ``id_splits["validation"]`` and the ``fit_split`` of the fitted methods (``"train"``), nothing else;
    runs on every process (fits are repeated per process, scoring is sharded); ``hyperparameters`` are each method's
    settings, which every grid point starts from; ``fixed`` names the settings not to search.
    """
    from ..detectors import fit_together, get_detector
    from .loaders import device_batches, make_dataloader
    from .loop import score_split
    from .plan import num_rows, subset
    from .scoring import batch_scorer

    start = time.perf_counter()
    validation = subset(id_splits["validation"], max_samples, seed, "validation")
    fit_rows, select_rows = split_halves(len(validation), seed)
    tune_fit, tune_select = validation.select(fit_rows), validation.select(select_rows)
    ood_sets = validation_ood_sets(benchmark, tune_fit, len(tune_select), VALIDATION_SEED)

    record: dict[str, Any] = {"rule": SELECTION_RULE, "methods": {}, "not_tuned": {}}
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
    fit_sizes: dict[str, int] = {}
    groups: dict[str, list[str]] = {}  # fixed before fitting: a fit can change what a detector still needs
    for key, detector in candidates.items():
        if detector.needs_fit:
            groups.setdefault(detector.fit_split, []).append(key)
    for split, keys in groups.items():
        if split == "validation":
            data = tune_fit
        elif split in id_splits:
            data = subset(id_splits[split], max_fit_samples, seed, f"fit_{split}")
        else:
            problems.update({key: f"needs the ID {split!r} split, which is not loaded" for key in keys})
            continue
        size = num_rows(data)
        fit_sizes["tune_fit" if split == "validation" else split] = size
        too_few = [key for key in keys if size is not None and size < candidates[key].min_fit_samples]
        problems.update({key: f"needs at least {candidates[key].min_fit_samples} fit samples, the fit data has {size}"
                         for key in too_few})
        keys = [key for key in keys if key not in too_few]
        if not keys:
            continue
        torch.manual_seed(seed)
        np.random.seed(seed)
        loader = make_dataloader(data, transform, batch_size, num_workers, accelerator.device,
                                 dataset_name=f"ID {split} (tuning fit)")
        with accelerator.autocast():
            fit_together([candidates[key] for key in keys], device_batches(loader, accelerator.device, on_error),
                         name=f"ID {split} data")
    for key in problems:
        candidates.pop(key, None)

    # Score: one bundle of every grid point, one backbone pass per batch of each set.
    scores: dict[str, dict[str, torch.Tensor]] = {}
    sizes: dict[str, int] = {}
    if candidates:
        for name, dataset in {"tune_select": tune_select, **ood_sets}.items():
            scorer = batch_scorer(model, candidates, False, {}, name)
            loader = make_dataloader(dataset, transform, batch_size, num_workers, accelerator.device,
                                     accelerator.process_index, accelerator.num_processes,
                                     dataset_name=f"{name} (tuning)")
            outputs = score_split(accelerator, loader, {"tune": scorer}, description=f"tune {name}", on_error=on_error)
            sizes[name] = int(outputs["labels"].shape[0])
            scores[name] = {key: outputs[("tune", key)] for key in candidates}

    for method, grid in points.items():
        entries, metrics = [], []
        for index, point in enumerate(grid):
            key = f"{method}[{index}]"
            result = None
            if key in candidates:
                result = _validation_metrics(scores["tune_select"][key],
                                             {name: scores[name][key] for name in ood_sets})
                if result is None:
                    problems[key] = "scores that are not finite (NaN or infinite)"
            metrics.append(result)
            entries.append({"hyperparameters": point, **(result or {"error": problems[key]})})
        chosen = select_point(metrics)
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
    lines = ["", f"Hyperparameters chosen on validation only (--tune, {record['num_grid_points']} grid points, "
                 f"{record['seconds']:.1f} s): ID tune_select {sizes['tune_select']} vs OOD validation {ood}; "
                 f"{record['rule']}.", ""]
    from .report import table_lines

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
    "HELDOUT_VALIDATION",
    "not_tuned_reason",
    "search_spaces",
    "SELECTION_RULE",
    "VALIDATION_SEED",
    "GeneratedImages",
    "chosen_hyperparameters",
    "grid_points",
    "heldout_classes_validation",
    "jigsaw_image",
    "markdown_lines",
    "select_point",
    "split_halves",
    "tune_hyperparameters",
    "validation_ood_sets",
]
