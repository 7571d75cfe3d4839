"""GradNorm: norm of the last-layer gradient of the KL divergence to uniform (Huang, Geng & Li, NeurIPS 2021)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig, number_check, setting
from .backbone_pass import BackbonePass
from .common import PenultimateDetector
from .interface import register_detector


def gradnorm_score(features: torch.Tensor, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``||dL/dW||_1`` per sample, in closed form: ``(1/T) * sum_k |K p_k - 1| * sum_j |F_j|``.

    ``L = -sum_k log softmax(y / T)_k`` (the authors' code: cross entropy against an all-ones target,
    ``K`` times ``KL(u || softmax)`` up to a constant), ``y = W F + b``. Then ``dL/dy_k = (K p_k - 1) / T``
    and ``dL/dW = (dL/dy) F^T``, whose entrywise L1 norm factorises.

    Args:
        features: ``F``, ``(B, D)``. logits: ``y``, ``(B, K)``.
    Returns:
        ``(B,)``.
    """
    probabilities = torch.softmax(logits / temperature, dim=-1)
    num_classes = logits.shape[-1]
    return (num_classes * probabilities - 1).abs().sum(dim=-1) * features.abs().sum(dim=-1) / temperature


@dataclass
class GradNormConfig(DetectorConfig):
    """Settings of GradNorm (:class:`GradNormDetector`)."""

    method: ClassVar[str] = "gradnorm"
    temperature: float = setting(1.0, number_check(0.0, math.inf, low_open=True),
                                 "``T`` of the softmax whose KL divergence to the uniform is differentiated; 1: "
                                 "the paper's setting.")


@register_detector
class GradNormDetector(PenultimateDetector):
    """L1 norm of the per-sample gradient of the KL divergence to the uniform distribution with respect to
    the classifier weight, :func:`gradnorm_score` (closed form; no backward pass).

    Huang, Geng, Li, "On the Importance of Gradients for Detecting Distributional Shifts in the Wild",
    NeurIPS 2021 (code: github.com/deeplearning-wisc/gradnorm_ood). Only the weight gradient counts, not
    the bias, as in the code. No fitting.

    Settings: :class:`GradNormConfig`.
    """

    config_class = GradNormConfig
    search_space = {"temperature": (1.0, 10.0, 100.0, 1000.0)}
    search_space_source = ("OpenOOD sweeps no temperature for GradNorm; its earlier ebo.yml list [1, 10, 100, 1000] "
                           "is searched, as for the other temperature-scaled scores")

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        features = self.features(batch)
        return gradnorm_score(features, self.head(features), self.hyperparameters["temperature"])
