"""What every head-only GSC variant at one split point shares: ``F``, ``y``, ``g``, ``c`` and the head.

The backbone runs once per (batch, split point); every variant then costs one pass (or one JVP) through
the head only. Built from the public pieces: :meth:`hf_gsc.split_points.SplitPoint.features` /
:meth:`~hf_gsc.split_points.SplitPoint.head` and :mod:`hf_gsc.shortcircuit`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..scores import ood_score
from ..shortcircuit import first_order_logits, num_masked, predicted_logit_update, short_circuit, short_circuit_mask
from ..split_points import SplitPoint
from .iterative import head_gradient, iterative_short_circuit


@dataclass
class HeadContext:
    """``F`` ``(B, *shape)``, logits ``y`` ``(B, K)``, ``g = d y_c / dF`` ``(B, *shape)``, ``c`` ``(B,)`` and ``head``."""

    features: torch.Tensor
    logits: torch.Tensor
    gradient: torch.Tensor
    predicted_class: torch.Tensor
    head: Callable[[torch.Tensor], torch.Tensor]


def head_context(split: SplitPoint, pixel_values: torch.Tensor) -> HeadContext:
    """Run the backbone once up to ``split`` and one backward through the head."""
    features = split.features(pixel_values)

    def head(f: torch.Tensor) -> torch.Tensor:
        return split.head(f, pixel_values)

    logits, gradient = head_gradient(head, features)
    return HeadContext(features.detach(), logits, gradient, logits.argmax(dim=-1), head)


def gsc_logits(
    context: HeadContext,
    mask_ratio: float = 0.05,
    selection: str = "gradient",
    operation: str = "zero",
    approximation: str = "first_order",
    alpha: float = 0.1,
    clip_bound: float = 1.0,
    beta: float = 0.5,
    steps: int = 1,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Short-circuited logits ``(B, K)`` of one variant, head only.

    ``steps == 1``: the same computation as :class:`hf_gsc.GSCForImageClassification` with a fixed mask size
    (``num_masked`` -> ``short_circuit_mask`` -> ``short_circuit`` -> ``approximation``).
    ``steps > 1``: :func:`hf_gsc.analysis.iterative.iterative_short_circuit` (zero op, exact logits).
    """
    if steps > 1:
        if operation != "zero" or approximation != "exact":
            raise ValueError("the iterative short-circuit is defined for operation='zero' with exact logits")
        return iterative_short_circuit(
            context.head, context.features, mask_ratio, steps, selection, generator,
            gradient=context.gradient, predicted_class=context.predicted_class,
        )[0]
    flat_f, flat_g = context.features.flatten(1), context.gradient.flatten(1)
    mask = short_circuit_mask(flat_g, num_masked(flat_g, mask_ratio), selection, generator=generator)
    shorted = short_circuit(flat_f, flat_g, mask, operation, alpha, clip_bound, beta)
    return logits_after(context, shorted, approximation)


def logits_after(context: HeadContext, shorted: torch.Tensor, approximation: str) -> torch.Tensor:
    """Logits at ``F'`` = ``shorted`` ``(B, d)``: ``first_order`` | ``predicted_logit`` | ``exact``."""
    features = context.features
    delta = shorted - features.flatten(1)
    if approximation == "first_order":
        with torch.inference_mode(False):
            return first_order_logits(context.head, features, delta.view_as(features)).detach()
    if approximation == "predicted_logit":
        return predicted_logit_update(context.logits, context.predicted_class, context.gradient.flatten(1), delta)
    if approximation == "exact":
        with torch.no_grad():
            return context.head(shorted.view_as(features)).detach()
    raise ValueError(f"approximation must be first_order, predicted_logit or exact, got {approximation!r}")


def scores_of(logits: torch.Tensor, score: str = "energy", temperature: float = 1.0) -> torch.Tensor:
    """:func:`hf_gsc.scores.ood_score` as float64 on the CPU."""
    return ood_score(logits, score, temperature).double().cpu()
