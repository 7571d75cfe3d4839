"""The checks of an evaluation's arguments that need neither model nor data (run by ``EvaluationArguments``' own
``__post_init__``), and the output folder's.

Each raises :class:`~hf_gsc.evaluation.errors.InputError` naming the flag and what was expected.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..utils.image_limits import max_image_pixels
from .errors import InputError
from .options import DEFAULT_TPR, IMAGE_BACKENDS, PRECISIONS, parse_hyperparameters, parse_methods, registered_methods


#: The error when the evaluated model is not given exactly once.
SOURCE_CHOICE = ("give exactly one of --model (an image classifier: fit, calibrate and evaluate methods on it) and "
                 "--detector (a saved detector, evaluated as it is)")
#: The near/far OOD groups a user's own OOD dataset can be given in (``--near-ood-dataset``, ``--far-ood-dataset``).
OOD_GROUP_FLAGS = {"near": "--near-ood-dataset", "far": "--far-ood-dataset"}


def _check_positive(args: Any, name: str, allow_none: bool = False) -> None:
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


def missing_local_path(spec: str | None) -> str | None:
    """The local path ``spec`` (a ``--model`` / ``--detector`` / ``--id-dataset`` value, ``:config`` allowed after a
    Hub id) names when it reads as one and does not exist, else None: it starts with ``.``, ``/`` or ``~``, holds more
    than one ``/`` or a backslash, or its first component exists here (``data/photo`` with a folder ``data``). A Hub
    id ``user/name`` reads as one only when no ``user`` exists here, so it goes to the Hub as before."""
    from ..storage.repo_ids import looks_local

    if not spec or os.path.exists(spec):
        return None
    head = spec if looks_local(spec) and ":" not in spec else spec.split(":", 1)[0]
    if os.path.exists(head):
        return None
    first = head.replace("\\", "/").split("/", 1)[0]
    if looks_local(head) or ("/" in head and first and os.path.exists(first)):
        return head
    return None


def _check_local_source(flag: str, spec: str | None) -> None:
    """A local-looking ``--model`` / ``--detector`` that does not exist: one line now, not Hub retries later."""
    missing = missing_local_path(spec)
    if missing is not None:
        raise InputError(f"{flag} {spec!r}: no such folder {missing!r} (working directory {os.getcwd()}); a local "
                         f"model is a folder saved with save_pretrained, a Hub model a repo id 'user/name'")


def _check_id_dataset(spec: str | None) -> None:
    from ..data.splits import missing_local_folder

    missing = None if spec is None else missing_local_folder(spec, split_required=False) or missing_local_path(spec)
    if missing is not None:
        raise InputError(f"--id-dataset {spec!r}: no such folder {missing!r} (local ID data is a saved DatasetDict or "
                         "a folder of images with train/validation/test sub-folders; Hub data is 'dataset_id[:config]')")


def _check_plots(args: Any) -> None:
    """The figures need matplotlib (the ``plots`` extra): without it, fail now, not after the scoring."""
    if args.no_plots:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise InputError(f"the figures need matplotlib ({error}): pip install 'hf_gsc[plots]', "
                         "or pass --no-plots to write results.json and results.md only") from None


def _is_local(spec: str) -> bool:
    """A path on disk, possibly followed by ``:split`` (the forms ``hf_gsc.data.load_split`` reads locally)."""
    return os.path.exists(spec) or (":" in spec and os.path.exists(spec.rsplit(":", 1)[0]))


def _reads(spec: str) -> tuple[bool, str, frozenset[str] | None]:
    """``(local, where, splits)``: what a split spec reads. Local: the resolved folder (an image-folder root's split
    folder when a ``:split`` names one) and the split of a saved ``DatasetDict`` (``None``: all it holds); Hub: the
    ``id[:config]`` and its ``+``-joined splits."""
    from ..data.splits import _local_path_and_split, parse_spec
    from ..utils.image_data import SPLIT_FOLDERS

    local = _local_path_and_split(spec)
    if local is not None:
        path, split = local[0].resolve(), local[1]
        if split is not None and not (path / "dataset_dict.json").is_file():
            folder = next((path / name for name in (split, *SPLIT_FOLDERS.get(split, ())) if (path / name).is_dir()),
                          None)
            if folder is not None:
                return True, str(folder), None
        return True, str(path), None if split is None else frozenset(split.split("+"))
    try:
        dataset_id, config, split = parse_spec(spec)
    except ValueError:  # not a spec load_split reads: refused, naming it, when it is loaded
        return False, spec, None
    return False, f"{dataset_id}:{config}", None if split is None else frozenset(split.split("+"))


def _overlap(a: str, b: str) -> bool:
    """Whether the data of spec ``a`` and spec ``b`` can share images: the same Hub dataset or folder with a split in
    common (or either read whole), or a folder read whole that holds the other's."""
    (local_a, where_a, splits_a), (local_b, where_b, splits_b) = _reads(a), _reads(b)
    if local_a != local_b:
        return False
    if local_a and where_a != where_b:
        path_a, path_b = Path(where_a), Path(where_b)
        return (path_a in path_b.parents and splits_a is None) or (path_b in path_a.parents and splits_b is None)
    return where_a == where_b and (splits_a is None or splits_b is None or bool(splits_a & splits_b))


def check_validation_is_not_test(val_ood: Sequence[tuple[str, str]], test_specs: Sequence[tuple[str, str]]) -> None:
    """Refuse an OOD validation set (``--val-ood-dataset NAME=SPEC``) that is, holds or lies inside a test split:
    ``test_specs`` are ``(the flag that gave it, SPEC)``, every ``--ood-dataset`` (near, far) and the ID test split."""
    for name, spec in val_ood:
        for flag, test_spec in test_specs:
            if _overlap(spec, test_spec):
                raise InputError(f"--val-ood-dataset {name}={spec}: it reads the test data of {flag} {test_spec}; "
                                 "the selection is made on validation data only: give OOD validation data that is not "
                                 "an --ood-dataset nor the ID test split (or leave --val-ood-dataset out: OOD "
                                 "validation sets are then generated from ID validation)")


def _check_device_options(args: Any) -> None:
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


def _check_streaming(args: Any, extra_ood: Sequence[tuple[str, str, str | None]]) -> None:
    if not args.streaming:
        return
    local = [spec for spec in ([args.id_dataset] if args.id_dataset else []) + [item[1] for item in extra_ood]
             if _is_local(spec)]
    if local:
        raise InputError(f"--streaming needs Hub dataset ids; {local[0]!r} is a local folder "
                         "(local data is memory-mapped from disk anyway: drop --streaming)")
    from ..data import benchmarks

    # Benchmarks read from the Hub can be streamed; the generated ones are built in memory on this machine.
    if args.benchmark is not None and args.benchmark not in getattr(benchmarks, "HUB_BENCHMARKS", ()):
        raise InputError(f"--streaming needs Hub dataset ids; --benchmark {args.benchmark} is built locally "
                         "(use --id-dataset and --ood-dataset with Hub ids, or a benchmark read from the Hub)")


def validate(args: Any) -> dict[str, Any]:
    """Cheap checks of every argument of ``args`` (an :data:`~hf_gsc.evaluation.arguments.EvaluationArguments`, read,
    never changed), before the model or data are loaded. Returns the parsed values."""
    detector = args.detector
    if args.model is not None and detector is not None:
        raise InputError(SOURCE_CHOICE)
    _check_local_source("--model", args.model if isinstance(args.model, str) else None)
    _check_local_source("--detector", detector if isinstance(detector, str) else None)
    if detector is not None:
        given = [option for option, value in (("--methods", args.methods), ("--hyperparameter", args.hyperparameter),
                                               ("--tune", args.tune),
                                               ("--save-detectors", args.save_detectors),
                                               ("--val-ood-dataset", args.val_ood_dataset),
                                               ("--conformal-delta", args.conformal_delta),
                                               # the threshold is the shipped one: nothing is calibrated
                                               ("--tpr", args.tpr is not None))
                 if value]
        given += [f"--{dest.replace('_', '-')}" for flags in args.method_flag_settings.values() for dest in flags
                  if getattr(args, dest, None) is not None]
        if given:
            raise InputError(f"--detector evaluates a saved detector as it is (its method, settings, fitted state and "
                             f"threshold): {', '.join(given)} would change it; use --model for that")
    methods = parse_methods(args.methods)
    _check_positive(args, "batch_size")
    _check_positive(args, "max_samples", allow_none=True)
    _check_positive(args, "max_fit_samples")
    _check_device_options(args)
    tpr = DEFAULT_TPR if args.tpr is None else args.tpr
    if isinstance(tpr, bool) or not isinstance(tpr, (int, float)) or not 0.0 < tpr <= 1.0:
        raise InputError(f"--tpr must be in (0, 1], got {tpr!r}")
    try:
        max_image_pixels()  # the image size limit, read by every decoding process
    except ValueError as error:
        raise InputError(str(error)) from None
    delta = args.conformal_delta
    if delta is not None:
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0.0 < delta < 1.0:
            raise InputError(f"--conformal-delta must be in (0, 1), got {delta!r}")
        if tpr >= 1.0:
            raise InputError(f"--conformal-delta needs --tpr below 1 (no finite sample guarantees TPR 1), got {tpr!r}")
    if (args.benchmark is None) == (args.id_dataset is None):
        raise InputError("give exactly one of --benchmark and --id-dataset")
    _check_id_dataset(args.id_dataset)
    for flag, value in (("--image-column", args.image_column), ("--label-column", args.label_column)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise InputError(f"{flag} must name a column of --id-dataset, got {value!r}")
        if value is not None and args.benchmark is not None:
            raise InputError(f"{flag} names a column of --id-dataset; --benchmark {args.benchmark} knows its own columns")
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
        if not (args.ood_dataset or args.near_ood_dataset or args.far_ood_dataset):
            raise InputError("--id-dataset needs at least one --ood-dataset (or --near-ood-dataset, --far-ood-dataset)")
    extra_ood = [(*_parse_ood_dataset(item, flag), group)
                 for group, flag, items in ((None, "--ood-dataset", args.ood_dataset),
                                            ("near", OOD_GROUP_FLAGS["near"], args.near_ood_dataset),
                                            ("far", OOD_GROUP_FLAGS["far"], args.far_ood_dataset))
                 for item in items]
    if args.tune and args.streaming:
        raise InputError("--tune splits the ID validation split in two at random, which a stream cannot do: "
                         "drop --streaming (or --tune)")
    _check_streaming(args, extra_ood)
    names = [name for name, _, _ in extra_ood] + (ood_splits or [])
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InputError(f"--ood-dataset: split name(s) {', '.join(repeated)} used twice; name them with NAME=SPEC")
    hyperparameters = parse_hyperparameters(args.hyperparameter, methods)
    _check_plots(args)
    for method, flags in args.method_flag_settings.items():  # a method's own flags (GSC's) are its hyperparameters
        flagged = {name: getattr(args, dest) for dest, name in flags.items() if getattr(args, dest, None) is not None}
        if not flagged:
            continue
        if method not in methods:
            raise InputError(f"{method} options ({', '.join(sorted(flagged))}) given but {method!r} is not in --methods")
        try:
            registered_methods()[method].config_class(**flagged)
        except ValueError as error:
            raise InputError(f"{method} options: {error}") from None
        # --hyperparameter METHOD.NAME=VALUE, the more specific, wins over a flag of the same setting.
        hyperparameters[method] = {**flagged, **hyperparameters[method]}
    val_ood = [_parse_ood_dataset(item, "--val-ood-dataset") for item in args.val_ood_dataset]
    if val_ood and args.no_selection:
        raise InputError("--val-ood-dataset is for the selection, which --no-selection turns off: drop one of them")
    repeated = sorted({name for name, _ in val_ood if [n for n, _ in val_ood].count(name) > 1})
    if repeated:
        raise InputError(f"--val-ood-dataset: split name(s) {', '.join(repeated)} used twice; name them with NAME=SPEC")
    check_validation_is_not_test(val_ood, [("--ood-dataset" if group is None else OOD_GROUP_FLAGS[group], spec)
                                           for _, spec, group in extra_ood] + (
        [("--id-dataset (its test split)", f"{args.id_dataset}:test")] if args.id_dataset is not None else []))
    from .labels import parse_label_map

    try:
        label_map = parse_label_map(args.label_map)
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


__all__ = ["OOD_GROUP_FLAGS", "SOURCE_CHOICE", "check_output_dir", "validate"]
