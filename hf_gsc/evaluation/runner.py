"""``run_evaluation(args)``: the OOD evaluation behind ``scripts/evaluate_ood.py`` and ``make demo``.

Steps, the same under ``python`` and ``accelerate launch`` (any number of processes):

1. Check the arguments (methods registered, numbers in range, benchmark / split names known,
   output dir writable), load the model and construct every detector (this resolves the GSC
   ``split_point``), load the data and check the splits exist. All of this happens before any
   fitting or scoring, so bad input fails in seconds with a message naming the argument.
2. Fit the detectors that need it on ID ``detector.fit_split`` data (``train`` or ``validation``,
   never test), capped by ``--max-fit-samples``. The main process fits and saves the fitted state to
   ``detectors/{method}/``; the other processes wait and load it. A rerun reuses a valid saved fit.
3. Score the ID test split, the ID validation split and every OOD split with every method; the
   batches of a split are sharded over the processes and gathered in dataset order. The main process
   writes ``scores/{method}/{split}.safetensors`` as soon as a split is done; valid files from an
   earlier run are loaded instead of recomputed. ID accuracy comes from the base model's logits on the
   ID test split (``scores/_base_model/id_test.safetensors``).
4. On the main process: calibrate each method's ``threshold`` on the ID validation scores only,
   report the TPR it reaches on ID test, compute FPR95 / AUROC / AUPR-In / AUPR-Out of ID test vs
   each OOD split, write ``results.json``, ``results.md`` and the plots.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .. import __version__
from .loop import SCORE_KEY, ScoreCache, fingerprint, make_dataloader, score_split
from .report import RESULTS_MD, method_results, write_report


#: The default of ``--methods`` (and of ``make demo``): GSC and the main baselines that need no long
#: fit, those of them that are registered.
DEFAULT_METHODS = ("gsc", "msp", "energy", "max_logit", "odin", "react", "ash_b")
#: Name of the ID test split and the ID validation split in the score cache.
ID_TEST, ID_VALIDATION = "id_test", "id_validation"
#: Prefix of the OOD splits in the score cache: ``ood_{name}``.
OOD_PREFIX = "ood_"
#: Key of the base model's predicted classes in its score file.
PREDICTIONS_KEY = "predictions"
#: Pseudo-method holding the base model's predictions on ID test (for ``id_accuracy``).
BASE_MODEL = "_base_model"
DETECTORS_DIR = "detectors"
#: ``GSCConfig`` fields settable from the command line: flag dest -> field name.
GSC_OPTIONS = {
    "split_point": "split_point",
    "mask_ratio": "mask_ratio",
    "selection": "selection",
    "operation": "operation",
    "approximation": "approximation",
    "alpha": "alpha",
    "clip_bound": "clip_bound",
    "beta": "beta",
    "gsc_score": "score",
    "gsc_temperature": "temperature",
}
#: ``GSCConfig`` fields a saved detector carries that are not method hyperparameters.
_GSC_NON_HYPERPARAMETERS = ("threshold", "calibration", "hf_gsc_version", "base_model_name_or_path", "base_model_revision")


class InputError(ValueError):
    """Bad command-line input, found before any expensive work; the message names the argument."""


# ---------------------------------------------------------------------------------------------- CLI
def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``scripts/evaluate_ood.py`` (also used by ``scripts/demo.py`` and tests)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="OOD evaluation of GSC and baselines on a Hugging Face image classifier. "
        "Runs with `python` or `accelerate launch` (sharded over processes).",
    )
    parser.add_argument("--model", required=True, help="image classifier or saved GSC detector: local path or Hub id")
    parser.add_argument("--revision", default=None, help="Hub revision of --model")
    data = parser.add_argument_group("data")
    data.add_argument("--benchmark", default=None, help="registered benchmark, e.g. fmnist-ood or fmnist-openset")
    data.add_argument(
        "--ood-splits", default=None,
        help="comma list: only these ood_splits of --benchmark (default: all)",
    )
    data.add_argument(
        "--id-dataset", default=None,
        help="instead of --benchmark: ID data with train/validation/test splits "
        "(local save_to_disk DatasetDict or Hub 'dataset_id[:config]')",
    )
    data.add_argument(
        "--ood-dataset", action="append", default=[], metavar="[NAME=]SPEC",
        help="an OOD split, repeatable: 'dataset_id[:config]:split' or a local path; NAME defaults from SPEC",
    )
    data.add_argument("--max-samples", type=int, default=None, help="at most this many samples per split (random, --seed)")
    data.add_argument("--max-fit-samples", type=int, default=10000, help="at most this many samples to fit a detector")
    run = parser.add_argument_group("run")
    run.add_argument(
        "--methods", default=None,
        help=f"comma list of registered methods (default: those registered of {','.join(DEFAULT_METHODS)})",
    )
    run.add_argument("--output-dir", required=True, help="results, score cache, fitted detectors, plots")
    run.add_argument("--batch-size", type=int, default=64)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--tpr", type=float, default=0.95, help="ID TPR the threshold is calibrated to (on ID validation)")
    run.add_argument(
        "--hyperparameter", action="append", default=[], metavar="METHOD.NAME=VALUE",
        help="a method hyperparameter, repeatable, e.g. odin.temperature=1000 (VALUE parsed as JSON if it can be)",
    )
    run.add_argument("--overwrite", action="store_true", help="recompute cached scores and fits")
    run.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    gsc = parser.add_argument_group("GSC options (default: GSCConfig defaults, or the saved detector's config)")
    gsc.add_argument("--split-point", dest="split_point", default=None)
    gsc.add_argument("--mask-ratio", dest="mask_ratio", type=float, default=None)
    gsc.add_argument("--selection", default=None, help="gradient | random | reverse")
    gsc.add_argument("--operation", default=None, help="zero | perturb | project | clip | scale")
    gsc.add_argument("--approximation", default=None, help="first_order | predicted_logit | exact")
    gsc.add_argument("--alpha", type=float, default=None)
    gsc.add_argument("--clip-bound", dest="clip_bound", type=float, default=None)
    gsc.add_argument("--beta", type=float, default=None)
    gsc.add_argument("--gsc-score", dest="gsc_score", default=None, help="energy | msp | max_logit")
    gsc.add_argument("--gsc-temperature", dest="gsc_temperature", type=float, default=None)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


# ------------------------------------------------------------------------------------ validation
def _registered_methods() -> dict[str, Any]:
    from ..detectors import DETECTORS

    return DETECTORS


def parse_methods(text: str | None) -> list[str]:
    """``"gsc, msp"`` -> ``["gsc", "msp"]``; ``None`` -> the registered :data:`DEFAULT_METHODS`.

    Unknown or repeated names raise :class:`InputError`.
    """
    registered = _registered_methods()
    if text is None:
        return [name for name in DEFAULT_METHODS if name in registered]
    methods = [name.strip() for name in text.split(",") if name.strip()]
    if not methods:
        raise InputError(f"--methods is empty; registered methods: {', '.join(sorted(registered))}")
    unknown = [name for name in methods if name not in registered]
    if unknown:
        raise InputError(
            f"--methods: unknown method(s) {', '.join(map(repr, unknown))}; "
            f"registered methods: {', '.join(sorted(registered))}"
        )
    repeated = sorted({name for name in methods if methods.count(name) > 1})
    if repeated:
        raise InputError(f"--methods: {', '.join(repeated)} given more than once")
    return methods


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
        probe = directory / f".write_test.{os.getpid()}.{process_index}"
        probe.write_text("ok")
        probe.unlink()
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


def _parse_ood_dataset(item: str) -> tuple[str, str]:
    name, sep, spec = item.partition("=")
    if not sep:
        spec = item
        base = os.path.basename(os.path.normpath(item)) if os.path.exists(item) else item
        name = base.replace("/", "_").replace(":", "_")
    if not spec or not name:
        raise InputError(f"--ood-dataset {item!r}: expected [NAME=]SPEC")
    return name, spec


def validate_args(args: argparse.Namespace) -> dict[str, Any]:
    """Cheap checks of every argument, before the model or data are loaded. Returns parsed values."""
    methods = parse_methods(args.methods)
    _check_positive(args, "batch_size")
    _check_positive(args, "max_samples", allow_none=True)
    _check_positive(args, "max_fit_samples")
    if not isinstance(args.tpr, (int, float)) or not 0.0 < args.tpr <= 1.0:
        raise InputError(f"--tpr must be in (0, 1], got {args.tpr!r}")
    if (args.benchmark is None) == (args.id_dataset is None):
        raise InputError("give exactly one of --benchmark and --id-dataset")
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
    names = [name for name, _ in extra_ood] + (ood_splits or [])
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InputError(f"--ood-dataset: split name(s) {', '.join(repeated)} used twice; name them with NAME=SPEC")
    hyperparameters = parse_hyperparameters(args.hyperparameter, methods)
    gsc_overrides = {field: getattr(args, dest) for dest, field in GSC_OPTIONS.items() if getattr(args, dest, None) is not None}
    if gsc_overrides and "gsc" not in methods:
        raise InputError(f"GSC options ({', '.join(sorted(gsc_overrides))}) given but 'gsc' is not in --methods")
    if gsc_overrides:
        from ..config import GSCConfig

        try:
            GSCConfig(**gsc_overrides)
        except ValueError as error:
            raise InputError(f"GSC options: {error}") from None
    return {
        "methods": methods,
        "ood_splits": ood_splits,
        "extra_ood": extra_ood,
        "hyperparameters": hyperparameters,
        "gsc_overrides": gsc_overrides,
    }


# ---------------------------------------------------------------------------------- model & data
def load_model(model_id: str, revision: str | None = None) -> tuple[torch.nn.Module, Any, dict[str, Any], str]:
    """Load a classifier or a saved GSC detector.

    Returns ``(base model, image processor, saved GSC hyperparameters (empty for a plain
    classifier), path the image processor came from)``.
    """
    from transformers import AutoModelForImageClassification

    from ..data import load_image_processor
    from ..modeling import CONFIG_NAME, GSCForImageClassification

    saved: dict[str, Any] = {}
    processor_source = model_id
    try:
        if os.path.isfile(os.path.join(model_id, CONFIG_NAME)):
            wrapper = GSCForImageClassification.from_pretrained(model_id, revision=revision)
            model = wrapper.model
            saved = {k: v for k, v in wrapper.config.to_dict().items() if k not in _GSC_NON_HYPERPARAMETERS}
            if not os.path.isfile(os.path.join(model_id, "preprocessor_config.json")):
                processor_source = wrapper.config.base_model_name_or_path or model_id
        else:
            model = AutoModelForImageClassification.from_pretrained(model_id, revision=revision)
        processor = load_image_processor(processor_source, revision=revision)
    except (OSError, ValueError, KeyError) as error:
        raise InputError(f"--model {model_id!r}: could not load an image classifier and its image processor: {error}") from None
    model.eval().requires_grad_(False)
    return model, processor, saved, processor_source


def image_transform(processor: Any, model: torch.nn.Module, dataset_name: str) -> Callable[[list], torch.Tensor]:
    """A list of PIL images -> ``pixel_values`` as the model expects (``hf_gsc.data.make_transform``)."""
    from ..data import make_transform, num_channels

    batch_transform = make_transform(processor, num_channels(model.config), dataset_name)

    def transform(images: list) -> torch.Tensor:
        return batch_transform({"image": images})["pixel_values"]

    return transform


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of the model's class, config and weights, so cached scores follow the weights, not a path."""
    digest = hashlib.sha256(type(model).__name__.encode())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        digest.update(config.to_json_string(use_diff=False).encode())
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]


def dataset_fingerprint(dataset: Any) -> str:
    """Hash of the rows' content (every column's Arrow buffers), so cached scores follow the data, not its name.

    A generated split (``textures``, ``notmnist``) or a Hub dataset can change under the same name and size;
    a cache keyed on the name alone would silently serve scores of the old images.
    """
    import pyarrow as pa

    digest = hashlib.blake2b(digest_size=16)
    if not hasattr(dataset, "with_format"):  # not a datasets.Dataset: fall back to its repr
        digest.update(repr(dataset).encode())
        return digest.hexdigest()
    for table in dataset.with_format("arrow").iter(batch_size=4096):
        # The IPC stream holds exactly these rows; the batch's own buffers can be slices of the whole table.
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.combine_chunks())
        digest.update(memoryview(sink.getvalue()))
    return digest.hexdigest()


def _load_split(spec: str, what: str) -> Any:
    """``hf_gsc.data.load_split`` with errors naming the argument."""
    from ..data import load_split

    try:
        return load_split(spec)
    except Exception as error:  # noqa: BLE001  (datasets and PIL raise many types)
        raise InputError(f"{what} {spec!r}: could not load it: {error}") from None


def needed_id_splits(detectors: Mapping[str, Any]) -> dict[str, str]:
    """ID split name -> why it is needed: ``test``, ``validation`` and each detector's ``fit_split``."""
    needed = {"test": "the metrics (ID test)", "validation": "threshold calibration (ID validation)"}
    for name, detector in detectors.items():
        if detector.needs_fit:
            needed.setdefault(detector.fit_split, f"fitting {name}")
    return needed


def load_data(
    args: argparse.Namespace, parsed: Mapping[str, Any], needed: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(id_splits, ood_splits)`` from ``--benchmark`` or ``--id-dataset``, plus ``--ood-dataset``.

    Only the ID splits in ``needed`` are returned; a missing one raises :class:`InputError`.
    """
    if args.benchmark is not None:
        from ..data import load_benchmark

        benchmark = load_benchmark(args.benchmark, ood_splits=parsed["ood_splits"])
        source = f"--benchmark {args.benchmark}"
        available = benchmark.id_splits
        id_splits = {split: available[split] for split in needed if split in available}
        ood_splits = dict(benchmark.ood_splits)
    else:
        source = f"--id-dataset {args.id_dataset}"
        id_splits = {}
        for split, why in needed.items():
            try:
                id_splits[split] = _load_split(f"{args.id_dataset}:{split}", "--id-dataset")
            except InputError as error:
                raise InputError(f"{source}: cannot load the ID {split!r} split, needed for {why}: {error}") from None
        ood_splits = {}
    for split, why in needed.items():
        if split not in id_splits:
            raise InputError(f"{source}: the ID data has no {split!r} split, needed for {why}")
    for name, spec in parsed["extra_ood"]:
        if name in ood_splits:
            raise InputError(f"--ood-dataset {name!r}: the benchmark already has an OOD split of that name")
        ood_splits[name] = _load_split(spec, "--ood-dataset")
    if not ood_splits:
        raise InputError(f"{source}: no OOD splits to evaluate")
    for label, dataset in [*((f"ID {s}", d) for s, d in id_splits.items()), *((f"OOD {n}", d) for n, d in ood_splits.items())]:
        if len(dataset) == 0:
            raise InputError(f"{source}: the {label} split is empty")
        if "image" not in dataset.column_names:
            raise InputError(f"{source}: the {label} split has no 'image' column (columns: {', '.join(dataset.column_names)})")
    return id_splits, ood_splits


def subset(dataset: Any, max_samples: int | None, seed: int, key: str) -> Any:
    """At most ``max_samples`` rows, drawn at random with ``(seed, key)``, kept in dataset order."""
    if max_samples is None or len(dataset) <= max_samples:
        return dataset
    rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
    indices = np.sort(rng.choice(len(dataset), size=max_samples, replace=False))
    return dataset.select(indices.tolist())


# ------------------------------------------------------------------------------------ detectors
def processor_image_std(processor: Any) -> list[float]:
    """The normalisation std of ``processor`` per channel (``[1.0]`` when it does not normalise).

    ODIN's ``epsilon`` is a step in [0, 1] pixel units; on normalised ``pixel_values`` it is ``epsilon / std``,
    so the evaluation passes this unless ``--hyperparameter odin.image_std=...`` is given.
    """
    std = getattr(processor, "image_std", None)
    if std is None or not getattr(processor, "do_normalize", True):
        return [1.0]
    return [float(value) for value in (std if isinstance(std, (list, tuple)) else [std])]


def build_detectors(
    model: torch.nn.Module, methods: Sequence[str], hyperparameters: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """Construct every detector right after the model is loaded (resolves split points early)."""
    from ..detectors import get_detector

    detectors = {}
    for name in methods:
        try:
            detectors[name] = get_detector(name, model, **hyperparameters.get(name, {}))
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise InputError(f"--methods {name}: cannot build this detector on this model: {error}") from None
    return detectors


def _fit_dir(output_dir: Path, method: str) -> Path:
    return output_dir / DETECTORS_DIR / method


def _load_fit(directory: Path, expected: str) -> dict[str, torch.Tensor] | None:
    from safetensors.torch import load_file

    from ..detectors.base import STATE_FILE

    try:
        with open(directory / "fit.json") as handle:
            info = json.load(handle)
        if info.get("fingerprint") != expected:
            return None
        return load_file(str(directory / STATE_FILE))
    except (OSError, ValueError):
        return None


def fit_detectors(
    accelerator: Any,
    detectors: Mapping[str, Any],
    to_fit: Sequence[str],
    fit_data: Mapping[str, Any],
    fit_fingerprints: Mapping[str, str],
    transform_for: Callable[[str], Callable[[list], torch.Tensor]],
    batch_size: int,
    output_dir: Path,
    seed: int,
    overwrite: bool,
) -> None:
    """Main process: load a valid saved fit or fit and save; then every other process loads it."""
    from ..detectors.base import STATE_FILE

    if accelerator.is_main_process:
        from tqdm.auto import tqdm

        for name in to_fit:
            directory = _fit_dir(output_dir, name)
            state = None if overwrite else _load_fit(directory, fit_fingerprints[name])
            if state is not None:
                detectors[name].load_state_dict(state)
                continue
            torch.manual_seed(seed)
            np.random.seed(seed)
            split = detectors[name].fit_split
            loader = make_dataloader(fit_data[name], transform_for(f"ID {split}"), batch_size)
            batches = (
                (batch["pixel_values"], batch["labels"])
                for batch in tqdm(loader, desc=f"fit {name}", leave=False)
            )
            detectors[name].fit(batches)
            detectors[name].save(directory)
            tmp = directory / f".fit.json.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({"fingerprint": fit_fingerprints[name], "num_samples": len(fit_data[name])}))
            os.replace(tmp, directory / "fit.json")
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        from safetensors.torch import load_file

        for name in to_fit:
            detectors[name].load_state_dict(load_file(str(_fit_dir(output_dir, name) / STATE_FILE)))


# ----------------------------------------------------------------------------------------- main
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


def make_accelerator() -> Any:
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    # Fitting runs on the main process while the others wait at a barrier: allow for a long fit.
    return Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(hours=3))])


@dataclass
class EvaluationPlan:
    """The exact samples of every split and the fingerprint of every cached artefact.

    Attributes:
        splits: ``id_test``, ``id_validation`` and ``ood_{name}`` -> the (subsampled) dataset.
        fit_data: method -> its (subsampled) ID fitting data, for methods that need a fit.
        fit_fingerprints: method -> fingerprint of its fitted state.
        score_fingerprints: ``(method, split)`` -> fingerprint of its score file.
    """

    splits: dict[str, Any]
    fit_data: dict[str, Any]
    fit_fingerprints: dict[str, str]
    score_fingerprints: dict[tuple[str, str], str]

    @property
    def ood_names(self) -> list[str]:
        return [split[len(OOD_PREFIX):] for split in self.splits if split.startswith(OOD_PREFIX)]


def make_plan(
    args: argparse.Namespace,
    parsed: Mapping[str, Any],
    model: torch.nn.Module,
    detectors: Mapping[str, Any],
    hyperparameters: Mapping[str, Mapping[str, Any]],
    id_splits: Mapping[str, Any],
    ood_splits: Mapping[str, Any],
) -> EvaluationPlan:
    """Subsample the splits and fingerprint what each score depends on: the weights, the method and
    its settings (and fit), the exact samples."""
    model_fp = model_fingerprint(model)
    source = args.benchmark or args.id_dataset
    splits = {
        ID_TEST: subset(id_splits["test"], args.max_samples, args.seed, "test"),
        ID_VALIDATION: subset(id_splits["validation"], args.max_samples, args.seed, "validation"),
        **{
            OOD_PREFIX + name: subset(dataset, args.max_samples, args.seed, OOD_PREFIX + name)
            for name, dataset in ood_splits.items()
        },
    }
    ood_sources = dict(parsed["extra_ood"])
    descriptions = {
        split: {
            "source": source if not split.startswith(OOD_PREFIX)
            else ood_sources.get(split[len(OOD_PREFIX):], f"{source}/{split[len(OOD_PREFIX):]}"),
            "rows": len(dataset),
            "max_samples": args.max_samples,
            "seed": args.seed,
            "content": dataset_fingerprint(dataset),
        }
        for split, dataset in splits.items()
    }
    fit_data = {
        name: subset(id_splits[detector.fit_split], args.max_fit_samples, args.seed, f"fit_{detector.fit_split}")
        for name, detector in detectors.items()
        if detector.needs_fit
    }
    fit_fps = {
        name: fingerprint({"model": model_fp, "method": name, "hyperparameters": hyperparameters.get(name, {}),
                           "fit_split": detectors[name].fit_split, "source": source,
                           "num_samples": len(dataset), "seed": args.seed, "content": dataset_fingerprint(dataset)})
        for name, dataset in fit_data.items()
    }
    score_fps = {
        (name, split): fingerprint({"model": model_fp, "method": name, "hyperparameters": hyperparameters.get(name, {}),
                                    "fit": fit_fps.get(name), "split": split, "data": descriptions[split]})
        for name in [*detectors, BASE_MODEL]
        for split in splits
    }
    return EvaluationPlan(splits, fit_data, fit_fps, score_fps)


def missing_scores(
    accelerator: Any, plan: EvaluationPlan, methods: Sequence[str], cache: ScoreCache, overwrite: bool
) -> dict[str, list[str]]:
    """Split -> methods whose score file is missing or stale. Decided on the main process and
    broadcast, so every process runs the same collective operations."""
    missing = None
    if accelerator.is_main_process:
        missing = {
            split: [
                name for name in ([*methods, BASE_MODEL] if split == ID_TEST else methods)
                if overwrite or not cache.is_cached(name, split, plan.score_fingerprints[(name, split)])
            ]
            for split in plan.splits
        }
    return _broadcast(accelerator, missing)


def score_missing(
    accelerator: Any,
    plan: EvaluationPlan,
    missing: Mapping[str, Sequence[str]],
    detectors: Mapping[str, Any],
    model: torch.nn.Module,
    transform_for: Callable[[str], Callable[[list], torch.Tensor]],
    cache: ScoreCache,
    batch_size: int,
) -> dict[str, dict[str, float]]:
    """Score each split with its missing methods (one pass over the split); the main process saves
    each split's files as soon as it is done. Returns method -> split -> scoring seconds (this process)."""

    def predictions(pixel_values: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(pixel_values=pixel_values).logits.argmax(dim=-1)

    seconds: dict[str, dict[str, float]] = {name: {} for name in detectors}
    for split, dataset in plan.splits.items():
        names = missing[split]
        if not names:
            continue
        scorers = {name: predictions if name == BASE_MODEL else detectors[name].score for name in names}
        outputs = score_split(
            accelerator, make_dataloader(dataset, transform_for(split), batch_size), _timed(scorers, seconds, split),
            description=f"{split} ({len(dataset)})",
        )
        if accelerator.is_main_process:
            for name in names:
                key = PREDICTIONS_KEY if name == BASE_MODEL else SCORE_KEY
                cache.save(name, split, {key: outputs[name], "labels": outputs["labels"]},
                           plan.score_fingerprints[(name, split)])
        accelerator.wait_for_everyone()
    return seconds


def collect_results(
    args: argparse.Namespace,
    plan: EvaluationPlan,
    cache: ScoreCache,
    detectors: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Calibrate on ID validation, evaluate on ID test vs OOD; returns ``(results without run
    metadata, ID test scores, OOD scores)`` from the score files."""

    def load(name: str, split: str) -> dict[str, torch.Tensor]:
        data = cache.load(name, split, plan.score_fingerprints[(name, split)])
        if data is None:
            raise RuntimeError(f"score file {cache.path(name, split)} vanished or changed during the run")
        return data

    base = load(BASE_MODEL, ID_TEST)
    id_scores, ood_scores, entries = {}, {}, {}
    for name, detector in detectors.items():
        id_scores[name] = load(name, ID_TEST)[SCORE_KEY]
        ood_scores[name] = {ood: load(name, OOD_PREFIX + ood)[SCORE_KEY] for ood in plan.ood_names}
        validation = load(name, ID_VALIDATION)[SCORE_KEY]
        entry = method_results(id_scores[name], validation, ood_scores[name], args.tpr, "validation")
        entry["hyperparameters"] = _effective_hyperparameters(detector)
        if name in plan.fit_data:
            entry["fit"] = {"split": detector.fit_split, "num_samples": len(plan.fit_data[name])}
        entries[name] = entry
    results = {
        "model": args.model,
        "benchmark": args.benchmark or "custom",
        "id_accuracy": float((base[PREDICTIONS_KEY] == base["labels"]).double().mean()),
        "methods": entries,
        "split_sizes": {
            "id_test": len(plan.splits[ID_TEST]),
            "id_validation": len(plan.splits[ID_VALIDATION]),
            "ood": {ood: len(plan.splits[OOD_PREFIX + ood]) for ood in plan.ood_names},
            "fit": {name: len(dataset) for name, dataset in plan.fit_data.items()},
        },
        "calibration_split": "validation",
    }
    return results, id_scores, ood_scores


def run_evaluation(args: argparse.Namespace | Sequence[str] | None = None) -> dict[str, Any] | None:
    """Run the whole evaluation; returns the ``results.json`` content on the main process, else ``None``.

    ``args`` is a namespace from :func:`build_parser` or an argv list. Raises :class:`InputError`
    (a ``ValueError``) on bad input, before fitting or scoring.
    """
    if args is None or not isinstance(args, argparse.Namespace):
        args = parse_args(args)
    start = time.perf_counter()
    parsed = validate_args(args)
    methods: list[str] = parsed["methods"]
    output_dir = check_output_dir(args.output_dir)

    accelerator = make_accelerator()
    check_output_dir(output_dir, accelerator.process_index)
    if not accelerator.is_local_main_process:
        _quiet_libraries()
    from accelerate.utils import set_seed

    set_seed(args.seed)

    # Model and detectors first: an unknown split point fails here, before data is loaded.
    model, processor, saved_gsc, _ = load_model(args.model, args.revision)
    model.to(accelerator.device)
    hyperparameters = {name: dict(values) for name, values in parsed["hyperparameters"].items()}
    if "gsc" in methods:
        hyperparameters["gsc"] = {**saved_gsc, **parsed["gsc_overrides"], **hyperparameters["gsc"]}
    if "odin" in methods and "image_std" not in hyperparameters["odin"]:
        hyperparameters["odin"]["image_std"] = processor_image_std(processor)
    detectors = build_detectors(model, methods, hyperparameters)
    id_splits, ood_splits = load_data(args, parsed, needed_id_splits(detectors))
    plan = make_plan(args, parsed, model, detectors, hyperparameters, id_splits, ood_splits)

    def transform_for(dataset_name: str) -> Callable[[list], torch.Tensor]:
        return image_transform(processor, model, dataset_name)

    # Fit (main process) only the detectors that still have scores to compute, then score.
    cache = ScoreCache(output_dir)
    missing = missing_scores(accelerator, plan, methods, cache, args.overwrite)
    to_fit = [name for name in plan.fit_data if any(name in names for names in missing.values())]
    fit_detectors(accelerator, detectors, to_fit, plan.fit_data, plan.fit_fingerprints, transform_for,
                  args.batch_size, output_dir, args.seed, args.overwrite)
    seconds = score_missing(accelerator, plan, missing, detectors, model, transform_for, cache, args.batch_size)
    if not accelerator.is_main_process:
        return None

    results, id_scores, ood_scores = collect_results(args, plan, cache, detectors)
    config = {**_jsonable(vars(args)), "methods": ",".join(methods)}
    if "gsc" in results["methods"]:  # the effective GSCConfig settings, read by hf_gsc.hub for model cards
        config["gsc"] = results["methods"]["gsc"]["hyperparameters"]
    results.update(
        num_processes=accelerator.num_processes,
        config=config,
        versions=package_versions(),
        seconds={
            "total": round(time.perf_counter() - start, 2),
            "scoring_main_process": {m: {s: round(t, 3) for s, t in v.items()} for m, v in seconds.items() if v},
        },
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    write_report(output_dir, results)
    if not args.no_plots:
        from .plots import write_plots

        write_plots(output_dir, id_scores, ood_scores, results)
        results["seconds"]["total"] = round(time.perf_counter() - start, 2)
        write_report(output_dir, results)
    return results


def _quiet_libraries() -> None:
    """No progress bars from ``datasets`` / ``transformers`` on processes other than the main one."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def _timed(
    scorers: Mapping[str, Callable[[torch.Tensor], torch.Tensor]], seconds: dict[str, dict[str, float]], split: str
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Wrap each scorer to add its wall time to ``seconds[name][split]``."""

    def wrap(name: str, scorer: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        def timed(pixel_values: torch.Tensor) -> torch.Tensor:
            begin = time.perf_counter()
            value = scorer(pixel_values)
            if name in seconds:
                seconds[name][split] = seconds[name].get(split, 0.0) + time.perf_counter() - begin
            return value

        return timed

    return {name: wrap(name, scorer) for name, scorer in scorers.items()}


def _effective_hyperparameters(detector: Any) -> dict[str, Any]:
    """The detector's settings; for GSC the full ``GSCConfig`` (defaults included), not only overrides."""
    wrapper = getattr(detector, "detector", None)
    config = getattr(wrapper, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        return {k: v for k, v in config.to_dict().items() if k not in _GSC_NON_HYPERPARAMETERS}
    return _jsonable(detector.hyperparameters)


def _jsonable(values: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(values), default=str))


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """CLI entry point: run, print ``results.md`` on the main process; bad input exits with status 2."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        results = run_evaluation(args)
    except InputError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if results is not None:
        print((Path(args.output_dir) / RESULTS_MD).read_text())
        print(f"wrote {Path(args.output_dir) / 'results.json'} ({results['seconds']['total']:.1f}s)")
    return 0


__all__ = [
    "DEFAULT_METHODS",
    "InputError",
    "build_parser",
    "check_output_dir",
    "load_data",
    "needed_id_splits",
    "main",
    "parse_args",
    "run_evaluation",
    "validate_args",
]
