"""RMDS: relative Mahalanobis distance (Ren, Fort, Liu, Roy, Padhy & Lakshminarayanan, 2021)."""

from __future__ import annotations

import torch

from ..backbone_pass import BackbonePass
from ..detector import register_detector
from ..features import ClassStatistics, mahalanobis_distances, tied_precision
from .mahalanobis import TiedGaussianDetector


def rmds_score(features: torch.Tensor, class_means: torch.Tensor, precision: torch.Tensor,
               background_mean: torch.Tensor, background_precision: torch.Tensor) -> torch.Tensor:
    """``max_c [-d_c(z) + d_0(z)]``: the class-conditional squared Mahalanobis distances relative to the distance
    ``d_0`` under one Gaussian of all ID training features; ``(B, D) -> (B,)``, float64."""
    background = mahalanobis_distances(features, background_mean[None, :], background_precision)[:, 0]
    return (-mahalanobis_distances(features, class_means, precision) + background[:, None]).amax(dim=1)


@register_detector
class RMDSDetector(TiedGaussianDetector):
    """Relative Mahalanobis distance, :func:`rmds_score`.

    Ren, Fort, Liu, Roy, Padhy, Lakshminarayanan, "A Simple Fix to Mahalanobis Distance for Improving Near-OOD
    Detection", 2021; the reference is OpenOOD v1.5's ``rmds_postprocessor.py``: class means and the tied covariance
    of the class-centred ID training features (sklearn ``EmpiricalCovariance``) as for Mahalanobis, and a background
    Gaussian: the mean and covariance of all ID training features. OpenOOD casts the centred features to float32
    before sklearn; here the statistics are float64 throughout (the same estimator, without the rounding).
    """

    method = "rmds"
    state_names = ("class_means", "precision", "background_mean", "background_precision")

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {**super().expected_state(), "background_mean": (self.feature_dim,),
                "background_precision": (self.feature_dim, self.feature_dim)}

    def _fit_statistics(self, statistics: ClassStatistics) -> None:
        super()._fit_statistics(statistics)
        mean = statistics.class_sums.sum(dim=0) / statistics.count
        self.background_mean = mean
        self.background_precision = tied_precision(statistics.outer / statistics.count - torch.outer(mean, mean))

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return rmds_score(self.features(batch), self.class_means, self.precision, self.background_mean,
                          self.background_precision)
