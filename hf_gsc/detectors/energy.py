"""Energy score (Liu et al., NeurIPS 2020)."""

from __future__ import annotations

from ..detector import register_detector
from .common import TemperatureLogitDetector


@register_detector
class EnergyDetector(TemperatureLogitDetector):
    """Negative free energy ``T * logsumexp(y / T)`` of the base model's logits ``y``.

    Liu, Wang, Owens, Li, "Energy-based Out-of-distribution Detection", NeurIPS 2020. No fitting.

    Hyperparameters:
        temperature: ``T = 1`` (the paper's setting).
    """

    method = "energy"
    in_default_table = True
    score_name = "energy"
