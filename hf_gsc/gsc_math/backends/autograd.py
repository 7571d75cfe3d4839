"""Autograd backend: any other batch-separable head (an earlier block, a module path), differentiated through
the model's own modules; the head's graph is built once per batch and serves ``g`` and ``J t``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...classifier.head_jacobians import LinearizedHead
from ...classifier.split_points import SplitPoint
from ...utils.precision import parameter_dtype, step_dtype
from .base import Backend, Linearization


def linearize_with_autograd(
    head: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor],
    features: torch.Tensor,
    pixel_values: torch.Tensor | None,
    keep_graph_for_jvp: bool = True,
) -> LinearizedHead:
    """:class:`LinearizedHead` of any batch-separable ``head(F, pixel_values)`` by autograd. The head's graph is
    built once; ``vjp`` and ``jvp`` both run backward through it. With ``keep_graph_for_jvp=False`` the first
    ``vjp`` frees the graph (its saved activations would otherwise stay alive) and ``jvp`` is unavailable.

    ``jvp`` uses two reverse passes instead of forward mode: ``v -> v^T J`` is linear in ``v``, so the gradient
    of ``<v^T J, t>`` with respect to ``v`` is ``J t``. Through two ViT blocks that is 2-3x faster than
    ``torch.func.jvp``, which runs LayerNorm as a Python decomposition and gives the constant weights slow
    zero tangents. It needs a twice-differentiable head (eager attention, as for forward mode).

    Works inside ``torch.inference_mode()``: tensors made there cannot be saved for backward, so ``F`` and
    ``pixel_values`` are cloned with inference mode switched off.
    """
    with torch.inference_mode(False), torch.enable_grad():
        primal = features.detach().to(step_dtype(features.dtype), copy=True).requires_grad_(True)
        pixel_values = None if pixel_values is None else pixel_values.clone()
        logits = head(primal, pixel_values)

    def vjp(cotangent: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(False):
            return torch.autograd.grad(logits, primal, cotangent.clone(), retain_graph=keep_graph_for_jvp)[0].detach()

    def jvp(tangent: torch.Tensor) -> torch.Tensor:
        if not keep_graph_for_jvp:
            raise RuntimeError("this head was linearized with keep_graph_for_jvp=False; it has no jvp")
        with torch.inference_mode(False), torch.enable_grad():
            cotangent = torch.zeros_like(logits, requires_grad=True)
            (pulled,) = torch.autograd.grad(logits, primal, cotangent, retain_graph=True, create_graph=True)
            return torch.autograd.grad(pulled, cotangent, tangent.clone())[0].detach()

    def function(moved: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return head(moved, pixel_values)

    return LinearizedHead(logits.detach(), vjp, jvp, function)


def in_model_dtype(
    head: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor], model: torch.nn.Module
) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """``head(F, pixel_values)``, a function of the model's own modules, fed ``F`` in the model's parameter dtype and
    returning logits in at least float32.

    A float32 model's head thus runs in float32 (the step disables autocast around it); a bf16 model's head runs
    in bf16, because a float32 copy of its modules (encoder blocks, for an earlier split point) would cost their
    size again in memory. Its logits, ``g`` and ``J t`` then carry bf16 rounding, and the step takes them on in
    float32.
    """
    dtype = parameter_dtype(model)

    def run(features: torch.Tensor, pixel_values: torch.Tensor | None) -> torch.Tensor:
        logits = head(features.to(dtype), pixel_values)
        return logits.to(step_dtype(logits.dtype))

    return run


def use_eager_attention_for_first_order(model: torch.nn.Module, config: Any) -> None:
    """A head made of encoder blocks contains attention; ``J t`` there takes a double backward, which the fused
    SDPA kernels lack. Eager attention computes the same function and has one."""
    from transformers import PreTrainedModel  # the models that have an attention implementation to choose

    if (config.approximation == "first_order" and isinstance(model, PreTrainedModel)
            and getattr(model.config, "_attn_implementation", None) == "sdpa"):
        model.set_attn_implementation("eager")


class AutogradHead(Backend):
    def linearize_at(
        self, features: torch.Tensor, pixel_values: torch.Tensor | None, whole_feature: bool, keep_graph: bool
    ) -> Linearization:
        head = linearize_with_autograd(in_model_dtype(self.split_point.head, self.split_point.model), features,
                                       pixel_values, keep_graph)
        return Linearization(features, "identity", features, head)


def dispatch(model: torch.nn.Module, split_point: SplitPoint, config: Any) -> Backend:
    """The default: applies to every split point."""
    if config.split_point not in ("final_encoder_output", "penultimate"):
        use_eager_attention_for_first_order(model, config)
    return AutogradHead(split_point)
