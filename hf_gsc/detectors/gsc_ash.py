"""GSC + ASH: Gradient Short-Circuit applied to the ASH-shaped feature (the paper's "GSC + ASH" row)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch import nn

from ..backbone_pass import BackbonePass
from ..backends import Backend, Linearization, select_backend
from ..config import DetectorConfig, GSCConfig
from ..gsc_step import GSCStep, gsc_step
from ..precision import full_precision, step_dtype
from ..split_points import SplitPoint
from .ash import ASH_VARIANTS, ash_shape, default_ash_percentile
from ..detector import register_detector
from .common import BaselineDetector

#: The ``GSCConfig`` settings GSC + ASH takes: all but the multi-layer and adaptive-size options (ASH shapes one
#: feature, and this baseline has no fitting step to calibrate a gradient mass).
GSC_SETTINGS = tuple(name for name in GSCConfig.setting_names() if name not in ("earlier_split_point", "mask_size"))


class ShapedFeatures(Backend):
    """A backend whose feature is shaped on the way out: ``F -> shaping(F)``, then ``inner``'s head at it."""

    def __init__(self, inner: Backend, shaping: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(inner.split_point)
        self.inner, self.shaping = inner, shaping

    @property
    def feature_split(self) -> SplitPoint:
        return self.inner.feature_split

    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.shaped(self.inner.features(pixel_values))

    def features_of(self, batch: BackbonePass) -> torch.Tensor:
        return self.shaped(self.inner.features_of(batch))

    def shaped(self, features: torch.Tensor) -> torch.Tensor:
        """``shaping(F)``, computed in float32 with autocast off (an activation percentile, see :mod:`hf_gsc.precision`)."""
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

    method = "gsc_ash"
    search_space = {"mask_ratio": (0.01, 0.05, 0.1, 0.2)}
    search_space_source = "not in OpenOOD: GSC's mask ratio around its default 0.05"
    defaults = {
        "ash_variant": "s",
        "ash_percentile": None,
        **{f.name: f.default for f in dataclasses.fields(GSCConfig) if f.name in GSC_SETTINGS},
        "split_point": "penultimate",
    }

    def __init__(self, model: nn.Module, config: DetectorConfig | None = None, **hyperparameters: Any) -> None:
        super().__init__(model, config, **hyperparameters)
        self.gsc_config = GSCConfig(**{k: v for k, v in self.hyperparameters.items() if k in GSC_SETTINGS})
        variant, percentile = self.hyperparameters["ash_variant"], self.hyperparameters["ash_percentile"]
        self.backend = ShapedFeatures(select_backend(model, self.gsc_config), lambda f: ash_shape(f, variant, percentile))

    def resolve_defaults(self, model: nn.Module, hyperparameters: dict[str, Any]) -> dict[str, Any]:
        if hyperparameters["ash_percentile"] is None:
            hyperparameters["ash_percentile"] = default_ash_percentile(model, hyperparameters["ash_variant"])
        return hyperparameters

    def validate(self) -> None:
        if self.hyperparameters["ash_variant"] not in ASH_VARIANTS:
            raise ValueError(f"gsc_ash: ash_variant must be one of {ASH_VARIANTS}, got {self.hyperparameters['ash_variant']!r}")
        self._number("ash_percentile", 0.0, 100.0)

    def feature_splits(self) -> tuple[SplitPoint, ...]:
        return (self.backend.feature_split,)

    def step(self, batch: BackbonePass) -> tuple[Linearization, GSCStep]:
        """The linearisation at ``F_ash`` and the GSC step there (as :meth:`GSCForImageClassification.step`)."""
        config = self.gsc_config
        linearization = self.backend.linearize(
            batch.pixel_values, features=self.backend.features_of(batch), whole_feature=config.selection == "random",
            keep_graph=config.approximation == "first_order",
        )
        return linearization, gsc_step(linearization.head, linearization.read_part, config,
                                       layer_sizes=linearization.layer_sizes)

    def score_batch(self, batch: BackbonePass) -> torch.Tensor:
        return self.step(batch)[1].ood_score
