"""Mahalanobis distance to class-conditional Gaussians with a tied covariance (Lee et al., NeurIPS 2018)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..settings.config import DetectorConfig
from .backbone_pass import BackbonePass
from .common import FittedDetector
from .interface import register_detector
from .penultimate import (
    ClassStatistics,
    MahalanobisTerms,
    StatisticsPass,
    mahalanobis_distances,
    mahalanobis_terms,
    tied_precision,
    whitening,
)


def l2_normalised(features: torch.Tensor) -> torch.Tensor:
    """``z / ||z||_2`` row-wise in float64, as the Mahalanobis++ code (``features / torch.norm(features, dim=-1,
    keepdim=True)``, no epsilon)."""
    features = features.double()
    return features / features.norm(dim=-1, keepdim=True)


def radially_scaled(features: torch.Tensor, beta: float) -> torch.Tensor:
    """``z / ||z||_2^beta`` row-wise in float64: radially scaled L2 normalisation (Janiak, Binkowski & Kajdanowicz,
    arXiv:2510.15202), which keeps each feature's direction and maps its norm ``r`` to ``r^(1 - beta)``. ``beta = 1``
    is :func:`l2_normalised` (Mahalanobis++; that exact expression), ``beta = 0`` the feature itself."""
    if beta == 1.0:
        return l2_normalised(features)
    features = features.double()
    return features / features.norm(dim=-1, keepdim=True) ** beta


def mahalanobis_score(features: torch.Tensor, terms: MahalanobisTerms) -> torch.Tensor:
    """``max_c -(F - mu_c)^T Sigma^-1 (F - mu_c)``: ``(B, D) -> (B,)``, float64; ``terms`` from
    :func:`~hf_gsc.detectors.penultimate.mahalanobis_terms` of the class means and the precision."""
    return -mahalanobis_distances(features, terms).amin(dim=1)


class TiedGaussianDetector(FittedDetector):
    """Class means and a tied covariance of the penultimate features of the ID training data.

    The covariance is the within-class one, ``(1/N) sum_i (F_i - mu_{y_i})(F_i - mu_{y_i})^T``, with the
    true labels ``y_i``; its pseudo-inverse is the precision. Fitting needs at least ``D + K`` samples
    (``N - K`` degrees of freedom for a full-rank ``D x D`` covariance) and one sample of every class.
    """

    state_names: ClassVar[tuple[str, ...]] = ("class_means", "precision")  # subclasses add their own
    #: Fit and score the L2-normalised feature ``z / ||z||_2`` (Mahalanobis++, Mueller & Hein, ICML 2025), or its
    #: radially scaled form ``z / ||z||_2^beta`` with ``beta`` from :meth:`radial_exponent`.
    normalise_features: ClassVar[bool] = False

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        # Derived from the fitted means and precision by _prepare (MahalanobisTerms); buffers so that .to(device)
        # moves them with the rest.
        for name in MahalanobisTerms._fields:
            self.register_buffer(f"terms_{name}", None, persistent=False)
        # (precision, its whitening) handed from _fit_statistics to _prepare.
        self._fitted_whitening: tuple[torch.Tensor, torch.Tensor] | None = None

    def fit_requirement(self) -> tuple[int, str]:
        return self.head.feature_dim + self.head.num_classes, "feature dim + classes, for a full-rank tied covariance"

    def _prepare(self) -> None:
        # A fit just made hands over its whitening (shared by the family's methods fitted together), taken only for
        # the precision it was derived from (a fit that failed after deriving it leaves one behind); a load derives
        # it from the precision, by the same function.
        handed, self._fitted_whitening = self._fitted_whitening, None
        fitted = None
        if handed is not None and handed[0].shape == self.precision.shape and torch.equal(
                handed[0].to(self.precision), self.precision):
            fitted = handed[1]
        for name, value in mahalanobis_terms(self.class_means, self.precision, fitted)._asdict().items():
            setattr(self, f"terms_{name}", value)

    @property
    def terms(self) -> MahalanobisTerms:
        """The scoring terms of the class Gaussians (:func:`~hf_gsc.detectors.penultimate.mahalanobis_terms`)."""
        # float64 whatever .to(dtype) made of the buffers: the distances are float64.
        return MahalanobisTerms(**{name: getattr(self, f"terms_{name}").double() for name in MahalanobisTerms._fields})

    needs_labels = True

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {"class_means": (self.num_classes, self.feature_dim), "precision": (self.feature_dim, self.feature_dim)}

    def fit_accumulator(self) -> tuple[Hashable, Callable[[], StatisticsPass]]:
        # Streamed float64 class sums and sum of outer products of the shaped features: (K + D) D numbers whatever
        # N; shared by every method of the family fitted in the pass on the same shaping.
        return ("class gaussian", self.radial_exponent()), lambda: StatisticsPass(
            ClassStatistics(self.head.num_classes, second_moment=True), self._shape_for_fit)

    def _shape_for_fit(self, features: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return self.shaped(features), labels, None

    def _fit(self, accumulated: StatisticsPass) -> None:
        self.check_fit_count(accumulated.count)
        self._fit_statistics(accumulated.statistics)

    def _fit_statistics(self, statistics: ClassStatistics) -> None:
        """Set the fitted tensors from the streamed statistics of the (shaped) ID training features."""
        self.class_means = statistics.class_means(self.method)

        def precision_and_whitening() -> tuple[torch.Tensor, torch.Tensor]:
            precision = tied_precision(statistics.tied_covariance(self.method))
            return precision, whitening(precision)

        self.precision, whitened_by = statistics.derived("tied precision", precision_and_whitening)
        self._fitted_whitening = (self.precision, whitened_by)

    def radial_exponent(self) -> float:
        """``beta`` of the feature as fitted and scored, ``z / ||z||_2^beta``: 0 (``z`` itself) unless
        :attr:`normalise_features`, 1 (``z / ||z||_2``) there unless the method has a ``beta`` setting."""
        if not self.normalise_features:
            return 0.0
        return float(self.hyperparameters.get("beta", 1.0))

    def shaped(self, features: torch.Tensor) -> torch.Tensor:
        """The feature as fitted and scored: ``z``, or ``z / ||z||_2^beta`` with :attr:`normalise_features`
        (:func:`radially_scaled`, float64)."""
        return radially_scaled(features, self.radial_exponent()) if self.normalise_features else features

    def features(self, batch: BackbonePass) -> torch.Tensor:
        return self.shaped(super().features(batch))


@dataclass
class MahalanobisConfig(DetectorConfig):
    """Mahalanobis has no settings: its config holds the common fields only (threshold, calibration, base model)."""

    method: ClassVar[str] = "mahalanobis"


@register_detector
class MahalanobisDetector(TiedGaussianDetector):
    """Negative Mahalanobis distance to the closest class mean, :func:`mahalanobis_score`.

    Lee, Lee, Lee, Shin, "A Simple Unified Framework for Detecting Out-of-Distribution Samples and
    Adversarial Attacks", NeurIPS 2018 (code: github.com/pokaxpoka/deep_Mahalanobis_detector): class
    means and a tied covariance (``sklearn`` ``EmpiricalCovariance`` of class-centred features) on the
    ID training data. Like the comparisons in the KNN, ViM and OpenOOD papers, this uses the penultimate
    feature only, without the input pre-processing and the layer ensemble of the full method.
    """

    config_class: ClassVar[type[DetectorConfig]] = MahalanobisConfig  # Mahalanobis++ brings its own

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return mahalanobis_score(self.features(batch), self.terms)
