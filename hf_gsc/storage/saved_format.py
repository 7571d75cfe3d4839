"""The saved-detector format: the folder layout, and the two files of it that hf_gsc writes itself (the PEFT way:
settings next to a base-model reference). :mod:`hf_gsc.storage.saving` writes a folder, :mod:`hf_gsc.storage.loading` reads one,
:mod:`hf_gsc.storage.results` handles the evaluation results it carries.

A detector folder (local or a Hub repo) holds, for every method:

* ``detector_config.json``: ``method`` (the type field, like PEFT's ``peft_type``), ``hyperparameters`` (every
  setting, defaults filled in), ``threshold`` and its ``calibration`` record, and the provenance
  (``base_model_name_or_path``, ``base_model_revision``, ``hf_gsc_version``): the config's own saved form,
  :meth:`hf_gsc.DetectorConfig.to_dict` / :meth:`hf_gsc.DetectorConfig.from_dict`;
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
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..settings.config import CONFIG_NAME, LEGACY_GSC_CONFIG_NAME, STATE_FILE, DetectorConfig, read_json_object
from ..utils import confined_files
from ..utils.calibration import MAX_KEPT_SCORES, Calibration


# ----------------------------------------------------------------------------- the config file
def read_config(directory: str | os.PathLike[str]) -> DetectorConfig | None:
    """The config of the detector saved in ``directory`` (``detector_config.json``, or a legacy GSC
    ``gsc_config.json``); ``None`` where there is neither."""
    from ..settings.registry import detector_class

    path = os.path.join(directory, CONFIG_NAME)
    if os.path.isfile(path):
        return DetectorConfig.from_dict(read_json_object(path, "detector settings"), str(path))
    legacy = os.path.join(directory, LEGACY_GSC_CONFIG_NAME)
    if os.path.isfile(legacy):
        return detector_class("gsc").config_class.from_json_file(legacy)
    return None


#: The words before a local path in a calibration record's ``source`` (:attr:`hf_gsc.utils.image_data.ImageRows.source`).
_LOCAL_SOURCE = re.compile(r"^(?P<kind>folder|file|split '[^']*' of dataset root|datasets\.Dataset saved in) "
                           r"(?P<path>.+?)(?P<rows> \(\d+ rows\))?$")


def public_config(values: Mapping[str, Any]) -> dict[str, Any]:
    """``detector_config.json`` as pushed: a calibration ``source`` read from a local path names the folder or file
    only (``"folder test (a local path, not published)"``); everything else as saved."""
    calibration = values.get("calibration") or {}
    match = _LOCAL_SOURCE.match(str(calibration.get("source") or ""))
    if match is None:
        return dict(values)
    source = (f"{match['kind']} {Path(match['path']).name} (a local path, not published)"
              f"{match['rows'] or ''}")
    return {**values, "calibration": {**calibration, "source": source}}


def write_config(values: Mapping[str, Any], directory: str | os.PathLike[str]) -> Path:
    path = Path(directory) / CONFIG_NAME
    confined_files.atomic_write_text(path, json.dumps(values, indent=2, sort_keys=True))
    return path


# ----------------------------------------------------------------------------- fitted state
#: Key of the sorted float64 ID calibration scores in ``detector_state.safetensors`` (p-values, ``set_tpr``).
CALIBRATION_SCORES_KEY = "calibration_scores"


def save_state(state: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    confined_files.save_file(state, path)


def read_state(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
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


def check_state(
    method: str, state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int | None, ...]], source: str
) -> None:
    """Each expected fitted tensor is present, floating point, finite and of the expected shape; else a
    ``ValueError`` naming the tensor, its shape and the expected one, and ``source``."""
    for name, shape in expected.items():
        where = f"{method}: fitted tensor {name!r} in {source}"
        if name not in state:
            raise ValueError(f"{where} is missing (the file holds {sorted(state)}); fit the detector again")
        tensor = state[name]
        if not tensor.is_floating_point():
            raise ValueError(f"{where} must be floating point, got {tensor.dtype}")
        wanted = "(" + ", ".join("*" if d is None else str(d) for d in shape) + ")"
        if tensor.ndim != len(shape) or any(d is not None and d != got for d, got in zip(shape, tensor.shape)):
            raise ValueError(f"{where} has shape {tuple(tensor.shape)}, expected {wanted} for this base model; "
                             "it was fitted for another model or settings")
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{where} holds NaN or infinite values; fit the detector again")


def read_state_and_scores(directory: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
    """The fitted tensors of ``directory``'s ``detector_state.safetensors`` (``None`` without one) and, apart, its kept
    calibration scores (``None`` when it keeps none)."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.isfile(path):
        return None, None
    check_kept_count(path)
    state = read_state(path)
    return state, state.pop(CALIBRATION_SCORES_KEY, None)


def check_kept_count(path: str | os.PathLike[str]) -> None:
    """Refuse, before reading them, more kept calibration scores than the format keeps
    (:data:`hf_gsc.utils.calibration.MAX_KEPT_SCORES`): no folder makes a load slow."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as handle:
            if CALIBRATION_SCORES_KEY not in handle.keys():
                return
            shape = handle.get_slice(CALIBRATION_SCORES_KEY).get_shape()
    except (SafetensorError, OSError):
        return  # read_state names the unreadable file
    count = math.prod(shape)
    if count > MAX_KEPT_SCORES:
        raise ValueError(f"{path} keeps {count} calibration scores, more than the {MAX_KEPT_SCORES} the format keeps "
                         "(a sorted sample beyond); calibrate the detector again and save it")


def read_calibration(directory: str | os.PathLike[str], saved: DetectorConfig,
                     scores: torch.Tensor | None) -> Calibration | None:
    """The calibration saved in ``directory`` (``saved``: its config; ``scores``: the kept scores of its state file),
    checked as one unit (:meth:`hf_gsc.utils.calibration.Calibration.from_dict`).

    Raises:
        ValueError: kept scores of another dtype or shape than the format's (float64, 1-D, ascending).
        UnboundCalibration: kept scores that do not belong to the saved threshold and record."""
    missing = (f"{directory} was saved without the ID calibration scores ({CALIBRATION_SCORES_KEY!r} in {STATE_FILE}), "
               "so p-values are unavailable until .calibrate(id_validation_data) is run")
    return Calibration.from_dict({"threshold": saved.threshold, "calibration": saved.calibration}, scores,
                                 source=os.path.join(directory, STATE_FILE), missing_scores=missing)
