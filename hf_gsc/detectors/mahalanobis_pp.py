"""Mahalanobis++: Mahalanobis on L2-normalised features (Mueller & Hein, ICML 2025)."""

from __future__ import annotations

from ..detector import register_detector
from .mahalanobis import MahalanobisDetector


@register_detector
class MahalanobisPPDetector(MahalanobisDetector):
    """Mahalanobis on the L2-normalised penultimate feature ``z / ||z||_2``, fitted and scored.

    Mueller & Hein, "Mahalanobis++: Improving OOD Detection via Feature Normalization", ICML 2025 (code:
    github.com/mueller-mp/maha-norm, ``mdsn_postprocessor.py``, the reference): the training features are normalised
    before the class means and the tied covariance (sklearn ``EmpiricalCovariance`` of the class-centred features)
    are fitted, and every scored feature is normalised the same way (no epsilon). The authors' code casts the
    centred features to float32 before sklearn; here they stay float64 (on a near-singular covariance float32
    changes the precision matrix, and the scores with it).
    """

    method = "mahalanobis_pp"
    normalise_features = True
