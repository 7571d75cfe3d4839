"""The saved-detector format, written and read only here (the PEFT way: settings next to a base-model reference).

A detector folder (local or a Hub repo) holds, for every method:

* ``detector_config.json``: ``method`` (the type field, like PEFT's ``peft_type``), ``hyperparameters`` (every
  setting, defaults filled in), ``threshold`` and its ``calibration`` record, and the provenance
  (``base_model_name_or_path``, ``base_model_revision``, ``hf_gsc_version``);
* ``detector_state.safetensors``: fitted tensors when there are any (KNN's bank, ViM's residual space, GSC's
  ``fisher_diagonal`` / ``gradient_mass``, ...), checked at load against the base model; never pickle;
* ``README.md``: the model card (:func:`hf_gsc.model_card.render_model_card`);
* ``config.json``: the base model's transformers config (labels, architecture), so that tools reading a
  model folder (``transformers.pipeline``) recognise it;
* optionally the base model's weights (``model.safetensors``) and image processor, and the method's evaluation
  outputs (``results.json``, ``results.md``, plots).

GSC folders saved as ``gsc_config.json`` (flat ``GSCConfig`` fields) still load. :func:`load_detector` serves
``AutoOODDetector.from_pretrained``, every class's ``from_pretrained`` and the evaluation's ``--model``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from . import __version__, safe_files
from .image_processors import load_image_processor
from .repo_ids import is_hub_id
from .config import (CONFIG_NAME, FITTED, LEGACY_GSC_CONFIG_NAME, SETTING, STATE_FILE, DetectorConfig, GSCConfig,
                     drop_unknown, read_json_object)

if TYPE_CHECKING:
    from .detector import OODDetector

#: Keyword arguments of ``from_pretrained`` that locate files; they go to the detector, the base model and
#: the image processor alike (``revision`` of the base comes from ``gsc_config.json`` when it is referenced).
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download")
#: Files of the base model's weights: a folder holding one of them has its base model saved in it.
BASE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
#: What a detector repo is recognised by, fetched before anything else.
_DETECTOR_FILES = [CONFIG_NAME, LEGACY_GSC_CONFIG_NAME, STATE_FILE, "config.json", *BASE_WEIGHTS]
RESULT_FILES = ("results.json", "results.md")


# ----------------------------------------------------------------------------- the config file
#: The top-level keys of ``detector_config.json``.
CONFIG_KEYS = ("method", "hyperparameters", "threshold", "calibration", "base_model_name_or_path",
               "base_model_revision", "hf_gsc_version")


def config_values(detector: "OODDetector", base: tuple[str | None, str | None] | None = None) -> dict[str, Any]:
    """The content of ``detector_config.json`` for ``detector``; ``base`` replaces its base-model reference
    (``(name_or_path, revision)``), e.g. by the repo itself when the base weights are pushed with it."""
    config = detector.config
    name, revision = base if base is not None else (config.base_model_name_or_path, config.base_model_revision)
    return {
        "method": detector.method,
        "hyperparameters": dict(detector.hyperparameters),
        "threshold": config.threshold,
        "calibration": config.calibration,
        "base_model_name_or_path": name,
        "base_model_revision": revision,
        "hf_gsc_version": __version__,
    }


def config_from_values(values: Mapping[str, Any], source: str) -> DetectorConfig:
    """The config a saved ``detector_config.json`` describes. Keys unknown to this version are an error, unless a
    newer hf_gsc wrote them: then they are dropped with a warning naming both versions (as PEFT does)."""
    from .registry import detector_class

    method = values.get("method")
    if not isinstance(method, str):
        raise ValueError(f"{source}: 'method' must name a registered detector method, got {method!r}")
    try:
        cls = detector_class(method)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    values = drop_unknown(values, CONFIG_KEYS, values.get("hf_gsc_version"), source, "keys")
    hyperparameters = values.get("hyperparameters") or {}
    if not isinstance(hyperparameters, Mapping):
        raise ValueError(f"{source}: 'hyperparameters' must be a JSON object, got {type(hyperparameters).__name__}")
    common = {key: values.get(key) for key in CONFIG_KEYS[2:] if key in values}
    config_class = cls.config_class
    try:
        # Hyperparameters a newer hf_gsc wrote are dropped with a warning; other unknown ones are an error.
        hyperparameters = drop_unknown(hyperparameters, config_class.setting_names(), common.get("hf_gsc_version"),
                                       source, f"{method} hyperparameters")
        return config_class(**hyperparameters, **common)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: {error}") from None


def read_config(directory: str | os.PathLike) -> DetectorConfig | None:
    """The config of the detector saved in ``directory`` (``detector_config.json``, or a legacy GSC
    ``gsc_config.json``); ``None`` where there is neither."""
    path = os.path.join(directory, CONFIG_NAME)
    if os.path.isfile(path):
        return config_from_values(read_json_object(path, "detector settings"), str(path))
    legacy = os.path.join(directory, LEGACY_GSC_CONFIG_NAME)
    if os.path.isfile(legacy):
        return GSCConfig.from_json_file(legacy)
    return None


def write_config(values: Mapping[str, Any], directory: str | os.PathLike) -> Path:
    path = Path(directory) / CONFIG_NAME
    safe_files.atomic_write_text(path, json.dumps(values, indent=2, sort_keys=True))
    return path


# ----------------------------------------------------------------------------- fitted state
def save_state(state: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
    safe_files.save_file(state, path)


def read_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a ``detector_state.safetensors``; a truncated or foreign file is a ``ValueError`` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise ValueError(
            f"{path} is not a readable safetensors file (truncated or corrupt: {error}); save the detector again, "
            "or delete the file to fit it again"
        ) from None


def load_state_from_dir(detector: "OODDetector", directory: str | os.PathLike) -> bool:
    """Load ``detector_state.safetensors`` of ``directory`` into ``detector`` (checked); whether there was one."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(path):
        return False
    detector.load_fitted_state(read_state(path), source=path)
    return True


# ----------------------------------------------------------------------------- keyword arguments
#: Keywords of ``AutoModelForImageClassification.from_pretrained`` (and config overrides) that look like a
#: hyperparameter's name but are not mistakes: they go to the base model as they are.
MODEL_LOADING_KWARGS = frozenset({
    "dtype", "torch_dtype", "device_map", "attn_implementation", "trust_remote_code", "low_cpu_mem_usage",
    "quantization_config", "ignore_mismatched_sizes", "num_labels", "id2label", "label2id", "subfolder",
    "use_safetensors", "variant", "config", "state_dict", "max_memory", "offload_folder", "image_size",
    "num_channels", "output_hidden_states", "output_attentions", "problem_type", "key_mapping", "weights_only",
})


def split_kwargs(
    kwargs: Mapping[str, Any], hyperparameter_names: set[str] | frozenset[str]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``from_pretrained`` keyword arguments -> (hyperparameters, Hub arguments, base-model loader arguments).

    A keyword that is none of the method's hyperparameters but close to one is a mistake (``mask_ration``), not a
    base-model argument: it raises here, naming the nearest hyperparameter, instead of failing inside the base
    model's ``__init__``.
    """
    from .registry import closest_name

    overrides = {k: v for k, v in kwargs.items() if k in hyperparameter_names}
    hub = {k: v for k, v in kwargs.items() if k in HUB_KWARGS}
    rest = {k: v for k, v in kwargs.items() if k not in hyperparameter_names and k not in HUB_KWARGS}
    for name in rest:
        if name in MODEL_LOADING_KWARGS or name.startswith("_"):
            continue
        close = closest_name(name, hyperparameter_names)
        if close is not None:
            raise TypeError(
                f"from_pretrained got an unknown keyword argument {name!r}; did you mean the hyperparameter "
                f"{close!r}? (known: {', '.join(sorted(hyperparameter_names))})"
            )
    return overrides, hub, rest


def hyperparameter_names(cls: type) -> frozenset[str]:
    """The keywords a detector class takes as settings: its config class's settings (and GSC's fitted
    ``gradient_mass``), and the config fields every method has (threshold, calibration, base-model reference), so
    that ``base_model_name_or_path=`` redirects any saved detector to another copy of its base model."""
    return frozenset(cls.config_class.names(SETTING, FITTED)) | frozenset(CONFIG_KEYS[2:6])


# ----------------------------------------------------------------------------- save
def saved_base_reference(
    detector: "OODDetector", save_base_model: bool, repo_id: str | None
) -> tuple[str | None, str | None]:
    """The base-model reference written to a saved detector. A detector saved with its base weights refers to itself
    when pushed (``repo_id``); saved locally with its weights it keeps a Hub id but never a local path (the folder is
    the base). Without the weights it keeps its reference."""
    config = detector.config
    if not save_base_model:
        return config.base_model_name_or_path, config.base_model_revision
    if repo_id is not None:
        return repo_id, None
    if is_hub_id(config.base_model_name_or_path):
        return config.base_model_name_or_path, config.base_model_revision
    return None, None


def check_savable(detector: "OODDetector", results_dir: str | os.PathLike | None = None) -> None:
    """Refuse to save (or push) a detector that needs a fit and has none (it would be saved without its state and
    fail only when loaded), or with a ``results_dir`` that is not this detector's or links outside itself: the local
    checks a push makes before it reaches the Hub."""
    if detector.needs_fit and not detector.fitted:
        raise ValueError(f"the {detector.method!r} detector is not fitted, so it cannot be saved: call "
                         f".fit(id_{detector.fit_split}_batches) first")
    if results_dir is not None:
        check_results_match(read_results(results_dir)[0], detector, results_dir)


def save_detector(
    detector: "OODDetector",
    directory: str | os.PathLike,
    save_base_model: bool = False,
    results_dir: str | os.PathLike | None = None,
    repo_id: str | None = None,
    license: str | None = None,
) -> Path:
    """Write a detector folder (see module docstring); returns its path.

    Everything that can fail (the card template, results that do not belong to this detector) is checked
    before the first file is written, so a failed save leaves no half-written folder.
    """
    from .model_card import DEFAULT_LICENSE, render_model_card

    check_savable(detector)
    results = table = None
    plots: list[Path] = []
    if results_dir is not None:
        results, table, plots = read_results(results_dir)
        check_results_match(results, detector, results_dir)
        if repo_id is not None:  # pushed: no local path reaches the card or the copied results
            results, table = public_results(results, table)
    values = config_values(detector, saved_base_reference(detector, save_base_model, repo_id))
    card = render_model_card(values, repo_id, results, table, [p.as_posix() for p in plots],
                             license=license or DEFAULT_LICENSE, base_in_repo=save_base_model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_config(values, directory)
    state = detector.fitted_state()
    if state:
        save_state(state, directory / STATE_FILE)
    elif (directory / STATE_FILE).is_file():
        (directory / STATE_FILE).unlink()  # a stale state of an earlier save would be loaded with this config
    base_config = getattr(detector.model, "config", None)
    # transformers opens its files itself: it writes into a fresh folder, whose files are then moved in.
    with safe_files.staged_writes(directory) as staged:
        if hasattr(base_config, "save_pretrained"):
            base_config.save_pretrained(staged)
        if save_base_model:
            detector.model.save_pretrained(staged)
            if detector.image_processor is not None:
                detector.image_processor.save_pretrained(staged)
    if results_dir is not None:
        copy_results(results_dir, directory, plots, public=repo_id is not None)
    safe_files.atomic_write_text(directory / "README.md", str(card))
    return directory


def read_results(results_dir: str | os.PathLike) -> tuple[dict[str, Any], str | None, list[Path]]:
    """``results.json`` (parsed), ``results.md`` (text or ``None``) and the plots (paths relative to the folder)
    of an evaluation output folder. A link leading out of the folder is refused (:class:`~hf_gsc.safe_files.LinkError`)."""
    source = Path(results_dir)
    if not safe_files.is_file(source, "results.json"):
        raise FileNotFoundError(f"results_dir {source} has no results.json; run `hf-gsc evaluate` first")
    results = json.loads(safe_files.read_text(source, "results.json"))
    table = safe_files.read_text(source, "results.md") if safe_files.is_file(source, "results.md") else None
    # Saved detectors and score files beside the results are not results (a saved detector carries a copy).
    plots = [p for p in safe_files.find_files(source, "*.png") if p.parts[0] not in ("detectors", "scores")]
    return results, table, plots


def copy_results(results_dir: str | os.PathLike, directory: Path, plots: list[Path], public: bool = False) -> None:
    """Copy the results files and ``plots`` into ``directory``, neither reading out of ``results_dir`` nor
    writing out of ``directory`` through a link. ``public`` (a push): the local paths that ``results.json`` names
    are replaced in ``results.json`` and ``results.md`` by :func:`public_results`."""
    source = Path(results_dir)
    names = [name for name in RESULT_FILES if safe_files.is_file(source, name)]
    if public and names:
        results, table, _ = read_results(source)
        results, table = public_results(results, table)
        safe_files.atomic_write_text(Path(directory) / RESULT_FILES[0], json.dumps(results, indent=2) + "\n")
        if table is not None:
            safe_files.atomic_write_text(Path(directory) / RESULT_FILES[1], table)
        names = []
    for relative in [*names, *plots]:
        safe_files.copy_file(source, relative, directory)


def _local_paths(value: Any) -> set[str]:
    """Every string in a results record that names a path on this machine (absolute, or an existing file or folder)."""
    if isinstance(value, Mapping):
        return set().union(*(_local_paths(item) for item in value.values())) if value else set()
    if isinstance(value, (list, tuple)):
        return set().union(*(_local_paths(item) for item in value)) if value else set()
    if isinstance(value, str) and value and not is_hub_id(value):
        if os.path.isabs(value) or (os.sep in value and os.path.exists(value)):
            return {value}
    return set()


def public_results(results: Mapping[str, Any], table: str | None) -> tuple[dict[str, Any], str | None]:
    """``results.json`` and ``results.md`` as they may leave this machine: each local path they name (the model
    folder, an image folder, the output dir) becomes ``local:NAME`` (its last component), so that nothing pushed
    reveals where files lie on the publisher's machine."""
    paths = sorted(_local_paths(results), key=len, reverse=True)

    def public(text: str) -> str:
        for path in paths:
            text = text.replace(path, f"local:{Path(path.rstrip(os.sep)).name}")
        return text

    return json.loads(public(json.dumps(results))), None if table is None else public(table)


def check_results_match(results: Mapping[str, Any], detector: "OODDetector", results_dir: str | os.PathLike) -> None:
    """Refuse results that another model or other settings produced: the card would claim them.

    The fingerprint compared is the evaluated model and every hyperparameter that changes ``ood_score``, as recorded
    under ``methods.{method}.hyperparameters`` in ``results.json``.
    """
    method = detector.method
    entry = (results.get("methods") or {}).get(method)
    if not entry or "hyperparameters" not in entry:
        raise ValueError(f"results_dir {results_dir}: results.json holds no {method} results with their hyperparameters")
    config = detector.config
    evaluated = str(results.get("model"))
    if not _same_model(evaluated, config.base_model_name_or_path):
        raise ValueError(
            f"results_dir {results_dir} evaluated the model {evaluated!r}, but this detector's base model is "
            f"{config.base_model_name_or_path!r}; attach results of this detector's own evaluation"
        )
    saved = entry["hyperparameters"]
    mine = detector.config.score_hyperparameters()
    differing = [name for name in mine if name in saved and _jsonable(saved[name]) != _jsonable(mine[name])]
    if differing:
        details = ", ".join(f"{name}: results {saved[name]!r} vs detector {mine[name]!r}" for name in differing)
        raise ValueError(f"results_dir {results_dir} was evaluated with other {method} settings ({details})")


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _same_model(evaluated: str, base: str | None) -> bool:
    if base is None:
        return False
    if os.path.isdir(evaluated):
        saved = read_config(evaluated)
        if saved is not None:  # the evaluation ran on a saved detector: compare its base model
            evaluated = saved.base_model_name_or_path or evaluated
    if os.path.isdir(evaluated) and os.path.isdir(base):
        return os.path.realpath(evaluated) == os.path.realpath(base)
    return evaluated == base


# ----------------------------------------------------------------------------- load
def is_detector_dir(directory: str | os.PathLike) -> bool:
    return any(os.path.isfile(os.path.join(directory, name)) for name in (CONFIG_NAME, LEGACY_GSC_CONFIG_NAME))


def resolve_detector_dir(name_or_path: str, **hub_kwargs: Any) -> str | None:
    """Local folder holding a saved detector (downloading its small files from the Hub or its cache if needed), or
    ``None`` for a plain image classifier, which transformers then loads with its own errors.

    Works offline from the cache exactly when transformers does: ``snapshot_download`` falls back to the
    cached snapshot of the revision when ``HF_HUB_OFFLINE=1`` or ``local_files_only=True``.
    """
    if os.path.isdir(name_or_path):
        if is_detector_dir(name_or_path):
            return name_or_path
        if os.path.isfile(os.path.join(name_or_path, STATE_FILE)):  # a detector folder that lost its config
            raise FileNotFoundError(
                f"{name_or_path} holds {STATE_FILE} but no {CONFIG_NAME}: a saved detector folder has {CONFIG_NAME} "
                f"(method, hyperparameters, threshold, base model) beside {STATE_FILE}, README.md and, with "
                "save_base_model=True, the base model's config.json and model.safetensors; save it again with "
                "save_pretrained"
            )
        if os.path.isfile(os.path.join(name_or_path, "config.json")):
            return None
        raise FileNotFoundError(
            f"{name_or_path} holds neither {CONFIG_NAME} (a saved detector) nor config.json (a transformers "
            "image classifier); pass the folder written by save_pretrained or a classifier's folder"
        )
    if not is_hub_id(name_or_path):
        raise FileNotFoundError(
            f"{name_or_path!r}: no such directory, and not a Hub repo id ('namespace/name'); check the path"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = snapshot_download(name_or_path, allow_patterns=_DETECTOR_FILES, **hub_kwargs)
    except (HfHubHTTPError, LocalEntryNotFoundError):
        # Not found, private without a token, not cached while offline: transformers raises the standard
        # message for this repo id.
        return None
    return folder if is_detector_dir(folder) else None


def load_detector(
    name_or_path: Any,
    method: str | None = None,
    expected_class: type | None = None,
    config: DetectorConfig | None = None,
    model: torch.nn.Module | None = None,
    **kwargs: Any,
) -> "OODDetector":
    """``AutoOODDetector.from_pretrained`` and every detector class's ``from_pretrained``.

    Args:
        name_or_path: a saved detector (folder or Hub repo), an image classifier (folder or Hub id), or a loaded
            classifier (``nn.Module``).
        method: the method to build on a classifier; for a saved detector, the method it must be (or ``None``).
        expected_class: the class whose ``from_pretrained`` was called (the loaded detector must be one).
        config: build on the classifier with these settings instead of looking for a saved detector.
        model: an already loaded base model to attach a saved detector to (as ``PeftModel.from_pretrained``).
        **kwargs: the method's hyperparameters (override saved ones); ``revision``, ``token``, ``cache_dir``,
            ``local_files_only``, ``force_download`` (Hub); the rest go to
            ``AutoModelForImageClassification.from_pretrained`` (``dtype``, ``device_map``, ...).
    """
    from transformers import AutoModelForImageClassification

    from .registry import DETECTORS, detector_class

    if isinstance(name_or_path, torch.nn.Module):
        if model is not None:
            raise ValueError("pass the classifier either as the first argument or as model=..., not both")
        model, name_or_path = name_or_path, None
    path = None if name_or_path is None else os.fspath(name_or_path)
    detector_dir = None
    if path is not None and config is None:
        hub_only = {k: v for k, v in kwargs.items() if k in HUB_KWARGS}
        detector_dir = resolve_detector_dir(path, **hub_only)
    saved = read_config(detector_dir) if detector_dir is not None else None
    if saved is not None:
        if method is not None and method != saved.method:
            raise ValueError(f"{path} holds a saved {saved.method!r} detector, not {method!r}; load it with "
                             f"AutoOODDetector.from_pretrained({path!r})")
        method, config = saved.method, saved
    if config is not None and method is None:
        method = config.method
    if method is None:
        raise ValueError(
            f"{path or 'the model'} is an image classifier, not a saved detector: pass method=... to build one "
            f"(registered methods: {', '.join(sorted(DETECTORS))})"
        )
    cls = detector_class(method)
    if expected_class is not None and not issubclass(cls, expected_class):
        raise ValueError(f"{path} holds a saved {method!r} detector ({cls.__name__}), not a {expected_class.__name__}; "
                         f"load it with AutoOODDetector.from_pretrained({path!r})")
    overrides, hub, model_kwargs = split_kwargs(kwargs, hyperparameter_names(cls))
    if saved is not None:
        if model is None:
            base, base_hub = _base_reference(path, detector_dir, saved, overrides, hub)
        else:
            base, base_hub = _processor_reference(path, detector_dir, saved, hub)
    elif path is not None:
        base, base_hub = path, hub
    else:
        base, base_hub = _loaded_model_reference(model), {}
        if model_kwargs or hub:
            raise TypeError(f"unknown keyword arguments {sorted({**model_kwargs, **hub})} for a loaded model; "
                            f"{method} takes {', '.join(sorted(hyperparameter_names(cls)))}")
    if model is None:
        model = AutoModelForImageClassification.from_pretrained(base, **base_hub, **model_kwargs)
    detector = _build(cls, model, config, overrides, path if saved is None else None, hub)
    detector.image_processor = None if base is None else load_image_processor(base, missing_ok=True, **base_hub)
    if detector_dir is not None:
        if not load_state_from_dir(detector, detector_dir) and detector.needs_fit:
            needed = ", ".join(repr(name) for name in (detector.expected_state() or detector.state_names))
            raise ValueError(
                f"{path} holds a {method!r} detector without its fitted state: {STATE_FILE} with {needed} is missing, "
                "so it cannot score. Fit it (.fit(id_train_batches)) and save it again"
            )
        if is_hub_id(path) and has_base_weights(detector_dir) and not is_hub_id(detector.config.base_model_name_or_path):
            # Its base weights are in the repo it came from: that repo is its base (it can be pushed on).
            detector.config.base_model_name_or_path = path
            detector.config.base_model_revision = hub.get("revision")
    return detector


def _build(cls: type, model: torch.nn.Module, config: Any, overrides: dict[str, Any], classifier_path: str | None,
           hub: Mapping[str, Any]) -> "OODDetector":
    if config is None:
        config = cls.config_class()
    if classifier_path is not None:
        overrides.setdefault("base_model_name_or_path", classifier_path)
        overrides.setdefault("base_model_revision", hub.get("revision"))
    for key in ("threshold", "calibration", "base_model_name_or_path", "base_model_revision"):
        if key in overrides:
            setattr(config, key, overrides.pop(key))
    return cls(model, config, **overrides)


def _loaded_model_reference(model: torch.nn.Module) -> str | None:
    """Where a loaded classifier's image processor can be found without the network: its folder, if it has one."""
    name = getattr(getattr(model, "config", None), "_name_or_path", None)
    return name if name and os.path.isdir(name) else None


def _base_reference(
    path: str, detector_dir: str, config: Any, overrides: dict[str, Any], hub: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """Where the base model of a saved detector comes from: the detector itself when its weights were saved,
    otherwise the reference in its config (or ``base_model_name_or_path=`` given to from_pretrained)."""
    if has_base_weights(detector_dir):
        return path, hub
    base = overrides.get("base_model_name_or_path", config.base_model_name_or_path)
    revision = overrides.get("base_model_revision", config.base_model_revision)
    if base is None:
        raise ValueError(f"{path}/{CONFIG_NAME} names no base model and {path} holds no base weights")
    if not os.path.isdir(base) and not is_hub_id(base):
        raise FileNotFoundError(
            f"{path}/{CONFIG_NAME} names the base model {base!r}, a local folder that does not exist (here); pass "
            "base_model_name_or_path='<Hub id or folder>' to from_pretrained, or load the base model yourself and "
            "pass it as model=..."
        )
    return base, {**hub, "revision": revision}


def _processor_reference(
    path: str, detector_dir: str, config: Any, hub: dict[str, Any]
) -> tuple[str | None, dict[str, Any]]:
    if os.path.isfile(os.path.join(detector_dir, "preprocessor_config.json")):
        return path, hub
    base = config.base_model_name_or_path
    if os.path.isdir(base or "") or is_hub_id(base):
        return base, {**hub, "revision": config.base_model_revision}
    return None, hub


def has_base_weights(directory: str | os.PathLike) -> bool:
    return any(os.path.isfile(os.path.join(directory, name)) for name in BASE_WEIGHTS)


def load_detector_or_classifier(
    name_or_path: str, **hub_kwargs: Any
) -> tuple[torch.nn.Module, Any, str, dict[str, Any]]:
    """What the evaluation's ``--model`` names: a saved detector (local or on the Hub) or a plain classifier.

    Returns ``(base model, the saved detector or None, where the image processor comes from, the Hub arguments
    for it)``.
    """
    from transformers import AutoModelForImageClassification

    hub = {k: v for k, v in hub_kwargs.items() if v is not None}
    detector_dir = resolve_detector_dir(name_or_path, **hub)
    if detector_dir is None:
        return AutoModelForImageClassification.from_pretrained(name_or_path, **hub), None, name_or_path, hub
    detector = load_detector(name_or_path, **hub)
    config = detector.config
    if os.path.isfile(os.path.join(detector_dir, "preprocessor_config.json")):
        return detector.model, detector, name_or_path, hub
    return detector.model, detector, config.base_model_name_or_path, {**hub, "revision": config.base_model_revision}


class DetectorFiles:
    """``from_pretrained`` / ``save_pretrained`` of every detector (mixed into :class:`hf_gsc.OODDetector`)."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, **kwargs: Any) -> "OODDetector":
        """Load a saved detector of this class's method, or build one on an image classifier (Hub id, path or loaded
        model); see :meth:`hf_gsc.AutoOODDetector.from_pretrained` for the arguments."""
        method = cls.__dict__.get("method")
        return load_detector(pretrained_model_name_or_path, method=kwargs.pop("method", None) or method,
                             expected_class=cls, **kwargs)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        save_base_model: bool = False,
        results_dir: str | os.PathLike | None = None,
        license: str | None = None,
    ) -> str:
        """Write ``detector_config.json`` (method, hyperparameters, threshold, base-model reference), the fitted
        state, a model card, and optionally the base weights and the method's evaluation results (``results_dir``:
        an ``hf-gsc evaluate`` output of this detector's model and settings, checked)."""
        return str(save_detector(self, save_directory, save_base_model, results_dir, license=license))
