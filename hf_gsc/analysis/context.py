"""What every head-only GSC variant at one split point shares: ``F``, ``y``, ``g``, ``c`` and the head.

The backbone runs once per (batch, split point) and the head is linearised once, by the same backend the
detector uses (:mod:`hf_gsc.gsc_math.backends`); every variant is then one :func:`hf_gsc.gsc_math.step.gsc_step` on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..classifier.split_points import SplitPoint
from ..detectors.gsc import GSCConfig
from ..gsc_math.backends import Linearization, split_point_backend
from ..gsc_math.choices import Approximation, Operation, Selection
from ..gsc_math.step import gsc_step, updated_logits
from ..utils.score_names import Score
from ..utils.scores import ood_score
from .iterative import iterative_short_circuit


@dataclass
class HeadContext:
    """``F`` ``(B, *shape)``, logits ``y`` ``(B, K)``, ``g = d y_c / dF`` ``(B, *shape)``, ``c`` ``(B,)``, ``head``
    (``F -> y``) and the head linearised on all of ``F`` (:class:`hf_gsc.gsc_math.backends.Linearization`)."""

    features: torch.Tensor
    logits: torch.Tensor
    gradient: torch.Tensor
    predicted_class: torch.Tensor
    head: Callable[[torch.Tensor], torch.Tensor]
    linearization: Linearization


def head_context(split: SplitPoint, pixel_values: torch.Tensor) -> HeadContext:
    """Run the backbone once up to ``split`` and linearise the head there (on all of ``F``: random selection
    draws one number per coordinate of ``F``, as in the detector)."""
    linearization = split_point_backend(split).linearize(pixel_values, whole_feature=True)
    head = linearization.head
    predicted_class = head.logits.argmax(dim=-1)
    assert head.class_gradient is not None  # LinearizedHead.__post_init__ fills it
    gradient = head.class_gradient(predicted_class)
    return HeadContext(linearization.features, head.logits, gradient, predicted_class, head.function, linearization)


def gsc_logits(
    context: HeadContext,
    mask_ratio: float = 0.05,
    selection: Selection = "gradient",
    operation: Operation = "zero",
    approximation: Approximation = "first_order",
    alpha: float = 0.1,
    clip_bound: float = 1.0,
    beta: float = 0.5,
    steps: int = 1,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Short-circuited logits ``(B, K)`` of one variant, head only.

    ``steps == 1``: :func:`hf_gsc.gsc_math.step.gsc_step`, as :class:`hf_gsc.GSCDetector` runs it with
    a fixed mask size. ``steps > 1``: :func:`hf_gsc.analysis.iterative.iterative_short_circuit` (zero op, exact
    logits).
    """
    if steps > 1:
        if operation != "zero" or approximation != "exact":
            raise ValueError("the iterative short-circuit is defined for operation='zero' with exact logits")
        return iterative_short_circuit(
            context.head, context.features, mask_ratio, steps, selection, generator,
            gradient=context.gradient, predicted_class=context.predicted_class,
        )[0]
    settings = GSCConfig(
        mask_ratio=mask_ratio, selection=selection, operation=operation, approximation=approximation,
        alpha=alpha, clip_bound=clip_bound, beta=beta,
    )
    return gsc_step(context.linearization.head, context.features, settings, generator=generator).gsc_logits


def logits_after(context: HeadContext, shorted: torch.Tensor, approximation: str) -> torch.Tensor:
    """Logits at ``F'`` = ``shorted`` ``(B, d)``: ``first_order`` | ``predicted_logit`` | ``exact``."""
    features = context.features
    return updated_logits(
        context.linearization.head, approximation, context.predicted_class, context.gradient.flatten(1),
        features.flatten(1), shorted, features.shape,
    )


def scores_of(logits: torch.Tensor, score: Score = "energy", temperature: float = 1.0) -> torch.Tensor:
    """:func:`hf_gsc.utils.scores.ood_score` as float64 on the CPU."""
    return ood_score(logits, score, temperature).double().cpu()
