"""``OODEvaluator(model, args).evaluate()``: the OOD evaluation behind ``hf-gsc evaluate``, as a library.

The phases, each a method, in the order :meth:`OODEvaluator.evaluate` runs them, the same under ``python`` and
``accelerate launch`` (any number of processes, any device):

1. :meth:`~OODEvaluator.load`: the accelerator (its device and mixed precision; a precision the device cannot run is
   an error here), the model, every detector (:mod:`.models`; this resolves the GSC ``split_point``: a method that
   cannot be built on the model is refused when named, skipped with the reason and the fixing flag under
   ``--methods all``), the data (:mod:`.plan`; only the splits the run reads), the labels by name. Bad input fails
   here, in seconds, with a message naming the argument.
2. :meth:`~OODEvaluator.tune` (``--tune``): each method's hyperparameters chosen on validation data (:mod:`.tuning`);
   the search is kept in ``tuning.json`` and reused by a rerun with the same inputs.
3. :meth:`~OODEvaluator.plan`: the exact samples of every split and the fingerprint of every fit and score file;
   which score files are missing.
4. :meth:`~OODEvaluator.fit`: the detectors that need ID data (:mod:`.fitting`); a valid saved fit is reused.
5. :meth:`~OODEvaluator.score`: ID test, ID validation and every OOD split (:mod:`.scoring`); valid score files are
   reused. An image that cannot be decoded stops the run with one line naming the split's source, the row and the
   file, or with ``--skip-unreadable-images`` is left out and counted per split.
6. :meth:`~OODEvaluator.select`: the OOD validation sets scored and every method ranked on validation data only
   (:mod:`.selection`).
7. :meth:`~OODEvaluator.report`: ``results.md``, the plots, and ``results.json`` last.
8. :meth:`~OODEvaluator.save` (``--save-detectors``): each method saved as a detector whose card carries those
   results, and the selected one as ``detectors/selected``, last.

The run folder is one artifact: the results files and ``detectors/selected`` of an earlier run are removed before
anything of this run is written, so after any run, interrupted or not, whatever results exist describe the fits,
score files and saved detectors beside them; a rerun of the same command reuses every valid fit, score file and
tuning record and rebuilds the rest.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..utils.version import __version__
from ..data.decoding import UndecodableImageError
from ..settings.registry import detector_class
from .accelerator import make_accelerator
from .arguments import is_evaluation_arguments
from .errors import InputError
from .fitting import FIT_INFO, fit_detectors, fit_dir, saved_fit_info
from .json_files import jsonable, write_json
from .labels import LabelMismatchWarning, class_names_of, compare_labels, label_warning, model_class_names
from .loaders import default_num_workers
from .models import build_detectors, effective_hyperparameters, image_backend_of, image_transform, load_model, load_shipped
from .plan import (
    BASE_MODEL,
    ID_TEST,
    ID_VALIDATION,
    OOD_PREFIX,
    VAL_OOD_PREFIX,
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
from .report import RESULTS_JSON, RESULTS_MD, method_results, write_report
from .run_info import check_process_count, data_description, run_header
from .score_cache import NUM_SKIPPED_KEY, PREDICTIONS_KEY, SCORE_KEY, ScoreCache
from .scoring import score_missing
from .timings import split_timings, update_timings
from .validation import SOURCE_CHOICE, check_output_dir

#: The folder (under ``OUTPUT/detectors/``) of the detector the selection chose.
SELECTED = "selected"
#: The ``--tune`` search's record in the output folder, reused by a rerun with the same inputs.
TUNING_RECORD = "tuning.json"
#: The phases timed in ``results.json``'s ``seconds`` (beside ``total``).
PHASES = ("fit", "tune", "selection", "score", "save")


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


class OODEvaluator:
    """An OOD evaluation of GSC and the baselines on one image classifier, or of one saved detector as it is.

    Args:
        model: the image classifier (a loaded ``*ForImageClassification``, or its folder or Hub id), or a saved
            detector (an :class:`~hf_gsc.OODDetector`, evaluated as it is: its settings, fitted state and threshold);
            ``None``: ``args.model`` or ``args.detector``.
        args: the :data:`~hf_gsc.evaluation.arguments.EvaluationArguments`.
        image_processor: the image processor of a loaded model (default: loaded from the model's
            ``name_or_path``, or the saved detector's own).

    :meth:`evaluate` runs the phases in order and returns an :class:`EvaluationResult` on the main process
    (``None`` on the others).
    """

    def __init__(self, model: Any = None, args: Any = None, *, image_processor: Any = None) -> None:
        if not is_evaluation_arguments(args):
            raise TypeError(f"args must be an EvaluationArguments, got {type(args).__name__}")
        if model is not None and (args.model is not None or args.detector is not None):
            raise InputError("give the model once: as OODEvaluator's model, or as --model / --detector, not both")
        if model is None and args.model is None and args.detector is None:
            raise InputError(SOURCE_CHOICE)
        self.args = args
        self.model_source = model if model is not None else (args.model or args.detector)
        self.image_processor = image_processor
        self.output_dir = Path(args.output_dir)
        self.seconds: dict[str, Any] = {}
        self.skipped: dict[str, str] = {}

    # ------------------------------------------------------------------------------------------------ the run
    def evaluate(self) -> EvaluationResult | None:
        """Run every phase; the :class:`EvaluationResult` on the main process, ``None`` on the others.

        Raises :class:`~hf_gsc.evaluation.errors.InputError` on bad input (before fitting or scoring),
        :class:`~hf_gsc.data.decoding.UndecodableImageError` at an unreadable image (without
        ``--skip-unreadable-images``), :class:`EverythingSkippedError` when no method is left to report.
        """
        created = _first_missing(self.output_dir)
        try:
            return self._run()
        except BaseException:
            # A run that failed before writing anything leaves no empty folder behind; a folder that existed before
            # this run, or holds anything, is kept.
            if created is not None and os.environ.get("RANK", "0") == "0":
                _remove_empty_folders(self.output_dir, created)
            raise

    def _run(self) -> EvaluationResult | None:
        start = time.perf_counter()
        self.seconds = {phase: 0.0 for phase in PHASES}
        self.load()
        with self._timed("tune"):
            self.tune()
        self.plan()
        self.clear_stale_results()
        with self._timed("fit"):
            self.fit()
        with self._timed("score"):
            self.score()
        with self._timed("selection"):
            self.select()
        if not self.accelerator.is_main_process:
            return None
        result = self.collect()
        self.seconds["total"] = round(time.perf_counter() - start, 2)
        self.report(result)
        if self.args.save_detectors:  # the detectors' cards copy results.json and results.md: they come after them
            with self._timed("save"):
                saved = self.save(result)
            self.seconds["total"] = round(time.perf_counter() - start, 2)
            write_json(self.output_dir / RESULTS_JSON, result.to_dict(), self.output_dir)
            _copy_results_json(self.output_dir, saved)  # with the save's time, the same file as the folder's
        return result

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = round(self.seconds.get(phase, 0.0) + time.perf_counter() - begin, 3)

    # ---------------------------------------------------------------------------------------------- 1. load
    def load(self) -> None:
        """Accelerator, model, detectors, data and labels: everything that can fail on bad input, before any work."""
        args = self.args
        check_output_dir(self.output_dir)
        self.accelerator = accelerator = make_accelerator(args.mixed_precision)
        check_process_count(accelerator)
        check_output_dir(self.output_dir, accelerator.process_index)
        if not accelerator.is_local_main_process:
            _quiet_libraries()
        from accelerate.utils import set_seed

        set_seed(args.seed)
        self.num_workers = default_num_workers(accelerator.device) if args.num_workers is None else args.num_workers
        self.shipped = None  # a saved detector evaluated as it is
        self.methods = args.method_names
        # Model and detectors first: an unknown split point fails here, before data is loaded. The main process
        # downloads (model, data) first, so that the others read its cache instead of racing it.
        with accelerator.main_process_first():
            self._load_model()
        if self.shipped is not None:
            self.shipped.to(accelerator.device)
        else:
            self.model.to(accelerator.device)
        with accelerator.main_process_first():
            id_splits, self.ood_splits = load_data(
                needed_id_splits({} if self.shipped is not None else self.detectors, calibrate=self.shipped is None),
                benchmark=args.benchmark, id_dataset=args.id_dataset, ood_split_names=args.ood_split_names,
                extra_ood=args.named_ood_datasets, streaming=args.streaming)
        # Labels by name, before anything reads them (fits, the tuning, the scores' labels, the ID accuracy).
        self.id_splits, self.label_check = _check_labels(id_splits, self.model.config, args.label_pairs)
        if accelerator.is_main_process and self.label_check.get("mapping"):
            pairs = ", ".join(f"{data!r} -> {label!r}" for data, label in self.label_check["mapping"].items())
            print(f"ID labels mapped to the model's id2label (by {self.label_check['mapped_by']}): {pairs}", flush=True)
        if accelerator.is_main_process and label_warning(self.label_check):
            warnings.warn(label_warning(self.label_check), LabelMismatchWarning, stacklevel=2)
        self.same_as_test = [name for name, dataset in self.ood_splits.items()
                             if same_images(dataset, self.id_splits["test"])]
        if accelerator.is_main_process and self.same_as_test:
            warnings.warn(same_as_test_warning(self.same_as_test), UserWarning, stacklevel=2)
        self.transform = image_transform(self.processor, self.model)

    def _load_model(self) -> None:
        """``self.model``, ``self.processor``, ``self.detectors`` (or ``self.shipped``) and ``self.hyperparameters``."""
        from ..detectors.interface import OODDetector

        args, source = self.args, self.model_source
        if isinstance(source, OODDetector) or (isinstance(source, str) and source == args.detector):
            if isinstance(source, OODDetector):
                shipped, processor = _check_shipped(source, self.image_processor)
            else:
                shipped, processor = load_shipped(source, args.revision, args.image_backend)
            if args.methods is not None or args.method_flags() or args.hyperparameter:
                raise InputError("a saved detector is evaluated as it is: --methods, --hyperparameter and method "
                                 "options would change it; evaluate its base model for that")
            self.shipped, self.model, self.processor = shipped, shipped.model, processor
            self.methods = [shipped.method]
            self.hyperparameters = {shipped.method: dict(shipped.hyperparameters)}
            self.detectors = {shipped.method: shipped}
            return
        if isinstance(source, torch.nn.Module):
            self.model, self.processor, saved = source, self.image_processor or _processor_of(source, args), {}
            self.model.eval().requires_grad_(False)
        else:
            self.model, self.processor, saved, _ = load_model(source, args.revision, args.image_backend)
        if saved and args.methods is None:
            # Refused rather than guessed: "evaluate my saved detector" (--detector: its fitted state and threshold) and
            # "fit methods on its base model with its settings as defaults" (--methods) are different runs.
            method = next(iter(saved))
            raise InputError(f"--model {source!r} is a saved {method!r} detector: to evaluate it as it was saved "
                             f"(its fitted state and threshold, no refit) use --detector {source}; to fit and "
                             f"evaluate methods on its base model with its settings as defaults, name them with "
                             f"--methods (e.g. --methods {method})")
        hyperparameters = args.method_hyperparameters
        for name, values in saved.items():  # a saved detector given as --model: its settings, unless overridden
            if name in self.methods:
                hyperparameters[name] = {**values, **hyperparameters[name]}
        for name in self.methods:  # defaults that depend on the model's image processor (ODIN's image_std), unless set
            hyperparameters[name] = {**detector_class(name).model_defaults(self.processor), **hyperparameters[name]}
        self.hyperparameters = hyperparameters
        self.detectors = self._build(self.methods)

    def _build(self, methods: list[str]) -> dict[str, Any]:
        """The detectors of ``methods``; one that cannot be built is refused when named, skipped (with the reason and
        the fixing flag) under ``--methods all`` or the default table."""
        detectors, problems = build_detectors(self.model, methods, self.hyperparameters)
        if problems and self.args.explicit_methods:
            name, reason = next(iter(problems.items()))
            raise InputError(f"--methods {name}: {reason}")
        self.skipped.update(problems)
        self.methods = [name for name in methods if name in detectors]
        if not detectors:
            raise EverythingSkippedError(self.skipped)
        return detectors

    # ---------------------------------------------------------------------------------------------- 2. tune
    def tune(self) -> None:
        """``--tune``: search the grids on validation data (:mod:`.tuning`), rebuild the detectors with the chosen
        values. Every process searches (scoring is sharded); the main process's choice is used by all."""
        self.tuning = None
        if not self.args.tune:
            return
        from .fingerprints import dataset_fingerprint, fingerprint, model_fingerprint
        from .tuning import chosen_hyperparameters, tune_hyperparameters

        args, accelerator = self.args, self.accelerator
        given = args.method_hyperparameters
        # Names set on the command line are the user's choice: not searched.
        fixed = {name: sorted(given.get(name, {})) for name in self.methods}
        # Kept in OUTPUT/tuning.json keyed on everything it read: a rerun does not search again.
        key = fingerprint(jsonable({
            "version": __version__, "model": model_fingerprint(self.model), "methods": list(self.methods),
            "hyperparameters": self.hyperparameters, "fixed": fixed, "benchmark": args.benchmark,
            "data": {split: dataset_fingerprint(dataset) for split, dataset in self.id_splits.items()},
            "max_samples": args.max_samples, "max_fit_samples": args.max_fit_samples, "seed": args.seed,
            "skip_unreadable_images": args.skip_unreadable_images}))
        saved_path = self.output_dir / TUNING_RECORD
        record = None
        if accelerator.is_main_process and not args.overwrite and saved_path.is_file():
            saved = json.loads(saved_path.read_text())
            record = saved.get("record") if saved.get("key") == key else None
        record = _broadcast(accelerator, record)
        if record is None:
            record = tune_hyperparameters(
                accelerator, self.model, self.methods, self.hyperparameters, fixed, self.id_splits, self.transform,
                benchmark=args.benchmark, max_samples=args.max_samples, max_fit_samples=args.max_fit_samples,
                seed=args.seed, batch_size=args.batch_size, num_workers=self.num_workers, on_error=args.on_error,
                output_dir=self.output_dir)
            record = _broadcast(accelerator, jsonable(record))
            if accelerator.is_main_process:
                write_json(saved_path, {"key": key, "record": record}, self.output_dir)
        elif accelerator.is_main_process:
            print(f"tuning: reusing the search saved in {saved_path} (the same model, data and settings)", flush=True)
        for name, values in chosen_hyperparameters(record).items():
            self.hyperparameters[name] = {**self.hyperparameters[name], **values}
        if accelerator.is_main_process:
            print(f"tuning: {record['num_grid_points']} grid points on validation data; "
                  + "; ".join(f"{name}: {values}" for name, values in chosen_hyperparameters(record).items()), flush=True)
        self.tuning = record
        self.detectors = self._build(self.methods)

    # ---------------------------------------------------------------------------------------------- 3. plan
    def plan(self) -> EvaluationPlan:
        """The splits, their subsets and fingerprints (:func:`~hf_gsc.evaluation.plan.make_plan`), the selection's
        data, and which score files are missing (decided on the main process, broadcast)."""
        args, accelerator = self.args, self.accelerator
        self.selection_data = None  # (OOD validation sets, ID side rows, description)
        if not args.no_selection and self.shipped is None:  # one shipped detector: nothing to choose
            from .selection import selection_sets

            self.selection_data = selection_sets(
                subset(self.id_splits["validation"], args.max_samples, args.seed, "validation"),
                given=args.named_val_ood_datasets, benchmark=args.benchmark, max_samples=args.max_samples,
                seed=args.seed, streaming=args.streaming)
            if not self.selection_data[0]:
                warnings.warn(f"no selection: {self.selection_data[2]}", UserWarning, stacklevel=2)
                self.selection_data = None
        sets, description = (self.selection_data[0], self.selection_data[2]) if self.selection_data else (None, "")
        self.evaluation_plan = plan = make_plan(
            self.model, self.detectors, self.id_splits, self.ood_splits, source=args.benchmark or args.id_dataset,
            ood_sources=dict(args.named_ood_datasets), max_samples=args.max_samples,
            max_fit_samples=args.max_fit_samples, seed=args.seed, validation_ood=sets,
            validation_ood_source=description, shipped=self.shipped is not None)
        if ID_VALIDATION in plan.splits:
            _check_conformal_size(args, num_rows(plan.splits[ID_VALIDATION]))
            if accelerator.is_main_process:
                _warn_small_calibration(args, num_rows(plan.splits[ID_VALIDATION]))
        self.cache = ScoreCache(self.output_dir)
        self.missing = _broadcast(accelerator, missing_scores(plan, self.methods, self.cache, args.overwrite)
                                  if accelerator.is_main_process else None)
        if accelerator.is_main_process:
            print(run_header({
                "model": self._model_name(),
                "data": data_description(args.benchmark, args.id_dataset, args.named_ood_datasets),
                **({"shipped": f"the saved {self.shipped.method!r} detector as it is: its settings, fitted state and "
                               f"threshold {self.shipped.config.threshold:.6g} (no refit, no recalibration)"}
                   if self.shipped is not None else {}),
                "device": accelerator.device, "num_processes": accelerator.num_processes,
                "mixed_precision": accelerator.mixed_precision, "num_workers": self.num_workers,
                "image_backend": image_backend_of(self.processor), "methods": self.methods,
                "split_sizes": {_split_label(split): num_rows(dataset) for split, dataset in plan.splits.items()},
                "fit_sizes": {name: num_rows(dataset) for name, dataset in plan.fit_data.items()},
                "num_to_score": sum(map(len, self.missing.values())),
                "num_scores": sum(len(self.methods) + (split == ID_TEST) for split in plan.splits),
                "visible_gpus": torch.cuda.device_count(),
            }), flush=True)
        return plan

    def clear_stale_results(self) -> None:
        """Before this run writes anything: remove the earlier run's ``results.json``, ``results.md`` and
        ``detectors/selected`` (rewritten at the end when this run has them), and the saved-detector files of a
        method whose fit is about to change (its fit folder keeps only the fit), so that the folder never holds
        results or detectors that disagree with its fits and score files, even when this run is interrupted."""
        accelerator = self.accelerator
        if accelerator.is_main_process:
            for name in (RESULTS_JSON, RESULTS_MD):
                (self.output_dir / name).unlink(missing_ok=True)
            selected = fit_dir(self.output_dir, SELECTED)
            if selected.is_dir() and not selected.is_symlink():
                shutil.rmtree(selected)
            for name, expected in self.evaluation_plan.fit_fingerprints.items():
                if self.shipped is None and (self.args.overwrite or _saved_fingerprint(self.output_dir, name) != expected):
                    _remove_saved_detector(self.output_dir, name)
        accelerator.wait_for_everyone()

    # ----------------------------------------------------------------------------------------------- 4. fit
    def fit(self) -> None:
        """Fit (or load the valid saved fit of) each detector that still has scores to compute, or that is saved."""
        args, plan = self.args, self.evaluation_plan
        to_fit = [name for name in plan.fit_data
                  if args.save_detectors or any(name in names for names in self.missing.values())]
        try:
            failed = fit_detectors(self.accelerator, self.detectors, to_fit, plan.fit_data, plan.fit_fingerprints,
                                   self.transform, args.batch_size, self.output_dir, args.seed, args.overwrite,
                                   self.num_workers, args.on_error, source=args.benchmark or args.id_dataset)
        except UndecodableImageError as error:
            raise _resumable(error) from None
        # The images each process read in this run's fit passes (by rank): what the sharded fit spread, beside its time.
        self.seconds["fit_images_per_process"] = list(failed.images_per_process)
        self._skip(failed)

    # --------------------------------------------------------------------------------------------- 5. score
    def score(self) -> None:
        """Score the test and calibration splits with every method whose score file is missing."""
        self._score_splits([split for split in self.evaluation_plan.splits if not split.startswith(VAL_OOD_PREFIX)])

    def _score_splits(self, splits: list[str]) -> None:
        missing = {split: (names if split in splits else []) for split, names in self.missing.items()}
        before = dict(self.skipped)
        try:
            seconds, throughput = score_missing(
                self.accelerator, self.evaluation_plan, missing, self.detectors, self.model, self.transform,
                self.cache, self.args.batch_size, self.num_workers, self.args.on_error, skipped=self.skipped)
        except UndecodableImageError as error:
            raise _resumable(error) from None
        self._skip({name: reason for name, reason in self.skipped.items() if name not in before})
        self.scoring_seconds = {**getattr(self, "scoring_seconds", {}), **{
            name: {**getattr(self, "scoring_seconds", {}).get(name, {}), **times} for name, times in seconds.items()}}
        self.throughput = {**getattr(self, "throughput", {}), **throughput}

    def _skip(self, failed: Mapping[str, str]) -> None:
        """Leave out the methods that failed (with their reasons); none left is :class:`EverythingSkippedError`."""
        self.skipped.update(failed)
        if self.accelerator.is_main_process:
            for name, reason in failed.items():
                print(f"skipped {name}: {reason}", flush=True)
        self.detectors = {name: detector for name, detector in self.detectors.items() if name not in self.skipped}
        if not self.detectors:
            raise EverythingSkippedError(self.skipped)

    # -------------------------------------------------------------------------------------------- 6. select
    def select(self) -> None:
        """Score the OOD validation sets, then (main process) rank every method on them: ``self.selection``."""
        self.selection = None
        if self.selection_data is None:
            return
        self._score_splits([split for split in self.evaluation_plan.splits if split.startswith(VAL_OOD_PREFIX)])
        if not self.accelerator.is_main_process:
            return
        from .selection import selection_record

        sets, id_rows, description = self.selection_data
        validation = {name: self._load_scores(name, ID_VALIDATION)[SCORE_KEY] for name in self.detectors}
        ood = {name: {set_name: self._load_scores(name, VAL_OOD_PREFIX + set_name)[SCORE_KEY] for set_name in sets}
               for name in self.detectors}
        self.selection = selection_record(validation, ood, id_rows, description)

    # ------------------------------------------------------------------------------------ the results (main)
    def _load_scores(self, name: str, split: str) -> dict[str, torch.Tensor]:
        plan = self.evaluation_plan
        data = self.cache.load(name, split, plan.score_fingerprints[(name, split)], num_rows(plan.splits[split]))
        if data is None:
            raise RuntimeError(f"score file {self.cache.path(name, split)} vanished or changed during the run (see the "
                               "warning above); run again to compute it again")
        return data

    def collect(self) -> EvaluationResult:
        """Calibrate on ID validation, evaluate on ID test vs every OOD split, from the score files (main process)."""
        args, plan = self.args, self.evaluation_plan
        base = self._load_scores(BASE_MODEL, ID_TEST)
        correct = base[PREDICTIONS_KEY] == base["labels"]  # per ID test sample, in dataset order like every score file
        groups = ood_groups_of(args.benchmark, plan.ood_names, args.ood_dataset_groups)
        fits = {name: _fit_record(self.output_dir, name, dataset) for name, dataset in plan.fit_data.items()}
        calibrated = ID_VALIDATION in plan.splits
        self.id_scores, self.ood_scores, entries = {}, {}, {}
        for name, detector in self.detectors.items():
            id_test = self._load_scores(name, ID_TEST)
            if not torch.equal(id_test["labels"], base["labels"]):
                raise RuntimeError(f"score files of {name!r} and of the base model list the ID test samples differently")
            self.id_scores[name] = id_test[SCORE_KEY]
            self.ood_scores[name] = {ood: self._load_scores(name, OOD_PREFIX + ood)[SCORE_KEY] for ood in plan.ood_names}
            if calibrated:
                entry = method_results(self.id_scores[name], self._load_scores(name, ID_VALIDATION)[SCORE_KEY],
                                       self.ood_scores[name], args.target_tpr, "validation", method=name,
                                       id_test_correct=correct, delta=args.conformal_delta, groups=groups)
            else:  # a saved detector at its own threshold: nothing calibrated
                entry = method_results(self.id_scores[name], None, self.ood_scores[name], method=name,
                                       id_test_correct=correct, groups=groups, threshold=detector.config.threshold)
            entry["hyperparameters"] = effective_hyperparameters(detector)
            if name in plan.fit_data:
                entry["fit"] = {"split": detector.fit_split, **fits[name]}
            entries[name] = entry
        self.correct = correct
        any_method = next(iter(self.detectors))

        def skipped(split: str) -> int:  # the same for every method: all read the split through the same decoding
            return int(self._load_scores(any_method, split).get(NUM_SKIPPED_KEY, torch.tensor(0)))

        details: dict[str, Any] = {
            "model": self._model_name(),
            "benchmark": args.benchmark,  # None with --id-dataset
            "id_dataset": args.id_dataset,
            "id_accuracy": float((base[PREDICTIONS_KEY] == base["labels"]).double().mean()),
            "split_sizes": {  # from the score files: a streamed split's size is known once it was read
                "id_test": int(self.id_scores[any_method].numel()),
                **({"id_validation": int(self._load_scores(any_method, ID_VALIDATION)[SCORE_KEY].numel())}
                   if calibrated else {}),
                "ood": {ood: int(scores.numel()) for ood, scores in self.ood_scores[any_method].items()},
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
            "ood_groups": groups,
        }
        if self.shipped is not None:
            details["detector"] = _at_shipped_threshold(entries[self.shipped.method], self.shipped, self._model_name(),
                                                        self.id_scores[self.shipped.method],
                                                        self.ood_scores[self.shipped.method], correct)
        details["ood_datasets"] = dict(args.named_ood_datasets)  # NAME -> SPEC of each OOD dataset given by hand
        if self.tuning is not None:
            details["tuning"] = self.tuning
        details["label_check"] = self.label_check
        if self.same_as_test:
            details["ood_same_as_id_test"] = self.same_as_test
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        # Timings of the passes that computed the scores used, this run's or an earlier one's (cached splits).
        throughput = getattr(self, "throughput", {})
        records = update_timings(self.cache.root, plan.score_fingerprints, self.missing, throughput,
                                 getattr(self, "scoring_seconds", {}))
        splits_scored, method_seconds = split_timings(records, plan.score_fingerprints, throughput, self.missing,
                                                      created)
        details.update(
            num_processes=self.accelerator.num_processes,
            device=str(self.accelerator.device),
            mixed_precision=self.accelerator.mixed_precision,
            num_workers=self.num_workers,
            image_backend=image_backend_of(self.processor),
            # where the image processor's rescale + normalize ran: "device" (deferred, see hf_gsc.data.normalization)
            pixel_normalization="device" if self.transform.normalization is not None else "workers",
            config={**jsonable(args.to_dict()), "methods": ",".join(self.detectors)},
            versions=package_versions(),
            created=created,
        )
        self.seconds.update(splits_scored=splits_scored,
                            scoring_main_process={m: v for m, v in method_seconds.items() if m in self.detectors})
        return EvaluationResult(methods=entries, selection=self.selection, skipped=dict(self.skipped),
                                seconds=self.seconds, details=details)

    # --------------------------------------------------------------------------------------------- 7. save
    def save(self, result: EvaluationResult) -> list[Path]:
        """``--save-detectors``: each evaluated method as a detector folder ``detectors/{method}/`` (beside its fit),
        with the threshold calibrated on ID validation for ``results.json`` and a card carrying these results; the
        method the selection chose again as ``detectors/selected/``. Returns the folders written."""
        if not self.args.save_detectors:
            return []
        for name, detector in self.detectors.items():
            entry = result.methods[name]
            detector.config.threshold = entry["threshold"]
            detector.config.calibration = entry["calibration"]
            if detector.image_processor is None:
                detector.image_processor = self.processor
            detector.save_pretrained(fit_dir(self.output_dir, name), results_dir=self.output_dir)
        folders = [fit_dir(self.output_dir, name) for name in self.detectors]
        chosen = result.selected_method
        if chosen in self.detectors:  # ready to publish: hf-gsc publish --detector-dir OUTPUT/detectors/selected
            self.detectors[chosen].save_pretrained(fit_dir(self.output_dir, SELECTED), results_dir=self.output_dir)
            print(f"selected {chosen} (validation only): saved as {fit_dir(self.output_dir, SELECTED)}", flush=True)
            folders.append(fit_dir(self.output_dir, SELECTED))
        return folders

    # ------------------------------------------------------------------------------------------- 8. report
    def report(self, result: EvaluationResult) -> None:
        """``results.md``, the plots, then ``results.json`` (written last: its presence says the run finished)."""
        results = result.to_dict()
        if not self.args.no_plots:
            from .plots import write_plots

            write_plots(self.output_dir, self.id_scores, self.ood_scores, results, self.correct)
        write_report(self.output_dir, results)

    def _model_name(self) -> str:
        source = self.model_source
        if isinstance(source, str):
            return source
        model = getattr(source, "model", source)
        return getattr(model, "name_or_path", None) or type(model).__name__


# ------------------------------------------------------------------------------------------------------ helpers
def _broadcast(accelerator: Any, value: Any) -> Any:
    """The main process's ``value`` on every process (a no-op with one process)."""
    if accelerator.num_processes == 1:
        return value
    from accelerate.utils import broadcast_object_list

    holder = [value]
    broadcast_object_list(holder, from_process=0)
    return holder[0]


def _resumable(error: UndecodableImageError) -> UndecodableImageError:
    return UndecodableImageError(f"{error} (fix or remove the file, or pass --skip-unreadable-images to leave such "
                                 "images out; finished splits are kept and not scored again)")


def _copy_results_json(output_dir: Path, folders: list[Path]) -> None:
    """The final ``results.json`` (with the save phase's time) into each saved detector folder, over the copy its
    ``save_pretrained`` made a moment before."""
    from ..utils.confined_files import copy_file

    for folder in folders:
        copy_file(output_dir, RESULTS_JSON, folder)


def _saved_fingerprint(output_dir: Path, method: str) -> str | None:
    try:
        return json.loads((fit_dir(output_dir, method) / FIT_INFO).read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


def _remove_saved_detector(output_dir: Path, method: str) -> None:
    """Remove what ``--save-detectors`` wrote for ``method`` (its config, card, processor files) beside a fit that
    this run replaces; the fit's own files stay for the fit to overwrite."""
    from ..settings.config import STATE_FILE

    folder = fit_dir(output_dir, method)
    if not folder.is_dir() or folder.is_symlink() or not (folder / "config.json").exists():
        return
    for path in folder.iterdir():
        if path.name in (STATE_FILE, FIT_INFO):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _processor_of(model: torch.nn.Module, args: Any) -> Any:
    """The image processor saved with a loaded model (from its ``name_or_path``)."""
    from ..data import load_image_processor

    source = getattr(model, "name_or_path", None)
    if not source:
        raise InputError("the model object has no name_or_path to load its image processor from: pass "
                         "image_processor= to OODEvaluator")
    try:
        return load_image_processor(source, backend=None if args.image_backend == "auto" else args.image_backend)
    except (OSError, ValueError) as error:
        raise InputError(f"no image processor for the model from {source!r}: {error}; pass image_processor= to "
                         "OODEvaluator") from None


def _check_shipped(detector: Any, processor: Any) -> tuple[Any, Any]:
    """A saved detector object given to :class:`OODEvaluator`: it needs a threshold and an image processor."""
    if detector.config.threshold is None:
        raise InputError(f"the {detector.method!r} detector has no threshold, so it makes no decision to check; "
                         "calibrate it (detector.calibrate(...)) first")
    processor = processor or detector.image_processor
    if processor is None:
        raise InputError("the detector has no image processor: pass image_processor= to OODEvaluator")
    detector.model.eval().requires_grad_(False)
    return detector, processor


def _at_shipped_threshold(entry: dict[str, Any], detector: Any, source: str, id_scores: torch.Tensor,
                          ood_scores: Mapping[str, torch.Tensor], correct: torch.Tensor) -> dict[str, Any]:
    """A saved detector's entry at its shipped threshold: per OOD split ``fpr_at_threshold`` (the fraction of OOD
    accepted as ID); returns ``results.json``'s ``detector`` record."""
    from .calibration import true_positive_rate

    threshold = float(detector.config.threshold)
    entry["calibration"] = detector.config.calibration or {"split": None, "note": "threshold set by hand"}
    for name, scores in ood_scores.items():
        entry["ood"][name]["fpr_at_threshold"] = true_positive_rate(scores, threshold)
    return {"source": source, "method": detector.method, "threshold": threshold,
            "calibration": detector.config.calibration, "hyperparameters": dict(detector.hyperparameters),
            "evaluated_as": "saved: no refit, no recalibration",
            "id_tpr_at_threshold": entry["id_tpr_at_threshold"],
            "fpr_at_threshold": {name: values["fpr_at_threshold"] for name, values in entry["ood"].items()}}


def _fit_record(output_dir: Path, method: str, dataset: Any) -> dict[str, Any]:
    """``num_samples`` (images the fit used) and ``num_skipped`` (unreadable ones left out) of a method's fit."""
    saved = saved_fit_info(output_dir, method)
    num_skipped = saved.get(NUM_SKIPPED_KEY, 0)
    rows = num_rows(dataset)
    return {"num_samples": rows - num_skipped if rows is not None else saved.get("num_samples"),
            NUM_SKIPPED_KEY: num_skipped}


def _check_labels(id_splits: Mapping[str, Any], config: Any, given: Mapping[str, str]) -> tuple[dict[str, Any],
                                                                                                dict[str, Any]]:
    """``(ID splits with their labels mapped to the model's classes, label_check)``. Each split is mapped by its own
    class names (an image-folder split without some class folder numbers its classes differently); the record is
    the test split's comparison plus ``mapping`` and ``mapped_by`` where labels were mapped."""
    from ..utils.label_names import label_mapping
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
    """``id_test`` -> ``ID test``, ``ood_far`` -> ``OOD far``: the split names of the run header."""
    if split.startswith(OOD_PREFIX):
        return f"OOD {split[len(OOD_PREFIX):]}"
    if split.startswith(VAL_OOD_PREFIX):
        return f"OOD validation {split[len(VAL_OOD_PREFIX):]}"
    return {ID_TEST: "ID test", ID_VALIDATION: "ID validation"}.get(split, split)


def _check_conformal_size(args: Any, num_validation: int | None) -> None:
    """Refuse ``--conformal-delta`` before any scoring when the ID validation split is too small for it
    (a streamed split's size is known only after scoring; the report raises then)."""
    if args.conformal_delta is None or num_validation is None:
        return
    from .calibration import conformal_order

    try:
        conformal_order(num_validation, args.target_tpr, args.conformal_delta)
    except ValueError as error:
        raise InputError(f"--conformal-delta {args.conformal_delta} with --tpr {args.target_tpr}: {error}") from None


def _warn_small_calibration(args: Any, num_validation: int | None) -> None:
    """The warning ``calibrate`` gives in Python below :data:`~hf_gsc.utils.thresholds.MIN_CALIBRATION_SAMPLES`,
    for the thresholds this run calibrates on ID validation (naming ``--max-samples`` when it is the cause)."""
    from ..utils.thresholds import MIN_CALIBRATION_SAMPLES

    if num_validation is None or num_validation >= MIN_CALIBRATION_SAMPLES:
        return
    cause = (f" (--max-samples {args.max_samples})" if args.max_samples is not None
             and args.max_samples < MIN_CALIBRATION_SAMPLES else "")
    warnings.warn(f"the thresholds are calibrated on {num_validation} ID validation samples{cause}, too few for a "
                  f"threshold to mean much (at least {MIN_CALIBRATION_SAMPLES}; with n samples the accepted fraction "
                  "on new data varies by about sqrt(tpr*(1-tpr)/n))", UserWarning, stacklevel=2)


def _first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` (``path`` itself or an ancestor) that does not exist yet: what this run
    creates; ``None`` when ``path`` exists."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists() or folder.is_symlink():
            break
        missing = folder
    return missing


def _remove_empty_folders(path: Path, created: Path) -> None:
    """Remove ``path`` and its ancestors up to ``created`` (the folders this run made), each only if it holds nothing
    (empty sub-folders this run made inside ``path``, e.g. the score cache's, go first)."""
    if path.is_dir() and not path.is_symlink():
        for root, folders, _ in os.walk(path, topdown=False):
            for name in folders:
                with suppress(OSError):  # not empty, or not ours to remove: kept
                    (Path(root) / name).rmdir()
    for folder in (path, *path.parents):
        try:
            folder.rmdir()
        except OSError:
            return
        if folder == created:
            return


def _quiet_libraries() -> None:
    """No progress bars from ``datasets`` / ``transformers`` on processes other than the main one."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


__all__ = ["PHASES", "SELECTED", "EvaluationResult", "EverythingSkippedError", "OODEvaluator", "ood_groups_of",
           "package_versions"]
