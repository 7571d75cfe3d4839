"""Mahalanobis distance to class-conditional Gaussians with a tied covariance (Lee et al., NeurIPS 2018)."""

from __future__ import annotations

from typing import Iterator

import torch

from ..features import ClassStatistics, mahalanobis_distances, tied_precision
from .base import register_detector
from .common import FittedDetector


def mahalanobis_score(features: torch.Tensor, class_means: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """``max_c -(F - mu_c)^T Sigma^-1 (F - mu_c)``: ``(B, D) -> (B,)``, float64."""
    return -mahalanobis_distances(features, class_means, precision).amin(dim=1)


class TiedGaussianDetector(FittedDetector):
    """Class means and a tied covariance of the penultimate features of the ID training data.

    The covariance is the within-class one, ``(1/N) sum_i (F_i - mu_{y_i})(F_i - mu_{y_i})^T``, with the
    true labels ``y_i``; its pseudo-inverse is the precision. Fitting needs at least ``D + K`` samples
    (``N - K`` degrees of freedom for a full-rank ``D x D`` covariance) and one sample of every class.
    """

    state_names = ("class_means", "precision")

    def fit_requirement(self) -> tuple[int, str]:
        return self.head.feature_dim + self.head.num_classes, "feature dim + classes, for a full-rank tied covariance"

    def _fit(self, stream: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        statistics = ClassStatistics(self.head.num_classes, second_moment=True)
        for features, labels in stream:
            statistics.update(features, labels)
        self.check_fit_count(statistics.count)
        self.class_means = statistics.class_means(self.name)
        self.precision = tied_precision(statistics.tied_covariance(self.name))


@register_detector
class MahalanobisDetector(TiedGaussianDetector):
    """Negative Mahalanobis distance to the closest class mean, :func:`mahalanobis_score`.

    Lee, Lee, Lee, Shin, "A Simple Unified Framework for Detecting Out-of-Distribution Samples and
    Adversarial Attacks", NeurIPS 2018 (code: github.com/pokaxpoka/deep_Mahalanobis_detector): class
    means and a tied covariance (``sklearn`` ``EmpiricalCovariance`` of class-centred features) on the
    ID training data. Like the comparisons in the KNN, ViM and OpenOOD papers, this uses the penultimate
    feature only, without the input pre-processing and the layer ensemble of the full method.
    """

    name = "mahalanobis"

    def _score(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return mahalanobis_score(self.features(pixel_values), self.class_means, self.precision)
