"""GSC + ASH: Gradient Short-Circuit applied to the ASH-shaped feature (the paper's "GSC + ASH" row)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from ..backends import Backend, Linearization
from ..config import GSCConfig
from ..modeling import GSCForImageClassification
from ..precision import full_precision, step_dtype
from .ash import ASH_VARIANTS, ash_shape, default_ash_percentile
from .base import register_detector
from .common import BaselineDetector

#: The ``GSCConfig`` settings GSC + ASH takes: all but the multi-layer and adaptive-size options (ASH shapes one
#: feature, and this baseline has no fitting step to calibrate a gradient mass).
GSC_SETTINGS = tuple(name for name in GSCConfig.setting_names() if name not in ("earlier_split_point", "mask_size"))


class ShapedFeatures(Backend):
    """A backend whose feature is shaped on the way out: ``F -> shaping(F)``, then ``inner``'s head at it."""

    def __init__(self, inner: Backend, shaping: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(inner.split_point)
        self.inner, self.shaping = inner, shaping

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``shaping(F)``, computed in float32 with autocast off (an activation percentile, see :mod:`hf_gsc.precision`)."""
        features = self.inner.features(pixel_values)
        with full_precision(features.device):
            return self.shaping(features.flatten(1).to(step_dtype(features.dtype))).view(features.shape)

    def linearize_at(
        self, features: torch.Tensor, pixel_values: torch.Tensor, whole_feature: bool, keep_graph: bool
    ) -> Linearization:
        return self.inner.linearize_at(features, pixel_values, whole_feature, keep_graph)


@register_detector
class GSCASHDetector(BaselineDetector):
    """GSC on the ASH-shaped feature: ``F -> F_ash = ASH(F) -> GSC(F_ash) -> energy``.

    Exactly: ``F`` is taken at the GSC split point; ASH (:func:`hf_gsc.detectors.ash.ash_shape`, per
    sample, variant ``ash_variant`` at ``ash_percentile``) replaces it by ``F_ash``; then
    :class:`hf_gsc.GSCForImageClassification` runs unchanged with ``F_ash`` as the feature: the gradient
    ``g = d y_c / dF`` of the predicted logit is taken at ``F_ash``, the top ``mask_ratio`` of ``|g|``
    is short-circuited in ``F_ash``, the logits are updated (``approximation``) and scored (``score``,
    energy by default). The split point defaults to ``"penultimate"``, where ASH is applied in the
    ASH authors' code (see ``ash_s``); with its linear head the first-order update is exact.

    Hyperparameters:
        ash_variant: ``"s"`` (ASH-S, the ASH authors' recommended variant; the paper describes its
            GSC + ASH row as adding "activation scaling").
        ash_percentile: ``None`` = the ASH authors' value for the architecture (see ``ash_s``).
        the ``GSCConfig`` settings (:data:`GSC_SETTINGS`): ``split_point`` (``"penultimate"``), ``mask_ratio`` (0.05),
            ``operation``, ``approximation``, ``score``, ... with ``GSCConfig`` defaults.
    """

    name = "gsc_ash"
    defaults = {
        "ash_variant": "s",
        "ash_percentile": None,
        **{f.name: f.default for f in dataclasses.fields(GSCConfig) if f.name in GSC_SETTINGS},
        "split_point": "penultimate",
    }

    def __init__(self, model: nn.Module, **hyperparameters: Any) -> None:
        variant = hyperparameters.get("ash_variant", self.defaults["ash_variant"])
        if hyperparameters.get("ash_percentile") is None:
            hyperparameters["ash_percentile"] = default_ash_percentile(model, variant)
        super().__init__(model, **hyperparameters)
        gsc_fields = {k: v for k, v in self.hyperparameters.items() if k in GSC_SETTINGS}
        self.detector = GSCForImageClassification(model, GSCConfig(**gsc_fields))
        self.detector.backend = ShapedFeatures(
            self.detector.backend, lambda f: ash_shape(f, variant, self.hyperparameters["ash_percentile"])
        )

    def validate(self) -> None:
        if self.hyperparameters["ash_variant"] not in ASH_VARIANTS:
            raise ValueError(f"gsc_ash: ash_variant must be one of {ASH_VARIANTS}, got {self.hyperparameters['ash_variant']!r}")
        self._number("ash_percentile", 0.0, 100.0)

    def _score(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.detector(pixel_values).ood_score
