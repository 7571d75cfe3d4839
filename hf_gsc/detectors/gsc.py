"""GSC as a registered detector, so the evaluation treats it like every baseline."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..config import GSCConfig
from ..modeling import GSCForImageClassification
from ..serialization import apply_state, detector_state
from .base import Detector, register_detector


@register_detector
class GSCDetector(Detector):
    """Gradient Short-Circuit (this paper). Hyperparameters are ``GSCConfig`` fields.

    ``score`` is ``GSCOutput.ood_score``: by default the energy of the first-order short-circuited logits.
    Plain GSC needs no fitting. Two options beyond the paper do: ``selection="fisher"`` fits the diagonal
    Fisher on ID ``train`` data, ``mask_size="adaptive"`` calibrates its gradient mass on ID ``validation``
    data; the two cannot be fitted together because they need different splits.
    """

    name = "gsc"

    def __init__(self, model: nn.Module, **hyperparameters: Any) -> None:
        super().__init__(model, **hyperparameters)
        if isinstance(model, GSCForImageClassification):
            self.detector = model
        else:
            self.detector = GSCForImageClassification(model, GSCConfig(**hyperparameters))
        config = self.detector.config
        fisher, adaptive = config.selection == "fisher", config.mask_size == "adaptive" and config.gradient_mass is None
        if fisher and adaptive:
            raise ValueError("selection='fisher' (fit on train) and mask_size='adaptive' (fit on validation) "
                             "cannot be fitted together; set gradient_mass explicitly for one of them")
        self.needs_fit = fisher or adaptive
        self.fit_split = "validation" if adaptive else "train"

    def fit(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> "GSCDetector":
        if self.detector.config.selection == "fisher":
            self.detector.fit_fisher(batches)
        elif self.detector.config.mask_size == "adaptive":
            self.detector.calibrate_gradient_mass(batches)
        self.fitted = True
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        return detector_state(self.detector)

    def load_state_dict(self, state: dict[str, torch.Tensor], source: str = "the saved state") -> None:
        apply_state(self.detector, state, source)
        self.fitted = True

    def _score(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.detector(pixel_values).ood_score
