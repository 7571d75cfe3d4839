"""What an evaluation will score: the data splits, their subsets, and the fingerprint of every cached artefact.

* :func:`load_data`: ID and OOD splits from ``--benchmark`` / ``--id-dataset`` / ``--ood-dataset``
  (streamed ``datasets.IterableDataset`` splits with ``--streaming``).
* :func:`subset`: the ``--max-samples`` rows of a split (random with ``--seed``; the first ones when streamed).
* :func:`make_plan` -> :class:`EvaluationPlan`: the exact samples of every split and the fingerprint of
  every score file and fitted state, from which :func:`missing_scores` decides what to compute.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..utils.version import __version__
from .context import RunContext
from .errors import InputError
from .fingerprints import dataset_fingerprint, fingerprint, is_streamed, model_fingerprint
from .models import effective_hyperparameters
from .score_cache import BASE_MODEL, ScoreCache


#: Name of the ID test split and the ID validation split in the score cache.
ID_TEST, ID_VALIDATION = "id_test", "id_validation"
#: Prefix of the OOD splits in the score cache: ``ood_{name}``.
OOD_PREFIX = "ood_"
#: Prefix of the OOD validation splits (the selection's) in the plan and the score cache.
VAL_OOD_PREFIX = "val_ood_"


def _load_split(spec: str, what: str, streaming: bool = False, **columns: Any) -> Any:
    """``hf_gsc.data.load_split`` with errors naming the argument; ``columns``: ``image_column``, ``label_column``,
    ``need_labels`` (the ID data's)."""
    from ..data import load_split

    try:
        return load_split(spec, streaming=True, **columns) if streaming else load_split(spec, **columns)
    except Exception as error:  # noqa: BLE001  (datasets and PIL raise many types)
        raise InputError(f"{what}: could not load {spec!r}: {error}") from None


def needed_id_splits(detectors: Mapping[str, Any], calibrate: bool = True) -> dict[str, str]:
    """ID split name -> why it is needed: ``test``, ``validation`` (unless nothing is calibrated: ``calibrate``
    false, a saved detector evaluated at its own threshold) and each detector's ``fit_split``."""
    needed = {"test": "the metrics (ID test)"}
    if calibrate:
        needed["validation"] = "threshold calibration (ID validation)"
    for name, detector in detectors.items():
        if detector.needs_fit:
            needed.setdefault(detector.fit_split, f"fitting {name}")
    return needed


def _check_columns(source: str, label: str, dataset: Any) -> None:
    columns = dataset.column_names
    if columns is None:  # a streamed dataset whose features are only known once read
        return
    if not is_streamed(dataset) and len(dataset) == 0:
        raise InputError(f"{source}: the {label} split is empty")
    if "image" not in columns:
        raise InputError(f"{source}: the {label} split has no 'image' column (columns: {', '.join(columns)})")
    if label == "ID test" and not is_streamed(dataset) and (
            "label" not in columns or max(dataset["label"], default=-1) < 0):
        # The ID accuracy compares predictions with these labels: labels that were never read are no accuracy.
        raise InputError(f"{source}: the ID test split has no labels (every row's label is -1, as in a Hub dataset's "
                         "unlabelled test split): give ID test data whose labels are the model's classes")


def load_data(
    needed: Mapping[str, str],
    *,
    benchmark: str | None,
    id_dataset: str | None,
    ood_split_names: Sequence[str] | None = None,
    extra_ood: Sequence[tuple[str, str]] = (),
    streaming: bool = False,
    image_column: str | None = None,
    label_column: str | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(id_splits, ood_splits)`` from ``benchmark`` (its OOD splits, or those named in ``ood_split_names``) or
    ``id_dataset`` (its ``image_column`` / ``label_column``, else found by type; an ID split without labels is
    refused: no accuracy is computed on labels that were not read), plus ``extra_ood`` (``(NAME, SPEC)`` of each
    ``--ood-dataset``, image column by type).

    Only the ID splits in ``needed`` are returned; a missing one raises :class:`InputError`.
    """
    if benchmark is not None:
        from ..data import load_benchmark

        try:  # streaming: only Hub-read benchmarks accept it (checked in options)
            loaded = load_benchmark(benchmark, ood_splits=ood_split_names, streaming=streaming)
        except Exception as error:  # noqa: BLE001  (Hub access, gated datasets, decoding: many types)
            raise InputError(f"--benchmark {benchmark}: could not load it: {error}") from None
        source = f"--benchmark {benchmark}"
        available = loaded.id_splits
        id_splits = {split: available[split] for split in needed if split in available}
        ood_splits = dict(loaded.ood_splits)
    else:
        source = f"--id-dataset {id_dataset}"
        id_splits = {}
        for split, why in needed.items():
            try:
                id_splits[split] = _load_split(f"{id_dataset}:{split}", "--id-dataset", streaming,
                                               image_column=image_column, label_column=label_column, need_labels=True)
            except InputError as error:
                raise InputError(f"{source}: cannot load the ID {split!r} split, needed for {why}: {error}") from None
        ood_splits = {}
    for split, why in needed.items():
        if split not in id_splits:
            raise InputError(f"{source}: the ID data has no {split!r} split, needed for {why}")
    for name, spec in extra_ood:
        if name in ood_splits:
            raise InputError(f"--ood-dataset {name!r}: the benchmark already has an OOD split of that name")
        ood_splits[name] = _load_split(spec, f"--ood-dataset {name}={spec}", streaming)
    if not ood_splits:
        raise InputError(f"{source}: no OOD splits to evaluate")
    for label, dataset in [*((f"ID {s}", d) for s, d in id_splits.items()), *((f"OOD {n}", d) for n, d in ood_splits.items())]:
        _check_columns(source, label, dataset)
    return id_splits, ood_splits


def subset(dataset: Any, max_samples: int | None, seed: int, key: str) -> Any:
    """At most ``max_samples`` rows, drawn at random with ``(seed, key)``, kept in dataset order.

    A streamed dataset has no random access: its first ``max_samples`` rows.
    """
    if max_samples is None:
        return dataset
    if is_streamed(dataset):
        return dataset.take(max_samples)
    if len(dataset) <= max_samples:
        return dataset
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    indices = np.sort(rng.choice(len(dataset), size=max_samples, replace=False))
    return dataset.select(indices.tolist())


def num_rows(dataset: Any) -> int | None:
    """``len(dataset)``, or ``None`` for a streamed dataset (known only once read)."""
    return None if is_streamed(dataset) else len(dataset)


@dataclass
class EvaluationPlan:
    """The exact samples of every split and the fingerprint of every cached artefact.

    Attributes:
        splits: ``id_test``, ``id_validation`` and ``ood_{name}`` -> the (subsampled) dataset.
        sources: the same keys -> where the split comes from (``--id-dataset``, ``--ood-dataset`` or
            benchmark), named in errors about its images.
        fit_data: method -> its (subsampled) ID fitting data, for methods that need a fit.
        fit_fingerprints: method -> fingerprint of its fitted state.
        score_fingerprints: ``(method, split)`` -> fingerprint of its score file.
    """

    splits: dict[str, Any]
    sources: dict[str, str]
    fit_data: dict[str, Any]
    fit_fingerprints: dict[str, str]
    score_fingerprints: dict[tuple[str, str], str]

    @property
    def ood_names(self) -> list[str]:
        return [split[len(OOD_PREFIX):] for split in self.splits if split.startswith(OOD_PREFIX)]


def make_plan(
    context: RunContext,
    model: torch.nn.Module,
    detectors: Mapping[str, Any],
    id_splits: Mapping[str, Any],
    ood_splits: Mapping[str, Any],
    validation_ood: tuple[Mapping[str, Any], str] | None = None,
    shipped: bool = False,
) -> EvaluationPlan:
    """Subsample the splits (``context.max_samples``, ``context.max_fit_samples``, ``context.seed``) and fingerprint
    what each score depends on: the weights, the method and its settings (and fit), the exact samples.
    ``context.source``: the benchmark or ID dataset; ``context.ood_sources``: the SPEC of each OOD split given by hand.
    ``validation_ood``: the OOD validation sets of the selection (:mod:`.selection`), already subsampled, planned as
    ``val_ood_{name}``, and what they are. ``shipped``: the detectors are saved ones evaluated as they are
    (``--detector``): nothing is fitted, nothing calibrated (no ID validation split unless ``id_splits`` has one),
    and their scores follow their saved fitted state."""
    max_samples, max_fit_samples, seed, source = (context.max_samples, context.max_fit_samples, context.seed,
                                                  context.source)
    validation_sets, validation_ood_source = validation_ood if validation_ood is not None else ({}, "")
    model_fp = model_fingerprint(model)
    splits = {
        ID_TEST: subset(id_splits["test"], max_samples, seed, "test"),
        **({ID_VALIDATION: subset(id_splits["validation"], max_samples, seed, "validation")}
           if "validation" in id_splits else {}),
        **{
            OOD_PREFIX + name: subset(dataset, max_samples, seed, OOD_PREFIX + name)
            for name, dataset in ood_splits.items()
        },
        **{VAL_OOD_PREFIX + name: dataset for name, dataset in validation_sets.items()},
    }
    ood_sources = dict(context.ood_sources)

    def split_source(split: str) -> str:
        if split.startswith(VAL_OOD_PREFIX):
            return f"{validation_ood_source} ({split[len(VAL_OOD_PREFIX):]})"
        if split.startswith(OOD_PREFIX):
            return ood_sources.get(split[len(OOD_PREFIX):], f"{source}/{split[len(OOD_PREFIX):]}")
        return source

    descriptions: dict[str, dict[str, Any]] = {
        split: {
            "source": split_source(split),
            "rows": num_rows(dataset),
            "max_samples": max_samples,
            "seed": seed,
            "content": dataset_fingerprint(dataset),
        }
        for split, dataset in splits.items()
    }
    # One subset object per fit split: the methods fitted on it share one pass over it (fitting.fit_groups).
    fit_sets = {
        split: subset(id_splits[split], max_fit_samples, seed, f"fit_{split}")
        for split in dict.fromkeys(detector.fit_split for detector in detectors.values() if detector.needs_fit)
        if not shipped
    }
    fit_data = {} if shipped else {name: fit_sets[detector.fit_split] for name, detector in detectors.items()
                                    if detector.needs_fit}
    # What is in effect: every setting with its default filled in, and the library version (a formula fixed in a new
    # release must not reuse old scores).
    settings = {name: effective_hyperparameters(detector) for name, detector in detectors.items()}
    fit_fps = {
        name: fingerprint({"model": model_fp, "method": name, "hyperparameters": settings[name], "hf_gsc": __version__,
                           "fit_split": detectors[name].fit_split, "source": source,
                           "num_samples": num_rows(dataset) if num_rows(dataset) is not None else max_fit_samples,
                           "seed": seed, "content": dataset_fingerprint(dataset)})
        for name, dataset in fit_data.items()
    }
    if shipped:  # the saved fitted state is what the scores depend on
        fit_fps = {name: fingerprint({name: tensor_fingerprint(tensor) for name, tensor in detector.fitted_state().items()})
                   for name, detector in detectors.items()}
    score_fps = {
        (name, split): fingerprint({"model": model_fp, "method": name, "hyperparameters": settings.get(name, {}),
                                    "hf_gsc": __version__, "fit": fit_fps.get(name), "split": split,
                                    "data": descriptions[split]})
        for name in [*detectors, BASE_MODEL]
        for split in splits
    }
    sources = {split: description["source"] for split, description in descriptions.items()}
    return EvaluationPlan(splits, sources, fit_data, fit_fps, score_fps)


def same_images(a: Any, b: Any) -> bool:
    """Whether two (non-streamed) splits hold the same images in the same order: an OOD split that is the ID test
    split scores AUROC 50 by construction. Hashed only when their sizes agree, so OOD data of another size costs
    nothing; a stream is not read for this."""
    if is_streamed(a) or is_streamed(b) or not hasattr(a, "select_columns") or not hasattr(b, "select_columns"):
        return False
    if len(a) != len(b) or "image" not in a.column_names or "image" not in b.column_names:
        return False
    if a is b:
        return True
    return dataset_fingerprint(a.select_columns(["image"])) == dataset_fingerprint(b.select_columns(["image"]))


def same_as_test_warning(names: Sequence[str]) -> str:
    """The warning (and ``results.md`` line) for OOD splits that are the ID test split's images."""
    return (f"OOD split(s) {', '.join(map(repr, names))} hold the same images as the ID test split: their AUROC is "
            "0.5 (50%) and their FPR95 about 95% by construction; give OOD data of other images (is --ood-dataset the "
            "ID data?)")


def tensor_fingerprint(tensor: torch.Tensor) -> str:
    """Hash of a tensor's dtype, shape and values."""
    import hashlib

    data = tensor.detach().cpu().contiguous()
    digest = hashlib.blake2b(f"{data.dtype}{tuple(data.shape)}".encode(), digest_size=16)
    digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


def missing_scores(
    plan: EvaluationPlan, methods: Sequence[str], cache: ScoreCache, overwrite: bool
) -> dict[str, list[str]]:
    """Split -> methods whose score file is missing or stale (the base model's predictions on ID test too).

    Call it on the main process and broadcast the answer, so every process runs the same collective operations.
    """
    return {
        split: [
            name for name in ([*methods, BASE_MODEL] if split == ID_TEST else methods)
            if overwrite
            or not cache.is_cached(name, split, plan.score_fingerprints[(name, split)], num_rows(plan.splits[split]))
        ]
        for split in plan.splits
    }


def check_conformal_size(args: Any, num_validation: int | None) -> None:
    """Refuse ``--conformal-delta`` before any scoring when the ID validation split is too small for it
    (a streamed split's size is known only after scoring; the report raises then)."""
    if args.conformal_delta is None or num_validation is None:
        return
    from .calibration import conformal_order

    try:
        conformal_order(num_validation, args.target_tpr, args.conformal_delta)
    except ValueError as error:
        raise InputError(f"--conformal-delta {args.conformal_delta} with --tpr {args.target_tpr}: {error}") from None


def warn_small_calibration(args: Any, num_validation: int | None) -> None:
    """The warning ``calibrate`` gives in Python below :data:`~hf_gsc.utils.thresholds.MIN_CALIBRATION_SAMPLES`,
    for the thresholds this run calibrates on ID validation (naming ``--max-samples`` when it is the cause)."""
    from ..utils.thresholds import MIN_CALIBRATION_SAMPLES, TOO_FEW_FOR_A_THRESHOLD

    if num_validation is None or num_validation >= MIN_CALIBRATION_SAMPLES:
        return
    cause = (f" (--max-samples {args.max_samples})" if args.max_samples is not None
             and args.max_samples < MIN_CALIBRATION_SAMPLES else "")
    warnings.warn(f"the thresholds are calibrated on {num_validation} ID validation samples{cause}, "
                  f"{TOO_FEW_FOR_A_THRESHOLD}", UserWarning, stacklevel=2)


__all__ = [
    "BASE_MODEL",
    "ID_TEST",
    "ID_VALIDATION",
    "OOD_PREFIX",
    "EvaluationPlan",
    "check_conformal_size",
    "load_data",
    "make_plan",
    "missing_scores",
    "needed_id_splits",
    "num_rows",
    "subset",
    "warn_small_calibration",
]
