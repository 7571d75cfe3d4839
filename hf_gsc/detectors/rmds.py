"""RMDS: relative Mahalanobis distance (Ren, Fort, Liu, Roy, Padhy & Lakshminarayanan, 2021)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig
from .backbone_pass import BackbonePass
from .interface import register_detector
from .mahalanobis import TiedGaussianDetector, mahalanobis_score
from .penultimate import ClassStatistics, MahalanobisTerms, tied_precision


def background_gaussian(statistics: ClassStatistics, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``mu_0`` ``(D,)`` and precision ``(D, D)`` of one Gaussian on all the fitting features, labels ignored,
    float64.

    The covariance is ``(1/N) sum_i (F_i - mu_0)(F_i - mu_0)^T`` (sklearn ``EmpiricalCovariance`` of ``F - mu_0``,
    as the authors' code), written by the law of total covariance as the tied within-class covariance plus the
    between-class one, ``sum_c (N_c / N) (mu_c - mu_0)(mu_c - mu_0)^T``: the same value, from the streamed
    statistics, without subtracting ``mu_0 mu_0^T`` from the raw second moment (which cancels digits where the
    features sit far from the origin relative to their spread, as L2-normalised ones do; the tied covariance is
    :class:`~hf_gsc.detectors.penultimate.ClassStatistics`' own, with whatever accuracy it has). The precision comes
    from :func:`~hf_gsc.detectors.penultimate.tied_precision`, as for the class Gaussians, so both inherit its rank cutoff.
    """
    class_means = statistics.class_means(method)
    weights = statistics.class_counts / statistics.count
    mean = weights @ class_means
    centred = class_means - mean
    covariance = statistics.tied_covariance(method) + (centred * weights[:, None]).T @ centred
    return mean, tied_precision(covariance)


def background_distance(features: torch.Tensor, mean: torch.Tensor, precision: torch.Tensor) -> torch.Tensor:
    """``(F - mu_0)^T Sigma_0^-1 (F - mu_0)``, ``(B, D) -> (B,)``, float64 (one Gaussian: the direct form)."""
    centred = features.double() - mean.double()
    return ((centred @ precision.double()) * centred).sum(dim=-1)


def rmds_score(features: torch.Tensor, terms: MahalanobisTerms, background_mean: torch.Tensor,
               background_precision: torch.Tensor) -> torch.Tensor:
    """``max_c [-d_c(F) + d_0(F)] = max_c -d_c(F) + d_0(F)``: the class-conditional squared Mahalanobis distances
    ``d_c`` (shared precision) relative to the squared distance ``d_0`` under the background Gaussian; ``(B, D) ->
    (B,)``, float64; ``terms``: :func:`~hf_gsc.detectors.penultimate.mahalanobis_terms` of the class means and
    precision. ``d_0`` does not depend on ``c``, so the max over classes is the Mahalanobis score plus ``d_0``."""
    return mahalanobis_score(features, terms) + background_distance(features, background_mean, background_precision)


@dataclass
class RMDSConfig(DetectorConfig):
    """RMDS has no settings: its config holds the common fields only (threshold, calibration, base model)."""

    method: ClassVar[str] = "rmds"


@register_detector
class RMDSDetector(TiedGaussianDetector):
    """Relative Mahalanobis distance, :func:`rmds_score`.

    Ren, Fort, Liu, Roy, Padhy, Lakshminarayanan, "A Simple Fix to Mahalanobis Distance for Improving Near-OOD
    Detection", arXiv:2106.09022, 2021. The reference is OpenOOD v1.5's ``rmds_postprocessor.py``: on the ID
    training features and their true labels, the class means and the tied covariance of the class-centred features
    (sklearn ``EmpiricalCovariance(assume_centered=False)``, ``precision_ = pinvh(covariance_)``), exactly as for
    ``mahalanobis``; and the background Gaussian (:func:`background_gaussian`): the mean of all the features and the
    ``EmpiricalCovariance`` of all of them centred on it. The score is ``max_c`` over classes of
    ``-d_c + d_0`` (OpenOOD's ``class_scores[:, c] - background_scores``, then ``torch.max``).

    Paper and code agree (the paper's ``RMD_k = MD_k - MD_0`` and confidence ``-min_k RMD_k``, squared distances).
    Differences from the code, all numerical:

    * OpenOOD computes the class means in float32 and casts the centred features to float32 before sklearn, then
      scores in float32. Here the statistics and the distances are float64 (returned as float32): with a float32
      model the features are the same, but float32 statistics change the precision matrix where the covariance is
      near-singular (ViT final-LayerNorm features), and ``-d_c + d_0`` is a difference of two large terms.
    * sklearn's ``pinvh`` cuts eigenvalues at ``D * eps`` of the largest, the level of rounding noise, so on a
      singular covariance (LayerNorm features sum to a constant) whether it inverts a noise eigenvalue depends on
      the rounding; :func:`~hf_gsc.detectors.penultimate.tied_precision` always drops eigenvalues below its stated cutoff
      (``PRECISION_RCOND`` of the largest). On a well-conditioned covariance the two are the same inverse.

    No hyperparameters.
    """

    config_class: ClassVar[type[DetectorConfig]] = RMDSConfig  # RMDS++ brings its own
    search_space_source = "no hyperparameters (OpenOOD's rmds.yml has no postprocessor_sweep)"
    state_names = ("class_means", "precision", "background_mean", "background_precision")

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        return {**super().expected_state(), "background_mean": (self.feature_dim,),
                "background_precision": (self.feature_dim, self.feature_dim)}

    def _fit_statistics(self, statistics: ClassStatistics) -> None:
        super()._fit_statistics(statistics)
        self.background_mean, self.background_precision = background_gaussian(statistics, self.method)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return rmds_score(self.features(batch), self.terms, self.background_mean, self.background_precision)
