"""Energy score (Liu et al., NeurIPS 2020)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .common import TemperatureConfig, TemperatureLogitDetector
from .interface import register_detector


@dataclass
class EnergyConfig(TemperatureConfig):
    """Settings of the energy score (:class:`EnergyDetector`)."""

    method: ClassVar[str] = "energy"


@register_detector
class EnergyDetector(TemperatureLogitDetector):
    """Negative free energy ``T * logsumexp(y / T)`` of the base model's logits ``y``.

    Liu, Wang, Owens, Li, "Energy-based Out-of-distribution Detection", NeurIPS 2020. No fitting.

    Settings: :class:`EnergyConfig`.
    """

    config_class = EnergyConfig
    in_default_table = True
    score_name = "energy"
