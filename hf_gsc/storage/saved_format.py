"""The saved-detector format: the folder layout, and the two files of it that hf_gsc writes itself (the PEFT way:
settings next to a base-model reference). :mod:`hf_gsc.storage.saving` writes a folder, :mod:`hf_gsc.storage.loading` reads one,
:mod:`hf_gsc.storage.results` handles the evaluation results it carries.

A detector folder (local or a Hub repo) holds, for every method:

* ``detector_config.json``: ``method`` (the type field, like PEFT's ``peft_type``), ``hyperparameters`` (every
  setting, defaults filled in), ``threshold`` and its ``calibration`` record, and the provenance
  (``base_model_name_or_path``, ``base_model_revision``, ``hf_gsc_version``);
* ``detector_state.safetensors``: fitted tensors when there are any (KNN's bank, ViM's residual space, GSC's
  ``fisher_diagonal`` / ``gradient_mass``, ...), checked at load against the base model, and, for a calibrated
  detector, ``calibration_scores`` (every ID calibration score, sorted, float64: p-values and ``set_tpr``; a folder
  without them loads, with p-values unavailable); never pickle;
* ``README.md``: the model card (:func:`hf_gsc.storage.model_card.render_model_card`);
* ``config.json``: the base model's transformers config (labels, architecture), so that tools reading a
  model folder (``transformers.pipeline``) recognise it;
* optionally the base model's weights (``model.safetensors``) and image processor, and the method's evaluation
  outputs (``results.json``, ``results.md``, plots).

GSC folders saved as ``gsc_config.json`` (flat ``GSCConfig`` fields) still load. :func:`hf_gsc.storage.loading.load_detector`
serves ``AutoOODDetector.from_pretrained``, every class's ``from_pretrained`` and the evaluation's ``--model``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ..utils import confined_files
from ..utils.version import __version__
from ..settings.config import (CONFIG_NAME, LEGACY_GSC_CONFIG_NAME, STATE_FILE, DetectorConfig, GSCConfig, drop_unknown,
                     read_json_object)

if TYPE_CHECKING:
    from ..detectors.interface import OODDetector


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
    from ..settings.registry import detector_class

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
    confined_files.atomic_write_text(path, json.dumps(values, indent=2, sort_keys=True))
    return path


# ----------------------------------------------------------------------------- fitted state
#: Key of the sorted float64 ID calibration scores in ``detector_state.safetensors`` (p-values, ``set_tpr``).
CALIBRATION_SCORES_KEY = "calibration_scores"


def save_state(state: Mapping[str, torch.Tensor], path: str | os.PathLike) -> None:
    confined_files.save_file(state, path)


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
    """Load ``detector_state.safetensors`` of ``directory`` into ``detector`` (checked), with its calibration scores;
    whether there was one. A calibrated folder without calibration scores loads with p-values unavailable, saying so."""
    path = os.path.join(directory, STATE_FILE)
    state = read_state(path) if os.path.isfile(path) else None
    calibration_scores = None if state is None else state.pop(CALIBRATION_SCORES_KEY, None)
    if state is not None:
        detector.load_fitted_state(state, source=path)
    if calibration_scores is not None:
        try:
            detector.keep_calibration_scores(calibration_scores)
        except ValueError as error:
            raise ValueError(f"{path}: {error}; calibrate the detector again and save it") from None
    elif detector.config.threshold is not None:
        detector.keep_calibration_scores(None, f"{directory} was saved without the ID calibration scores "
                                         f"({CALIBRATION_SCORES_KEY!r} in {STATE_FILE}), so p-values are unavailable "
                                         "until .calibrate(id_validation_data) is run")
    return state is not None
