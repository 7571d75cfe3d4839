"""Loading a detector (:mod:`hf_gsc.storage.saved_format` describes the folder): ``from_pretrained``'s keyword arguments routed
to the detector, the Hub and the base model; the detector folder found locally or on the Hub; the detector built on
its base model, saved or given."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..settings.config import CONFIG_NAME, LEGACY_GSC_CONFIG_NAME, STATE_FILE, DetectorConfig
from ..utils.calibration import UnboundCalibration
from ..utils.image_processors import converting_to_rgb, load_image_processor
from .repo_ids import is_hub_id, looks_local, stored_reference
from .saved_format import read_calibration, read_config, read_state_and_scores


if TYPE_CHECKING:
    from ..detectors.interface import OODDetector


#: Keyword arguments of ``from_pretrained`` that locate files; they go to the detector, the base model and
#: the image processor alike (``revision`` of the base comes from ``gsc_config.json`` when it is referenced).
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download")
#: Files of the base model's weights: a folder holding one of them has its base model saved in it.
BASE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
#: Weight files of a transformers classifier folder (a folder with config.json and none of them is no classifier).
CLASSIFIER_WEIGHTS = (*BASE_WEIGHTS, "pytorch_model.bin", "pytorch_model.bin.index.json")
#: What a detector repo is recognised by, fetched before anything else.
_DETECTOR_FILES = [CONFIG_NAME, LEGACY_GSC_CONFIG_NAME, STATE_FILE, "config.json", *BASE_WEIGHTS]


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
    from ..settings.registry import closest_name

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


def hyperparameter_names(cls: type[OODDetector]) -> frozenset[str]:
    """The keywords a detector class takes for its config (:meth:`hf_gsc.DetectorConfig.keyword_names`, as its
    constructor does): its settings, fitted values and base-model reference, so that ``base_model_name_or_path=``
    redirects any saved detector to another copy of its base model."""
    return frozenset(cls.config_class.keyword_names())


# ----------------------------------------------------------------------------- load
def is_detector_dir(directory: str | os.PathLike[str]) -> bool:
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
            if any(os.path.isfile(os.path.join(name_or_path, name)) for name in CLASSIFIER_WEIGHTS):
                return None
            # config.json without weights: a detector folder (save_pretrained writes the base's config.json beside
            # detector_config.json) that lost its config, not a classifier
            present = ", ".join(sorted(os.listdir(name_or_path)))
            raise FileNotFoundError(
                f"{name_or_path} holds config.json but neither {CONFIG_NAME} (a saved detector: save_pretrained writes "
                f"{CONFIG_NAME}, README.md, config.json, and {STATE_FILE} for a fitted method) nor a classifier's "
                f"weights ({', '.join(CLASSIFIER_WEIGHTS)}); it holds {present}. Save the detector again with "
                "save_pretrained, or pass a classifier's folder"
            )
        raise FileNotFoundError(
            f"{name_or_path} holds neither {CONFIG_NAME} (a saved detector) nor config.json (a transformers "
            "image classifier); pass the folder written by save_pretrained or a classifier's folder"
        )
    if not is_hub_id(name_or_path):
        raise FileNotFoundError(
            f"{name_or_path!r}: no such directory, and not a Hub repo id ('namespace/name'); check the path"
        )
    from huggingface_hub import snapshot_download

    # Not found, private or gated without access, unreachable, not cached while offline: the Hub's own error
    # (RepositoryNotFoundError, GatedRepoError, LocalEntryNotFoundError, ...) says what happened and propagates;
    # a repo that exists but holds no detector is a classifier (None).
    folder = snapshot_download(name_or_path, allow_patterns=_DETECTOR_FILES, **hub_kwargs)
    return folder if is_detector_dir(folder) else None


def load_detector(
    name_or_path: Any,
    method: str | None = None,
    expected_class: type | None = None,
    config: DetectorConfig | None = None,
    model: torch.nn.Module | None = None,
    **kwargs: Any,
) -> OODDetector:
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

    from ..settings.registry import DETECTORS, detector_class

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
        assert detector_dir is not None  # saved was read from it
        method, config = saved.method, saved
        saved.base_model_name_or_path = base_in_folder(detector_dir, saved.base_model_name_or_path)
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
    if saved is not None and "threshold" in overrides:  # a threshold by hand: the saved record is not its record
        overrides.setdefault("calibration", None)
    base: str | None
    if saved is not None:
        assert path is not None and detector_dir is not None  # saved was read from the folder path resolved to
        if model is None:
            base, base_hub = _base_reference(path, detector_dir, saved, overrides, hub)
            model = AutoModelForImageClassification.from_pretrained(base, **base_hub, **model_kwargs)
        else:
            base, base_hub = _processor_reference(path, detector_dir, saved, hub)
    elif path is not None:
        base, base_hub = path, hub
        if model is None:
            model = AutoModelForImageClassification.from_pretrained(base, **base_hub, **model_kwargs)
    elif model is not None:
        base, base_hub = _loaded_model_reference(model), {}
        if model_kwargs or hub:
            raise TypeError(f"unknown keyword arguments {sorted({**model_kwargs, **hub})} for a loaded model; "
                            f"{method} takes {', '.join(sorted(hyperparameter_names(cls)))}")
    else:
        raise ValueError("load_detector: pass a saved detector or a classifier (a folder, a Hub id or a loaded "
                         "model), not None")
    # A local classifier folder is referred to by its absolute path: a later save loads from any working directory.
    detector = _build(cls, model, config, overrides, stored_reference(path) if saved is None else None, hub)
    processor = None if base is None else load_image_processor(base, missing_ok=True, **base_hub)
    detector.image_processor = converting_to_rgb(processor, detector.num_channels)
    scores = None
    if detector_dir is not None:
        state, scores = read_state_and_scores(detector_dir)
        if state is not None:
            detector.load_fitted_state(state, source=os.path.join(detector_dir, STATE_FILE))
        elif detector.needs_fit:
            needed = ", ".join(repr(name) for name in (detector.expected_state() or detector.state_names))
            raise ValueError(
                f"{path} holds a {method!r} detector without its fitted state: {STATE_FILE} with {needed} is missing, "
                "so it cannot score. Fit it (.fit(id_train_batches)) and save it again"
            )
        if is_hub_id(path) and has_base_weights(detector_dir) and not is_hub_id(detector.config.base_model_name_or_path):
            # Its base weights are in the repo it came from: that repo is its base (it can be pushed on).
            detector.config.base_model_name_or_path = path
            detector.config.base_model_revision = hub.get("revision")
    if saved is not None and not {"threshold", "calibration"} & set(overrides):
        assert detector_dir is not None  # saved was read from it
        _load_calibration(detector, detector_dir, saved, scores, overrides)
    return detector


def _load_calibration(detector: OODDetector, directory: str, saved: DetectorConfig, scores: torch.Tensor | None,
                      overrides: Mapping[str, Any]) -> None:
    """Put the saved calibration in place, checked as one unit (scores that do not belong to the threshold and
    record drop it, with one warning naming what disagrees), and only for the settings and fitted state it was
    calibrated for."""
    try:
        detector.set_calibration(read_calibration(directory, saved, scores))
    except UnboundCalibration as error:
        detector.clear_calibration(str(error))
        return
    # The saved values of the settings given again here: an older calibration record (without the settings it
    # depends on) keeps its threshold only where these are unchanged.
    given_settings = {name: value for name, value in detector.calibration_settings(saved).items()
                      if name in overrides}
    detector.check_loaded_calibration(given_settings)


def _build(cls: type[OODDetector], model: torch.nn.Module, config: Any, overrides: dict[str, Any], classifier_path: str | None,
           hub: Mapping[str, Any]) -> OODDetector:
    """The detector, built as its constructor builds it (:meth:`hf_gsc.DetectorConfig.from_kwargs`)."""
    if classifier_path is not None:
        overrides.setdefault("base_model_name_or_path", classifier_path)
        overrides.setdefault("base_model_revision", hub.get("revision"))
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
        raise ValueError(f"{path}/{CONFIG_NAME} names no base model and {path} holds no base weights; pass the base "
                         f"classifier: from_pretrained({path!r}, model=<the loaded classifier>) (or "
                         "base_model_name_or_path='<Hub id or folder>'), or save the detector with "
                         "save_pretrained(..., save_base_model=True) so that its folder is its own base")
    if not os.path.isdir(base) and (looks_local(base) or not is_hub_id(base)):
        # Before any Hub call: a path that cannot be a repo id would only end in retries and a "connection" error.
        raise FileNotFoundError(base_not_found(path, base))
    return base, {**hub, "revision": revision}


def base_in_folder(detector_dir: str, base: str | None) -> str | None:
    """A saved detector's base reference: a relative local path is resolved against the detector's folder (where it
    was written from), never the working directory; a Hub id, an absolute path or ``None`` as saved. A relative name
    that is a valid Hub id (``models/vit3``) is the folder's when the folder has it, else the Hub's."""
    if base is None or os.path.isabs(base) or base.startswith("~"):
        return base
    inside = os.path.abspath(os.path.join(detector_dir, base))
    return inside if os.path.isdir(inside) or looks_local(base) or not is_hub_id(base) else base


def base_not_found(path: str, base: str) -> str:
    """The error for a saved detector whose base model folder is gone: the folder, and the two ways out."""
    return (f"{path}/{CONFIG_NAME} names the base model {base!r}, a local folder that does not exist (working "
            f"directory {os.getcwd()}); pass the base classifier: from_pretrained({path!r}, model=<the loaded "
            "classifier>) (or base_model_name_or_path='<Hub id or folder>'), or save the detector with its base weights "
            "(save_pretrained(..., save_base_model=True), hf-gsc publish --save-base-model) so that its folder is its "
            "own base")


def _processor_reference(
    path: str, detector_dir: str, config: Any, hub: dict[str, Any]
) -> tuple[str | None, dict[str, Any]]:
    if os.path.isfile(os.path.join(detector_dir, "preprocessor_config.json")):
        return path, hub
    base = config.base_model_name_or_path
    if os.path.isdir(base or "") or is_hub_id(base):
        return base, {**hub, "revision": config.base_model_revision}
    return None, hub


def has_base_weights(directory: str | os.PathLike[str]) -> bool:
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

