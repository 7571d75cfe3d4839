"""A backend whose feature is shaped on the way out (``F -> shaping(F)``), by one of the feature shapings GSC can
apply (GSC's ``feature_shaping`` setting names one of :data:`hf_gsc.utils.feature_shapings.FEATURE_SHAPINGS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from ...classifier.split_points import SplitPoint
from ...utils.feature_shapings import feature_shaping
from ...utils.precision import full_precision, step_dtype
from .base import Backend, Linearization


if TYPE_CHECKING:
    from ...detectors.backbone_pass import BackbonePass


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
        """``shaping(F)``, computed in float32 with autocast off (an activation percentile, see :mod:`hf_gsc.utils.precision`)."""
        with full_precision(features.device):
            return self.shaping(features.flatten(1).to(step_dtype(features.dtype))).view(features.shape)

    def linearize_at(
        self, features: torch.Tensor, pixel_values: torch.Tensor | None, whole_feature: bool, keep_graph: bool
    ) -> Linearization:
        return self.inner.linearize_at(features, pixel_values, whole_feature, keep_graph)


def shaped_backend(inner: Backend, model: nn.Module, name: str, percentile: float | None) -> ShapedFeatures:
    """``inner`` with its feature shaped by the registered shaping ``name`` at ``percentile`` (``None``: the
    authors' percentile for ``model``)."""
    shaping = feature_shaping(name)
    percentile = shaping.default_percentile(model) if percentile is None else percentile
    return ShapedFeatures(inner, lambda features: shaping.shape(features, percentile))
