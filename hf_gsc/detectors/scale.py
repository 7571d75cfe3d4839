"""SCALE: activation scaling (Xu, Chen, Franchi & Yao, ICLR 2024)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig, number_check, setting, split_point_check
from ..utils.feature_shapings import FeatureShaping, register_feature_shaping
from .ash import ShapedEnergyDetector, ash_keep_count
from .interface import register_detector
from .penultimate import linear_head


#: The authors' ``configs/postprocessors/scale.yml`` ``percentile: 85`` (also OpenOOD's), their ImageNet-1K
#: ResNet-50 setting.
DEFAULT_PERCENTILE = 85.0


def scale_factor(features: torch.Tensor, percentile: float) -> torch.Tensor:
    """``exp(s1 / s2)`` of each row of ``features`` ``(B, n)``, ``(B, 1)``: ``s1`` is the sample's sum of
    activations, ``s2`` the sum of its ``k = n - round(n p / 100)`` largest (ASH's keep count, :func:`ash_keep_count`).

    As the authors' ``scale()``, ``s2 = 0`` is not guarded: the factor is then infinite or NaN (ASH-S here leaves
    such a sample unscaled instead). A NaN score is OOD here."""
    k = ash_keep_count(features.shape[1], percentile)
    if k < 1:
        raise ValueError(f"SCALE: percentile {percentile} keeps no activation of {features.shape[1]} "
                         f"(k = n - round(n p / 100) = {k}); lower the percentile")
    s1 = features.sum(dim=1, keepdim=True)
    # The sum of the top-k values equals the authors' sum of the pruned tensor (zeros elsewhere).
    s2 = features.topk(k, dim=1).values.sum(dim=1, keepdim=True)
    return torch.exp(s1 / s2)


def scale_shape(features: torch.Tensor, percentile: float) -> torch.Tensor:
    """``z * exp(s1 / s2)`` of each row of ``features`` ``(B, n)`` (:func:`scale_factor`), as ``scale()`` of the
    SCALE code: the whole feature is scaled, nothing is pruned (ASH-S scales the pruned feature). ``(B, n)``."""
    return features * scale_factor(features, percentile)


@dataclass
class SCALEConfig(DetectorConfig):
    """Settings of activation scaling (:class:`SCALEDetector`)."""

    method: ClassVar[str] = "scale"
    percentile: float = setting(
        DEFAULT_PERCENTILE, number_check(0.0, 100.0),
        "Percentile of a sample's activations left out of ``s2``; 85: the authors' scale.yml ``postprocessor_args``, "
        "the paper's ImageNet-1K setting (their saved OpenOOD runs choose 65 on CIFAR-10/100 and 80 on ImageNet-200 "
        "by validation search).")
    split_point: str = setting(
        "penultimate", split_point_check(),
        "Where the activation is scaled; ``\"penultimate\"``: the input of the last ``nn.Linear``, as the authors' "
        "``scale`` on the pooled feature.")


@register_detector
class SCALEDetector(ShapedEnergyDetector):
    """Energy of the logits of the scaled feature, ``logsumexp(W (z * exp(s1 / s2)) + b)``, :func:`scale_shape`.

    Xu, Chen, Franchi, Yao, "Scaling for Training Time and Post-hoc Out-of-distribution Detection Enhancement", ICLR
    2024. Reference: the authors' code (github.com/kai422/SCALE, an OpenOOD fork: ``openood/networks/scale_net.py``
    ``scale`` and ``ScaleNet.forward_threshold``, ``openood/postprocessors/scale_postprocessor.py``), identical to
    OpenOOD v1.5's. No fitting: the scale is per sample.

    Where: like ASH, the activation that feeds the classifier (``split_point="penultimate"``: after global average
    pooling for ResNet, the ``[CLS]`` token after the final LayerNorm for ViT); the authors' ``scale`` takes the
    pooled ``(B, C, 1, 1)`` feature, so ``n = C``. ``split_point="final_encoder_output"`` scales the whole last
    feature map (``n = C H W``, the same function on a 4-D input) before the head's pooling.

    Code, followed here: ``exp(s1 / s2)`` from ASH-S's sums (``s2`` after pruning in place) multiplies a clone of the
    activation taken *before* pruning, so the head sees the whole feature scaled; ``k`` uses ``np.round`` (half to
    even), as :func:`ash_keep_count`. A sample whose kept activations sum to 0 gets an infinite or NaN score, as in
    the code (no guard; ASH-S here guards it).

    Settings: :class:`SCALEConfig`.
    """

    config_class = SCALEConfig
    search_space = {"percentile": (50.0, 55.0, 60.0, 65.0, 70.0, 75.0, 80.0, 85.0, 90.0, 95.0)}
    search_space_source = ("the authors' configs/postprocessors/scale.yml: percentile_list [50, 55, ..., 95] "
                           "(OpenOOD's scale.yml and the authors' saved runs sweep [65, 70, ..., 95])")

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        if self.split.name == "penultimate":
            # n is known now (the head's input); another split's n is known at the first batch (scale_factor).
            n = linear_head(self.model).feature_dim
            if ash_keep_count(n, self.hyperparameters["percentile"]) < 1:
                raise ValueError(f"scale: percentile {self.hyperparameters['percentile']} keeps none of the {n} "
                                 "penultimate activations (k = n - round(n p / 100) = 0); lower the percentile")

    def shape(self, flat: torch.Tensor) -> torch.Tensor:
        """The scaling (sums over the activations, ``exp(s1 / s2)``); the head and the energy follow as ASH's
        (:meth:`~hf_gsc.detectors.ash.ShapedEnergyDetector.score_batch`)."""
        return scale_shape(flat, self.hyperparameters["percentile"])


# GSC's feature_shaping="scale" shapes F with SCALE's own math.
register_feature_shaping("scale", FeatureShaping(shape=scale_shape,
                                                  default_percentile=lambda model: DEFAULT_PERCENTILE))
