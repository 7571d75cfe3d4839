"""GSC + ASH: Gradient Short-Circuit applied to the ASH-shaped feature (the paper's "GSC + ASH" row)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..settings.config import feature_shaping_check, setting, split_point_check
from .gsc import GSCConfig, GSCDetector
from .interface import register_detector


@dataclass
class GSCASHConfig(GSCConfig):
    """:class:`~hf_gsc.GSCConfig` with the "GSC + ASH" defaults: ASH-S at the penultimate feature."""

    method: ClassVar[str] = "gsc_ash"
    split_point: str = setting("penultimate", split_point_check(),
                               "``\"penultimate\"``: the feature the ASH authors' code shapes (see ``ash_s``).")
    feature_shaping: str = setting("ash_s", feature_shaping_check,
                                   "``\"ash_s\"``: the paper's \"GSC + ASH\" row (another ASH variant may be named).")


@register_detector
class GSCASHDetector(GSCDetector):
    """GSC on the ASH-shaped feature: ``F -> F_ash = ASH(F) -> GSC(F_ash) -> energy``.

    Exactly :class:`hf_gsc.GSCDetector` with ``feature_shaping="ash_s"`` at ``split_point=
    "penultimate"``: ``F`` is taken at the split point; ASH (:func:`hf_gsc.detectors.ash.ash_shape`, per sample,
    at ``shaping_percentile``, by default the ASH authors' value for the architecture) replaces it by ``F_ash``; the
    gradient ``g = d y_c / dF`` of the predicted logit is taken at ``F_ash``, the top ``mask_ratio`` of ``|g|`` is
    short-circuited in ``F_ash``, the logits are updated (``approximation``) and scored (``score``, energy by
    default). The penultimate feature is where the ASH authors' code applies ASH (see ``ash_s``); with its linear head
    the first-order update is exact. Every GSC setting applies (``feature_shaping`` may name another ASH variant).
    """

    config_class = GSCASHConfig
    search_space_source = "not in OpenOOD: GSC's mask ratio around its default 0.05"
