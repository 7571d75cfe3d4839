"""Deep nearest neighbours (Sun, Ming, Zhu & Li, ICML 2022)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig, integer_check, setting
from .penultimate import FeatureStore
from .backbone_pass import BackbonePass
from .interface import register_detector
from .common import FittedDetector


def l2_normalise(features: torch.Tensor) -> torch.Tensor:
    """``x / (||x||_2 + 1e-10)`` row-wise, the normaliser of the KNN code."""
    return features / (features.norm(dim=-1, keepdim=True) + 1e-10)


def knn_score(features: torch.Tensor, bank: torch.Tensor, k: int, chunk_size: int = 4096) -> torch.Tensor:
    """``-||z - z_(k)||_2``: minus the distance of the normalised feature to its ``k``-th nearest normalised
    training feature. ``features (B, D)``, ``bank (N, D)`` already normalised; returns ``(B,)``."""
    query = l2_normalise(features.to(bank.dtype))
    nearest = []
    for start in range(0, bank.shape[0], chunk_size):
        distances = torch.cdist(query, bank[start : start + chunk_size])
        nearest.append(distances.topk(min(k, distances.shape[1]), dim=1, largest=False).values)
    kth = torch.cat(nearest, dim=1).topk(k, dim=1, largest=False).values[:, -1]
    return -kth


@dataclass
class KNNConfig(DetectorConfig):
    """Settings of deep nearest neighbours (:class:`KNNDetector`)."""

    method: ClassVar[str] = "knn"
    k: int = setting(50, integer_check(1), "The neighbour whose distance is the score: the ``k``-th nearest. 50: the "
                     "paper's CIFAR-10 setting (1000 with 1% of the training set on ImageNet).")


@register_detector
class KNNDetector(FittedDetector):
    """Minus the distance to the ``k``-th nearest L2-normalised ID training feature, :func:`knn_score`.

    Sun, Ming, Zhu, Li, "Out-of-Distribution Detection with Deep Nearest Neighbors", ICML 2022 (code:
    github.com/deeplearning-wisc/knn-ood). The authors' faiss index returns squared distances; the
    ranking, hence every metric, is the same. The bank is the whole normalised training feature set
    ``(N, D)`` (features, not images).

    Settings: :class:`KNNConfig`.
    """

    config_class = KNNConfig
    search_space = {"k": (1, 10, 50, 100, 200, 500, 1000)}
    search_space_source = ("OpenOOD knn.yml: K_list [50, 100, 200, 500, 1000] (for banks of 50k-1.2M images); 1 and 10 "
                           "added since the bank here is the --max-fit-samples subset. A k above the bank size is left out")
    state_names = ("bank",)

    def fit_requirement(self) -> tuple[int, str]:
        return self.hyperparameters["k"], f"k={self.hyperparameters['k']} neighbours"

    def _fit(self, accumulated: FeatureStore) -> None:
        # Normalised batch by batch into the one bank tensor: the fit holds the stored features and the bank, never a
        # concatenation of either.
        self.check_fit_count(accumulated.count)
        batches = accumulated.features
        self.bank = torch.empty(accumulated.count, batches[0].shape[1], dtype=batches[0].dtype)
        filled = 0
        for features in batches:
            self.bank[filled:filled + features.shape[0]] = l2_normalise(features)
            filled += features.shape[0]

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"bank": (None, self.feature_dim)}

    def _prepare(self) -> None:
        self.check_fit_count(self.bank.shape[0])

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return knn_score(self.features(batch), self.bank, self.hyperparameters["k"])
