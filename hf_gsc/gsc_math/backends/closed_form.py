"""Closed-form backend: the head has the registered pool / LayerNorm / linear form (every ``final_encoder_output``
of a registered architecture, every ``penultimate``); logits, ``g`` and ``J t`` come from
:mod:`hf_gsc.classifier.head_jacobians`, with no autograd. Where the head reads ``F`` through a mean over positions, the
linearised head carries that mean (``pooled_read``) and the GSC step runs per channel (:mod:`hf_gsc.gsc_math.step`)."""

from __future__ import annotations

from typing import Any

import torch

from ...classifier.head_jacobians import PoolNormLinearHead, pool, restrict_to_read_part
from ...classifier.split_points import SplitPoint
from .base import Backend, Linearization


class ClosedFormHead(Backend):
    def linearize_at(
        self, features: torch.Tensor, pixel_values: torch.Tensor, whole_feature: bool, keep_graph: bool
    ) -> Linearization:
        split = self.split_point
        # Folded with the model's current parameters on every call: a few small ops next to the backbone, and
        # nothing to invalidate when the weights change.
        head = in_dtype(split.bound_head(), features.dtype)
        read = "identity" if whole_feature else split.read_pool
        if read != "identity":
            head = restrict_to_read_part(head)
        read_part = pool(features, read)
        return Linearization(features, read, read_part, head.linearize(read_part))


def in_dtype(head: PoolNormLinearHead, dtype: torch.dtype) -> PoolNormLinearHead:
    """``head`` with its folded tensors in ``dtype`` (a few ``K x D`` matrices): a bf16 model's head computes in
    float32 on float32 features. The fold itself ran in float64 and was rounded to the parameters' dtype."""
    if head.weight.dtype == dtype:
        return head

    def cast(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(dtype)

    return PoolNormLinearHead(head.pool, cast(head.weight), cast(head.bias), head.norm_eps, head.norm_before_pool,
                              cast(head.centered_weight))


def dispatch(model: torch.nn.Module, split_point: SplitPoint, config: Any) -> Backend | None:
    """This backend where the head has a registered closed form."""
    return ClosedFormHead(split_point) if split_point.head_spec is not None else None
