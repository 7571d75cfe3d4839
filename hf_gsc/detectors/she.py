"""SHE: simplified Hopfield energy with stored class patterns (Zhang et al., ICLR 2023)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Iterator

import torch

from ..settings.config import DetectorConfig
from .penultimate import ClassStatistics, LinearHead
from .backbone_pass import BackbonePass
from .interface import register_detector
from .common import FittedDetector


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

    def _fit(self, stream: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        statistics = ClassStatistics(self.head.num_classes)
        seen = 0
        for features, labels in stream:
            seen += features.shape[0]
            statistics.update(features, labels, keep=self.head(features).argmax(dim=-1) == labels)
        self.check_fit_count(seen)
        self.patterns = statistics.class_means(self.method, "correctly classified sample")

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return she_score(self.features(batch), self.head, self.patterns)
