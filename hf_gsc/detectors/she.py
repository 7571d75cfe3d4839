"""SHE: simplified Hopfield energy with stored class patterns (Zhang et al., ICLR 2023)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import ClassStatistics, LinearHead, StatisticsPass


def she_score(features: torch.Tensor, head: LinearHead, patterns: torch.Tensor) -> torch.Tensor:
    """``<F, S_c>`` with ``c = argmax(W F + b)`` the predicted class and ``S_c`` its stored pattern, ``(B,)``."""
    predicted = head(features).argmax(dim=-1)
    return (features.to(patterns.dtype) * patterns[predicted]).sum(dim=-1)


@dataclass
class SHEConfig(DetectorConfig):
    """SHE has no settings: its config holds the common fields only (threshold, calibration, base model)."""

    method: ClassVar[str] = "she"


@register_detector
class SHEDetector(FittedDetector):
    """Inner product of the feature with the stored pattern of its predicted class, :func:`she_score`.

    Zhang, Fu, Chen, Liu, Jiang, Zhou, Huang, "Out-of-Distribution Detection based on In-Distribution
    Data Patterns Memorization with Modern Hopfield Energy", ICLR 2023 (and OpenOOD's
    ``SHEPostprocessor``, inner-product metric). The stored pattern of class ``c`` is the mean
    penultimate feature of the ID training samples of class ``c`` that the model classifies correctly;
    every class needs at least one.
    """

    config_class = SHEConfig
    state_names = ("patterns",)

    def fit_requirement(self) -> tuple[int, str]:
        return self.head.num_classes, "one correctly classified sample per class"

    needs_labels = True

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"patterns": (self.num_classes, self.feature_dim)}

    def fit_accumulator(self) -> tuple[Hashable, Callable[[], StatisticsPass]]:
        # Streamed float64 sums of the correctly classified samples per class: K D numbers whatever N.
        return "correct class sums", lambda: StatisticsPass(ClassStatistics(self.head.num_classes), self._correct)

    def _correct(self, features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return features, labels, self.head(features).argmax(dim=-1) == labels

    def _fit(self, accumulated: StatisticsPass) -> None:
        self.check_fit_count(accumulated.count)
        self.patterns = accumulated.statistics.class_means(self.method, "correctly classified sample")

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return she_score(self.features(batch), self.head, self.patterns)
