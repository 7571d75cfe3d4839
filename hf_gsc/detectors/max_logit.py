"""MaxLogit: the largest logit (Hendrycks et al., ICML 2022)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig
from ..utils.scores import max_logit_score
from .backbone_pass import BackbonePass
from .common import BaselineDetector
from .interface import register_detector


@dataclass
class MaxLogitConfig(DetectorConfig):
    """MaxLogit has no settings: its config holds the common fields only (threshold, calibration, base model)."""

    method: ClassVar[str] = "max_logit"


@register_detector
class MaxLogitDetector(BaselineDetector):
    """``max_k y_k`` of the base model's logits ``y``.

    Hendrycks, Basart, Mazeika, Zou, Kwon, Mostajabi, Steinhardt, Song, "Scaling Out-of-Distribution
    Detection for Real-World Settings", ICML 2022. No hyperparameters, no fitting.
    """

    config_class = MaxLogitConfig
    in_default_table = True
    reads_logits = True

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return max_logit_score(batch.model_logits())
