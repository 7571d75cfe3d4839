"""RMDS++: relative Mahalanobis distance on L2-normalised features (Mueller & Hein, ICML 2025)."""

from __future__ import annotations

from ..detector import register_detector
from .rmds import RMDSDetector


@register_detector
class RMDSPPDetector(RMDSDetector):
    """RMDS on the L2-normalised penultimate feature ``z / ||z||_2``, fitted and scored.

    Mueller & Hein, "Mahalanobis++: Improving OOD Detection via Feature Normalization", ICML 2025 (code:
    github.com/mueller-mp/maha-norm, ``rmdsn_postprocessor.py``, the reference): the training features are normalised
    before the class and background Gaussians are fitted, and every scored feature the same way (no epsilon). As for
    ``mahalanobis_pp``, the statistics stay float64 where the authors' code casts to float32.
    """

    method = "rmds_pp"
    normalise_features = True
