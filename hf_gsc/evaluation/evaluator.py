"""``OODEvaluator(model, args).evaluate()``: the OOD evaluation behind ``hf-gsc evaluate``, as a library.

:meth:`OODEvaluator.evaluate` runs the phases, each a method, in this order, the same under ``python`` and
``accelerate launch`` (any number of processes, any device); a phase called on its own before the one it needs says
which that is. What they share is built once: the frozen :class:`~hf_gsc.evaluation.context.RunContext`
(``evaluator.context``: accelerator, transform, batch size, workers, error policy, seed, output folder, ...), and
what they build is the :class:`EvaluationState` (``evaluator.state``), declared up front.

1. :meth:`~OODEvaluator.load`: the accelerator (its device and mixed precision; a precision the device cannot run is
   an error here), the model, every detector (:mod:`.models`; this resolves the GSC ``split_point``: a method that
   cannot be built on the model is skipped with the reason and the fixing flag, and the others run), the data (:mod:`.plan`; only the splits the run reads), the labels by name. Bad input fails
   here, in seconds, with a message naming the argument.
2. :meth:`~OODEvaluator.tune` (``--tune``): each method's hyperparameters chosen on validation data (:mod:`.tuning`);
   the search is kept in ``tuning.json`` and reused by a rerun with the same inputs.
3. :meth:`~OODEvaluator.plan`: the exact samples of every split and the fingerprint of every fit and score file;
   which score files are missing; the earlier run's results removed (:mod:`.run_folder`).
4. :meth:`~OODEvaluator.fit`: the detectors that need ID data (:mod:`.fitting`); a valid saved fit is reused.
5. :meth:`~OODEvaluator.score`: ID test, ID validation and every OOD split (:mod:`.scoring`); valid score files are
   reused. An image that cannot be decoded stops the run with one line naming the split's source, the row and the
   file, or with ``--skip-unreadable-images`` is left out and counted per split.
6. :meth:`~OODEvaluator.select`: the OOD validation sets scored and every method ranked on validation data only
   (:mod:`.selection`).
7. :meth:`~OODEvaluator.collect` (main process): thresholds calibrated on ID validation, the metrics on ID test
   against every OOD split, from the score files: the :class:`~hf_gsc.evaluation.result.EvaluationResult`.
8. :meth:`~OODEvaluator.report`: ``results.md``, the plots, and ``results.json`` last.
9. :meth:`~OODEvaluator.save` (``--save-detectors``): each method saved as a detector whose card carries those
   results, and the selected one as ``detectors/selected``, last.

The run folder is one artifact: the results files and ``detectors/selected`` of an earlier run are removed before
anything of this run is written, so after any run, interrupted or not, whatever results exist describe the fits,
score files and saved detectors beside them; a rerun of the same command reuses every valid fit, score file and
tuning record and rebuilds the rest. A run that fails before writing anything leaves no folder it created.
"""

from __future__ import annotations

import errno
import json
import os
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ..data.decoding import UndecodableImageError
from ..settings.registry import detector_class
from ..utils.version import __version__
from .accelerator import make_accelerator, quiet_libraries
from .arguments import is_evaluation_arguments
from .calibration import calibration_of
from .context import EvaluationState, RunContext
from .distributed import broadcast
from .errors import DiskFullError, InputError
from .fitting import fit_detectors, fit_dir, fit_record
from .json_files import jsonable, write_json
from .labels import LabelMismatchWarning, check_labels, label_warning, labels_note, mapping_line
from .loaders import default_num_workers
from .models import (
    build_detectors,
    check_shipped,
    effective_hyperparameters,
    image_transform,
    load_model,
    load_shipped,
    processor_of,
)
from .plan import (
    BASE_MODEL,
    ID_TEST,
    ID_VALIDATION,
    OOD_PREFIX,
    VAL_OOD_PREFIX,
    EvaluationPlan,
    check_conformal_size,
    load_data,
    make_plan,
    missing_scores,
    needed_id_splits,
    num_rows,
    same_as_test_warning,
    same_images,
    subset,
    warn_small_calibration,
)
from .report import RESULTS_JSON, method_results, write_report
from .result import EvaluationResult, EverythingSkippedError, at_shipped_threshold, ood_groups_of, run_details
from .run_folder import (
    SELECTED,
    claim_output_dir,
    clear_stale_results,
    copy_results_json,
    first_missing,
    kept_files,
    mark_run_folder,
    remove_empty_folders,
    unmark_if_alone,
)
from .run_info import check_process_count, evaluation_header, validation_source
from .score_cache import PREDICTIONS_KEY, SCORE_KEY, ScoreCache
from .scoring import score_missing
from .validation import SOURCE_CHOICE, check_output_dir


#: The ``--tune`` search's record in the output folder, reused by a rerun with the same inputs.
TUNING_RECORD = "tuning.json"
#: The phases timed in ``results.json``'s ``seconds`` (beside ``total``).
PHASES = ("fit", "tune", "selection", "score", "save")
#: The phases in the order :meth:`OODEvaluator.evaluate` runs them.
PHASE_ORDER = ("load", "tune", "plan", "fit", "score", "select", "collect", "report", "save")
#: Each phase -> the phase it needs done first (``tune`` may be skipped; ``evaluate`` runs them all in order).
NEEDS = {"tune": "load", "plan": "load", "fit": "plan", "score": "fit", "select": "score", "collect": "select",
         "report": "collect", "save": "collect"}


class OODEvaluator:
    """An OOD evaluation of GSC and the baselines on one image classifier, or of one saved detector as it is.

    Args:
        model: the image classifier (a loaded ``*ForImageClassification``, or its folder or Hub id), or a saved
            detector (an :class:`~hf_gsc.OODDetector`, evaluated as it is: its settings, fitted state and threshold);
            ``None``: ``args.model`` or ``args.detector``.
        args: the :class:`~hf_gsc.evaluation.arguments.EvaluationArguments`.
        image_processor: the image processor of a loaded model (default: loaded from the model's
            ``name_or_path``, or the saved detector's own).

    :meth:`evaluate` runs the phases in order and returns an :class:`EvaluationResult` on the main process
    (``None`` on the others).
    """

    def __init__(self, model: Any = None, args: Any = None, *, image_processor: Any = None) -> None:
        if not is_evaluation_arguments(args):
            raise TypeError(f"args must be an EvaluationArguments, got {type(args).__name__}")
        #: The path or Hub id the arguments name when the caller also passed that model loaded: the one recorded.
        self.named_source: str | None = None
        if model is not None and (args.model is not None or args.detector is not None):
            # transformers' idiom: parse the command line (--model included), load the model, pass both.
            self.named_source = same_model_or_refuse(model, args)
        if model is None and args.model is None and args.detector is None:
            raise InputError(SOURCE_CHOICE)
        self.args = args
        self.model_source = model if model is not None else (args.model or args.detector)
        self.image_processor = image_processor
        self.output_dir = Path(args.output_dir)
        # Whether --output-dir is a run's (its earlier files are this run's to replace or remove) or a folder of the
        # user's accepted with --overwrite (nothing in it is deleted); set by load().
        self.run_folder = True
        self.state = EvaluationState()
        self.context: RunContext | None = None  # built by load()

    # ------------------------------------------------------------------------------------------------ the run
    def evaluate(self) -> EvaluationResult | None:
        """Run every phase; the :class:`EvaluationResult` on the main process, ``None`` on the others.

        Raises :class:`~hf_gsc.evaluation.errors.InputError` on bad input (before fitting or scoring),
        :class:`~hf_gsc.data.decoding.UndecodableImageError` at an unreadable image (without
        ``--skip-unreadable-images``), :class:`EverythingSkippedError` when no method is left to report,
        :class:`~hf_gsc.evaluation.errors.DiskFullError` (one line naming the folder and what it keeps) when the disk
        fills up.
        """
        created = first_missing(self.output_dir)
        try:
            return self._run()
        except OSError as error:
            self._clean_up_after_failure(created)
            if error.errno != errno.ENOSPC or isinstance(error, DiskFullError):
                raise
            where = f" while writing {error.filename}" if error.filename else ""
            raise DiskFullError(errno.ENOSPC, f"no space left on the device{where}; --output-dir {self.output_dir} "
                                f"keeps {kept_files(self.output_dir)}: free some space and run the same command again "
                                "to resume from them") from None
        except BaseException:
            self._clean_up_after_failure(created)
            raise

    def _clean_up_after_failure(self, created: Path | None) -> None:
        """A run that failed before writing anything leaves no empty folder (nor its marker alone) behind; a folder
        that existed before this run, or holds anything, is kept."""
        if os.environ.get("RANK", "0") == "0":
            unmark_if_alone(self.output_dir)
            if created is not None:
                remove_empty_folders(self.output_dir, created)

    def _run(self) -> EvaluationResult | None:
        start = time.perf_counter()
        self.state = EvaluationState(seconds={phase: 0.0 for phase in PHASES})
        self.load()
        with self._timed("tune"):
            self.tune()
        self.plan()
        with self._timed("fit"):
            self.fit()
        with self._timed("score"):
            self.score()
        with self._timed("selection"):
            self.select()
        if not self._context.accelerator.is_main_process:
            return None
        result = self.collect()
        seconds = self.state.seconds
        seconds["total"] = round(time.perf_counter() - start, 2)
        self.report(result)
        if self.args.save_detectors:  # the detectors' cards copy results.json and results.md: they come after them
            with self._timed("save"):
                saved = self.save(result)
            seconds["total"] = round(time.perf_counter() - start, 2)
            write_json(self.output_dir / RESULTS_JSON, result.to_dict(), self.output_dir)
            copy_results_json(self.output_dir, saved)  # with the save's time, the same file as the folder's
        return result

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.state.seconds[phase] = round(self.state.seconds.get(phase, 0.0) + time.perf_counter() - begin, 3)

    def _begin(self, phase: str) -> None:
        """Refuse a phase whose prerequisite has not run (naming it), then record the phase as run."""
        needed = NEEDS.get(phase)
        if needed is not None and needed not in self.state.done:
            raise RuntimeError(f"OODEvaluator.{phase}() needs {needed}() first: the phases run in the order "
                               f"{', '.join(PHASE_ORDER)} (tune does something only with --tune); evaluate() runs "
                               "them all")
        self.state.done.append(phase)

    @property
    def _context(self) -> RunContext:
        assert self.context is not None, "load() builds the run context"
        return self.context

    @property
    def _model(self) -> torch.nn.Module:
        assert self.state.model is not None, "load() loads the model"
        return self.state.model

    @property
    def _cache(self) -> ScoreCache:
        assert self.state.cache is not None, "plan() opens the score files"
        return self.state.cache

    # ---------------------------------------------------------------------------------------------- 1. load
    def load(self) -> None:
        """Accelerator, model, detectors, data and labels: everything that can fail on bad input, before any work;
        then the run context."""
        self._begin("load")
        args, state = self.args, self.state
        self.run_folder = claim_output_dir(self.output_dir, args.overwrite)  # a folder of the user's: --overwrite only
        check_output_dir(self.output_dir)
        accelerator = make_accelerator(args.mixed_precision)
        check_process_count(accelerator)
        check_output_dir(self.output_dir, accelerator.process_index)
        if accelerator.is_main_process:
            mark_run_folder(self.output_dir)
        if not accelerator.is_local_main_process:
            quiet_libraries()
        from accelerate.utils import set_seed

        set_seed(args.seed)
        state.methods = args.method_names
        # Model and detectors first: an unknown split point fails here, before data is loaded. The main process
        # downloads (model, data) first, so that the others read its cache instead of racing it.
        with accelerator.main_process_first():
            self._load_model()
        (state.shipped if state.shipped is not None else self._model).to(accelerator.device)
        with accelerator.main_process_first():
            id_splits, state.ood_splits = load_data(
                needed_id_splits({} if state.shipped is not None else state.detectors, calibrate=state.shipped is None),
                benchmark=args.benchmark, id_dataset=args.id_dataset, ood_split_names=args.ood_split_names,
                extra_ood=args.named_ood_datasets, streaming=args.streaming, image_column=args.image_column,
                label_column=args.label_column)
        # Labels by name, before anything reads them (fits, the tuning, the scores' labels, the ID accuracy).
        state.id_splits, state.label_check = check_labels(id_splits, self._model.config, args.label_pairs,
                                                          args.labels_by_order)
        for line in (mapping_line(state.label_check), labels_note(state.label_check)):
            if accelerator.is_main_process and line:
                print(line[:1].upper() + line[1:], flush=True)
        mismatch = label_warning(state.label_check)
        if accelerator.is_main_process and mismatch:
            warnings.warn(mismatch, LabelMismatchWarning, stacklevel=2)
        state.same_as_test = [name for name, dataset in state.ood_splits.items()
                              if same_images(dataset, state.id_splits["test"])]
        if accelerator.is_main_process and state.same_as_test:
            warnings.warn(same_as_test_warning(state.same_as_test), UserWarning, stacklevel=2)
        self.context = RunContext(
            accelerator=accelerator, transform=image_transform(state.processor, self._model),
            batch_size=args.batch_size,
            num_workers=default_num_workers(accelerator.device) if args.num_workers is None else args.num_workers,
            on_error=args.on_error, seed=args.seed, output_dir=self.output_dir, overwrite=args.overwrite,
            max_samples=args.max_samples, max_fit_samples=args.max_fit_samples,
            source=args.benchmark or args.id_dataset, ood_sources=dict(args.named_ood_datasets))

    def _load_model(self) -> None:
        """The state's ``model``, ``processor``, ``detectors`` (or ``shipped``) and ``hyperparameters``."""
        from ..detectors.interface import OODDetector

        args, state, source = self.args, self.state, self.model_source
        if isinstance(source, OODDetector) or (isinstance(source, str) and source == args.detector):
            if isinstance(source, OODDetector):
                shipped, processor = check_shipped(source, self.image_processor)
            else:
                shipped, processor = load_shipped(source, args.revision, args.image_backend)
            if args.methods is not None or args.method_flags() or args.hyperparameter:
                raise InputError("a saved detector is evaluated as it is: --methods, --hyperparameter and method "
                                 "options would change it; evaluate its base model for that")
            state.shipped, state.model, state.processor = shipped, shipped.model, processor
            state.methods = [shipped.method]
            state.hyperparameters = {shipped.method: dict(shipped.hyperparameters)}
            state.detectors = {shipped.method: shipped}
            return
        saved: dict[str, Any]  # method -> settings of a saved detector given as --model
        if isinstance(source, torch.nn.Module):
            state.model, state.processor, saved = source, self.image_processor or processor_of(source, args), {}
            state.model.eval().requires_grad_(False)
        else:
            state.model, state.processor, saved, _ = load_model(source, args.revision, args.image_backend)
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
            if name in state.methods:
                hyperparameters[name] = {**values, **hyperparameters[name]}
        for name in state.methods:  # defaults that depend on the model's image processor (ODIN's image_std), unless set
            hyperparameters[name] = {**detector_class(name).model_defaults(state.processor), **hyperparameters[name]}
        state.hyperparameters = hyperparameters
        state.detectors = self._build(state.methods)

    def _build(self, methods: list[str]) -> dict[str, Any]:
        """The detectors of ``methods``; one that cannot be built on the model (a split point its architecture does
        not have) is skipped, with the reason and the fixing flag, said on the console and recorded in ``skipped``
        like a failed fit, and the run goes on with the others (none left: :class:`EverythingSkippedError`)."""
        from accelerate import PartialState

        state = self.state
        detectors, problems = build_detectors(self._model, methods, state.hyperparameters)
        if PartialState().is_main_process:
            for name, reason in problems.items():
                print(f"skipped {name}: {reason}", flush=True)
        state.skipped.update(problems)
        state.methods = [name for name in methods if name in detectors]
        if not detectors:
            raise EverythingSkippedError(state.skipped)
        return detectors

    # ---------------------------------------------------------------------------------------------- 2. tune
    def tune(self) -> None:
        """``--tune``: search the grids on validation data (:mod:`.tuning`), rebuild the detectors with the chosen
        values. Every process searches (scoring is sharded); the main process's choice is used by all."""
        self._begin("tune")
        args, state, context = self.args, self.state, self._context
        state.tuning = None
        if not args.tune:
            return
        from .fingerprints import dataset_fingerprint, fingerprint, model_fingerprint
        from .tuning import chosen_hyperparameters, tune_hyperparameters

        accelerator = context.accelerator
        given = args.method_hyperparameters
        # Names set on the command line are the user's choice: not searched.
        fixed = {name: sorted(given.get(name, {})) for name in state.methods}
        # Kept in OUTPUT/tuning.json keyed on everything it read: a rerun does not search again.
        key = fingerprint(jsonable({
            "version": __version__, "model": model_fingerprint(self._model), "methods": list(state.methods),
            "hyperparameters": state.hyperparameters, "fixed": fixed, "benchmark": args.benchmark,
            "data": {split: dataset_fingerprint(dataset) for split, dataset in state.id_splits.items()},
            "max_samples": args.max_samples, "max_fit_samples": args.max_fit_samples, "seed": args.seed,
            "skip_unreadable_images": args.skip_unreadable_images}))
        saved_path = self.output_dir / TUNING_RECORD
        record = None
        if accelerator.is_main_process and not args.overwrite and saved_path.is_file():
            saved = json.loads(saved_path.read_text())
            record = saved.get("record") if saved.get("key") == key else None
        record = broadcast(accelerator, record)
        if record is None:
            searched = {name: state.hyperparameters[name] for name in state.methods}
            record = tune_hyperparameters(context, self._model, searched, fixed, state.id_splits, args.benchmark)
            record = broadcast(accelerator, jsonable(record))
            if accelerator.is_main_process:
                write_json(saved_path, {"key": key, "record": record}, self.output_dir)
        elif accelerator.is_main_process:
            print(f"tuning: reusing the search saved in {saved_path} (the same model, data and settings)", flush=True)
        for name, values in chosen_hyperparameters(record).items():
            state.hyperparameters[name] = {**state.hyperparameters[name], **values}
        if accelerator.is_main_process:
            print(f"tuning: {record['num_grid_points']} grid points on validation data; "
                  + "; ".join(f"{name}: {values}" for name, values in chosen_hyperparameters(record).items()), flush=True)
        state.tuning = record
        state.detectors = self._build(state.methods)

    # ---------------------------------------------------------------------------------------------- 3. plan
    def plan(self) -> EvaluationPlan:
        """The splits, their subsets and fingerprints (:func:`~hf_gsc.evaluation.plan.make_plan`), the selection's
        data, which score files are missing (decided on the main process, broadcast); then the earlier run's results
        are removed (:func:`~hf_gsc.evaluation.run_folder.clear_stale_results`)."""
        self._begin("plan")
        args, state, context = self.args, self.state, self._context
        accelerator = context.accelerator
        state.selection_data = None
        if not args.no_selection and state.shipped is None:  # one shipped detector: nothing to choose
            from .selection import selection_sets

            state.selection_data = selection_sets(
                subset(state.id_splits["validation"], args.max_samples, args.seed, "validation"),
                given=args.named_val_ood_datasets, benchmark=args.benchmark, max_samples=args.max_samples,
                seed=args.seed, streaming=args.streaming,
                test_splits={"ID test": state.id_splits["test"],
                             **{f"OOD {name}": dataset for name, dataset in state.ood_splits.items()}})
            if not state.selection_data.sets:
                warnings.warn(f"no selection: {state.selection_data.description}", UserWarning, stacklevel=2)
                state.selection_data = None
        validation_ood = ((state.selection_data.sets, state.selection_data.description)
                          if state.selection_data is not None else None)
        state.plan = plan = make_plan(context, self._model, state.detectors, state.id_splits, state.ood_splits,
                                      validation_ood, shipped=state.shipped is not None)
        if ID_VALIDATION in plan.splits:
            check_conformal_size(args, num_rows(plan.splits[ID_VALIDATION]))
            if accelerator.is_main_process:
                warn_small_calibration(args, num_rows(plan.splits[ID_VALIDATION]))
        state.cache = ScoreCache(self.output_dir)
        state.missing = broadcast(accelerator, missing_scores(plan, state.methods, state.cache, args.overwrite)
                                  if accelerator.is_main_process else None)
        if accelerator.is_main_process:
            print(evaluation_header(args, state, context, self.model_name(), plan), flush=True)
            # Before this run writes anything: the folder never holds results or detectors that disagree with its
            # fits and score files, even when this run is interrupted. A folder of the user's: nothing is deleted.
            if self.run_folder:
                clear_stale_results(self.output_dir, plan.fit_fingerprints, shipped=state.shipped is not None,
                                    overwrite=args.overwrite)
        accelerator.wait_for_everyone()
        return plan

    # ----------------------------------------------------------------------------------------------- 4. fit
    def fit(self) -> None:
        """Fit (or load the valid saved fit of) each detector that still has scores to compute, or that is saved."""
        self._begin("fit")
        state, plan = self.state, self._plan
        to_fit = [name for name in plan.fit_data
                  if self.args.save_detectors or any(name in names for names in state.missing.values())]
        try:
            outcome = fit_detectors(self._context, state.detectors, to_fit, plan.fit_data, plan.fit_fingerprints)
        except UndecodableImageError as error:
            raise _resumable(error) from None
        # The images each process read in this run's fit passes (by rank): what the sharded fit spread, beside its time.
        state.seconds["fit_images_per_process"] = list(outcome.images_per_process)
        self._skip(outcome.failed)

    # --------------------------------------------------------------------------------------------- 5. score
    def score(self) -> None:
        """Score the test and calibration splits with every method whose score file is missing."""
        self._begin("score")
        self._score_splits([split for split in self._plan.splits if not split.startswith(VAL_OOD_PREFIX)])

    def _score_splits(self, splits: list[str]) -> None:
        state = self.state
        missing = {split: (names if split in splits else []) for split, names in state.missing.items()}
        before = dict(state.skipped)
        try:
            seconds, throughput = score_missing(self._context, self._plan, missing, state.detectors, self._model,
                                                self._cache, skipped=state.skipped)
        except UndecodableImageError as error:
            raise _resumable(error) from None
        self._skip({name: reason for name, reason in state.skipped.items() if name not in before})
        for name, times in seconds.items():
            state.scoring_seconds[name] = {**state.scoring_seconds.get(name, {}), **times}
        state.throughput.update(throughput)

    def _skip(self, failed: Mapping[str, str]) -> None:
        """Leave out the methods that failed (with their reasons); none left is :class:`EverythingSkippedError`."""
        state = self.state
        state.skipped.update(failed)
        if self._context.accelerator.is_main_process:
            for name, reason in failed.items():
                print(f"skipped {name}: {reason}", flush=True)
        state.detectors = {name: detector for name, detector in state.detectors.items() if name not in state.skipped}
        if not state.detectors:
            raise EverythingSkippedError(state.skipped)

    # -------------------------------------------------------------------------------------------- 6. select
    def select(self) -> None:
        """Score the OOD validation sets, then (main process) rank every method on them: the state's ``selection``."""
        self._begin("select")
        state = self.state
        state.selection = None
        if state.selection_data is None:
            return
        self._score_splits([split for split in self._plan.splits if split.startswith(VAL_OOD_PREFIX)])
        if not self._context.accelerator.is_main_process:
            return
        from .selection import selection_record

        sets, id_rows, description = state.selection_data
        validation = {name: self.load_scores(name, ID_VALIDATION)[SCORE_KEY] for name in state.detectors}
        ood = {name: {set_name: self.load_scores(name, VAL_OOD_PREFIX + set_name)[SCORE_KEY] for set_name in sets}
               for name in state.detectors}
        state.selection = selection_record(validation, ood, id_rows, description)

    # ------------------------------------------------------------------------------------ 7. collect (main)
    @property
    def _plan(self) -> EvaluationPlan:
        assert self.state.plan is not None, "plan() makes the plan"
        return self.state.plan

    def load_scores(self, name: str, split: str) -> dict[str, torch.Tensor]:
        """``name``'s score file of ``split`` (this run's plan; it must exist)."""
        plan, cache = self._plan, self._cache
        data = cache.load(name, split, plan.score_fingerprints[(name, split)], num_rows(plan.splits[split]))
        if data is None:
            raise RuntimeError(f"score file {cache.path(name, split)} vanished or changed during the run (see the "
                               "warning above); run again to compute it again")
        return data

    def collect(self) -> EvaluationResult:
        """Calibrate on ID validation, evaluate on ID test vs every OOD split, from the score files (main process)."""
        self._begin("collect")
        args, state, plan = self.args, self.state, self._plan
        base = self.load_scores(BASE_MODEL, ID_TEST)
        # per ID test sample, in dataset order like every score file
        state.correct = correct = base[PREDICTIONS_KEY] == base["labels"]
        groups = ood_groups_of(args.benchmark, plan.ood_names, args.ood_dataset_groups)
        fits = {name: fit_record(self.output_dir, name, dataset) for name, dataset in plan.fit_data.items()}
        calibrated = ID_VALIDATION in plan.splits
        # What every method's threshold was calibrated on: one split for all of them.
        calibration_source = validation_source(args.benchmark, args.id_dataset) if calibrated else None
        state.id_scores, state.ood_scores, entries = {}, {}, {}
        # The first method's score files by split: run_details reads the split sizes and the unreadable images left
        # out there (the same for every method), without loading them again.
        first_files: dict[str, dict[str, torch.Tensor]] = {}
        for name, detector in state.detectors.items():
            files = {ID_TEST: self.load_scores(name, ID_TEST)}
            id_test = files[ID_TEST]
            if not torch.equal(id_test["labels"], base["labels"]):
                raise RuntimeError(f"score files of {name!r} and of the base model list the ID test samples differently")
            files.update({OOD_PREFIX + ood: self.load_scores(name, OOD_PREFIX + ood) for ood in plan.ood_names})
            state.id_scores[name] = id_test[SCORE_KEY]
            state.ood_scores[name] = {ood: files[OOD_PREFIX + ood][SCORE_KEY] for ood in plan.ood_names}
            if calibrated:
                files[ID_VALIDATION] = self.load_scores(name, ID_VALIDATION)
                validation = files[ID_VALIDATION][SCORE_KEY]
                entry = method_results(state.id_scores[name], validation,
                                       state.ood_scores[name], args.target_tpr, "validation", method=name,
                                       id_test_correct=correct, delta=args.conformal_delta, groups=groups)
                entry["calibration"]["source"] = calibration_source
                self._cache.save_p_values(name, validation, {ID_TEST: state.id_scores[name], **{
                    OOD_PREFIX + ood: scores for ood, scores in state.ood_scores[name].items()}})
            else:  # a saved detector at its own threshold: nothing calibrated
                entry = method_results(state.id_scores[name], None, state.ood_scores[name], method=name,
                                       id_test_correct=correct, groups=groups, threshold=detector.config.threshold)
            entry["hyperparameters"] = effective_hyperparameters(detector)
            if name in plan.fit_data:
                entry["fit"] = {"split": detector.fit_split, **fits[name]}
            entries[name] = entry
            first_files = first_files or files
        details = run_details(self.args, state, self._context, self.model_name(), base, fits, calibrated, groups,
                              first_files)
        if state.shipped is not None:
            method = state.shipped.method
            details["detector"] = at_shipped_threshold(entries[method], state.shipped, self.model_name(),
                                                       state.ood_scores[method])
        return EvaluationResult(methods=entries, selection=state.selection, skipped=dict(state.skipped),
                                seconds=state.seconds, details=details)

    # ------------------------------------------------------------------------------------------- 8. report
    def report(self, result: EvaluationResult) -> None:
        """``results.md``, the plots, then ``results.json`` (written last: its presence says the run finished)."""
        self._begin("report")
        results = result.to_dict()
        if not self.args.no_plots:
            from .plots import write_plots

            write_plots(self.output_dir, self.state.id_scores, self.state.ood_scores, results, self.state.correct)
        write_report(self.output_dir, results)

    # --------------------------------------------------------------------------------------------- 9. save
    def save(self, result: EvaluationResult) -> list[Path]:
        """``--save-detectors``: each evaluated method as a detector folder ``detectors/{method}/`` (beside its fit),
        with the threshold calibrated on ID validation for ``results.json`` and a card carrying these results; the
        method the selection chose again as ``detectors/selected/``. Returns the folders written."""
        self._begin("save")
        if not self.args.save_detectors:
            return []
        detectors = self.state.detectors
        for name, detector in detectors.items():
            entry = result.methods[name]
            if ID_VALIDATION in self._plan.splits:  # results.json's calibration, made again the one way
                detector.set_calibration(calibration_of(entry, self.load_scores(name, ID_VALIDATION)[SCORE_KEY],
                                                        detector.calibration_dependencies()))
            if detector.image_processor is None:
                detector.image_processor = self.state.processor
            detector.save_pretrained(fit_dir(self.output_dir, name), results_dir=self.output_dir)
        folders = [fit_dir(self.output_dir, name) for name in detectors]
        chosen = result.selected_method
        if chosen in detectors:  # ready to publish: hf-gsc publish --detector-dir OUTPUT/detectors/selected
            detectors[chosen].save_pretrained(fit_dir(self.output_dir, SELECTED), results_dir=self.output_dir)
            print(f"selected {chosen} (validation only): saved as {fit_dir(self.output_dir, SELECTED)}", flush=True)
            folders.append(fit_dir(self.output_dir, SELECTED))
        return folders

    def model_name(self) -> str:
        """How the evaluated model is named in the header and the results."""
        source = self.model_source
        if self.named_source is not None:
            return self.named_source
        if isinstance(source, str):
            return source
        model = getattr(source, "model", source)
        return getattr(model, "name_or_path", None) or type(model).__name__


# ------------------------------------------------------------------------------------------------------ helpers
def same_model_or_refuse(model: Any, args: Any) -> str:
    """The path or Hub id that ``args`` names (``--model``, or ``--detector`` for a detector) when ``model`` (a
    loaded classifier or detector, or a name) is that same model; else an :class:`InputError` naming both.

    A loaded model is the one named when its ``name_or_path`` (a detector: its base model's, or its config's base
    reference) is the name, or the same folder."""
    from ..detectors.interface import OODDetector

    flag, named = ("--detector", args.detector) if args.detector is not None else ("--model", args.model)
    candidates: list[Any]
    if isinstance(model, str):
        kind_matches, candidates = True, [model]
    elif isinstance(model, OODDetector):
        kind_matches = flag == "--detector"
        candidates = [getattr(model.model, "name_or_path", None), model.config.base_model_name_or_path]
    else:
        kind_matches, candidates = flag == "--model", [getattr(model, "name_or_path", None)]
    names = [str(name) for name in candidates if name]
    if kind_matches and any(_same_name(name, str(named)) for name in names):
        return str(named)
    given = repr(names[0]) if names else f"a {type(model).__name__} with no name_or_path"
    what = "detector" if isinstance(model, OODDetector) else "model"
    if not kind_matches:
        raise InputError(f"OODEvaluator's model is a loaded {what} ({given}) but the arguments name {flag} {named!r}: "
                         "a loaded detector goes with --detector, a classifier with --model (or pass "
                         "OODEvaluator(None, args))")
    raise InputError(f"OODEvaluator's {what} is {given} but the arguments name {flag} {named!r}, another model: give "
                     f"the model once (OODEvaluator(model, args) with {flag} naming that model, or "
                     "OODEvaluator(None, args))")


def _same_name(a: str, b: str) -> bool:
    """The same Hub id, or the same local folder however it is spelled."""
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return a.rstrip("/") == b.rstrip("/")


def _resumable(error: UndecodableImageError) -> UndecodableImageError:
    return UndecodableImageError(f"{error} (fix or remove the file, or pass --skip-unreadable-images to leave such "
                                 "images out; finished splits are kept and not scored again)")


__all__ = ["NEEDS", "PHASES", "PHASE_ORDER", "SELECTED", "EvaluationResult", "EvaluationState", "EverythingSkippedError",
           "OODEvaluator", "RunContext", "same_model_or_refuse"]
