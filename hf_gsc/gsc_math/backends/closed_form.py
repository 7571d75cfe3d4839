"""Closed-form backend: the head has the registered pool / LayerNorm / linear form (every ``final_encoder_output``
of a registered architecture, every ``penultimate``); logits, ``g`` and ``J t`` come from
:mod:`hf_gsc.classifier.head_jacobians`, with no autograd. Where the head reads ``F`` through a mean over positions, the
linearised head carries that mean (``pooled_read``) and the GSC step runs per channel (:mod:`hf_gsc.gsc_math.step`)."""

from __future__ import annotations

from typing import Any

import torch

from ...classifier.head_jacobians import PoolNormLinearHead, pool, restrict_to_read_part
from ...classifier.heads import HeadSpec, submodule
from ...classifier.split_points import SplitPoint
from .base import Backend, Linearization


class ClosedFormHead(Backend):
    def __init__(self, split_point: SplitPoint) -> None:
        super().__init__(split_point)
        if split_point.head_spec is None:
            raise ValueError(f"split point {split_point.name!r} has no registered head form (HeadSpec) for the "
                             "closed form; its head is linearised by autograd")
        self.head_spec: HeadSpec = split_point.head_spec
        # (key, folded head): the last fold, reused while the head's parameters are the same tensors, unchanged.
        self._folded: tuple[tuple[Any, ...], PoolNormLinearHead] | None = None

    def linearize_at(
        self, features: torch.Tensor, pixel_values: torch.Tensor | None, whole_feature: bool, keep_graph: bool
    ) -> Linearization:
        read = "identity" if whole_feature else self.split_point.read_pool
        head = self.folded_head(features.dtype, read != "identity")
        read_part = pool(features, read)
        return Linearization(features, read, read_part, head.linearize(read_part))

    def folded_head(self, dtype: torch.dtype, on_read_part: bool) -> PoolNormLinearHead:
        """The head with the model's current parameters, its LayerNorm folded into the classifier, in ``dtype``.

        Folding is about twenty small ops (float64 products, casts, transposed copies), as many as the rest of the
        step; it is redone only when a parameter of the head is replaced (another tensor, or other storage), changed
        in place (its version counter, which ``load_state_dict`` and every in-place op under ``no_grad`` advance), or
        moved. The key holds the parameter tensors themselves, so a freed one's address cannot come back as a
        false match. A change made through ``param.data`` bypasses the version counter and is not seen: assign or
        copy parameters under ``torch.no_grad()`` instead. Inside ``torch.compile`` the fold is traced (the compiled
        graph guards on the parameters itself).
        """
        split = self.split_point
        if torch.compiler.is_compiling():
            return _read_part(in_dtype(split.bound_head(), dtype), on_read_part)
        key = _parameter_key(split.model, self.head_spec, dtype, on_read_part)
        cached = self._folded
        if key is not None and cached is not None and _same_key(cached[0], key):
            return cached[1]
        head = _read_part(in_dtype(split.bound_head(), dtype), on_read_part)
        if key is not None:
            self._folded = (key, head)  # one assignment: threads calling at once see an old or a new pair
        return head


def _read_part(head: PoolNormLinearHead, on_read_part: bool) -> PoolNormLinearHead:
    return restrict_to_read_part(head) if on_read_part else head


def _parameter_key(model: torch.nn.Module, spec: HeadSpec, dtype: torch.dtype,
                   on_read_part: bool) -> tuple[Any, ...] | None:
    """What a folded head depends on: each parameter tensor with its storage and version, the LayerNorm's epsilon
    and the dtype; ``None`` where a version cannot be read (parameters made under ``torch.inference_mode``)."""
    parameters = spec.parameters(model)
    norm = None if spec.layernorm is None else submodule(model, spec.layernorm)
    try:
        state = tuple(None if p is None else (p, p.data_ptr(), p._version, p.dtype, p.device, p.shape)
                      for p in parameters)
    except RuntimeError:  # an inference tensor has no version counter
        return None
    return (state, None if norm is None else norm.eps, dtype, on_read_part)


def _same_key(old: tuple[Any, ...], new: tuple[Any, ...]) -> bool:
    (old_state, *old_rest), (new_state, *new_rest) = old, new
    if old_rest != new_rest or len(old_state) != len(new_state):
        return False
    for a, b in zip(old_state, new_state):
        if (a is None) != (b is None):
            return False
        if a is not None and (a[0] is not b[0] or a[1:] != b[1:]):
            return False
    return True


def in_dtype(head: PoolNormLinearHead, dtype: torch.dtype) -> PoolNormLinearHead:
    """``head`` with its folded tensors in ``dtype`` (a few ``K x D`` matrices): a bf16 model's head computes in
    float32 on float32 features. The fold itself ran in float64 and was rounded to the parameters' dtype."""
    if head.weight.dtype == dtype:
        return head

    def cast(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(dtype)

    return PoolNormLinearHead(head.pool, head.weight.to(dtype), cast(head.bias), head.norm_eps, head.norm_before_pool,
                              cast(head.centered_weight))


def dispatch(model: torch.nn.Module, split_point: SplitPoint, config: Any) -> Backend | None:
    """This backend where the head has a registered closed form."""
    return ClosedFormHead(split_point) if split_point.head_spec is not None else None
