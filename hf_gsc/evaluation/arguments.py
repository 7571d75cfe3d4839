"""``EvaluationArguments``: every option of ``hf-gsc evaluate`` as one dataclass field with its help, as transformers'
``TrainingArguments``, and :class:`EvaluationArgumentParser` (a ``transformers.HfArgumentParser``) that reads them from
the command line.

The fields are declared here, in groups that are the help's sections (:class:`SourceArguments`,
:class:`DataArguments`, :class:`RunArguments`, :class:`DeviceArguments`), and GSC's own settings,
:class:`GSCArguments`, are generated from ``GSCConfig``'s fields (:func:`~hf_gsc.evaluation.setting_flags.setting_flags`); :class:`EvaluationArguments` inherits them all, so that
``HfArgumentParser((EvaluationArguments,))`` parses every flag of ``hf-gsc evaluate``, and the command line parses the
groups (``HfArgumentParser``'s ``_argument_group_name``) and joins them into one :class:`EvaluationArguments`.

Every check that needs neither model nor data runs once, in ``__post_init__``: a value of the wrong type (a field
accepts its natural Python types: one string or a list of them for a repeatable flag, a list or a comma string for
``methods``) or a bad value fails in well under a second with one line naming the field's flag
(:class:`~hf_gsc.evaluation.errors.InputError`); the instance is frozen afterwards. The values the checks parse (the
method list, each method's settings, the named OOD sets) are read-only properties.

No torch import here: ``hf-gsc evaluate --help`` prints without it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional, Union, get_type_hints

from transformers import HfArgumentParser
from transformers.hf_argparser import DataClassType

from ..settings.gsc import GSCConfig
from .errors import InputError
from .options import DEFAULT_TPR, IMAGE_BACKENDS, PRECISIONS, method_lines
from .setting_flags import setting_flags


#: The help's argument groups (the source options come first, in the parser's own group).
DATA_GROUP, RUN_GROUP, DEVICE_GROUP = "data", "run", "device and throughput"
#: The method whose settings have their own flags (:class:`GSCArguments`).
GSC_METHOD = "gsc"


def _option(default: Any = None, help: str = "", **parser_kwargs: Any) -> Any:  # noqa: A002
    """A dataclass field with its ``--help`` text (``metadata["help"]``, read by ``HfArgumentParser``);
    ``parser_kwargs`` go to ``add_argument`` (``metavar``, ``action``)."""
    metadata = {"help": help, **parser_kwargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


class _GroupTitle:
    """``_argument_group_name`` (the help section ``HfArgumentParser`` puts a dataclass's fields in), seen on the class
    that declares it only: :class:`EvaluationArguments`, which inherits every group, is parsed as one group."""

    def __init__(self, title: str) -> None:
        self.title = title

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner = owner

    def __get__(self, instance: Any, owner: type) -> str:
        if owner is not self.owner:
            raise AttributeError("_argument_group_name")
        return self.title


@dataclass(frozen=True, kw_only=True)
class SourceArguments:
    """What is evaluated: an image classifier (``model``) or a saved detector as it is (``detector``)."""

    model: Optional[str] = _option(
        help="image classifier (or a saved detector, whose settings become the defaults): local path or Hub id; the "
        "methods are fitted and calibrated on it")
    detector: Optional[str] = _option(
        help="instead of --model: evaluate this saved detector as it is (its method, settings, fitted state and "
        "threshold; no refit, no recalibration), with the TPR and FPR at its threshold", metavar="FOLDER_OR_REPO_ID")
    revision: Optional[str] = _option(help="Hub revision of --model or --detector")


@dataclass(frozen=True, kw_only=True)
class DataArguments:
    """The ID and OOD data, and how much of it is read."""

    _argument_group_name: ClassVar[Any] = _GroupTitle(DATA_GROUP)
    benchmark: Optional[str] = _option(help="registered benchmark, e.g. fmnist-ood or fmnist-openset")
    ood_splits: Union[list[str], str, None] = _option(help="comma list: only these ood_splits of --benchmark (default: all)")
    id_dataset: Optional[str] = _option(
        help="instead of --benchmark: ID data with train/validation/test splits: a folder with train/, validation/, "
        "test/ subfolders of class folders (image folders), a local save_to_disk DatasetDict, or a Hub "
        "'dataset_id[:config]'")
    image_column: Optional[str] = _option(
        help="the image column of --id-dataset (a saved or Hub dataset); default: its one datasets.Image column, "
        "found by type (several are refused, listing the columns). OOD data's image column is always found by type",
        metavar="COLUMN")
    label_column: Optional[str] = _option(
        help="the label column of --id-dataset, whose classes are the model's (by name, as class folders); default: "
        "its one datasets.ClassLabel column, found by type (else an integer or text column named label or labels); "
        "none, or several ClassLabel columns (CIFAR-100's fine_label and coarse_label), is refused, listing the "
        "columns", metavar="COLUMN")
    ood_dataset: list[str] | str = _option(
        [], help="an OOD split, repeatable: 'dataset_id[:config]:split' or a local path; NAME defaults from SPEC; "
        "it belongs to no near/far group (see --near-ood-dataset, --far-ood-dataset)",
        metavar="[NAME=]SPEC", action="extend")
    near_ood_dataset: list[str] | str = _option(
        [], help="like --ood-dataset, an OOD split of the near-OOD group (semantic shift, close to the ID classes): "
        "results.json and results.md average it with the benchmark's near-OOD splits", metavar="[NAME=]SPEC",
        action="extend")
    far_ood_dataset: list[str] | str = _option(
        [], help="like --ood-dataset, an OOD split of the far-OOD group (other kinds of images): averaged with the "
        "benchmark's far-OOD splits", metavar="[NAME=]SPEC", action="extend")
    val_ood_dataset: list[str] | str = _option(
        [], help="an OOD *validation* split for choosing the detector (the selection record), repeatable, like "
        "--ood-dataset; default: OOD sets generated from half of ID validation, as --tune does (never a test split)",
        metavar="[NAME=]SPEC", action="extend")
    label_map: Optional[str] = _option(
        help="which of the model's id2label classes each ID data class is (class folder or ClassLabel name = model "
        "label, or its index), or a .json file of the same pairs; needed only where the names differ: the same names "
        "in another order, or a subset, are mapped by name; recorded in results.json's label_check",
        metavar="DATA_NAME=MODEL_LABEL,...")
    labels_by_order: bool = _option(
        False, help="for a model whose id2label is generic (LABEL_0, ...) and ID data with named classes: take the "
        "data's class i as the model's class i, unchecked (said on the console and above results.md's tables); "
        "without it such a run is refused (name the model's classes in id2label, or give --label-map)")
    no_selection: bool = _option(
        False, help="do not rank the methods on validation data nor choose one (skips scoring the OOD validation sets)")
    max_samples: Optional[int] = _option(
        help="at most this many samples per split (random, --seed; with --streaming: the first ones)")
    max_fit_samples: int = _option(10000, help="at most this many samples to fit a detector")
    skip_unreadable_images: bool = _option(
        False, help="leave out images that cannot be decoded (counted per split in results.json) instead of stopping "
        "at the first one")
    streaming: bool = _option(False, help="stream Hub datasets (datasets.IterableDataset) instead of downloading them "
                              "whole")


@dataclass(frozen=True, kw_only=True)
class RunArguments:
    """The methods, their settings, the thresholds and the output folder."""

    _argument_group_name: ClassVar[Any] = _GroupTitle(RUN_GROUP)
    methods: Union[list[str], str, None] = _option(
        help="comma list of registered methods (one that cannot be built on the model is skipped with the reason, "
        "and the others run), or 'all' (every method that can be built on the model; the others are skipped with the "
        "reason), or 'all,-NAME,-NAME' (every method but those); default: the default table, "
        "GSC and the main baselines that need no long fit (--list-methods shows every method, the default ones "
        "marked)")
    output_dir: str = field(metadata={"help": "results, score cache, fitted detectors, plots; a new or empty folder, "
                                      "or one an earlier run wrote (a non-empty folder of other files needs "
                                      "--overwrite)"})
    batch_size: int = _option(64, help="images per batch of every backbone pass (fit, scoring, tuning), per process")
    seed: int = _option(0, help="seed of every random choice: the --max-samples subsets, the ID validation halves, "
                        "the generated OOD validation sets, fits that draw")
    tpr: Optional[float] = _option(
        help=f"ID TPR the threshold is calibrated to (on ID validation; default {DEFAULT_TPR})")
    conformal_delta: Optional[float] = _option(
        help="split-conformal thresholds: keep ID TPR >= --tpr on new ID data with probability >= 1 - DELTA (default: "
        "the plain --tpr quantile of the ID validation scores)", metavar="DELTA")
    hyperparameter: list[str] | str = _option(
        [], help="a method hyperparameter, repeatable, e.g. odin.temperature=1000 (VALUE parsed as JSON if it can be)",
        metavar="METHOD.NAME=VALUE", action="extend")
    tune: bool = _option(
        False, help="choose each method's hyperparameters on validation data only before evaluating: a small grid per "
        "method, half of ID validation vs OOD sets generated from the other half (never a test split); costs one "
        "backbone pass over 1.5x the ID validation rows for all grid points together, plus fit passes and ODIN's own "
        "passes (see 'hf-gsc docs evaluation')")
    overwrite: bool = _option(
        False, help="recompute cached scores and fits; and write into a non-empty --output-dir that holds no run of "
        "hf-gsc evaluate (refused without it): the run's files replace those of the same names, nothing else there "
        "is deleted")
    no_plots: bool = _option(False, help="skip the PNG figures (they need matplotlib: pip install 'hf_gsc[plots]')")
    save_detectors: bool = _option(
        False, help="save every evaluated method as a detector (fitted, threshold calibrated on ID validation, model "
        "card with its results) under OUTPUT_DIR/detectors/METHOD, loadable with "
        "hf_gsc.AutoOODDetector.from_pretrained and publishable with hf-gsc publish --detector-dir")


@dataclass(frozen=True, kw_only=True)
class DeviceArguments:
    """Precision, data-loading workers and the image backend."""

    _argument_group_name: ClassVar[Any] = _GroupTitle(DEVICE_GROUP)
    mixed_precision: Optional[str] = _option(
        help="backbone under accelerate's autocast (default: accelerate's config / ACCELERATE_MIXED_PRECISION, else no)",
        metavar="{" + ",".join(PRECISIONS) + "}")
    num_workers: Optional[int] = _option(
        help="DataLoader worker processes decoding and preprocessing images (default on CUDA: the CPUs this process may "
        "use over the processes on this machine, less one; 0 on CPU; see 'hf-gsc docs evaluation')")
    image_backend: str = _option("auto", help="image processor backend (default auto: torchvision when installed, "
                                 "else PIL)", metavar="{" + ",".join(IMAGE_BACKENDS) + "}")


#: GSC's settings whose flag would clash with a run option (``--seed``) or read as another method's (``--score``,
#: ``--temperature``): given as ``--gsc-score``, ``--gsc-temperature``, ``--gsc-seed``.
_GSC_PREFIXED = ("score", "temperature", "seed")
#: :class:`GSCArguments` (GSC's settings as flags, generated from ``GSCConfig``'s fields: each unset unless given, with
#: the setting's type, help and default) and :data:`GSC_FLAGS` (each field -> the ``GSCConfig`` setting it gives).
#: Every other method's settings are given with ``--hyperparameter METHOD.NAME=VALUE``.
_GSC_SETTING_FLAGS = setting_flags(
    GSCConfig, "GSCArguments", prefix=f"{GSC_METHOD}_", prefixed=_GSC_PREFIXED,
    reserved=tuple(item.name for group in (SourceArguments, DataArguments, RunArguments, DeviceArguments)
                   for item in dataclasses.fields(group)),
    namespace={"__module__": __name__, "_argument_group_name": _GroupTitle(
        f"{GSC_METHOD} options (default: GSCConfig defaults, or the saved detector's config)")})
# Any: a class made at run time, whose fields (one per GSCConfig setting) a type checker cannot see.
GSCArguments: Any = _GSC_SETTING_FLAGS.arguments
GSC_FLAGS = _GSC_SETTING_FLAGS.settings
#: method -> its own flags (field name -> setting): GSC's only; every method's settings are ``--hyperparameter``.
METHOD_FLAGS: dict[str, dict[str, str]] = {GSC_METHOD: GSC_FLAGS}
#: The argument groups in the order of the help (:class:`EvaluationArguments` inherits them all, in this order).
ARGUMENT_GROUPS: tuple[DataClassType, ...] = tuple(
    DataClassType(group) for group in (SourceArguments, DataArguments, RunArguments, DeviceArguments, GSCArguments))
#: Fields given as a list of strings (a repeatable flag): one string is accepted as a list of one.
_LIST_FIELDS = ("ood_dataset", "near_ood_dataset", "far_ood_dataset", "val_ood_dataset", "hyperparameter")
#: Fields given as a comma list: a list of strings is accepted and joined.
_COMMA_FIELDS = ("methods", "ood_splits")


@dataclass(frozen=True, kw_only=True)
class EvaluationArguments(GSCArguments, DeviceArguments, RunArguments, DataArguments, SourceArguments):
    """The options of an OOD evaluation (``hf-gsc evaluate``), one field per flag. Construct it in Python with the
    flags' names (``EvaluationArguments(benchmark="fmnist-ood", output_dir="runs/x", methods="gsc,msp")``) or parse it
    from a command line with :class:`EvaluationArgumentParser` (or ``HfArgumentParser((EvaluationArguments,))``);
    the checks run on construction."""

    #: :data:`METHOD_FLAGS`, for the checks (:mod:`.validation`, which this module imports, not the reverse).
    method_flag_settings: ClassVar[dict[str, dict[str, str]]] = METHOD_FLAGS
    #: The values the checks parse (read through the properties below); set once, in ``__post_init__``.
    _parsed: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from .validation import validate

        for name, value in _natural_values(self).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_parsed", validate(self))

    # ------------------------------------------------------------------ values parsed by the checks (read-only)
    @property
    def method_names(self) -> list[str]:
        """``--methods`` as a list (the default table without it)."""
        return list(self._parsed["methods"])

    @property
    def method_hyperparameters(self) -> dict[str, dict[str, Any]]:
        """method -> the settings given for it (``--hyperparameter`` over its own flags)."""
        return {name: dict(values) for name, values in self._parsed["hyperparameters"].items()}

    @property
    def ood_split_names(self) -> list[str] | None:
        """``--ood-splits`` as a list (``None``: every OOD split of ``--benchmark``)."""
        names = self._parsed["ood_splits"]
        return None if names is None else list(names)

    @property
    def named_ood_datasets(self) -> list[tuple[str, str]]:
        """``(NAME, SPEC)`` of every ``--ood-dataset``, ``--near-ood-dataset`` and ``--far-ood-dataset``."""
        return [(name, spec) for name, spec, _ in self._parsed["extra_ood"]]

    @property
    def ood_dataset_groups(self) -> dict[str, list[str]]:
        """``near`` / ``far`` -> the names of the OOD datasets given in that group."""
        groups: dict[str, list[str]] = {}
        for name, _, group in self._parsed["extra_ood"]:
            if group is not None:
                groups.setdefault(group, []).append(name)
        return groups

    @property
    def named_val_ood_datasets(self) -> list[tuple[str, str]]:
        """``(NAME, SPEC)`` of every ``--val-ood-dataset``."""
        return list(self._parsed["val_ood"])

    @property
    def label_pairs(self) -> dict[str, str]:
        """``--label-map`` as ``data name -> model label``."""
        return dict(self._parsed["label_map"] or {})

    @property
    def target_tpr(self) -> float:
        """The ID TPR thresholds are calibrated to: ``--tpr``, else :data:`~hf_gsc.evaluation.options.DEFAULT_TPR`."""
        return DEFAULT_TPR if self.tpr is None else float(self.tpr)

    @property
    def on_error(self) -> str:
        """What an unreadable image does: ``"skip"`` with ``--skip-unreadable-images``, else ``"raise"``."""
        return "skip" if self.skip_unreadable_images else "raise"

    def method_flags(self) -> dict[str, Any]:
        """Every method flag given (field name -> value)."""
        return {name: getattr(self, name) for name in GSC_FLAGS if getattr(self, name) is not None}

    def to_dict(self) -> dict[str, Any]:
        """The options as given (``results.json``'s ``config``, with ``methods`` as run)."""
        return {item.name: getattr(self, item.name) for item in dataclasses.fields(self) if item.init}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _natural_values(args: Any) -> dict[str, Any]:
    """The fields given in another natural Python type, in the field's own type: one string for a repeatable flag
    (``ood_dataset="photos=data/ood"``) becomes a list of one, a list for a comma list (``methods=["gsc", "knn"]``)
    becomes ``"gsc,knn"``; any other type is an :class:`InputError` naming the field and its flag."""
    changed: dict[str, Any] = {}
    for name in _LIST_FIELDS:
        value = getattr(args, name)
        if isinstance(value, str):
            changed[name] = [value]
        elif isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
            if not isinstance(value, list):
                changed[name] = list(value)
        else:
            raise InputError(f"{name} ({_flag(name)}) must be a string or a list of strings, got {value!r}")
    for name in _COMMA_FIELDS:
        value = getattr(args, name)
        if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
            changed[name] = ",".join(value)
        elif value is not None and not isinstance(value, str):
            raise InputError(f"{name} ({_flag(name)}) must be a comma-separated string or a list of strings, "
                             f"got {value!r}")
    for name in _string_fields():
        value = getattr(args, name)
        if value is not None and not isinstance(value, str):
            raise InputError(f"{name} ({_flag(name)}) must be a string, got {value!r}")
    return changed


def _string_fields() -> list[str]:
    """The fields typed ``str`` or ``Optional[str]`` (paths, ids, names)."""
    hints = get_type_hints(EvaluationArguments)
    return [item.name for item in dataclasses.fields(EvaluationArguments)
            if hints[item.name] in (str, Optional[str]) and item.name not in _COMMA_FIELDS]


class _ListMethods(argparse.Action):
    """``--list-methods``: print :func:`~hf_gsc.evaluation.options.method_lines` and exit, like ``--help``."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print("\n".join(method_lines()))
        parser.exit(0)


class EvaluationArgumentParser(HfArgumentParser):
    """``HfArgumentParser`` of the argument groups (:data:`ARGUMENT_GROUPS`, one help section each) with
    ``--list-methods``: :meth:`parse` joins the groups into one :class:`EvaluationArguments`."""

    def __init__(self, prog: str | None = None) -> None:
        super().__init__(
            ARGUMENT_GROUPS, prog=prog, formatter_class=argparse.HelpFormatter,
            description="OOD evaluation of GSC and baselines on a Hugging Face image classifier. Runs with `python` or "
            "`accelerate launch` (sharded over processes).")
        for action in self._actions:
            # The flag as spelled everywhere (--output-dir) first in the help, HfArgumentParser's --output_dir after.
            action.option_strings = sorted(action.option_strings, key=lambda option: "_" in option)
        run = next(group for group in self._action_groups if group.title == RUN_GROUP)
        run.add_argument("--list-methods", action=_ListMethods,
                         help="list every registered method, one per line, and exit")

    def parse(self, argv: Sequence[str] | None = None) -> EvaluationArguments:
        """The :class:`EvaluationArguments` of ``argv`` (``sys.argv[1:]`` when ``None``); bad input raises
        :class:`~hf_gsc.evaluation.errors.InputError`."""
        groups = self.parse_args_into_dataclasses(list(argv) if argv is not None else None, look_for_args_file=False)
        return EvaluationArguments(**{item.name: getattr(group, item.name)
                                      for group in groups for item in dataclasses.fields(group)})


def parse_arguments(argv: Sequence[str] | None = None) -> EvaluationArguments:
    """``argv`` (a ``hf-gsc evaluate`` command line without the program name) -> :class:`EvaluationArguments`."""
    return EvaluationArgumentParser().parse(argv)


def is_evaluation_arguments(value: Any) -> bool:
    """Whether ``value`` is an :class:`EvaluationArguments`."""
    return isinstance(value, EvaluationArguments)


__all__ = [
    "ARGUMENT_GROUPS",
    "GSC_FLAGS",
    "METHOD_FLAGS",
    "DataArguments",
    "DeviceArguments",
    "EvaluationArgumentParser",
    "EvaluationArguments",
    "GSCArguments",
    "RunArguments",
    "SourceArguments",
    "is_evaluation_arguments",
    "parse_arguments",
]
