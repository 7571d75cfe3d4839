"""GEM: Gaussian mixture energy (Morteza & Li, AAAI 2022)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig
from .backbone_pass import BackbonePass
from .interface import register_detector
from .mahalanobis import TiedGaussianDetector
from .penultimate import MahalanobisTerms, mahalanobis_distances


def gem_score(features: torch.Tensor, terms: MahalanobisTerms) -> torch.Tensor:
    """``log sum_c exp(-1/2 (F - mu_c)^T Sigma^-1 (F - mu_c))``: ``(B, D) -> (B,)``, float64; ``terms`` from
    :func:`~hf_gsc.detectors.penultimate.mahalanobis_terms` (the nearest class, which dominates the sum, taken
    again: :func:`~hf_gsc.detectors.penultimate.mahalanobis_distances`)."""
    return torch.logsumexp(-0.5 * mahalanobis_distances(features, terms), dim=1)


@dataclass
class GEMConfig(DetectorConfig):
    """GEM has no settings: its config holds the common fields only (threshold, calibration, base model)."""

    method: ClassVar[str] = "gem"


@register_detector
class GEMDetector(TiedGaussianDetector):
    """Log-sum-exp over classes of ``-1/2`` squared Mahalanobis distances, :func:`gem_score`.

    Morteza & Li, "Provable Guarantees for Understanding Out-of-distribution Detection", AAAI 2022.
    Class means and the tied covariance are fitted on the ID training data exactly as for
    ``mahalanobis`` (penultimate feature, true labels).
    """

    config_class = GEMConfig

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return gem_score(self.features(batch), self.terms)
