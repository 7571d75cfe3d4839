"""DICE: directed sparsification of the last layer (Sun & Li, ECCV 2022)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig, number_check, setting
from ..utils.scores import energy_score
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import LinearHead, StatisticsPass, percentile


def dice_mask(weight: torch.Tensor, mean_features: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep the weights whose contribution ``V = mean_F * W`` (``(K, D)``) exceeds its ``sparsity``-th percentile."""
    contribution = mean_features.to(weight.dtype)[None, :] * weight
    return contribution > percentile(contribution, sparsity)


def dice_logits(features: torch.Tensor, head: LinearHead, mask: torch.Tensor) -> torch.Tensor:
    """``(W * M) F + b``: logits through the sparsified weight. ``(B, D) -> (B, K)``."""
    return LinearHead(head.weight * mask, head.bias)(features)


@dataclass
class DICEConfig(DetectorConfig):
    """Settings of directed sparsification (:class:`DICEDetector`)."""

    method: ClassVar[str] = "dice"
    sparsity: float = setting(90.0, number_check(0.0, 100.0),
                              "Percentile ``p`` of the weight contributions pruned; 90: the paper's CIFAR setting "
                              "(70 for ImageNet).")


@register_detector
class DICEDetector(FittedDetector):
    """Energy of the logits through the DICE-sparsified classifier weight.

    Sun & Li, "DICE: Leveraging Sparsification for Out-of-Distribution Detection", ECCV 2022 (code:
    github.com/deeplearning-wisc/dice). The contribution matrix ``V = E_train[F] * W`` uses the mean
    penultimate feature of the ID training data; weights with ``V`` at or below the ``sparsity``-th
    percentile of ``V`` are set to zero.

    Settings: :class:`DICEConfig`.
    """

    config_class = DICEConfig
    search_space = {"sparsity": (50.0, 70.0, 90.0)}
    search_space_source = ("OpenOOD dice.yml fixes p = 90 (p_list [90]); searched here because DICE at 90 can sit "
                           "near chance")
    state_names = ("mean_features",)

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        # Derived from the fitted mean by _prepare; a buffer so that .to(device) moves it with the rest.
        self.register_buffer("mask", None, persistent=False)

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"mean_features": (self.feature_dim,)}

    fit_accumulator = FittedDetector.mean_accumulator

    def _fit(self, accumulated: StatisticsPass) -> None:
        self.mean_features = self.mean_feature(accumulated)

    def _prepare(self) -> None:
        self.mask = dice_mask(self.head.weight, self.mean_features, self.hyperparameters["sparsity"])

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return energy_score(dice_logits(self.features(batch), self.head, self.mask))
