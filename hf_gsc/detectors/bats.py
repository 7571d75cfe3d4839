"""BATS: the penultimate feature truncated to the typical set of the last BatchNorm (Zhu et al., NeurIPS 2022)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig, choice_check, number_check, setting
from ..utils.scores import ood_score
from .backbone_pass import BackbonePass
from .common import PenultimateDetector
from .interface import register_detector


#: The OOD scores BATS boosts without a backward pass (the authors' code also runs ODIN and GradNorm on the truncated
#: features; those need gradients of their own).
BATS_SCORES = ("energy", "msp")


def last_batchnorm(model: nn.Module, width: int) -> nn.modules.batchnorm._BatchNorm | None:
    """The last affine BatchNorm layer of ``model`` (in the order its modules are registered, which for the
    Hugging Face CNNs is their order in the forward) with ``width`` channels; ``None`` when there is none."""
    found = None
    for module in model.modules():
        if (isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine
                and module.num_features == width):
            found = module
    return found


def bats_truncate(features: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, lam: float) -> torch.Tensor:
    """The authors' two ``torch.where``: values above ``mean + lam std`` set to it, then values below
    ``mean - lam std`` set to that (in this order: a negative ``std``, a BatchNorm weight below 0, leaves every value at
    the second bound). ``features (B, D)``, ``mean`` and ``std`` ``(D,)``."""
    mean, std = mean.to(features), std.to(features)
    upper, lower = std * lam + mean, -std * lam + mean
    features = torch.where(features < upper, features, upper)
    return torch.where(features > lower, features, lower)


@dataclass
class BATSConfig(DetectorConfig):
    """Settings of BATS (:class:`BATSDetector`)."""

    method: ClassVar[str] = "bats"
    lam: float = setting(1.05, number_check(0.0, math.inf), "``lambda``, the half-width of the typical set in BatchNorm "
                         "standard deviations; 1.05: the authors' ImageNet setting (test_ood.py ``lam``; CIFAR-10: "
                         "3.25).")
    score: str = setting("energy", choice_check(BATS_SCORES), "The score of the truncated features' logits; energy: "
                         "the authors' ``--score`` default (test_ood.py; msp is their other gradient-free one).")


@register_detector
class BATSDetector(PenultimateDetector):
    """The energy (or MSP) of the logits of the penultimate feature truncated to ``[beta - lam gamma, beta + lam
    gamma]``, :func:`bats_truncate`, with ``(gamma, beta)`` the weight and bias of the model's last BatchNorm.

    Zhu, Chen, Xie, Li, Zhang, Xue, Tian, Zheng, Chen, "Boosting Out-of-distribution Detection with Typical Features",
    NeurIPS 2022. Reference: the authors' code, alibaba/easyrobust ``examples/ood_detection/BATS/test_ood.py``
    (``iterate_data_energy`` / ``iterate_data_msp``): the head's input ``model.forward_features(x)`` is clipped with two
    ``torch.where`` to ``feature_mean -+ lam feature_std``, then ``model.forward_head`` and the score. The code loads
    ``feature_mean`` / ``feature_std`` from saved ``.pt`` files whose making is not in the repository; the paper
    estimates the typical set with the BatchNorm's learnt ``beta`` and ``gamma`` (BatchNorm makes each channel
    ``N(beta, gamma^2)``), which is what is read here, from the last affine BatchNorm with as many channels as the
    feature (:func:`last_batchnorm`). No fitting. A model without one (a ViT, a ConvNeXt: LayerNorm) is refused when the detector is built, and ``hf-gsc
    evaluate`` skips the method there with that reason.

    Settings: :class:`BATSConfig`.
    """

    config_class = BATSConfig
    # The model's last BatchNorm's beta and gamma, as buffers (registered in __init__).
    batchnorm_mean: torch.Tensor
    batchnorm_std: torch.Tensor
    search_space_source = "the authors' code fixes lam per benchmark (ImageNet 1.05, CIFAR-10 3.25): no sweep"

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        width = self.head.feature_dim
        batchnorm = last_batchnorm(self.model, width)
        if batchnorm is None:
            raise ValueError(
                f"bats: {type(model).__name__} has no affine BatchNorm layer of the feature width {width}; BATS "
                "truncates the penultimate feature to that BatchNorm's beta -+ lam gamma, so it applies to BatchNorm "
                "CNNs (ResNet, ...) only")
        # The base model's own parameters (not saved), as buffers so that .to(device) moves them with the head.
        self.register_buffer("batchnorm_mean", batchnorm.bias.detach(), persistent=False)
        self.register_buffer("batchnorm_std", batchnorm.weight.detach(), persistent=False)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        truncated = bats_truncate(self.features(batch), self.batchnorm_mean, self.batchnorm_std,
                                  self.hyperparameters["lam"])
        return ood_score(self.head(truncated), self.hyperparameters["score"])
