"""MSP: maximum softmax probability (Hendrycks & Gimpel, ICLR 2017)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .common import TemperatureConfig, TemperatureLogitDetector
from .interface import register_detector


@dataclass
class MSPConfig(TemperatureConfig):
    """Settings of the maximum softmax probability (:class:`MSPDetector`)."""

    method: ClassVar[str] = "msp"


@register_detector
class MSPDetector(TemperatureLogitDetector):
    """``max_k softmax(y / T)_k`` of the base model's logits ``y``.

    Hendrycks & Gimpel, "A Baseline for Detecting Misclassified and Out-of-Distribution Examples in
    Neural Networks", ICLR 2017. No fitting.

    Settings: :class:`MSPConfig`.
    """

    config_class = MSPConfig
    in_default_table = True
    score_name = "msp"
