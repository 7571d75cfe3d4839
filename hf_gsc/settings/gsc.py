"""GSC's settings, :class:`GSCConfig`, apart from its detector (:class:`hf_gsc.GSCDetector`, in
:mod:`hf_gsc.detectors.gsc`, which names this class as its ``config_class``): this module imports no torch, so that
``hf-gsc evaluate --help`` generates GSC's flags from these fields (:mod:`hf_gsc.evaluation.method_arguments`)
without loading the model stack. Every other method's config class is in its method's file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ..gsc_math.choices import (
    APPROXIMATIONS,
    MASK_SIZES,
    OPERATIONS,
    SELECTIONS,
    Approximation,
    MaskSize,
    Operation,
    Selection,
)
from ..utils.score_names import SCORES, Score
from .config import (
    MIN_TEMPERATURE,
    DetectorConfig,
    choice_check,
    feature_shaping_check,
    fitted,
    number_check,
    setting,
    split_point_check,
)


def _seed(name: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return value


@dataclass
class GSCConfig(DetectorConfig):
    """Settings of Gradient Short-Circuit (paper Algorithm 1) and its fitted gradient mass, on the common fields of
    :class:`DetectorConfig` (threshold, calibration, base-model reference). The paper's values are the defaults;
    settings marked "beyond the paper" are this library's extensions (docs/gsc.md)."""

    split_point: str = setting(
        "final_encoder_output", split_point_check(),
        "Where ``F`` is taken: ``\"final_encoder_output\"`` (before the final LayerNorm / pooler; input-dependent "
        "gradients for ViT/Swin/ConvNeXt; the paper's feature), ``\"penultimate\"`` (input of the last "
        "``nn.Linear``; linear head, ``g = W[c]``), or a dotted module path in the base model.")
    earlier_split_point: str | None = setting(
        None, split_point_check(optional=True),
        "Multi-layer short-circuit (beyond the paper): an earlier encoder block (``\"vit.layers.-3\"``) "
        "short-circuited together with ``split_point`` under one shared budget "
        "``k = ceil(mask_ratio * (n_earlier + n_final))``, coordinates ranked by ``|g|`` normalised per layer.")
    mask_ratio: float = setting(
        0.05, number_check(0.0, 1.0),
        "Fraction of the coordinates the head reads (nonzero gradient) to short-circuit; ``k = ceil(mask_ratio * n)`` "
        "per sample (the paper's 5 %). With ``mask_size=\"adaptive\"`` it is the *mean* ratio on ID validation data "
        "that ``calibrate_gradient_mass`` targets.")
    mask_size: MaskSize = setting(
        "fixed", choice_check(MASK_SIZES),
        "``fixed`` (``k`` from ``mask_ratio``, the paper) or ``adaptive`` (per sample, the smallest ``k`` whose "
        "top-``k`` ``|g|`` hold ``gradient_mass`` of the total; beyond the paper).")
    gradient_mass: float | None = fitted(
        None, number_check(0.0, 1.0, optional=True),
        "The mass fraction of ``mask_size=\"adaptive\"``, set by ``calibrate_gradient_mass``.")
    selection: Selection = setting(
        "gradient", choice_check(SELECTIONS),
        "``gradient`` (largest ``|g|``, the paper), ``fisher`` (largest ``|g_i|/sqrt(lambda_i)``, diagonal Fisher "
        "fitted on ID training data by ``fit_fisher``; beyond the paper), ``random`` or ``reverse`` (ablation "
        "controls).")
    operation: Operation = setting(
        "zero", choice_check(OPERATIONS),
        "On the masked coordinates: ``zero`` (the paper) | ``perturb`` (``F - alpha*sign(g)``) | ``project`` (remove "
        "the component along ``g``) | ``clip`` (to ``[-clip_bound, clip_bound]``) | ``scale`` (``beta * F``).")
    alpha: float = setting(0.1, number_check(0.0, math.inf),
                           "Step of ``operation=\"perturb\"``; the paper's \"small scaling factor\" ``alpha`` has no "
                           "value given, 0.1 is this library's.")
    clip_bound: float = setting(1.0, number_check(0.0, math.inf),
                                "Bound of ``operation=\"clip\"`` (an ablation beyond the paper; 1.0 is this library's).")
    beta: float = setting(0.5, number_check(0.0, 1.0),
                          "Factor of ``operation=\"scale\"`` (the paper's partial scaling ``beta < 1``, Appendix "
                          "A.1.2, has no value given; 0.5 is this library's).")
    approximation: Approximation = setting(
        "first_order", choice_check(APPROXIMATIONS),
        "``first_order`` (``y + J(F'-F)`` for all K logits, one Jacobian-vector product), ``predicted_logit`` (only "
        "``y_c`` moves by ``g.(F'-F)``, the paper's O(d) update) or ``exact`` (a second pass through the head only).")
    score: Score = setting(
        "energy", choice_check(SCORES),
        "``energy`` (the paper) | ``msp`` | ``max_logit`` on the short-circuited logits; higher = more ID.")
    temperature: float = setting(1.0, number_check(MIN_TEMPERATURE, math.inf),
                                 "Softmax / energy temperature (the paper's 1).")
    seed: int = setting(0, _seed, "Random source of ``selection=\"random\"`` (an ablation control).")
    feature_shaping: str = setting(
        "none", feature_shaping_check,
        "``none`` (the paper), or a shaping of ``F`` before the gradient is taken, registered by the method that "
        "defines it: ``ash_p`` / ``ash_b`` / ``ash_s`` (ASH), ``scale`` (SCALE); the paper's \"GSC + ASH\" row is "
        "``ash_s`` at the penultimate feature (method ``gsc_ash``). Beyond the paper otherwise.")
    shaping_percentile: float | None = setting(
        None, number_check(0.0, 100.0, optional=True),
        "The shaping's percentile; ``None`` = its authors' value for the architecture.")

    #: Settings that decide what a detector builds (where ``F`` is taken, which backend linearises the head, the
    #: attention kernel): assigning one on a detector's config rebuilds the detector before it next scores or saves
    #: (:meth:`GSCDetector.rebuild`).
    structural_names: ClassVar[tuple[str, ...]] = ("split_point", "earlier_split_point", "approximation", "selection",
                                                   "feature_shaping", "shaping_percentile")

    method: ClassVar[str] = "gsc"
