"""Plumbing shared by the baseline detectors: hyperparameter defaults, logits, penultimate features, fitted state.

* :class:`BaselineDetector`: known hyperparameters with documented defaults (unknown names raise), the
  model's logits.
* :class:`TemperatureLogitDetector`: a score of the logits at a temperature (MSP, Energy).
* :class:`PenultimateDetector`: adds the penultimate feature ``F`` (input of the last ``nn.Linear``,
  ``(B, D)``) and the linear head (:class:`hf_gsc.features.LinearHead`).
* :class:`FittedDetector`: ``fit`` streams ``(features, labels)`` batches to ``_fit``; the fitted tensors
  are the attributes named in ``state_names`` and go to / come from safetensors unchanged.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Iterable, Iterator

import torch
from torch import nn

from ..features import LinearHead, check_fit_samples, linear_head, penultimate_features, penultimate_split
from ..scores import ood_score
from .base import Detector


class BaselineDetector(Detector):
    """A detector whose hyperparameters are exactly the keys of ``defaults``.

    The stored ``hyperparameters`` hold every value (defaults filled in), so a saved
    ``detector_config.json`` describes the method completely.
    """

    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, model: nn.Module, **hyperparameters: Any) -> None:
        unknown = sorted(set(hyperparameters) - set(self.defaults))
        if unknown:
            raise ValueError(
                f"unknown hyperparameters {unknown} for detector {self.name!r}; known: {sorted(self.defaults)}"
            )
        super().__init__(model, **{**self.defaults, **hyperparameters})
        self.validate()

    def validate(self) -> None:
        """Check ``self.hyperparameters``; raise ``ValueError`` naming the bad one."""

    def _number(self, name: str, low: float = -math.inf, high: float = math.inf, low_open: bool = False) -> float:
        value = self.hyperparameters[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{self.name}: {name} must be a finite number, got {value!r}")
        if value < low or value > high or (low_open and value == low):
            raise ValueError(f"{self.name}: {name} must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")
        return value

    def _integer(self, name: str, low: int = 1) -> int:
        value = self.hyperparameters[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{self.name}: {name} must be an integer >= {low}, got {value!r}")
        return value

    def logits(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The base model's logits ``(B, K)``, without gradient."""
        with torch.no_grad():
            return self.model(pixel_values=pixel_values).logits


class TemperatureLogitDetector(BaselineDetector):
    """Scores the base model's logits with ``hf_gsc.scores.ood_score(logits, score, temperature)``."""

    score_name: ClassVar[str]
    defaults = {"temperature": 1.0}

    def validate(self) -> None:
        self._number("temperature", 0.0, low_open=True)

    def _score(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return ood_score(self.logits(pixel_values), self.score_name, self.hyperparameters["temperature"])


class PenultimateDetector(BaselineDetector):
    """A detector on the penultimate feature ``F`` ``(B, D)`` and the linear head ``W F + b``."""

    def __init__(self, model: nn.Module, **hyperparameters: Any) -> None:
        super().__init__(model, **hyperparameters)
        self.split = penultimate_split(self.model)
        self.head: LinearHead = linear_head(self.model)

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W) -> (B, D)``, without gradient, on the CPU (where fitted statistics live)."""
        return self.split.features(pixel_values).flatten(1).cpu()

    def score(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """As :meth:`Detector.score`, returned on the device of ``pixel_values``."""
        return super().score(pixel_values).to(pixel_values.device)


class FittedDetector(PenultimateDetector):
    """A penultimate-feature detector with statistics fitted on ID data.

    Subclasses implement ``_fit(stream)``, which consumes ``(features (B, D), labels (B,))`` batches
    once, checks the count with :meth:`check_fit_count` and sets the attributes named in
    ``state_names``; ``_prepare()`` derives anything else from them (it also runs after
    :meth:`load_state_dict`). ``min_fit_samples`` is set per instance by :meth:`fit_requirement`.
    """

    needs_fit = True
    state_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: nn.Module, **hyperparameters: Any) -> None:
        super().__init__(model, **hyperparameters)
        self.min_fit_samples, self.fit_requirement_reason = self.fit_requirement()

    def fit_requirement(self) -> tuple[int, str]:
        """``(minimum number of fitting samples, why)`` for this model and these hyperparameters."""
        return 1, "at least one sample"

    def check_fit_count(self, got: int) -> None:
        """Raise :class:`hf_gsc.features.NotEnoughSamplesError` below ``min_fit_samples``."""
        check_fit_samples(self.name, got, self.min_fit_samples, self.fit_requirement_reason)

    def fit(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> "FittedDetector":
        self._fit(penultimate_features(self.model, batches))
        self._prepare()
        self.fitted = True
        return self

    def _fit(self, stream: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        raise NotImplementedError

    def _prepare(self) -> None:
        """Derive scoring-time tensors from the fitted state (default: nothing)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        if not self.fitted:
            return {}
        return {name: getattr(self, name) for name in self.state_names}

    def load_state_dict(self, state: dict[str, torch.Tensor], source: str = "the saved state") -> None:
        missing = sorted(set(self.state_names) - set(state))
        if missing:
            raise ValueError(f"detector {self.name!r}: saved state lacks {missing}")
        for name in self.state_names:
            setattr(self, name, state[name])
        self._prepare()
        self.fitted = True
