"""``GSCConfig``: the detector's settings, validated on construction, saved as its own JSON file.

Like a PEFT adapter config, it sits next to a *reference* to the base model (name or path and
revision) instead of the base model's own config.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from . import __version__
from .scores import SCORES
from .shortcircuit import APPROXIMATIONS, MASK_SIZES, OPERATIONS, SELECTIONS
from .split_points import validate_split_point_name

CONFIG_NAME = "gsc_config.json"
# Fitted tensors of a detector (GSC options or baselines), next to its config; safetensors, never pickle.
STATE_FILE = "detector_state.safetensors"


def _check_number(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"GSCConfig.{name} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"GSCConfig.{name} must be in {bracket}{low}, {high}], got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"GSCConfig.{name} must be one of {choices}, got {value!r}")


@dataclass
class GSCConfig:
    """Settings of Gradient Short-Circuit (paper Algorithm 1).

    Attributes:
        split_point: where ``F`` is taken: ``"final_encoder_output"`` (before the final LayerNorm /
            pooler; input-dependent gradients for ViT/Swin/ConvNeXt), ``"penultimate"`` (input of the
            last ``nn.Linear``; linear head, ``g = W[c]``), or a dotted module path in the base model.
        earlier_split_point: multi-layer short-circuit (beyond the paper): an earlier encoder block
            (``"vit.layers.-3"``) short-circuited together with ``split_point`` under one shared budget
            ``k = ceil(mask_ratio * (n_earlier + n_final))``, coordinates ranked by ``|g|`` normalised per layer.
        mask_ratio: fraction of the coordinates the head reads (nonzero gradient) to short-circuit;
            ``k = ceil(mask_ratio * n)`` per sample. With ``mask_size="adaptive"`` it is the *mean* ratio
            on ID validation data that ``calibrate_gradient_mass`` targets.
        mask_size: ``fixed`` (``k`` from ``mask_ratio``) or ``adaptive`` (per sample, the smallest ``k`` whose
            top-``k`` ``|g|`` hold ``gradient_mass`` of the total; beyond the paper).
        gradient_mass: the mass fraction of ``mask_size="adaptive"``, set by ``calibrate_gradient_mass``.
        selection: ``gradient`` (largest ``|g|``, the paper), ``fisher`` (largest ``|g_i|/sqrt(lambda_i)``,
            diagonal Fisher fitted on ID training data by ``fit_fisher``; beyond the paper), ``random``
            or ``reverse`` (ablation controls).
        operation: ``zero`` | ``perturb`` (``F - alpha*sign(g)``) | ``project`` (remove the component along
            ``g``) | ``clip`` (to ``[-clip_bound, clip_bound]``) | ``scale`` (``beta * F``), on masked coordinates.
        approximation: ``first_order`` (``y + J(F'-F)`` for all K logits, one Jacobian-vector product),
            ``predicted_logit`` (only ``y_c`` moves by ``g.(F'-F)``, the paper's O(d) update) or
            ``exact`` (a second pass through the head only).
        score: ``energy`` | ``msp`` | ``max_logit`` on the short-circuited logits; higher = more ID.
        temperature: softmax / energy temperature.
        threshold: ``is_ood = ood_score < threshold``; set by ``calibrate`` on ID validation data.
        calibration: what the threshold was calibrated on (``split``, ``num_samples``, ``tpr``).
        seed: random source of ``selection="random"``.
        base_model_name_or_path, base_model_revision: reference to the base classifier.
    """

    split_point: str = "final_encoder_output"
    earlier_split_point: str | None = None
    mask_ratio: float = 0.05
    mask_size: str = "fixed"
    gradient_mass: float | None = None
    selection: str = "gradient"
    operation: str = "zero"
    alpha: float = 0.1
    clip_bound: float = 1.0
    beta: float = 0.5
    approximation: str = "first_order"
    score: str = "energy"
    temperature: float = 1.0
    threshold: float | None = None
    calibration: dict[str, Any] | None = None
    seed: int = 0
    base_model_name_or_path: str | None = None
    base_model_revision: str | None = None
    hf_gsc_version: str = field(default=__version__)

    def __post_init__(self) -> None:
        validate_split_point_name(self.split_point)
        if self.earlier_split_point is not None:
            validate_split_point_name(self.earlier_split_point)
        _check_number("mask_ratio", self.mask_ratio, 0.0, 1.0)
        _check_choice("selection", self.selection, SELECTIONS)
        _check_choice("mask_size", self.mask_size, MASK_SIZES)
        if self.gradient_mass is not None:
            _check_number("gradient_mass", self.gradient_mass, 0.0, 1.0)
        _check_choice("operation", self.operation, OPERATIONS)
        _check_choice("approximation", self.approximation, APPROXIMATIONS)
        _check_choice("score", self.score, SCORES)
        _check_number("alpha", self.alpha, 0.0, math.inf)
        _check_number("clip_bound", self.clip_bound, 0.0, math.inf)
        _check_number("beta", self.beta, 0.0, 1.0)
        _check_number("temperature", self.temperature, 0.0, math.inf, low_open=True)
        if self.threshold is not None:
            _check_number("threshold", self.threshold, -math.inf, math.inf)
            self.threshold = float(self.threshold)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"GSCConfig.seed must be an int, got {self.seed!r}")
        if self.calibration is not None and not isinstance(self.calibration, dict):
            raise ValueError(f"GSCConfig.calibration must be a dict or None, got {type(self.calibration).__name__}")
        for name in ("base_model_name_or_path", "base_model_revision"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"GSCConfig.{name} must be a string or None, got {value!r}")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GSCConfig":
        unknown = set(values) - cls.field_names()
        if unknown:
            raise ValueError(f"unknown GSCConfig fields {sorted(unknown)}; known: {sorted(cls.field_names())}")
        return cls(**values)

    def save_pretrained(self, directory: str | os.PathLike) -> str:
        """Write ``gsc_config.json`` into ``directory``; returns its path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, CONFIG_NAME)
        with open(path, "w") as handle:
            json.dump({**self.to_dict(), "hf_gsc_version": __version__}, handle, indent=2, sort_keys=True)
        return path

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "GSCConfig":
        with open(path) as handle:
            try:
                values = json.load(handle)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} is not valid JSON: {error}") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path} must hold a JSON object of GSCConfig fields")
        return cls.from_dict(values)
