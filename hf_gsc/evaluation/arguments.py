"""``EvaluationArguments``: every option of ``hf-gsc evaluate`` as one dataclass field with its help, as transformers'
``TrainingArguments``, and :class:`EvaluationArgumentParser` (a ``transformers.HfArgumentParser``) that reads them from
the command line.

Every check that needs neither model nor data runs once, in ``__post_init__``, so a bad argument fails in well under
a second with one line naming the flag (:class:`~hf_gsc.evaluation.errors.InputError`); the instance is frozen
afterwards. The values the checks parse (the method list, each method's settings, the named OOD sets) are read-only
properties.

A method's own flags (its class's ``command_line_flags``: GSC's ``--split-point``, ``--mask-ratio``, ...) are fields
too, added from the registry when this module is imported, so that a flag, its field and its setting keep one name.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from transformers import HfArgumentParser

from .options import (
    DEFAULT_TPR,
    IMAGE_BACKENDS,
    PRECISIONS,
    command_line_flags,
    default_methods,
    method_lines,
    registered_methods,
)

#: The help's argument groups: field name -> group title (the other fields are listed first).
DATA_GROUP, RUN_GROUP, DEVICE_GROUP = "data", "run", "device and throughput"


def _option(default: Any = None, help: str = "", group: str | None = None, **parser_kwargs: Any) -> Any:  # noqa: A002
    """A dataclass field with its ``--help`` text (``metadata["help"]``, read by ``HfArgumentParser``); ``group``
    places it in the help (:data:`_GROUPS`), ``parser_kwargs`` go to ``add_argument`` (``metavar``, ``action``)."""
    metadata = {"help": help, **parser_kwargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class _RunArguments:
    """The options every evaluation has (the method flags are added by :data:`EvaluationArguments`)."""

    model: Optional[str] = _option(
        help="image classifier (or a saved detector, whose settings become the defaults): local path or Hub id; the "
        "methods are fitted and calibrated on it")
    detector: Optional[str] = _option(
        help="instead of --model: evaluate this saved detector as it is (its method, settings, fitted state and "
        "threshold; no refit, no recalibration), with the TPR and FPR at its threshold", metavar="FOLDER_OR_REPO_ID")
    revision: Optional[str] = _option(help="Hub revision of --model or --detector")
    # data
    benchmark: Optional[str] = _option(help="registered benchmark, e.g. fmnist-ood or fmnist-openset")
    ood_splits: Optional[str] = _option(help="comma list: only these ood_splits of --benchmark (default: all)")
    id_dataset: Optional[str] = _option(
        help="instead of --benchmark: ID data with train/validation/test splits: a folder with train/, validation/, "
        "test/ subfolders of class folders (image folders), a local save_to_disk DatasetDict, or a Hub "
        "'dataset_id[:config]'")
    ood_dataset: list[str] = _option(
        [], help="an OOD split, repeatable: 'dataset_id[:config]:split' or a local path; NAME defaults from SPEC; "
        "it belongs to no near/far group (see --near-ood-dataset, --far-ood-dataset)",
        metavar="[NAME=]SPEC", action="extend")
    near_ood_dataset: list[str] = _option(
        [], help="like --ood-dataset, an OOD split of the near-OOD group (semantic shift, close to the ID classes): "
        "results.json and results.md average it with the benchmark's near-OOD splits", metavar="[NAME=]SPEC",
        action="extend")
    far_ood_dataset: list[str] = _option(
        [], help="like --ood-dataset, an OOD split of the far-OOD group (other kinds of images): averaged with the "
        "benchmark's far-OOD splits", metavar="[NAME=]SPEC", action="extend")
    val_ood_dataset: list[str] = _option(
        [], help="an OOD *validation* split for choosing the detector (the selection record), repeatable, like "
        "--ood-dataset; default: OOD sets generated from half of ID validation, as --tune does (never a test split)",
        metavar="[NAME=]SPEC", action="extend")
    label_map: Optional[str] = _option(
        help="which of the model's id2label classes each ID data class is (class folder or ClassLabel name = model "
        "label, or its index), or a .json file of the same pairs; needed only where the names differ: the same names "
        "in another order, or a subset, are mapped by name; recorded in results.json's label_check",
        metavar="DATA_NAME=MODEL_LABEL,...")
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
    # run
    methods: Optional[str] = _option(
        help="comma list of registered methods, or 'all' (every method that can be built on the model; the others "
        "are skipped with the reason), or 'all,-NAME,-NAME' (every method but those; default: "
        f"{','.join(default_methods())}; --list-methods shows them all)")
    output_dir: str = field(metadata={"help": "results, score cache, fitted detectors, plots"})
    batch_size: int = _option(64, help="images per batch of every backbone pass (fit, scoring, tuning), per process")
    seed: int = _option(0, help="seed of every random choice: the --max-samples subsets, the ID validation halves, "
                        "the generated OOD validation sets, fits that draw")
    tpr: Optional[float] = _option(
        help=f"ID TPR the threshold is calibrated to (on ID validation; default {DEFAULT_TPR})")
    conformal_delta: Optional[float] = _option(
        help="split-conformal thresholds: keep ID TPR >= --tpr on new ID data with probability >= 1 - DELTA (default: "
        "the plain --tpr quantile of the ID validation scores)", metavar="DELTA")
    hyperparameter: list[str] = _option(
        [], help="a method hyperparameter, repeatable, e.g. odin.temperature=1000 (VALUE parsed as JSON if it can be)",
        metavar="METHOD.NAME=VALUE", action="extend")
    tune: bool = _option(
        False, help="choose each method's hyperparameters on validation data only before evaluating: a small grid per "
        "method, half of ID validation vs OOD sets generated from the other half (never a test split); costs one "
        "backbone pass over 1.5x the ID validation rows for all grid points together, plus fit passes and ODIN's own "
        "passes (see docs/evaluation.md)")
    overwrite: bool = _option(False, help="recompute cached scores and fits")
    no_plots: bool = _option(False, help="skip the PNG figures (they need matplotlib: pip install 'hf_gsc[plots]')")
    save_detectors: bool = _option(
        False, help="save every evaluated method as a detector (fitted, threshold calibrated on ID validation, model "
        "card with its results) under OUTPUT_DIR/detectors/METHOD, loadable with "
        "hf_gsc.AutoOODDetector.from_pretrained and publishable with hf-gsc publish --detector-dir")
    # device and throughput
    mixed_precision: Optional[str] = _option(
        help="backbone under accelerate's autocast (default: accelerate's config / ACCELERATE_MIXED_PRECISION, else no)",
        metavar="{" + ",".join(PRECISIONS) + "}")
    num_workers: Optional[int] = _option(
        help="DataLoader worker processes decoding and preprocessing images (default on CUDA: the CPUs this process may "
        "use over the processes on this machine, less one; 0 on CPU; see docs/evaluation.md)")
    image_backend: str = _option("auto", help="image processor backend (default auto: torchvision when installed, "
                                 "else PIL)", metavar="{" + ",".join(IMAGE_BACKENDS) + "}")

    def __post_init__(self) -> None:
        from .validation import validate

        object.__setattr__(self, "_parsed", validate(self))

    # ------------------------------------------------------------------ values parsed by the checks (read-only)
    @property
    def method_names(self) -> list[str]:
        """``--methods`` as a list (the default table without it)."""
        return list(self._parsed["methods"])

    @property
    def explicit_methods(self) -> bool:
        """Whether ``--methods`` names its methods (``gsc,knn``) rather than ``all`` or the default table: a named
        method that cannot be built on the model is refused, one of ``all`` is skipped with the reason."""
        return self.methods is not None and not self.methods.strip().startswith("all")

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
        """Every method flag given (flag dest -> value)."""
        return {dest: getattr(self, dest) for flags in command_line_flags().values() for dest in flags
                if getattr(self, dest, None) is not None}

    def to_dict(self) -> dict[str, Any]:
        """The options as given (``results.json``'s ``config``, with ``methods`` as run)."""
        return {item.name: getattr(self, item.name) for item in dataclasses.fields(self) if item.init}


def _method_fields() -> list[tuple[str, Any, Any]]:
    """One optional field per method flag (its class's ``command_line_flags``), typed and documented from its config
    class's default."""
    fields = []
    for method, flags in command_line_flags().items():
        config_class = registered_methods()[method].config_class
        defaults = config_class()
        for dest, name in flags.items():
            default = getattr(defaults, name)
            kind = str if default is None else type(default)
            fields.append((dest, Optional[kind], field(default=None, metadata={
                "help": f"{config_class.__name__}.{name} (default {default!r})",
                "group": f"{method} options (default: {config_class.__name__} defaults, or the saved detector's config)",
            })))
    return fields


def arguments_class() -> type:
    """The :data:`EvaluationArguments` class of the methods registered now: a method registered after this module was
    imported (a plugin) has its flags too. One class per set of flags."""
    fields = _method_fields()
    key = tuple(name for name, _, _ in fields)
    if key not in _CLASSES:
        _CLASSES[key] = dataclasses.make_dataclass(
            "EvaluationArguments", fields, bases=(_RunArguments,), frozen=True, kw_only=True,
            namespace={"__module__": __name__, "__doc__": _RunArguments.__doc__.replace(
                " (the method flags are added by :data:`EvaluationArguments`)", ", and each method's own flags")})
    return _CLASSES[key]


_CLASSES: dict[tuple[str, ...], type] = {}
#: The options of an OOD evaluation (``hf-gsc evaluate``), one field per flag. Construct it in Python with the flags'
#: names (``EvaluationArguments(benchmark="fmnist-ood", output_dir="runs/x", methods="gsc,msp")``) or parse it from a
#: command line with :class:`EvaluationArgumentParser`; the checks run on construction.
EvaluationArguments = arguments_class()

_GROUPS = {
    **dict.fromkeys(("benchmark", "ood_splits", "id_dataset", "ood_dataset", "near_ood_dataset", "far_ood_dataset",
                     "val_ood_dataset", "label_map", "no_selection", "max_samples", "max_fit_samples",
                     "skip_unreadable_images", "streaming"), DATA_GROUP),
    **dict.fromkeys(("methods", "output_dir", "batch_size", "seed", "tpr", "conformal_delta", "hyperparameter",
                     "tune", "overwrite", "no_plots", "save_detectors"), RUN_GROUP),
    **dict.fromkeys(("mixed_precision", "num_workers", "image_backend"), DEVICE_GROUP),
}


class _ListMethods(argparse.Action):
    """``--list-methods``: print :func:`~hf_gsc.evaluation.options.method_lines` and exit, like ``--help``."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print("\n".join(method_lines()))
        parser.exit(0)


class EvaluationArgumentParser(HfArgumentParser):
    """``HfArgumentParser(EvaluationArguments)`` with the help in groups and ``--list-methods``:
    ``EvaluationArgumentParser().parse_args_into_dataclasses(argv)[0]`` is the :data:`EvaluationArguments`."""

    def __init__(self, prog: str | None = None) -> None:
        super().__init__(
            arguments_class(), prog=prog, formatter_class=argparse.HelpFormatter,
            description="OOD evaluation of GSC and baselines on a Hugging Face image classifier. Runs with `python` or "
            "`accelerate launch` (sharded over processes).")
        self._groups["run"].add_argument(
            "--list-methods", action=_ListMethods, help="list every registered method, one per line, and exit")

    def _add_dataclass_arguments(self, dtype: Any) -> None:
        # HfArgumentParser puts every field in one group; the help reads better in today's groups.
        from typing import get_type_hints

        self._groups: dict[str, Any] = {}
        hints = get_type_hints(dtype)
        for item in dataclasses.fields(dtype):
            if not item.init:
                continue
            item.type = hints[item.name]
            title = _GROUPS.get(item.name) or item.metadata.get("group")
            parser = self if title is None else self._groups.setdefault(title, self.add_argument_group(title))
            metadata = {key: value for key, value in item.metadata.items() if key != "group"}
            if metadata != dict(item.metadata):
                item = _with_metadata(item, metadata)
            self._parse_dataclass_field(parser, item)
            # The flag as spelled everywhere (--output-dir) first in the help, HfArgumentParser's --output_dir after.
            action = self._actions[-1]
            action.option_strings.sort(key=lambda option: "_" in option)

    def parse(self, argv: Sequence[str] | None = None) -> Any:
        """The :data:`EvaluationArguments` of ``argv`` (``sys.argv[1:]`` when ``None``); bad input raises
        :class:`~hf_gsc.evaluation.errors.InputError`."""
        return self.parse_args_into_dataclasses(list(argv) if argv is not None else None, look_for_args_file=False)[0]


def _with_metadata(item: dataclasses.Field, metadata: dict[str, Any]) -> dataclasses.Field:
    """A copy of the dataclass field ``item`` with other ``metadata`` (the class's own field is left as it is)."""
    import copy
    import types

    clone = copy.copy(item)
    clone.metadata = types.MappingProxyType(metadata)
    return clone


def parse_arguments(argv: Sequence[str] | None = None) -> Any:
    """``argv`` (a ``hf-gsc evaluate`` command line without the program name) -> :data:`EvaluationArguments`."""
    return EvaluationArgumentParser().parse(argv)


def is_evaluation_arguments(value: Any) -> bool:
    """Whether ``value`` is an :data:`EvaluationArguments` (of any set of registered methods)."""
    return isinstance(value, _RunArguments)


__all__ = ["EvaluationArgumentParser", "EvaluationArguments", "arguments_class", "is_evaluation_arguments",
           "parse_arguments"]
