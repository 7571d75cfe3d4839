"""Temperature scaling: the maximum softmax at a temperature fitted by NLL on ID labelled data (Guo et al., ICML 2017)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import FeatureStore, LinearHead, check_labels


#: The authors' optimiser (OpenOOD ``temp_scaling_postprocessor.py``, as gpleiss/temperature_scaling): the temperature
#: starts at 1.5 and takes one ``torch.optim.LBFGS(lr=0.01, max_iter=50)`` step on the mean cross-entropy.
INITIAL_TEMPERATURE = 1.5
LBFGS_LR = 0.01
LBFGS_MAX_ITER = 50


class LogitStore(FeatureStore):
    """Every fitting sample's logits ``W z + b`` (``K`` numbers, not the ``D`` of its feature) and label, one tensor
    per batch, in the features' stored precision (float32, float64 for a float64 model)."""

    def __init__(self, head: LinearHead) -> None:
        super().__init__()
        self.head = head

    def update(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        check_labels(labels, self.head.num_classes)
        super().update(self.head(features), labels)


def fit_temperature(logits: Sequence[torch.Tensor], labels: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(1,)`` float64: the temperature the authors' optimiser reaches on these logits and labels (per batch):
    ``T = 1.5``, then one ``LBFGS([T], lr=0.01, max_iter=50).step`` on ``mean CE(logits / T, labels)``. With that
    step size it need not reach the NLL minimum: this is the authors' temperature, not the minimiser's. The loss is
    summed batch by batch in float64 (the authors concatenate the logits: the same sum, rounded in another order)."""
    count = sum(batch.shape[0] for batch in labels)
    temperature = torch.nn.Parameter(torch.full((1,), INITIAL_TEMPERATURE, dtype=torch.float64))
    optimizer = torch.optim.LBFGS([temperature], lr=LBFGS_LR, max_iter=LBFGS_MAX_ITER)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = sum((torch.nn.functional.cross_entropy(batch.double() / temperature, target, reduction="sum")
                    for batch, target in zip(logits, labels)), temperature.new_zeros(())) / count
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return temperature.detach().clone()


def temperature_msp(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``max_k softmax(y / T)_k``, ``(B, K) -> (B,)`` (a tensor ``T`` stays on the device: no host read)."""
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    return torch.softmax(logits / temperature.to(logits), dim=-1).amax(dim=-1)


@dataclass
class TempScalingConfig(DetectorConfig):
    """Temperature scaling has no settings: the temperature is fitted (``temperature``, the fitted state); the
    config holds the common fields only (threshold, calibration, base model)."""

    method: ClassVar[str] = "temp_scaling"


@register_detector
class TempScalingDetector(FittedDetector):
    """The maximum softmax probability of the logits at a fitted temperature, :func:`temperature_msp`.

    Guo, Pleiss, Sun, Weinberger, "On Calibration of Modern Neural Networks", ICML 2017. Reference: OpenOOD v1.5
    ``temp_scaling_postprocessor.py`` (the optimiser of the authors' gpleiss/temperature_scaling): ``T`` from 1.5,
    one ``LBFGS(lr=0.01, max_iter=50)`` step on the mean cross-entropy of ``y / T`` (:func:`fit_temperature`). The
    paper minimises the NLL; that step size need not reach its minimum, and the code's temperature is the one kept
    here. OpenOOD fits on its ID validation split; here on the fit split, which is ID *training* data (labelled),
    never test or OOD data: a network fitted to its training set is more confident there than on held-out data, so
    the temperature may come out lower than on validation data. Fitted in float64 (OpenOOD: float32 on the GPU).

    Settings: :class:`TempScalingConfig`.
    """

    config_class = TempScalingConfig
    search_space_source = "OpenOOD temp_scaling.yml: no hyperparameters (the temperature is fitted)"
    state_names = ("temperature",)
    needs_labels = True

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"temperature": (1,)}

    def fit_accumulator(self) -> tuple[Hashable, Callable[[], LogitStore]]:
        # Logits, not features: K numbers per sample, and each of the optimiser's ~60 losses reads N K, not N D K.
        return "logits", lambda: LogitStore(self.head)

    def _fit(self, accumulated: LogitStore) -> None:
        self.check_fit_count(accumulated.count)
        temperature = fit_temperature(accumulated.features, accumulated.labels)
        if not (torch.isfinite(temperature).all() and temperature.item() > 0):
            raise ValueError(f"{self.method}: the fitted temperature is {temperature.item()}, not a positive number; "
                             "check the fitting labels (they must be the model's class indices)")
        self.temperature = temperature

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return temperature_msp(self.head(self.features(batch)), self.temperature)
