"""The evaluation's command-line options and their validation: every check that needs neither model nor data.

:func:`validate_args` runs before the accelerator, the model or the data are touched, so a bad argument
fails in well under a second with one line naming the flag (:class:`InputError`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..image_limits import max_image_pixels
from .errors import InputError

#: ``--tpr``'s default: the ID TPR thresholds are calibrated to (FPR@95's operating point).
DEFAULT_TPR = 0.95
#: ``--mixed-precision`` values (accelerate's names); unset = accelerate's config / ``ACCELERATE_MIXED_PRECISION``.
PRECISIONS = ("no", "fp16", "bf16")
#: ``--image-backend`` values: ``auto`` = transformers' default (torchvision when installed, else PIL).
IMAGE_BACKENDS = ("auto", "pil", "torchvision")


def describe_method(cls: type) -> str:
    """One line about a registered method: the first sentence of its docstring, without reST markup."""
    paragraph = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", paragraph).replace("``", "")
    sentence = text.split(". ")[0].rstrip(".")
    return sentence + "."


def method_lines() -> list[str]:
    """``--list-methods``: one line per registered method (name, what it scores, what it needs)."""
    registered = registered_methods()
    width = max(map(len, registered))
    lines = []
    for name in sorted(registered):
        cls = registered[name]
        notes = [f"fitted on ID {cls.fit_split}"] if getattr(cls, "needs_fit", False) else []
        if name in default_methods():
            notes.append("default")
        suffix = f" [{', '.join(notes)}]" if notes else ""
        lines.append(f"{name:<{width}}  {describe_method(cls)}{suffix}")
    return lines


class _ListMethods(argparse.Action):
    """``--list-methods``: print :func:`method_lines` and exit, like ``--help`` (no other argument needed)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print("\n".join(method_lines()))
        parser.exit(0)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``scripts/evaluate_ood.py`` (also used by ``scripts/demo.py`` and tests)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="OOD evaluation of GSC and baselines on a Hugging Face image classifier. "
        "Runs with `python` or `accelerate launch` (sharded over processes).",
    )
    parser.add_argument("--model", default=None,
                        help="image classifier (or a saved detector, whose settings become the defaults): local path "
                        "or Hub id; the methods are fitted and calibrated on it")
    parser.add_argument("--detector", default=None, metavar="FOLDER_OR_REPO_ID",
                        help="instead of --model: evaluate this saved detector as it is (its method, settings, fitted "
                        "state and threshold; no refit, no recalibration), with the TPR and FPR at its threshold")
    parser.add_argument("--revision", default=None, help="Hub revision of --model or --detector")
    data = parser.add_argument_group("data")
    data.add_argument("--benchmark", default=None, help="registered benchmark, e.g. fmnist-ood or fmnist-openset")
    data.add_argument(
        "--ood-splits", default=None,
        help="comma list: only these ood_splits of --benchmark (default: all)",
    )
    data.add_argument(
        "--id-dataset", default=None,
        help="instead of --benchmark: ID data with train/validation/test splits: a folder with train/, validation/, "
        "test/ subfolders of class folders (image folders), a local save_to_disk DatasetDict, or a Hub "
        "'dataset_id[:config]'",
    )
    data.add_argument(
        "--ood-dataset", action="append", default=[], metavar="[NAME=]SPEC",
        help="an OOD split, repeatable: 'dataset_id[:config]:split' or a local path; NAME defaults from SPEC",
    )
    data.add_argument(
        "--val-ood-dataset", action="append", default=[], metavar="[NAME=]SPEC",
        help="an OOD *validation* split for choosing the detector (the selection record), repeatable, like "
        "--ood-dataset; default: OOD sets generated from half of ID validation, as --tune does (never a test split)",
    )
    data.add_argument(
        "--label-map", default=None, metavar="DATA_NAME=MODEL_LABEL,...",
        help="which of the model's id2label classes each ID data class is (class folder or ClassLabel name = model "
        "label, or its index), or a .json file of the same pairs; needed only where the names differ: the same names "
        "in another order, or a subset, are mapped by name; recorded in results.json's label_check",
    )
    data.add_argument("--no-selection", action="store_true",
                      help="do not rank the methods on validation data nor choose one (skips scoring the OOD "
                      "validation sets)")
    data.add_argument("--max-samples", type=int, default=None,
                      help="at most this many samples per split (random, --seed; with --streaming: the first ones)")
    data.add_argument("--max-fit-samples", type=int, default=10000, help="at most this many samples to fit a detector")
    data.add_argument("--skip-unreadable-images", action="store_true",
                      help="leave out images that cannot be decoded (counted per split in results.json) instead of "
                      "stopping at the first one")
    data.add_argument("--streaming", action="store_true",
                      help="stream Hub datasets (datasets.IterableDataset) instead of downloading them whole")
    run = parser.add_argument_group("run")
    run.add_argument(
        "--methods", default=None,
        help=f"comma list of registered methods, or 'all', or 'all,-NAME,-NAME' (every method but those; default: "
        f"{','.join(default_methods())}; --list-methods shows them all)",
    )
    run.add_argument("--list-methods", action=_ListMethods, help="list every registered method, one per line, and exit")
    run.add_argument("--output-dir", required=True, help="results, score cache, fitted detectors, plots")
    run.add_argument("--batch-size", type=int, default=64)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--tpr", type=float, default=None,
                     help=f"ID TPR the threshold is calibrated to (on ID validation; default {DEFAULT_TPR})")
    run.add_argument(
        "--conformal-delta", type=float, default=None, metavar="DELTA",
        help="split-conformal thresholds: keep ID TPR >= --tpr on new ID data with probability >= 1 - DELTA "
        "(default: the plain --tpr quantile of the ID validation scores)",
    )
    run.add_argument(
        "--hyperparameter", action="append", default=[], metavar="METHOD.NAME=VALUE",
        help="a method hyperparameter, repeatable, e.g. odin.temperature=1000 (VALUE parsed as JSON if it can be)",
    )
    run.add_argument(
        "--tune", action="store_true",
        help="choose each method's hyperparameters on validation data only before evaluating: a small grid per "
        "method, half of ID validation vs OOD sets generated from the other half (never a test split); costs one "
        "backbone pass over 1.5x the ID validation rows for all grid points together, plus fit passes and ODIN's "
        "own passes (see docs/evaluation.md)",
    )
    run.add_argument("--overwrite", action="store_true", help="recompute cached scores and fits")
    run.add_argument("--no-plots", action="store_true",
                     help="skip the PNG figures (they need matplotlib: pip install 'hf_gsc[plots]')")
    run.add_argument("--save-detectors", action="store_true",
                     help="save every evaluated method as a detector (fitted, threshold calibrated on ID validation, "
                          "model card with its results) under OUTPUT_DIR/detectors/METHOD, loadable with "
                          "hf_gsc.AutoOODDetector.from_pretrained and publishable with hf-gsc publish --detector-dir")
    device = parser.add_argument_group("device and throughput")
    device.add_argument(
        "--mixed-precision", default=None, metavar="{" + ",".join(PRECISIONS) + "}",
        help="backbone under accelerate's autocast (default: accelerate's config / ACCELERATE_MIXED_PRECISION, else no)",
    )
    device.add_argument(
        "--num-workers", type=int, default=None,
        help="DataLoader worker processes decoding and preprocessing images "
        "(default: min(4, CPU count) on CUDA, 0 on CPU; see docs/evaluation.md)",
    )
    device.add_argument(
        "--image-backend", default="auto", metavar="{" + ",".join(IMAGE_BACKENDS) + "}",
        help="image processor backend (default auto: torchvision when installed, else PIL)",
    )
    # A method's own flags (its class's ``command_line_flags``: GSC's settings), one group per method.
    for method, flags in command_line_flags().items():
        config_class = registered_methods()[method].config_class
        group = parser.add_argument_group(
            f"{method} options (default: {config_class.__name__} defaults, or the saved detector's config)")
        defaults = config_class()
        for dest, name in flags.items():
            default = getattr(defaults, name)
            kind = str if default is None else type(default)
            group.add_argument(f"--{dest.replace('_', '-')}", dest=dest, type=kind, default=None,
                               help=f"{config_class.__name__}.{name} (default {default!r})")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def registered_methods() -> dict[str, Any]:
    from ..detectors import DETECTORS

    return DETECTORS


def default_methods() -> list[str]:
    """The default of ``--methods`` (and of ``make demo``): the methods whose class sets ``in_default_table``."""
    from ..registry import default_methods as registered_defaults

    registered_methods()  # every method's module imported, so that each has registered
    return registered_defaults()


def command_line_flags() -> dict[str, dict[str, str]]:
    """method -> its own flags (flag dest -> setting), from the classes' ``command_line_flags``."""
    from ..registry import command_line_flags as registered_flags

    registered_methods()
    return registered_flags()


def parse_methods(text: str | None) -> list[str]:
    """``"gsc, msp"`` -> ``["gsc", "msp"]``; ``"all"`` -> every registered method; ``"all,-she,-knn"`` -> every
    registered method but those; ``None`` -> :func:`default_methods`.

    Unknown or repeated names raise :class:`InputError` naming the nearest registered one.
    """
    registered = registered_methods()
    if text is None:
        return default_methods()
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise InputError(f"--methods is empty; registered methods: {', '.join(sorted(registered))}")
    excluded = [name[1:].strip() for name in names if name.startswith("-")]
    if excluded and names[0] != "all":
        raise InputError(f"--methods {text!r}: '-NAME' excludes a method from 'all' and must follow it "
                         "(--methods all,-she,-knn)")
    methods = sorted(registered) if names[0] == "all" else names
    if names[0] == "all" and len(names) > 1 + len(excluded):
        raise InputError(f"--methods {text!r}: after 'all' only '-NAME' exclusions may follow")
    _check_names(methods if names[0] != "all" else excluded, registered)
    if names[0] == "all":
        methods = [name for name in methods if name not in excluded]
        if not methods:
            raise InputError(f"--methods {text!r} excludes every registered method")
    repeated = sorted({name for name in methods if methods.count(name) > 1})
    if repeated:
        raise InputError(f"--methods: {', '.join(repeated)} given more than once")
    return methods


def _check_names(names: Sequence[str], registered: Mapping[str, Any]) -> None:
    unknown = [name for name in names if name not in registered]
    if unknown:
        from ..registry import suggest_names

        raise InputError(
            f"--methods: unknown method(s) {', '.join(map(repr, unknown))}{suggest_names(unknown, sorted(registered))}; "
            f"registered methods: {', '.join(sorted(registered))}"
        )


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_hyperparameters(items: Sequence[str], methods: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["odin.temperature=1000"]`` -> ``{"odin": {"temperature": 1000}}``."""
    result: dict[str, dict[str, Any]] = {name: {} for name in methods}
    for item in items:
        key, sep, value = item.partition("=")
        method, dot, name = key.partition(".")
        if not sep or not dot or not method or not name:
            raise InputError(f"--hyperparameter {item!r}: expected METHOD.NAME=VALUE, e.g. odin.temperature=1000")
        if method not in result:
            raise InputError(f"--hyperparameter {item!r}: method {method!r} is not in --methods ({', '.join(methods)})")
        result[method][name] = _parse_value(value)
    return result


def _check_positive(args: argparse.Namespace, name: str, allow_none: bool = False) -> None:
    value = getattr(args, name)
    flag = "--" + name.replace("_", "-")
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"{flag} must be a positive integer, got {value!r}")


def check_output_dir(path: str | os.PathLike, process_index: int = 0) -> Path:
    """Create ``path`` if needed and prove it writable by writing and removing a file."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # A new file of a random name (O_EXCL): a link planted in the folder is never written through.
        with tempfile.NamedTemporaryFile(dir=directory, prefix=f".write_test.{process_index}."):
            pass
    except OSError as error:
        raise InputError(f"--output-dir {str(directory)!r} is not writable: {error}") from None
    return directory


def _split_names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise InputError("--ood-splits is empty")
    return names


def _parse_ood_dataset(item: str, option: str = "--ood-dataset") -> tuple[str, str]:
    from ..data.splits import missing_local_folder

    name, sep, spec = item.partition("=")
    if not sep:
        spec = item
        base = os.path.basename(os.path.normpath(item)) if os.path.exists(item) else item
        name = base.replace("/", "_").replace(":", "_")
    if not spec or not name:
        raise InputError(f"{option} {item!r}: expected [NAME=]SPEC")
    missing = missing_local_folder(spec)
    if missing is not None:
        raise InputError(f"{option} {item!r}: no such folder {missing!r} (a local OOD split is a folder of "
                         "images or a saved dataset; a Hub split is 'dataset_id[:config]:split')")
    return name, spec


def _check_id_dataset(spec: str | None) -> None:
    from ..data.splits import missing_local_folder

    missing = None if spec is None else missing_local_folder(spec, split_required=False)
    if missing is not None:
        raise InputError(f"--id-dataset {spec!r}: no such folder {missing!r} (local ID data is a saved DatasetDict or "
                         "a folder of images with train/validation/test sub-folders; Hub data is 'dataset_id[:config]')")


def _check_plots(args: argparse.Namespace) -> None:
    """The figures need matplotlib (the ``plots`` extra): without it, fail now, not after the scoring."""
    if getattr(args, "no_plots", False):
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise InputError(f"the figures need matplotlib ({error}): pip install 'hf_gsc[plots]', "
                         "or pass --no-plots to write results.json and results.md only") from None


def _is_local(spec: str) -> bool:
    """A path on disk, possibly followed by ``:split`` (the forms ``hf_gsc.data.load_split`` reads locally)."""
    return os.path.exists(spec) or (":" in spec and os.path.exists(spec.rsplit(":", 1)[0]))


def _check_device_options(args: argparse.Namespace) -> None:
    if args.mixed_precision is not None and args.mixed_precision not in PRECISIONS:
        raise InputError(f"--mixed-precision must be one of {', '.join(PRECISIONS)}, got {args.mixed_precision!r}")
    if args.num_workers is not None and (isinstance(args.num_workers, bool) or args.num_workers < 0):
        raise InputError(f"--num-workers must be a nonnegative integer (0 = load in the main process), got {args.num_workers!r}")
    if args.image_backend not in IMAGE_BACKENDS:
        raise InputError(f"--image-backend must be one of {', '.join(IMAGE_BACKENDS)}, got {args.image_backend!r}")
    if args.image_backend == "torchvision":
        import importlib.util

        if importlib.util.find_spec("torchvision") is None:
            raise InputError("--image-backend torchvision: torchvision is not installed (pip install torchvision, "
                             "or use --image-backend pil)")


def _check_streaming(args: argparse.Namespace, extra_ood: Sequence[tuple[str, str]]) -> None:
    if not args.streaming:
        return
    local = [spec for spec in ([args.id_dataset] if args.id_dataset else []) + [spec for _, spec in extra_ood]
             if _is_local(spec)]
    if local:
        raise InputError(f"--streaming needs Hub dataset ids; {local[0]!r} is a local folder "
                         "(local data is memory-mapped from disk anyway: drop --streaming)")
    from ..data import benchmarks

    # Benchmarks read from the Hub can be streamed; the generated ones are built in memory on this machine.
    if args.benchmark is not None and args.benchmark not in getattr(benchmarks, "HUB_BENCHMARKS", ()):
        raise InputError(f"--streaming needs Hub dataset ids; --benchmark {args.benchmark} is built locally "
                         "(use --id-dataset and --ood-dataset with Hub ids, or a benchmark read from the Hub)")


def validate_args(args: argparse.Namespace) -> dict[str, Any]:
    """Cheap checks of every argument, before the model or data are loaded. Returns parsed values."""
    detector = getattr(args, "detector", None)
    if (args.model is None) == (detector is None):
        raise InputError("give exactly one of --model (an image classifier: fit, calibrate and evaluate methods on it) "
                         "and --detector (a saved detector, evaluated as it is)")
    if detector is not None:
        given = [option for option, value in (("--methods", args.methods), ("--hyperparameter", args.hyperparameter),
                                               ("--tune", getattr(args, "tune", False)),
                                               ("--save-detectors", getattr(args, "save_detectors", False)),
                                               ("--val-ood-dataset", getattr(args, "val_ood_dataset", [])),
                                               ("--conformal-delta", getattr(args, "conformal_delta", None)),
                                               # the threshold is the shipped one: nothing is calibrated
                                               ("--tpr", args.tpr is not None))
                 if value]
        given += [f"--{dest.replace('_', '-')}" for flags in command_line_flags().values() for dest in flags
                  if getattr(args, dest, None) is not None]
        if given:
            raise InputError(f"--detector evaluates a saved detector as it is (its method, settings, fitted state and "
                             f"threshold): {', '.join(given)} would change it; use --model for that")
    methods = parse_methods(args.methods)
    _check_positive(args, "batch_size")
    _check_positive(args, "max_samples", allow_none=True)
    _check_positive(args, "max_fit_samples")
    _check_device_options(args)
    if args.tpr is None:
        args.tpr = DEFAULT_TPR
    if isinstance(args.tpr, bool) or not isinstance(args.tpr, (int, float)) or not 0.0 < args.tpr <= 1.0:
        raise InputError(f"--tpr must be in (0, 1], got {args.tpr!r}")
    try:
        max_image_pixels()  # the image size limit, read by every decoding process
    except ValueError as error:
        raise InputError(str(error)) from None
    delta = getattr(args, "conformal_delta", None)
    if delta is not None:
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0.0 < delta < 1.0:
            raise InputError(f"--conformal-delta must be in (0, 1), got {delta!r}")
        if args.tpr >= 1.0:
            raise InputError(f"--conformal-delta needs --tpr below 1 (no finite sample guarantees TPR 1), got {args.tpr!r}")
    if (args.benchmark is None) == (args.id_dataset is None):
        raise InputError("give exactly one of --benchmark and --id-dataset")
    _check_id_dataset(args.id_dataset)
    ood_splits = _split_names(args.ood_splits)
    if args.benchmark is not None:
        from ..data.benchmarks import BENCHMARKS

        if args.benchmark not in BENCHMARKS:
            raise InputError(f"--benchmark {args.benchmark!r} is not registered; known: {', '.join(sorted(BENCHMARKS))}")
        known = list(BENCHMARKS[args.benchmark].ood_builders)
        missing = [name for name in ood_splits or [] if name not in known]
        if missing:
            raise InputError(
                f"--ood-splits: {', '.join(map(repr, missing))} not in the ood_splits of {args.benchmark} "
                f"({', '.join(known)})"
            )
    else:
        if ood_splits is not None:
            raise InputError("--ood-splits selects among the ood_splits of --benchmark; with --id-dataset use --ood-dataset")
        if not args.ood_dataset:
            raise InputError("--id-dataset needs at least one --ood-dataset")
    extra_ood = [_parse_ood_dataset(item) for item in args.ood_dataset]
    if getattr(args, "tune", False) and args.streaming:
        raise InputError("--tune splits the ID validation split in two at random, which a stream cannot do: "
                         "drop --streaming (or --tune)")
    _check_streaming(args, extra_ood)
    names = [name for name, _ in extra_ood] + (ood_splits or [])
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InputError(f"--ood-dataset: split name(s) {', '.join(repeated)} used twice; name them with NAME=SPEC")
    hyperparameters = parse_hyperparameters(args.hyperparameter, methods)
    _check_plots(args)
    for method, flags in command_line_flags().items():  # a method's own flags (GSC's) are its hyperparameters
        given = {name: getattr(args, dest) for dest, name in flags.items() if getattr(args, dest, None) is not None}
        if not given:
            continue
        if method not in methods:
            raise InputError(f"{method} options ({', '.join(sorted(given))}) given but {method!r} is not in --methods")
        try:
            registered_methods()[method].config_class(**given)
        except ValueError as error:
            raise InputError(f"{method} options: {error}") from None
        # --hyperparameter METHOD.NAME=VALUE, the more specific, wins over a flag of the same setting.
        hyperparameters[method] = {**given, **hyperparameters[method]}
    val_ood = [_parse_ood_dataset(item, "--val-ood-dataset") for item in getattr(args, "val_ood_dataset", [])]
    if val_ood and getattr(args, "no_selection", False):
        raise InputError("--val-ood-dataset is for the selection, which --no-selection turns off: drop one of them")
    repeated = sorted({name for name, _ in val_ood if [n for n, _ in val_ood].count(name) > 1})
    if repeated:
        raise InputError(f"--val-ood-dataset: split name(s) {', '.join(repeated)} used twice; name them with NAME=SPEC")
    from .labels import parse_label_map

    try:
        label_map = parse_label_map(getattr(args, "label_map", None))
    except ValueError as error:
        raise InputError(str(error)) from None
    return {
        "methods": methods,
        "label_map": label_map,
        "ood_splits": ood_splits,
        "extra_ood": extra_ood,
        "val_ood": val_ood,
        "hyperparameters": hyperparameters,
    }


__all__ = [
    "DEFAULT_TPR",
    "IMAGE_BACKENDS",
    "PRECISIONS",
    "InputError",
    "build_parser",
    "check_output_dir",
    "describe_method",
    "method_lines",
    "parse_args",
    "parse_hyperparameters",
    "parse_methods",
    "registered_methods",
    "validate_args",
]
