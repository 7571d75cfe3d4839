"""GSC as a registered detector, so the evaluation treats it like every baseline."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import GSCConfig
from ..modeling import GSCForImageClassification
from .base import Detector, register_detector


@register_detector
class GSCDetector(Detector):
    """Gradient Short-Circuit (this paper). Hyperparameters are ``GSCConfig`` fields; no fitting.

    ``score`` is ``GSCOutput.ood_score``: by default the energy of the first-order short-circuited logits.
    """

    name = "gsc"

    def __init__(self, model: nn.Module, **hyperparameters: Any) -> None:
        super().__init__(model, **hyperparameters)
        self.detector = (
            model if isinstance(model, GSCForImageClassification) else GSCForImageClassification(model, GSCConfig(**hyperparameters))
        )

    def _score(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.detector(pixel_values).ood_score
