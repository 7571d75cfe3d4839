"""fDBD: fast decision-boundary-based OOD detection (Liu & Qin, ICML 2024)."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch import nn

from ..backbone_pass import BackbonePass
from ..config import DetectorConfig
from ..detector import register_detector
from ..features import ClassStatistics, LinearHead
from .common import FittedDetector


def boundary_denominators(weight: torch.Tensor) -> torch.Tensor:
    """``D[p, j] = ||w_j - w_p||_2`` (``1`` on the diagonal): the scale that turns the logit gap ``|y_j - y_p|`` into
    the feature-space distance to the boundary between classes ``p`` and ``j``; ``(K, D) -> (K, K)``, float64."""
    weight = weight.double()
    denominators = torch.cdist(weight, weight)
    return denominators.fill_diagonal_(1.0)


def fdbd_score(features: torch.Tensor, head: LinearHead, denominators: torch.Tensor, train_mean: torch.Tensor | None
               ) -> torch.Tensor:
    """``sum_j |y_j - y_c| / ||w_j - w_c|| / ||z - mu||`` (``||z||`` when ``train_mean`` is ``None``), ``c`` the
    predicted class: the mean distance to the decision boundaries, regularised; ``(B, D) -> (B,)``, float64."""
    features = features.double()
    logits = head(features)
    top, predicted = logits.max(dim=-1)
    distances = ((logits - top[:, None]).abs() / denominators[predicted]).sum(dim=-1)
    scale = features.norm(dim=-1) if train_mean is None else (features - train_mean.double()).norm(dim=-1)
    return distances / scale


@register_detector
class FDBDDetector(FittedDetector):
    """Distance to the decision boundaries over the distance to the ID mean feature, :func:`fdbd_score`.

    Liu & Qin, "Fast Decision Boundary based Out-of-Distribution Detector", ICML 2024 (code: github.com/litianliu/
    fDBD-OOD); the reference is OpenOOD v1.5's ``fdbd_postprocessor.py``: ``mu`` is the mean penultimate feature of
    the ID training data, the logits include the bias, the sum runs over every class (the predicted one adds 0).
    Like OpenOOD, and unlike the paper (which always divides by ``||z - mu||``), ``distance_as_normalizer=False``
    divides by ``||z||`` instead, a choice OpenOOD makes on validation data.

    Hyperparameters:
        distance_as_normalizer: ``True`` (OpenOOD fdbd.yml, the paper's regulariser ``||z - mu||``).
    """

    method = "fdbd"
    defaults = {"distance_as_normalizer": True}
    search_space = {"distance_as_normalizer": (True, False)}
    search_space_source = "OpenOOD fdbd.yml: distance_as_normalizer_list [True, False]"
    state_names = ("train_mean",)

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        # From the head alone (no fitting); a buffer so that .to(device) moves it, not saved.
        self.register_buffer("denominators", boundary_denominators(self.head_weight), persistent=False)

    def validate(self) -> None:
        if not isinstance(self.hyperparameters["distance_as_normalizer"], bool):
            raise ValueError(f"fdbd: distance_as_normalizer must be True or False, got "
                             f"{self.hyperparameters['distance_as_normalizer']!r}")

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"train_mean": (self.feature_dim,)}

    def _fit(self, stream: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        statistics = ClassStatistics(num_classes=1)
        for features, _ in stream:
            statistics.update(features, torch.zeros(features.shape[0], dtype=torch.long))
        self.check_fit_count(statistics.count)
        self.train_mean = statistics.class_sums[0] / statistics.count

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        mean = self.train_mean if self.hyperparameters["distance_as_normalizer"] else None
        return fdbd_score(self.features(batch), self.head, self.denominators, mean)
