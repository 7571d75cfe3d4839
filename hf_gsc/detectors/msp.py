"""MSP: maximum softmax probability (Hendrycks & Gimpel, ICLR 2017)."""

from __future__ import annotations

from ..detector import register_detector
from .common import TemperatureLogitDetector


@register_detector
class MSPDetector(TemperatureLogitDetector):
    """``max_k softmax(y / T)_k`` of the base model's logits ``y``.

    Hendrycks & Gimpel, "A Baseline for Detecting Misclassified and Out-of-Distribution Examples in
    Neural Networks", ICLR 2017. No fitting.

    Hyperparameters:
        temperature: ``T = 1`` (the paper's plain softmax).
    """

    method = "msp"
    in_default_table = True
    score_name = "msp"
