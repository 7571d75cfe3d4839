"""fDBD: fast decision-boundary-based OOD detection (Liu & Qin, ICML 2024)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig, bool_check, setting
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import LinearHead, StatisticsPass


def boundary_denominators(weight: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """``D[i, j] = ||w_j - w_c||_2`` with ``c = predicted[i]`` (``1`` where ``j = c``): the scale that turns the
    logit gap ``|y_j - y_c|`` into the feature-space distance to the boundary between classes ``c`` and ``j``;
    ``weight`` ``(K, D)``, ``predicted`` ``(B,)`` -> ``(B, K)``, float64.

    OpenOOD precomputes all ``K x K`` of them; only the predicted rows are needed, and a ``K x K`` float64 matrix
    is 3.8 GB for a 21841-class head (this costs one more ``B x K x D`` pass, like the head's own). Differences
    are taken directly (no ``|a|^2 + |b|^2 - 2 a.b``, which cancels for close weight rows), as the authors do.
    """
    weight = weight.double()
    denominators = torch.cdist(weight[predicted], weight, compute_mode="donot_use_mm_for_euclid_dist")
    return denominators.scatter(-1, predicted[:, None], 1.0)


def fdbd_score(features: torch.Tensor, head: LinearHead, train_mean: torch.Tensor | None) -> torch.Tensor:
    """``sum_j |y_j - y_c| / ||w_j - w_c||_2 / ||z - mu||_2`` (``||z||_2`` when ``train_mean`` is ``None``), ``y =
    W z + b`` the logits, ``c`` the predicted class (its own term is ``0 / 1``), ``mu`` the ID training mean:
    the distances to the decision boundaries, regularised by the distance to the ID mean; ``(B, D) -> (B,)``,
    float64."""
    features = features.double()
    logits = head(features)
    top, predicted = logits.max(dim=-1)
    distances = ((logits - top[:, None]).abs() / boundary_denominators(head.weight, predicted)).sum(dim=-1)
    scale = features.norm(dim=-1) if train_mean is None else (features - train_mean.double()).norm(dim=-1)
    return distances / scale


@dataclass
class FDBDConfig(DetectorConfig):
    """Settings of fast decision-boundary distances (:class:`FDBDDetector`)."""

    method: ClassVar[str] = "fdbd"
    distance_as_normalizer: bool = setting(
        True, bool_check,
        "Divide by the distance to the ID training mean ``||z - mu||`` (the paper's regulariser); True: OpenOOD "
        "fdbd.yml.")


@register_detector
class FDBDDetector(FittedDetector):
    """Distance to the decision boundaries over the distance to the ID mean feature, :func:`fdbd_score`.

    Liu & Qin, "Fast Decision Boundary based Out-of-Distribution Detector", ICML 2024 (code: github.com/litianliu/
    fDBD-OOD ``run_imagenet.py``; OpenOOD v1.5 ``fdbd_postprocessor.py``, the reference here, which the authors
    contributed). ``mu`` is the mean penultimate feature of the ID training data; the logits include the bias;
    ``c`` is the arg max of the logits. Where paper and code differ, this follows the code:

    * the paper averages the distances over the ``K - 1`` other classes; both codes sum them over every class
      (the predicted one adds ``0``): a constant factor ``1 / (K - 1)``, the same ranking;
    * OpenOOD's ``distance_as_normalizer=False`` divides by ``||z||`` instead of the paper's (and the authors'
      repository's) ``||z - mu||``, a choice OpenOOD makes on validation data (its sweep).

    Settings: :class:`FDBDConfig`.
    """

    config_class = FDBDConfig
    search_space = {"distance_as_normalizer": (True, False)}
    search_space_source = "OpenOOD fdbd.yml postprocessor_sweep: distance_as_normalizer_list [True, False]"
    state_names = ("train_mean",)

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"train_mean": (self.feature_dim,)}

    fit_accumulator = FittedDetector.mean_accumulator

    def _fit(self, accumulated: StatisticsPass) -> None:
        # Fitted whatever distance_as_normalizer says, as OpenOOD does: the sweep switches it after fitting.
        self.train_mean = self.mean_feature(accumulated)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        mean = self.train_mean if self.hyperparameters["distance_as_normalizer"] else None
        return fdbd_score(self.features(batch), self.head, mean)
