"""The saved-detector format, written and read only here (the PEFT way: settings next to a base-model reference).

A detector folder (local or a Hub repo) holds:

* ``gsc_config.json``: the :class:`~hf_gsc.config.GSCConfig` (settings, fitted state, provenance);
* ``detector_state.safetensors``: fitted tensors when there are any (``fisher_diagonal``, ``gradient_mass``);
  never pickle;
* ``README.md``: the model card (:func:`hf_gsc.hub.render_model_card`);
* ``config.json``: the base model's transformers config (labels, architecture), so that tools reading a
  model folder (``transformers.pipeline``) recognise it;
* optionally the base model's weights (``model.safetensors``) and image processor, and the evaluation
  outputs (``results.json``, ``results.md``, plots).

``GSCForImageClassification.from_pretrained`` / ``save_pretrained``, ``GSCDetector`` (the evaluation's
saved fits) and the evaluation runner's ``--model`` all go through these functions.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from . import safe_files
from .config import CONFIG_NAME, STATE_FILE, GSCConfig

if TYPE_CHECKING:
    from .modeling import GSCForImageClassification

#: Keyword arguments of ``from_pretrained`` that locate files; they go to the detector, the base model and
#: the image processor alike (``revision`` of the base comes from ``gsc_config.json`` when it is referenced).
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download")
#: Files of the base model's weights: a folder holding one of them has its base model saved in it.
BASE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
#: What a detector repo is recognised by, fetched before anything else.
_DETECTOR_FILES = [CONFIG_NAME, STATE_FILE, "config.json", *BASE_WEIGHTS]
RESULT_FILES = ("results.json", "results.md")


# ----------------------------------------------------------------------------- names
def is_hub_id(name: str | None) -> bool:
    """Whether ``name`` can only mean a Hub repo id: a valid ``[namespace/]name`` that is no local folder."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or os.path.isdir(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def split_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``from_pretrained`` keyword arguments -> (``GSCConfig`` overrides, Hub arguments, base-model loader arguments)."""
    names = GSCConfig.field_names()
    overrides = {k: v for k, v in kwargs.items() if k in names}
    hub = {k: v for k, v in kwargs.items() if k in HUB_KWARGS}
    rest = {k: v for k, v in kwargs.items() if k not in names and k not in HUB_KWARGS}
    return overrides, hub, rest


# ----------------------------------------------------------------------------- fitted state
def detector_state(detector: "GSCForImageClassification") -> dict[str, torch.Tensor]:
    """The fitted tensors of a detector: ``fisher_diagonal`` ``(d,)`` and ``gradient_mass`` ``()`` when set."""
    state = {}
    if detector.fisher_diagonal is not None:
        state["fisher_diagonal"] = detector.fisher_diagonal
    if detector.config.gradient_mass is not None:
        state["gradient_mass"] = torch.tensor(detector.config.gradient_mass, dtype=torch.float64)
    return state


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


def apply_state(
    detector: "GSCForImageClassification", state: Mapping[str, torch.Tensor], source: str | os.PathLike
) -> None:
    """Put saved fitted tensors into ``detector`` after checking them (shape, finite, sign).

    Raises:
        ValueError: naming the tensor and ``source`` (the file it came from).
    """
    fisher = state.get("fisher_diagonal")
    if fisher is not None:
        _check_fisher(detector, fisher, source)
        detector.fisher_diagonal = fisher
    mass = state.get("gradient_mass")
    if mass is not None:
        if mass.numel() != 1:
            raise ValueError(f"gradient_mass in {source} must be one number, got shape {tuple(mass.shape)}")
        try:
            detector.config.gradient_mass = float(mass)
        except ValueError as error:
            raise ValueError(f"gradient_mass in {source}: {error}") from None


def _check_fisher(detector: "GSCForImageClassification", fisher: torch.Tensor, source: str | os.PathLike) -> None:
    where = f"fisher_diagonal in {source}"
    if fisher.ndim != 1 or not fisher.is_floating_point():
        raise ValueError(f"{where} must be a 1-D float tensor (d,), got {fisher.dtype} of shape {tuple(fisher.shape)}")
    if not torch.isfinite(fisher).all():
        raise ValueError(f"{where} holds NaN or infinite values; fit it again with fit_fisher(id_train_batches)")
    if (fisher < 0).any():
        raise ValueError(f"{where} holds negative values; a diagonal Fisher is a mean of squares, fit it again")
    expected = _feature_size(detector)
    if expected is not None and fisher.numel() != expected:
        raise ValueError(
            f"{where} has {fisher.numel()} entries but the feature at split_point="
            f"{detector.config.split_point!r} of this base model has {expected}; it was fitted for another model "
            "or split point"
        )


def _feature_size(detector: "GSCForImageClassification") -> int | None:
    """Number of coordinates of ``F`` (what ``fisher_diagonal`` covers), from one forward of two blank images at
    the base model's ``config.image_size``; ``None`` where the config does not fix the input size (CNNs)."""
    config = getattr(detector.model, "config", None)
    size = getattr(config, "image_size", None)
    if size is None:
        return None
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    channels = getattr(config, "num_channels", 3)
    # A shallow copy sharing the base model: the probe runs with plain gradient selection, which needs no
    # fitted state, without touching the detector's own configuration.
    probe = copy.copy(detector)
    probe.config = dataclasses.replace(detector.config, selection="gradient", mask_size="fixed", gradient_mass=None)
    blank = torch.zeros(2, channels, height, width, dtype=detector.dtype, device=detector.device)
    features = probe(blank, output_short_circuit=True).features
    return features[0].numel()


# ----------------------------------------------------------------------------- save
def save_detector(
    detector: "GSCForImageClassification",
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
    from .hub import DEFAULT_LICENSE, render_model_card

    results = table = None
    plots: list[Path] = []
    if results_dir is not None:
        results, table, plots = read_results(results_dir)
        check_results_match(results, detector.config, results_dir)
    card = render_model_card(
        detector.config, repo_id, results, table, [p.as_posix() for p in plots], license=license or DEFAULT_LICENSE
    )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    detector.config.save_pretrained(directory)
    state = detector_state(detector)
    if state:
        save_state(state, directory / STATE_FILE)
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
        copy_results(results_dir, directory, plots)
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
    return results, table, safe_files.find_files(source, "*.png")


def copy_results(results_dir: str | os.PathLike, directory: Path, plots: list[Path]) -> None:
    """Copy the results files and ``plots`` into ``directory``, neither reading out of ``results_dir`` nor
    writing out of ``directory`` through a link."""
    source = Path(results_dir)
    for relative in [*(name for name in RESULT_FILES if safe_files.is_file(source, name)), *plots]:
        safe_files.copy_file(source, relative, directory)


def check_results_match(results: Mapping[str, Any], config: GSCConfig, results_dir: str | os.PathLike) -> None:
    """Refuse results that another model or other GSC settings produced: the card would claim them.

    The fingerprint compared is the evaluated model and every field that changes ``ood_score``
    (:meth:`GSCConfig.score_names`), as recorded under ``methods.gsc.hyperparameters`` in ``results.json``.
    """
    gsc = (results.get("methods") or {}).get("gsc")
    if not gsc or "hyperparameters" not in gsc:
        raise ValueError(f"results_dir {results_dir}: results.json holds no GSC results with their hyperparameters")
    evaluated = str(results.get("model"))
    if not _same_model(evaluated, config.base_model_name_or_path):
        raise ValueError(
            f"results_dir {results_dir} evaluated the model {evaluated!r}, but this detector's base model is "
            f"{config.base_model_name_or_path!r}; attach results of this detector's own evaluation"
        )
    saved = gsc["hyperparameters"]
    differing = [name for name in GSCConfig.score_names() if name in saved and saved[name] != getattr(config, name)]
    if differing:
        details = ", ".join(f"{name}: results {saved[name]!r} vs detector {getattr(config, name)!r}" for name in differing)
        raise ValueError(f"results_dir {results_dir} was evaluated with other GSC settings ({details})")


def _same_model(evaluated: str, base: str | None) -> bool:
    if base is None:
        return False
    if os.path.isdir(evaluated) and os.path.isfile(os.path.join(evaluated, CONFIG_NAME)):
        # The evaluation ran on a saved detector: compare its base model.
        evaluated = GSCConfig.from_json_file(os.path.join(evaluated, CONFIG_NAME)).base_model_name_or_path or evaluated
    if os.path.isdir(evaluated) and os.path.isdir(base):
        return os.path.realpath(evaluated) == os.path.realpath(base)
    return evaluated == base


# ----------------------------------------------------------------------------- load
def resolve_detector_dir(name_or_path: str, **hub_kwargs: Any) -> str | None:
    """Local folder holding ``gsc_config.json`` (downloading it from the Hub or its cache if needed), or
    ``None`` for a plain image classifier, which transformers then loads with its own errors.

    Works offline from the cache exactly when transformers does: ``snapshot_download`` falls back to the
    cached snapshot of the revision when ``HF_HUB_OFFLINE=1`` or ``local_files_only=True``.
    """
    if os.path.isdir(name_or_path):
        if os.path.isfile(os.path.join(name_or_path, CONFIG_NAME)):
            return name_or_path
        if os.path.isfile(os.path.join(name_or_path, "config.json")):
            return None
        raise FileNotFoundError(
            f"{name_or_path} holds neither {CONFIG_NAME} (a saved GSC detector) nor config.json (a transformers "
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
    return folder if os.path.isfile(os.path.join(folder, CONFIG_NAME)) else None


def load_detector(
    cls: type["GSCForImageClassification"],
    name_or_path: str | os.PathLike,
    config: GSCConfig | None = None,
    model: torch.nn.Module | None = None,
    **kwargs: Any,
) -> "GSCForImageClassification":
    """``GSCForImageClassification.from_pretrained``: a saved detector (folder or Hub repo), or any image
    classifier wrapped with ``config`` (defaults when ``None``). See its docstring for the arguments."""
    from transformers import AutoModelForImageClassification

    overrides, hub, model_kwargs = split_kwargs(kwargs)
    path = os.fspath(name_or_path)
    detector_dir = None if config is not None else resolve_detector_dir(path, **hub)
    if detector_dir is not None:
        config = GSCConfig.from_json_file(os.path.join(detector_dir, CONFIG_NAME))
        if model is None:
            base, base_hub = _base_reference(path, detector_dir, config, overrides, hub)
        else:
            # Attached to the caller's model: the base reference only serves to find the image processor.
            base, base_hub = _processor_reference(path, detector_dir, config, hub)
    else:
        base, base_hub = path, hub
        config = config or GSCConfig()
        overrides.setdefault("base_model_name_or_path", path)
        overrides.setdefault("base_model_revision", hub.get("revision"))
    if model is None:
        model = AutoModelForImageClassification.from_pretrained(base, **base_hub, **model_kwargs)
    detector = cls(model, config, **overrides)
    detector.image_processor = None if base is None else _load_image_processor(base, base_hub)
    if detector_dir is not None and os.path.isfile(os.path.join(detector_dir, STATE_FILE)):
        state_file = os.path.join(detector_dir, STATE_FILE)
        apply_state(detector, read_state(state_file), state_file)
    return detector


def _base_reference(
    path: str, detector_dir: str, config: GSCConfig, overrides: dict[str, Any], hub: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """Where the base model of a saved detector comes from: the detector itself when its weights were saved,
    otherwise the reference in ``gsc_config.json`` (or ``base_model_name_or_path=`` given to from_pretrained)."""
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
    path: str, detector_dir: str, config: GSCConfig, hub: dict[str, Any]
) -> tuple[str | None, dict[str, Any]]:
    if os.path.isfile(os.path.join(detector_dir, "preprocessor_config.json")):
        return path, hub
    base = config.base_model_name_or_path
    if os.path.isdir(base or "") or is_hub_id(base):
        return base, {**hub, "revision": config.base_model_revision}
    return None, hub


def has_base_weights(directory: str | os.PathLike) -> bool:
    return any(os.path.isfile(os.path.join(directory, name)) for name in BASE_WEIGHTS)


def _load_image_processor(name_or_path: str, hub: Mapping[str, Any]) -> Any:
    """The base model's image processor when it has one (``None`` otherwise)."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(name_or_path, **hub)
    except (OSError, ValueError):
        return None


def load_detector_or_classifier(
    name_or_path: str, **hub_kwargs: Any
) -> tuple[torch.nn.Module, GSCConfig | None, str, dict[str, Any]]:
    """What the evaluation's ``--model`` names: a saved detector (local or on the Hub) or a plain classifier.

    Returns ``(base model, saved GSCConfig or None, where the image processor comes from, the Hub arguments
    for it)``. A saved detector's fitted state (Fisher, gradient mass) travels in its config and model.
    """
    from transformers import AutoModelForImageClassification

    from .modeling import GSCForImageClassification

    hub = {k: v for k, v in hub_kwargs.items() if v is not None}
    detector_dir = resolve_detector_dir(name_or_path, **hub)
    if detector_dir is None:
        return AutoModelForImageClassification.from_pretrained(name_or_path, **hub), None, name_or_path, hub
    detector = load_detector(GSCForImageClassification, name_or_path, **hub)
    config = detector.config
    if os.path.isfile(os.path.join(detector_dir, "preprocessor_config.json")):
        return detector.model, config, name_or_path, hub
    return detector.model, config, config.base_model_name_or_path, {**hub, "revision": config.base_model_revision}
