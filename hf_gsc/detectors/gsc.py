"""GSC as a registered detector, so the evaluation treats it like every baseline."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..config import GSCConfig
from ..modeling import GSCForImageClassification
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
        state = self.detector.state_dict_for_saving()
        if self.detector.config.gradient_mass is not None:
            state["gradient_mass"] = torch.tensor(self.detector.config.gradient_mass, dtype=torch.float64)
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if "fisher_diagonal" in state:
            self.detector.fisher_diagonal = state["fisher_diagonal"]
        if "gradient_mass" in state:
            self.detector.config.gradient_mass = float(state["gradient_mass"])
        self.fitted = True

    def _score(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.detector(pixel_values).ood_score
