"""NCI: neural-collapse-inspired OOD detection (Liu & Qin, CVPR 2025)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig, number_check, setting
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import LinearHead, StatisticsPass


def nci_score(features: torch.Tensor, head: LinearHead, train_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """``w_c . (z - mu) / ||z - mu||_2 + alpha ||z||_1``: ``c`` the predicted class (arg max of ``W z + b``, the
    bias included), ``w_c`` its weight row (not normalised), ``mu`` the mean ID training feature; the first term is
    the proximity of the centred feature to the class's weight, the second the norm filter; ``(B, D) -> (B,)``,
    float64."""
    features = features.double()
    predicted = head(features).argmax(dim=-1)
    centred = features - train_mean.double()
    alignment = (head.weight.double()[predicted] * centred).sum(dim=-1) / centred.norm(dim=-1)
    return alignment + alpha * features.abs().sum(dim=-1)


@dataclass
class NCIConfig(DetectorConfig):
    """Settings of NCI (:class:`NCIDetector`)."""

    method: ClassVar[str] = "nci"
    # alpha = 0 is the proximity term alone; a negative alpha would reward the small norms the filter rejects.
    alpha: float = setting(0.0001, number_check(0.0, math.inf),
                           "Weight of the ``||z||_1`` filter term; 1e-4: OpenOOD nci.yml ``alpha``.")


@register_detector
class NCIDetector(FittedDetector):
    """Alignment of the centred feature with the predicted class's weight plus an L1 norm term, :func:`nci_score`.

    Liu & Qin, "Detecting Out-of-Distribution through the Lens of Neural Collapse", CVPR 2025 (code: github.com/
    litianliu/NCI-OOD, which is OpenOOD v1.5's ``nci_postprocessor.py``, the reference here): ``mu`` is the mean
    penultimate feature of the ID training data, ``c`` the arg max of the logits (bias included), ``w_c`` the
    classifier's weight row of that class (the bias is not used in the proximity term, and ``w_c`` is not divided
    by its norm), and the norm term is the L1 norm of the uncentred feature ``z``.

    Settings: :class:`NCIConfig`.
    """

    config_class = NCIConfig
    search_space = {"alpha": (0.0001, 0.001, 0.01, 0.1)}
    search_space_source = "OpenOOD nci.yml postprocessor_sweep: alpha_list [0.0001, 0.001, 0.01, 0.1]"
    state_names = ("train_mean",)

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"train_mean": (self.feature_dim,)}

    fit_accumulator = FittedDetector.mean_accumulator

    def _fit(self, accumulated: StatisticsPass) -> None:
        # The mean in float64 over every training sample: OpenOOD's np.mean.
        self.train_mean = self.mean_feature(accumulated)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return nci_score(self.features(batch), self.head, self.train_mean, self.hyperparameters["alpha"])
