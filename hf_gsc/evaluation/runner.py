"""``run_evaluation(args)``: the OOD evaluation behind ``scripts/evaluate_ood.py`` and ``make demo``.

Steps, the same under ``python`` and ``accelerate launch`` (any number of processes, any device):

1. Check the arguments (:mod:`.options`), create the accelerator (its device and mixed precision; a
   precision the device cannot run is an error here), load the model and construct every detector
   (:mod:`.models`; this resolves the GSC ``split_point``), load the data and check the splits exist
   (:mod:`.plan`). All of this happens before any fitting or scoring, so bad input fails in seconds
   with a message naming the argument.
2. Fit the detectors that need it on ID ``detector.fit_split`` data (:mod:`.fitting`); a rerun reuses a valid saved fit.
3. Score the ID test split, the ID validation split and every OOD split with every method
   (:mod:`.scoring`, :mod:`.loop`); valid score files from an earlier run are loaded instead of recomputed.
   An image that cannot be decoded stops the run with one line naming the split's source, the row and the
   file (the splits finished before it keep their score files), or with ``--skip-unreadable-images`` is left
   out and counted per split in ``results.json`` (``num_skipped``). A column that holds no images at all
   (text, numbers) is refused in step 1, when the data is loaded.
4. On the main process: calibrate each method's ``threshold`` on the ID validation scores only, report
   the TPR it reaches on ID test, compute FPR95 / AUROC / AUPR-In / AUPR-Out of ID test vs each OOD
   split, write ``results.json``, ``results.md`` and the plots (:mod:`.report`, :mod:`.plots`).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import __version__
from ..registry import detector_class
from ..data.decoding import UndecodableImageError
from .fitting import fit_detectors, saved_fit_info
from .labels import LabelMismatchWarning, class_names_of, compare_labels, label_warning, model_class_names
from .accelerator import make_accelerator
from .loaders import default_num_workers
from .score_cache import NUM_SKIPPED_KEY, SCORE_KEY, ScoreCache
from .models import (
    build_detectors,
    effective_hyperparameters,
    image_backend_of,
    image_transform,
    load_model,
    load_shipped,
)
from .options import InputError, check_output_dir, parse_args, validate_args
from .plan import (
    BASE_MODEL,
    ID_TEST,
    ID_VALIDATION,
    OOD_PREFIX,
    EvaluationPlan,
    load_data,
    make_plan,
    missing_scores,
    needed_id_splits,
    num_rows,
    same_as_test_warning,
    same_images,
    subset,
)
from .report import jsonable, method_results, write_json, write_report
from .run_info import check_process_count, data_description, run_header
from .scoring import PREDICTIONS_KEY, score_missing
from .timings import split_timings, update_timings


#: The folder (under ``OUTPUT/detectors/``) of the detector the selection chose.
SELECTED = "selected"
#: The ``--tune`` search's record in the output folder, reused by a rerun with the same inputs.
TUNING_RECORD = "tuning.json"


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


def _broadcast(accelerator: Any, value: Any) -> Any:
    """The main process's ``value`` on every process (a no-op with one process)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    holder = [value]
    broadcast_object_list(holder, from_process=0)
    return holder[0]


def collect_results(
    args: argparse.Namespace,
    plan: EvaluationPlan,
    cache: ScoreCache,
    detectors: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], torch.Tensor]:
    """Calibrate on ID validation, evaluate on ID test vs OOD; returns ``(results without run
    metadata, ID test scores, OOD scores, per ID test sample whether the base model is right)`` from the score
    files."""

    def load(name: str, split: str) -> dict[str, torch.Tensor]:
        data = cache.load(name, split, plan.score_fingerprints[(name, split)], num_rows(plan.splits[split]))
        if data is None:
            raise RuntimeError(f"score file {cache.path(name, split)} vanished or changed during the run (see the "
                               "warning above); run again to compute it again")
        return data

    base = load(BASE_MODEL, ID_TEST)
    correct = base[PREDICTIONS_KEY] == base["labels"]  # per ID test sample, in dataset order like every score file
    groups = ood_groups_of(args.benchmark, plan.ood_names)
    fits = {name: _fit_record(Path(args.output_dir), name, dataset) for name, dataset in plan.fit_data.items()}
    id_scores, ood_scores, entries = {}, {}, {}
    for name, detector in detectors.items():
        id_test = load(name, ID_TEST)
        if not torch.equal(id_test["labels"], base["labels"]):
            raise RuntimeError(f"score files of {name!r} and of the base model list the ID test samples differently")
        id_scores[name] = id_test[SCORE_KEY]
        ood_scores[name] = {ood: load(name, OOD_PREFIX + ood)[SCORE_KEY] for ood in plan.ood_names}
        validation = load(name, ID_VALIDATION)[SCORE_KEY]
        entry = method_results(id_scores[name], validation, ood_scores[name], args.tpr, "validation", method=name,
                               id_test_correct=correct, delta=getattr(args, "conformal_delta", None), groups=groups)
        entry["hyperparameters"] = effective_hyperparameters(detector)
        if name in plan.fit_data:
            entry["fit"] = {"split": detector.fit_split, **fits[name]}
        entries[name] = entry
    any_method = next(iter(detectors))

    def skipped(split: str) -> int:  # the same for every method: all read the split through the same decoding
        return int(load(any_method, split).get(NUM_SKIPPED_KEY, torch.tensor(0)))

    results = {
        "model": args.model,
        "benchmark": args.benchmark,  # None with --id-dataset
        "id_dataset": args.id_dataset,
        "id_accuracy": float((base[PREDICTIONS_KEY] == base["labels"]).double().mean()),
        "methods": entries,
        "split_sizes": {  # from the score files: a streamed split's size is known once it was read
            "id_test": int(id_scores[any_method].numel()),
            "id_validation": int(load(any_method, ID_VALIDATION)[SCORE_KEY].numel()),
            "ood": {ood: int(scores.numel()) for ood, scores in ood_scores[any_method].items()},
            "fit": {name: fit["num_samples"] for name, fit in fits.items()},
        },
        # Unreadable images left out (--skip-unreadable-images; without it, any one stops the run).
        NUM_SKIPPED_KEY: {
            "id_test": skipped(ID_TEST),
            "id_validation": skipped(ID_VALIDATION),
            "ood": {ood: skipped(OOD_PREFIX + ood) for ood in plan.ood_names},
            "fit": {name: fit[NUM_SKIPPED_KEY] for name, fit in fits.items()},
        },
        "calibration_split": "validation",
        "ood_groups": groups,
    }
    return results, id_scores, ood_scores, correct


def _at_shipped_threshold(entry: dict[str, Any], detector: Any, source: str, id_scores: torch.Tensor,
                          ood_scores: Mapping[str, torch.Tensor], correct: torch.Tensor) -> dict[str, Any]:
    """``--detector``: the method's entry re-read at the shipped threshold (not the one the report would calibrate):
    ``threshold``, ``calibration`` (the saved record), ``id_tpr_at_threshold``, per OOD split ``fpr_at_threshold`` (the
    fraction of OOD accepted as ID) and the selective accuracy; returns ``results.json``'s ``detector`` record."""
    from .calibration import true_positive_rate
    from .selective import selective_accuracy

    threshold = float(detector.config.threshold)
    entry["threshold"] = threshold
    entry["calibration"] = detector.config.calibration or {"split": None, "note": "threshold set by hand"}
    entry["id_tpr_at_threshold"] = true_positive_rate(id_scores, threshold)
    for name, scores in ood_scores.items():
        entry["ood"][name]["fpr_at_threshold"] = true_positive_rate(scores, threshold)
    if "selective" in entry:
        entry["selective"]["accuracy"] = selective_accuracy(id_scores, correct, threshold)["accuracy"]
    return {"source": source, "method": detector.method, "threshold": threshold,
            "calibration": detector.config.calibration, "hyperparameters": dict(detector.hyperparameters),
            "evaluated_as": "saved: no refit, no recalibration",
            "id_tpr_at_threshold": entry["id_tpr_at_threshold"],
            "fpr_at_threshold": {name: values["fpr_at_threshold"] for name, values in entry["ood"].items()}}


def _selection(plan: EvaluationPlan, cache: ScoreCache, detectors: Mapping[str, Any],
               selection_data: tuple[dict[str, Any], list[int] | None, str],
               throughput: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``results.json``'s ``selection`` from the score files of ID validation and the OOD validation sets."""
    from .selection import VAL_OOD_PREFIX, selection_record

    sets, id_rows, description = selection_data

    def load(name: str, split: str) -> torch.Tensor:
        data = cache.load(name, split, plan.score_fingerprints[(name, split)], num_rows(plan.splits[split]))
        if data is None:
            raise RuntimeError(f"score file {cache.path(name, split)} vanished or changed during the run; run again")
        return data[SCORE_KEY]

    validation = {name: load(name, ID_VALIDATION) for name in detectors}
    ood = {name: {set_name: load(name, VAL_OOD_PREFIX + set_name) for set_name in sets} for name in detectors}
    seconds = sum(throughput.get(VAL_OOD_PREFIX + set_name, {}).get("seconds", 0.0) for set_name in sets)
    return selection_record(validation, ood, id_rows, description, seconds)


def ood_groups_of(benchmark: str | None, ood_names: Sequence[str]) -> dict[str, list[str]]:
    """``{"near": [...], "far": [...]}``: the evaluated OOD splits in each OpenOOD v1.5 group of ``benchmark``
    (empty without a benchmark; ``--ood-dataset`` splits belong to no group)."""
    if benchmark is None:
        return {}
    from ..data.benchmarks import ood_groups

    return {group: [name for name in names if name in ood_names] for group, names in ood_groups(benchmark).items()}


def _tune(
    accelerator: Any,
    args: argparse.Namespace,
    parsed: Mapping[str, Any],
    model: torch.nn.Module,
    methods: Sequence[str],
    hyperparameters: dict[str, dict[str, Any]],
    id_splits: Mapping[str, Any],
    transform: Any,
    num_workers: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--tune``: search the grids on validation data (:mod:`.tuning`), put the chosen values into
    ``hyperparameters`` and rebuild the detectors with them; returns ``(the search's record, the detectors)``.
    Every process searches (scoring is sharded); the main process's choice is used by all."""
    from .tuning import chosen_hyperparameters, tune_hyperparameters

    # Names set on the command line are the user's choice: not searched.
    fixed = {name: sorted(parsed["hyperparameters"].get(name, {})) for name in methods}
    # The search's record is kept in OUTPUT/tuning.json as soon as it exists, keyed on everything it read, so that a
    # rerun after a failure later in the run does not search again.
    from .fingerprints import dataset_fingerprint, fingerprint, model_fingerprint

    key = fingerprint(jsonable({
        "version": __version__, "model": model_fingerprint(model), "methods": list(methods),
        "hyperparameters": hyperparameters, "fixed": fixed, "benchmark": args.benchmark,
        "data": {split: dataset_fingerprint(dataset) for split, dataset in id_splits.items()},
        "max_samples": args.max_samples, "max_fit_samples": args.max_fit_samples, "seed": args.seed,
        "skip_unreadable_images": args.skip_unreadable_images}))
    saved_path = Path(args.output_dir) / TUNING_RECORD
    record = None
    if accelerator.is_main_process and not args.overwrite and saved_path.is_file():
        saved = json.loads(saved_path.read_text())
        record = saved.get("record") if saved.get("key") == key else None
    record = _broadcast(accelerator, record)
    if record is None:
        record = tune_hyperparameters(
            accelerator, model, methods, hyperparameters, fixed, id_splits, transform, benchmark=args.benchmark,
            max_samples=args.max_samples, max_fit_samples=args.max_fit_samples, seed=args.seed,
            batch_size=args.batch_size, num_workers=num_workers,
            on_error="skip" if args.skip_unreadable_images else "raise")
        record = _broadcast(accelerator, jsonable(record))
        if accelerator.is_main_process:
            write_json(saved_path, {"key": key, "record": record}, Path(args.output_dir))
    elif accelerator.is_main_process:
        print(f"tuning: reusing the search saved in {saved_path} (the same model, data and settings)", flush=True)
    for name, values in chosen_hyperparameters(record).items():
        hyperparameters[name] = {**hyperparameters[name], **values}
    if accelerator.is_main_process:
        print(f"tuning: {record['num_grid_points']} grid points on validation data in {record['seconds']:.1f} s; "
              + "; ".join(f"{name}: {values}" for name, values in chosen_hyperparameters(record).items()), flush=True)
    return record, build_detectors(model, methods, hyperparameters)


def _fit_record(output_dir: Path, method: str, dataset: Any) -> dict[str, Any]:
    """``num_samples`` (images the fit used) and ``num_skipped`` (unreadable ones left out) of a method's fit."""
    saved = saved_fit_info(output_dir, method)
    num_skipped = saved.get(NUM_SKIPPED_KEY, 0)
    rows = num_rows(dataset)
    return {"num_samples": rows - num_skipped if rows is not None else saved.get("num_samples"),
            NUM_SKIPPED_KEY: num_skipped}


def run_evaluation(args: argparse.Namespace | Sequence[str] | None = None) -> dict[str, Any] | None:
    """Run the whole evaluation; returns the ``results.json`` content on the main process, else ``None``.

    ``args`` is a namespace from :func:`~hf_gsc.evaluation.options.build_parser` or an argv list. Raises
    :class:`InputError` (a ``ValueError``) on bad input, before fitting or scoring, and
    :class:`~hf_gsc.data.decoding.UndecodableImageError` (a ``ValueError``) at an unreadable image unless
    ``--skip-unreadable-images`` is given.
    """
    if args is None or not isinstance(args, argparse.Namespace):
        args = parse_args(args)
    start = time.perf_counter()
    parsed = validate_args(args)
    methods: list[str] = parsed["methods"]
    output_dir = check_output_dir(args.output_dir)

    accelerator = make_accelerator(args.mixed_precision)
    check_process_count(accelerator)
    check_output_dir(output_dir, accelerator.process_index)
    if not accelerator.is_local_main_process:
        _quiet_libraries()
    from accelerate.utils import set_seed

    set_seed(args.seed)
    num_workers = default_num_workers(accelerator.device) if args.num_workers is None else args.num_workers

    # Model and detectors first: an unknown split point fails here, before data is loaded. The main
    # process downloads (model, data) first, so that the others read its cache instead of racing it.
    shipped = None  # --detector: a saved detector evaluated as it is
    if getattr(args, "detector", None) is not None:
        with accelerator.main_process_first():
            shipped, processor = load_shipped(args.detector, args.revision, args.image_backend)
        model = shipped.model
        shipped.to(accelerator.device)
        methods = [shipped.method]
        hyperparameters = {shipped.method: dict(shipped.hyperparameters)}
        detectors = {shipped.method: shipped}
    else:
        with accelerator.main_process_first():
            model, processor, saved, _ = load_model(args.model, args.revision, args.image_backend)
        model.to(accelerator.device)
        if saved and args.methods is None:
            # Refused rather than guessed: "evaluate my saved detector" (--detector: its fitted state and threshold) and
            # "fit methods on its base model with its settings as defaults" (--methods) are different runs; the
            # default table would leave the saved method out and refitting it would not test what was shipped.
            method = next(iter(saved))
            raise InputError(f"--model {args.model!r} is a saved {method!r} detector: to evaluate it as it was saved "
                             f"(its fitted state and threshold, no refit) use --detector {args.model}; to fit and "
                             f"evaluate methods on its base model with its settings as defaults, name them with "
                             f"--methods (e.g. --methods {method})")
        hyperparameters = {name: dict(values) for name, values in parsed["hyperparameters"].items()}
        for name, values in saved.items():  # a saved detector given as --model: its settings, unless overridden
            if name in methods:
                hyperparameters[name] = {**values, **hyperparameters[name]}
        for name in methods:  # defaults that depend on the model's image processor (ODIN's image_std), unless set
            hyperparameters[name] = {**detector_class(name).model_defaults(processor), **hyperparameters[name]}
        detectors = build_detectors(model, methods, hyperparameters)
    with accelerator.main_process_first():
        id_splits, ood_splits = load_data(args, parsed, needed_id_splits({} if shipped is not None else detectors))
    # Labels by name, before anything reads them (fits, the tuning, the scores' labels, the ID accuracy).
    id_splits, label_check = _check_labels(id_splits, model.config, parsed.get("label_map") or {})
    if accelerator.is_main_process and label_check.get("mapping"):
        pairs = ", ".join(f"{data!r} -> {label!r}" for data, label in label_check["mapping"].items())
        print(f"ID labels mapped to the model's id2label (by {label_check['mapped_by']}): {pairs}", flush=True)
    if accelerator.is_main_process and label_warning(label_check):
        warnings.warn(label_warning(label_check), LabelMismatchWarning, stacklevel=2)
    same_as_test = [name for name, dataset in ood_splits.items() if same_images(dataset, id_splits["test"])]
    if accelerator.is_main_process and same_as_test:
        warnings.warn(same_as_test_warning(same_as_test), UserWarning, stacklevel=2)
    transform = image_transform(processor, model)
    tuning = None
    if getattr(args, "tune", False):  # choose hyperparameters on validation data, then evaluate with them
        tuning, detectors = _tune(accelerator, args, parsed, model, methods, hyperparameters, id_splits, transform,
                                  num_workers)
    selection_data = None  # (OOD validation sets, ID side rows, description): the data the detector is chosen on
    if not getattr(args, "no_selection", False) and shipped is None:  # one shipped detector: nothing to choose
        from .selection import selection_sets

        selection_data = selection_sets(args, parsed, subset(id_splits["validation"], args.max_samples, args.seed,
                                                             "validation"))
        if not selection_data[0]:
            warnings.warn(f"no selection: {selection_data[2]}", UserWarning, stacklevel=2)
            selection_data = None
    plan = make_plan(args, parsed, model, detectors, hyperparameters, id_splits, ood_splits,
                     *(selection_data[0], selection_data[2]) if selection_data else (None, ""), shipped=shipped is not None)
    _check_conformal_size(args, num_rows(plan.splits[ID_VALIDATION]))

    # Fit (main process) only the detectors that still have scores to compute, then score.
    cache = ScoreCache(output_dir)
    missing = _broadcast(accelerator, missing_scores(plan, methods, cache, args.overwrite)
                         if accelerator.is_main_process else None)
    to_fit = [name for name in plan.fit_data if any(name in names for names in missing.values())]
    if accelerator.is_main_process:
        print(run_header({
            "model": args.model or args.detector,
            "data": data_description(args.benchmark, args.id_dataset, parsed["extra_ood"]),
            **({"shipped": f"the saved {shipped.method!r} detector as it is: its settings, fitted state and threshold "
                           f"{shipped.config.threshold:.6g} (no refit, no recalibration)"} if shipped is not None else {}),
            "device": accelerator.device, "num_processes": accelerator.num_processes,
            "mixed_precision": accelerator.mixed_precision, "num_workers": num_workers,
            "image_backend": image_backend_of(processor), "methods": methods,
            "split_sizes": {_split_label(split): num_rows(dataset) for split, dataset in plan.splits.items()},
            "fit_sizes": {name: num_rows(dataset) for name, dataset in plan.fit_data.items()},
            "num_to_score": sum(map(len, missing.values())),
            "num_scores": sum(len(methods) + (split == ID_TEST) for split in plan.splits),  # + base model on ID test
            "visible_gpus": torch.cuda.device_count(),
        }), flush=True)
    on_error = "skip" if args.skip_unreadable_images else "raise"
    # A method that cannot be fitted or scored on this model and data is skipped, with its reason, and the others go
    # on: a full table never dies for one method (its fits and score files are kept for a rerun either way).
    skipped: dict[str, str] = {}
    try:
        skipped.update(fit_detectors(accelerator, detectors, to_fit, plan.fit_data, plan.fit_fingerprints, transform,
                                     args.batch_size, output_dir, args.seed, args.overwrite, num_workers, on_error,
                                     source=args.benchmark or args.id_dataset))
        seconds, splits = score_missing(accelerator, plan, missing, detectors, model, transform, cache,
                                        args.batch_size, num_workers, on_error, skipped=skipped)
    except UndecodableImageError as error:
        raise UndecodableImageError(f"{error} (fix or remove the file, or pass --skip-unreadable-images to leave "
                                    "such images out; finished splits are kept and not scored again)") from None
    if accelerator.is_main_process:
        for name, reason in skipped.items():
            print(f"skipped {name}: {reason}", flush=True)
    detectors = {name: detector for name, detector in detectors.items() if name not in skipped}
    if not detectors:
        raise RuntimeError("every method was skipped: " + "; ".join(f"{n}: {r}" for n, r in skipped.items()))
    if not accelerator.is_main_process:
        return None

    results, id_scores, ood_scores, correct = collect_results(args, plan, cache, detectors)
    results["skipped"] = skipped
    if shipped is not None:
        results["model"] = args.detector
        results["detector"] = _at_shipped_threshold(results["methods"][shipped.method], shipped, args.detector,
                                                    id_scores[shipped.method], ood_scores[shipped.method], correct)
    if selection_data is not None:
        results["selection"] = _selection(plan, cache, detectors, selection_data, splits)
    results["ood_datasets"] = dict(parsed["extra_ood"])  # NAME -> SPEC of each --ood-dataset
    if tuning is not None:
        results["tuning"] = tuning
    results["label_check"] = label_check
    if same_as_test:
        results["ood_same_as_id_test"] = same_as_test
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    # Timings of the passes that computed the scores used, this run's or an earlier one's (cached splits).
    records = update_timings(cache.root, plan.score_fingerprints, missing, splits, seconds)
    splits_scored, method_seconds = split_timings(records, plan.score_fingerprints, splits, missing, created)
    config = {**jsonable(vars(args)), "methods": ",".join(methods)}
    results.update(
        num_processes=accelerator.num_processes,
        device=str(accelerator.device),
        mixed_precision=accelerator.mixed_precision,
        num_workers=num_workers,
        image_backend=image_backend_of(processor),
        # where the image processor's rescale + normalize ran: "device" (deferred, see hf_gsc.data.normalization)
        pixel_normalization="device" if transform.normalization is not None else "workers",
        config=config,
        versions=package_versions(),
        seconds={
            "total": round(time.perf_counter() - start, 2),
            "splits_scored": splits_scored,
            "scoring_main_process": {m: v for m, v in method_seconds.items() if m in detectors},
        },
        created=created,
    )
    write_report(output_dir, results)
    if not args.no_plots:
        from .plots import write_plots

        write_plots(output_dir, id_scores, ood_scores, results, correct)
        results["seconds"]["total"] = round(time.perf_counter() - start, 2)
        write_report(output_dir, results)
    if getattr(args, "save_detectors", False):
        save_detectors(output_dir, detectors, results, processor)
    return results


def save_detectors(output_dir: Path, detectors: Mapping[str, Any], results: Mapping[str, Any], processor: Any) -> None:
    """Save each evaluated method as a detector folder ``detectors/{method}/`` (beside its fit): its threshold is the
    one calibrated on ID validation for ``results.json``, and its card carries these results. The method the
    selection chose is saved again as ``detectors/selected/``, its card saying why."""
    from .fitting import fit_dir

    for name, detector in detectors.items():
        entry = results["methods"][name]
        detector.config.threshold = entry["threshold"]
        detector.config.calibration = entry["calibration"]
        if detector.image_processor is None:
            detector.image_processor = processor
        detector.save_pretrained(fit_dir(output_dir, name), results_dir=output_dir)
    chosen = (results.get("selection") or {}).get("method")
    if chosen in detectors:  # the decision, ready to publish: hf-gsc publish --detector-dir OUTPUT/detectors/selected
        detectors[chosen].save_pretrained(fit_dir(output_dir, SELECTED), results_dir=output_dir)
        print(f"selected {chosen} (validation only): saved as {fit_dir(output_dir, SELECTED)}", flush=True)


def _check_labels(id_splits: Mapping[str, Any], config: Any, given: Mapping[str, str]) -> tuple[dict[str, Any],
                                                                                                dict[str, Any]]:
    """``(ID splits with their labels mapped to the model's classes, label_check)``. Each split is mapped by its own
    class names (an image-folder split without some class folder numbers its classes differently); the record is
    the test split's comparison plus ``mapping`` and ``mapped_by`` where labels were mapped."""
    from ..label_names import label_mapping
    from .labels import MATCH, map_labels, mapping_record

    model_names = model_class_names(config)
    label_check = compare_labels(class_names_of(id_splits["test"]), model_names)
    if given and (model_names is None or class_names_of(id_splits["test"]) is None):
        raise InputError(f"--label-map: cannot map by name: {label_check.get('reason', 'no class names')}")
    if model_names is None:
        return dict(id_splits), label_check
    mapped = {}
    for split, dataset in id_splits.items():
        names = class_names_of(dataset)
        if names is None or (compare_labels(names, model_names)["status"] == MATCH and not given):
            mapped[split] = dataset
            continue
        try:
            mapping = label_mapping(names, model_names, given)
        except ValueError as error:
            raise InputError(f"ID {split!r} split: {error}") from None
        if mapping is None:  # names that are not the model's: nothing to map by; the warning says so
            mapped[split] = dataset
            continue
        mapped[split] = map_labels(dataset, mapping, model_names)
        if split == "test" and mapping_record(names, model_names, mapping):
            label_check = {**label_check, "mapping": mapping_record(names, model_names, mapping),
                           "mapped_by": "--label-map" if given else "name"}
    return mapped, label_check


def _split_label(split: str) -> str:
    """``id_test`` -> ``ID test``, ``ood_far`` -> ``OOD far``: the split names of ``results.md``."""
    if split.startswith(OOD_PREFIX):
        return f"OOD {split[len(OOD_PREFIX):]}"
    if split.startswith("val_ood_"):
        return f"OOD validation {split[len('val_ood_'):]}"
    return {ID_TEST: "ID test", ID_VALIDATION: "ID validation"}.get(split, split)


def _check_conformal_size(args: argparse.Namespace, num_validation: int | None) -> None:
    """Refuse ``--conformal-delta`` before any scoring when the ID validation split is too small for it
    (a streamed split's size is known only after scoring; the report raises then)."""
    delta = getattr(args, "conformal_delta", None)
    if delta is None or num_validation is None:
        return
    from .calibration import conformal_order

    try:
        conformal_order(num_validation, args.tpr, delta)
    except ValueError as error:
        raise InputError(f"--conformal-delta {delta} with --tpr {args.tpr}: {error}") from None


def _quiet_libraries() -> None:
    """No progress bars from ``datasets`` / ``transformers`` on processes other than the main one."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


__all__ = ["InputError", "collect_results", "package_versions", "run_evaluation"]
