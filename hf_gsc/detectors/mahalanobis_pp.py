"""Mahalanobis++: Mahalanobis on L2-normalised features (Mueller & Hein, ICML 2025)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..settings.config import DetectorConfig
from .backbone_pass import BackbonePass
from .interface import register_detector
from .mahalanobis import MahalanobisDetector


def check_normalisable(method: str, features: torch.Tensor) -> None:
    """Check that every fitting feature of a batch has a finite, non-zero L2 norm.

    ``z / ||z||_2`` of a zero feature (a ResNet whose pooled ReLU output is all zero) is NaN, and one NaN in the
    sums makes the covariance's eigendecomposition fail with an unrelated linear-algebra error; say so here instead,
    at the batch. (Scoring such a feature gives NaN, which the detector decides as OOD.)
    """
    norms = features.double().norm(dim=-1)
    bad = ~(torch.isfinite(norms) & (norms > 0))
    if bad.any():
        raise ValueError(f"detector {method!r} L2-normalises the penultimate features (z / ||z||_2), so every ID "
                         f"fitting feature must be finite and non-zero; a fitting batch has {int(bad.sum())} of "
                         f"{len(bad)} zero or not finite")


class NormalisedFeatures:
    """Mixin for a tied-Gaussian detector (:class:`~hf_gsc.detectors.mahalanobis.TiedGaussianDetector`): fit and
    score ``z / ||z||_2`` (Mahalanobis++), with the fitting features checked by :func:`check_normalisable`."""

    normalise_features: ClassVar[bool] = True

    def fit_update(self, batch: BackbonePass, labels: torch.Tensor | None) -> None:
        # Checked by each detector before the shared sums take the batch, so that the error names its own method.
        check_normalisable(self.method, batch.flat_features(self.split, "cpu"))
        super().fit_update(batch, labels)


@dataclass
class MahalanobisPPConfig(DetectorConfig):
    """Mahalanobis++ has no settings: its config holds the common fields only (threshold, calibration, base model)."""

    method: ClassVar[str] = "mahalanobis_pp"


@register_detector
class MahalanobisPPDetector(NormalisedFeatures, MahalanobisDetector):
    """Mahalanobis on the L2-normalised penultimate feature ``z / ||z||_2``, fitted and scored.

    Mueller & Hein, "Mahalanobis++: Improving OOD Detection via Feature Normalization", ICML 2025. The reference is
    the authors' code, github.com/mueller-mp/maha-norm, ``OpenOOD/openood/postprocessors/mdsn_postprocessor.py``:
    OpenOOD's ``mds`` with ``all_feats = all_feats / torch.norm(all_feats, dim=-1, keepdim=True)`` after the
    training features are gathered and ``features = features / torch.norm(features, dim=-1, keepdim=True)`` before
    scoring (no epsilon; :func:`~hf_gsc.detectors.mahalanobis.l2_normalised`); then the class means, the tied
    covariance of the class-centred normalised features (sklearn ``EmpiricalCovariance(assume_centered=False)``)
    and ``max_c -(F - mu_c)^T Sigma^-1 (F - mu_c)``, as ``mahalanobis``.

    Paper and code agree. Differences from the code, numerical only (as for ``rmds``): the authors normalise, centre
    and score in float32 and fit sklearn on float32 centred features; here normalisation, statistics and distances
    are float64 (returned as float32), and the precision is :func:`~hf_gsc.detectors.penultimate.tied_precision`'s, with its
    stated rank cutoff where sklearn's ``pinvh`` cuts at the level of rounding noise. A zero fitting feature, NaN in
    the authors' code, is refused (:func:`check_normalisable`).

    No hyperparameters.
    """

    config_class = MahalanobisPPConfig
    search_space_source = "no hyperparameters (maha-norm's mdsn.yml has no postprocessor_sweep)"
