"""SCALE: activation scaling (Xu, Chen, Franchi & Yao, ICLR 2024)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..backbone_pass import BackbonePass
from ..backends.shaped import FeatureShaping, register_feature_shaping
from ..config import DetectorConfig
from ..detector import register_detector
from ..precision import full_precision, parameter_dtype, step_dtype
from ..scores import energy_score
from ..split_points import SplitPoint, resolve_split_point, validate_split_point_name
from .ash import ash_keep_count
from .common import BaselineDetector

#: OpenOOD scale.yml and the SCALE paper's ImageNet ResNet-50 setting.
DEFAULT_PERCENTILE = 85.0


def scale_shape(features: torch.Tensor, percentile: float) -> torch.Tensor:
    """``z * exp(s1 / s2)`` of each row of ``features`` ``(B, n)``, as ``scale`` of the SCALE code: ``s1`` is the
    sample's sum of activations, ``s2`` the sum of its ``k = n - round(n p / 100)`` largest; the feature itself is
    not pruned (unlike ASH-S). Returns ``(B, n)``."""
    k = ash_keep_count(features.shape[1], percentile)
    if k < 1:
        raise ValueError(f"SCALE at percentile {percentile} keeps no activation of {features.shape[1]}; lower it")
    s1 = features.sum(dim=1, keepdim=True)
    s2 = features.topk(k, dim=1).values.sum(dim=1, keepdim=True)
    return features * torch.exp(s1 / s2)


@register_detector
class SCALEDetector(BaselineDetector):
    """Energy of the logits of the scaled penultimate feature, :func:`scale_shape`.

    Xu, Chen, Franchi, Yao, "Scaling for Training Time and Post-hoc Out-of-distribution Detection Enhancement", ICLR
    2024 (code: github.com/kai422/SCALE; OpenOOD v1.5 ``scale_postprocessor.py`` and ``networks/scale_net.py``, the
    reference). No fitting: the scale is per sample. Where: like ASH, the activation that feeds the classifier
    (``split_point="penultimate"``). A sample whose kept activations sum to 0 gets an infinite or NaN score, as in the
    authors' code (which divides by that sum); a NaN score is OOD here.

    Hyperparameters:
        percentile: ``85`` (OpenOOD scale.yml; the paper's ImageNet setting).
        split_point: ``"penultimate"``.
    """

    method = "scale"
    defaults = {"percentile": DEFAULT_PERCENTILE, "split_point": "penultimate"}
    search_space = {"percentile": (65.0, 70.0, 75.0, 80.0, 85.0, 90.0, 95.0)}
    search_space_source = "OpenOOD scale.yml: percentile_list [65, 70, 75, 80, 85, 90, 95]"

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        self.split = resolve_split_point(self.model, self.hyperparameters["split_point"])

    def feature_splits(self) -> tuple[SplitPoint, ...]:
        return (self.split,)

    def validate(self) -> None:
        self._number("percentile", 0.0, 100.0)
        validate_split_point_name(self.hyperparameters["split_point"])

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        """The scaling (sums over the activations, ``exp(s1 / s2)``), the head and the energy in float32 or wider
        with autocast off (:mod:`hf_gsc.precision`), as ASH's."""
        features = batch.features(self.split)
        with full_precision(features.device), torch.no_grad():
            flat = features.flatten(1).to(step_dtype(features.dtype))
            shaped = scale_shape(flat, self.hyperparameters["percentile"]).view(features.shape)
            logits = self.split.head(shaped.to(parameter_dtype(self.model)), batch.pixel_values)
            return energy_score(logits.to(flat.dtype))


# GSC's feature_shaping="scale" shapes F with SCALE's own math.
register_feature_shaping("scale", FeatureShaping(shape=scale_shape, default_percentile=lambda model: DEFAULT_PERCENTILE))
