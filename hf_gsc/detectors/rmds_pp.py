"""RMDS++: relative Mahalanobis distance on L2-normalised features (Mueller & Hein, ICML 2025)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..settings.config import DetectorConfig
from .interface import register_detector
from .mahalanobis_pp import NormalisedFeatures
from .rmds import RMDSDetector


@dataclass
class RMDSPPConfig(DetectorConfig):
    """RMDS++ has no settings: its config holds the common fields only (threshold, calibration, base model)."""

    method: ClassVar[str] = "rmds_pp"


@register_detector
class RMDSPPDetector(NormalisedFeatures, RMDSDetector):
    """RMDS (:func:`~hf_gsc.detectors.rmds.rmds_score`) on the L2-normalised penultimate feature ``z / ||z||_2``,
    fitted and scored.

    Mueller & Hein, "Mahalanobis++: Improving OOD Detection via Feature Normalization", ICML 2025. The reference is
    the authors' code, github.com/mueller-mp/maha-norm, ``OpenOOD/openood/postprocessors/rmdsn_postprocessor.py``:
    OpenOOD's ``rmds`` with the training features normalised (``all_feats / torch.norm(all_feats, dim=-1,
    keepdim=True)``, no epsilon) before the class Gaussians and the background Gaussian (mean and
    ``EmpiricalCovariance`` of all normalised features) are fitted, and every scored feature normalised the same
    way before ``max_c -d_c + d_0``.

    Paper and code agree. Differences from the code, numerical only, as for ``rmds`` and ``mahalanobis_pp``: float64
    normalisation, statistics and distances where the authors use float32 (returned as float32),
    :func:`~hf_gsc.detectors.penultimate.tied_precision`'s stated rank cutoff for both precisions, and a zero fitting feature
    refused instead of NaN.

    No hyperparameters.
    """

    config_class = RMDSPPConfig
    search_space_source = "no hyperparameters (maha-norm's rmdsn.yml has no postprocessor_sweep)"
