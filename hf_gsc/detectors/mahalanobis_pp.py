"""Mahalanobis++: Mahalanobis on L2-normalised features (Mueller & Hein, ICML 2025)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..settings.config import DetectorConfig, number_check, setting
from .backbone_pass import BackbonePass
from .interface import register_detector
from .mahalanobis import MahalanobisDetector, TiedGaussianDetector
from .penultimate import StatisticsPass


def check_normalisable(method: str, features: torch.Tensor, beta: float = 1.0) -> None:
    """Check that every fitting feature of a batch has a finite, non-zero L2 norm (``beta``: the exponent of the
    norm the feature is divided by, named in the error where it is not 1).

    ``z / ||z||_2`` of a zero feature (a ResNet whose pooled ReLU output is all zero) is NaN, and one NaN in the
    sums makes the covariance's eigendecomposition fail with an unrelated linear-algebra error; say so here instead,
    at the batch. (Scoring such a feature gives NaN, which the detector decides as OOD.)
    """
    norms = features.double().norm(dim=-1)
    bad = ~(torch.isfinite(norms) & (norms > 0))
    if bad.any():
        shaping = "L2-normalises the penultimate features (z / ||z||_2)" if beta == 1.0 else \
            f"divides the penultimate features by a power of their norm (z / ||z||_2^beta, beta = {beta:g})"
        raise ValueError(f"detector {method!r} {shaping}, so every ID "
                         f"fitting feature must be finite and non-zero; a fitting batch has {int(bad.sum())} of "
                         f"{len(bad)} zero or not finite")


# The mixin's base as a type checker sees it: the detectors it is mixed into. At run time, object: the detector class
# it is mixed into comes after it in the bases.
if TYPE_CHECKING:
    _MixedInto = TiedGaussianDetector
else:
    _MixedInto = object


class NormalisedFeatures(_MixedInto):
    """Mixin for a tied-Gaussian detector (:class:`~hf_gsc.detectors.mahalanobis.TiedGaussianDetector`): fit and
    score ``z / ||z||_2`` (Mahalanobis++), with the fitting features checked by :func:`check_normalisable`."""

    normalise_features: ClassVar[bool] = True

    def fit_update(self, batch: BackbonePass, labels: torch.Tensor | None) -> None:
        # Checked by each detector before the shared sums take the batch, so that the error names its own method.
        # (``beta <= 0`` divides by no positive power of the norm: a zero feature stays finite.)
        beta = self.radial_exponent()
        if beta > 0:
            check_normalisable(self.method, batch.flat_features(self.split, "cpu"), beta)
        super().fit_update(batch, labels)


@dataclass
class MahalanobisPPConfig(DetectorConfig):
    """Settings of Mahalanobis++ (:class:`MahalanobisPPDetector`)."""

    method: ClassVar[str] = "mahalanobis_pp"
    beta: float = setting(
        1.0, number_check(-math.inf, math.inf),
        "Exponent of the norm the feature is divided by, ``z / ||z||_2^beta`` (radially scaled L2 normalisation, "
        "Janiak, Binkowski & Kajdanowicz, arXiv:2510.15202): the norm ``r`` becomes ``r^(1 - beta)``, the direction "
        "is kept. 1: Mahalanobis++ as published (Mueller & Hein, ICML 2025; maha-norm's mdsn_postprocessor.py), "
        "0: plain ``mahalanobis``; any finite number.")


@register_detector
class MahalanobisPPDetector(NormalisedFeatures, MahalanobisDetector):
    """Mahalanobis on the L2-normalised penultimate feature ``z / ||z||_2`` (``z / ||z||_2^beta`` with ``beta``),
    fitted and scored.

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

    ``beta`` (:class:`MahalanobisPPConfig`): the radially scaled variant ``z / ||z||_2^beta`` of Janiak, Binkowski &
    Kajdanowicz, "A Geometry-Based View of Mahalanobis OOD Detection", arXiv:2510.15202 (v1: "Dissecting
    Mahalanobis"), ``phi_beta(z) = z / ||z||^beta`` fitted and scored as above; the default 1 is Mahalanobis++
    itself. No code of theirs was found (their OpenOOD fork, github.com/djaniak/OpenOOD, holds a plain L2-normalised
    ``mds_plus`` only), so this is the paper's formula inside the maha-norm code: ``all_feats / torch.norm(...)``
    becomes ``all_feats / torch.norm(...) ** beta`` on both sides. The paper picks ``beta`` per model from ID-only
    geometry statistics; that selection is not implemented, and no grid is published, so ``--tune`` leaves ``beta``
    as set. ``beta <= 0`` divides by no positive power of the norm, so a zero fitting feature is then allowed.
    """

    config_class = MahalanobisPPConfig
    search_space_source = ("maha-norm's mdsn.yml has no postprocessor_sweep, and the radially scaled "
                           "variant's authors choose beta from ID geometry statistics, with no published grid")
    #: ``fitted_beta``: the ``beta`` the state was fitted with, kept (and saved) where it is not 1; ``beta = 1`` is
    #: said by its absence, in the state as in the calibration record (:meth:`calibration_settings`), so that a
    #: Mahalanobis++ folder with no ``beta`` anywhere loads as ``beta = 1`` with its threshold.
    state_names = ("class_means", "precision", "fitted_beta")
    fitted_beta: torch.Tensor | None

    def expected_state(self) -> dict[str, tuple[int | None, ...]]:
        extra = {} if self.radial_exponent() == 1.0 else {"fitted_beta": (1,)}
        return {**super().expected_state(), **extra}

    def _fit(self, accumulated: StatisticsPass) -> None:
        super()._fit(accumulated)
        self.fitted_beta = torch.tensor([self.radial_exponent()], dtype=torch.float64)

    def fit_end(self) -> None:
        super().fit_end()
        if self.radial_exponent() == 1.0:
            self.fitted_beta = None  # not kept, nor saved, for the published normalisation

    def load_fitted_state(self, state: dict[str, torch.Tensor], source: str = "the saved state") -> None:
        if "fitted_beta" not in state:  # fitted with beta = 1: said so here, before the check names a missing tensor
            self._check_fitted_beta(1.0)
        super().load_fitted_state(state, source)

    def _prepare(self) -> None:
        self._check_fitted_beta(1.0 if self.fitted_beta is None else float(self.fitted_beta.reshape(-1)[0]))
        super()._prepare()

    def _check_fitted_beta(self, fitted: float) -> None:
        # The means and precision are of the features as scaled at the fit: scoring features scaled with another
        # beta would compare unlike things, so a load with another beta is refused (beta is structural: a fitted
        # detector refuses its assignment too).
        if fitted != self.radial_exponent():
            raise ValueError(f"{self.method}: the fitted state is of z / ||z||^beta with beta={fitted:g}, but "
                             f"beta={self.radial_exponent():g}; load it with beta={fitted:g} (what it was fitted "
                             f"with), or fit a new detector with beta={self.radial_exponent():g}")

    def calibration_settings(self, config: DetectorConfig | None = None) -> dict[str, Any]:
        # ``beta = 1`` is recorded by its absence (a record without ``beta`` is of the published normalisation); any
        # other ``beta`` is recorded, and a change of it drops the threshold.
        settings = super().calibration_settings(config)
        if settings.get("beta") == 1.0:
            del settings["beta"]
        return settings
