"""The GSC step (paper Algorithm 1 after the backbone), once, as a pure function of tensors.

Given the head linearised at ``F`` (its logits ``y``, ``v^T J``, ``J t`` and the head itself), the step is::

    c = argmax y;  g = d y_c / dF
    k = ceil(mask_ratio * n)            (or the adaptive size);  mask = top-k of the ranking of g
    F' = S(F, g) on the mask            (hf_gsc.gsc_math.shortcircuit.short_circuit)
    gsc_logits = y + J(F' - F)  |  y + e_c g.(F' - F)  |  head(F')
    ood_score = score(gsc_logits)

:meth:`hf_gsc.GSCDetector.forward`, every analysis (:mod:`hf_gsc.analysis`) and GSC + ASH
(:mod:`hf_gsc.detectors.gsc_ash`) call :func:`gsc_step`; how ``F`` and the linearised head are obtained is the
backend's business (:mod:`hf_gsc.gsc_math.backends`).

A head that reads ``F`` only through a mean over positions (a ResNet's or ConvNeXt's spatial mean, a mean over
tokens; LayerNorm, if any, after it) carries that mean (:class:`hf_gsc.classifier.head_jacobians.PooledRead`). Its ``g``
is the same at every position of a channel, so the step runs per channel: ``k`` and the ranking from the ``C``
channel values, the mask as a prefix of each channel's positions (:func:`hf_gsc.gsc_math.shortcircuit.repeated_top_k_counts`,
which keeps the tie order of the ranking on every coordinate), and the update from the mean over positions of
``F' - F``. Same mask, same ``g``, the same logits up to float rounding (``tests/test_pooled_step.py``); for
ResNet-50 that is 2,048 values to rank instead of 100,352. ``selection="random"`` (one draw per coordinate) and a
Fisher diagonal that varies over a channel's positions keep the step on every coordinate.

Precision: the step runs in float32 (float64 for float64 inputs) with autocast off, whatever the backbone ran
in (a bf16 model, or ``accelerator.autocast()``): ranking ``g``, the top-k cut, ``F' - F`` and the first-order
update are differences of nearby numbers, which bf16's 8-bit mantissa would round away (:mod:`hf_gsc.utils.precision`).
The backends hand over ``F`` and the linearised head in that precision (:meth:`hf_gsc.gsc_math.backends.Backend.linearize`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..classifier.head_jacobians import LinearizedHead, PooledRead, pool_adjoint
from ..utils.precision import full_precision
from ..utils.score_names import Score
from ..utils.scores import ood_score
from .choices import Approximation, MaskSize, Operation, Selection
from .shortcircuit import (
    num_masked,
    num_masked_adaptive,
    predicted_logit_update,
    prefix_mask,
    repeated_top_k_counts,
    selection_priority,
    short_circuit,
    top_k_mask,
)


class StepSettings(Protocol):
    """The :class:`hf_gsc.GSCConfig` fields the step reads."""

    mask_ratio: float
    mask_size: MaskSize
    gradient_mass: float | None
    selection: Selection
    operation: Operation
    alpha: float
    clip_bound: float
    beta: float
    approximation: Approximation
    score: Score
    temperature: float
    seed: int


@dataclass(frozen=True)
class GSCStep:
    """Result of :func:`gsc_step` on a batch of ``B`` samples with ``d`` read coordinates each.

    Attributes:
        logits: ``(B, K)`` ``y``, the head's logits at ``F``.
        predicted_class: ``(B,)`` ``c = argmax y``.
        gsc_logits: ``(B, K)`` logits after the short-circuit.
        ood_score: ``(B,)`` score of ``gsc_logits``; higher = more in-distribution.
        gradient: ``(B, d)`` ``g = d y_c / dF`` on the read part of ``F``, flattened.
        mask: ``(B, d)`` bool, the short-circuited coordinates.

    ``gradient`` and ``mask`` are made on first access: the per-channel step of a pooled head never needs them
    coordinate by coordinate.
    """

    logits: torch.Tensor
    predicted_class: torch.Tensor
    gsc_logits: torch.Tensor
    ood_score: torch.Tensor
    coordinates: Callable[[], tuple[torch.Tensor, torch.Tensor]] = field(repr=False, compare=False)

    @functools.cached_property
    def _gradient_and_mask(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.coordinates()

    @property
    def gradient(self) -> torch.Tensor:
        return self._gradient_and_mask[0]

    @property
    def mask(self) -> torch.Tensor:
        return self._gradient_and_mask[1]


def ranking_gradient(gradient: torch.Tensor, layer_sizes: Sequence[int] | None = None) -> torch.Tensor:
    """The gradient that ranks coordinates, ``(B, d) -> (B, d)``: the gradient itself, or, for a feature joining
    several layers (``layer_sizes`` coordinates each), each layer's part divided by its RMS over the read
    coordinates, because raw gradient scales differ between layers that share one budget."""
    if layer_sizes is None:
        return gradient
    parts = []
    for part in torch.split(gradient, list(layer_sizes), dim=1):
        read = (part != 0).sum(dim=1, keepdim=True).clamp_min(1)
        rms = (part.pow(2).sum(dim=1, keepdim=True) / read).sqrt()
        parts.append(part / rms.clamp_min(torch.finfo(part.dtype).tiny))
    return torch.cat(parts, dim=1)


def updated_logits(
    head: LinearizedHead,
    approximation: str,
    predicted_class: torch.Tensor,
    gradient: torch.Tensor,
    features: torch.Tensor,
    shorted: torch.Tensor,
    shape: torch.Size,
) -> torch.Tensor:
    """``gsc_logits`` ``(B, K)`` after moving ``F`` to ``F'`` by the approximation.

    Args:
        head: linearised at ``F``. gradient, features, shorted: ``g``, ``F``, ``F'`` flattened, ``(B, d)``.
        shape: the shape ``head`` takes, ``(B, *shape)`` with ``d`` coordinates per sample.
    """
    delta = shorted - features
    return moved_logits(head, approximation, predicted_class, gradient, delta if delta.shape == shape
                        else delta.view(shape), lambda: shorted if shorted.shape == shape else shorted.view(shape))


def moved_logits(
    head: LinearizedHead,
    approximation: str,
    predicted_class: torch.Tensor,
    gradient: torch.Tensor,
    delta: torch.Tensor,
    moved: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """:func:`updated_logits` from ``delta = F' - F`` in the shape ``head`` takes (``g`` flattened alike) and
    ``moved()``, ``F'`` in that shape, computed only for the exact update."""
    if approximation == "first_order":
        return head.logits + head.jvp(delta)
    if approximation == "predicted_logit":
        return predicted_logit_update(head.logits, predicted_class, gradient, delta.flatten(1))
    if approximation == "exact":
        return head.function(moved())
    raise ValueError(f"approximation must be first_order, predicted_logit or exact, got {approximation!r}")


def gsc_step(
    head: LinearizedHead,
    features: torch.Tensor,
    settings: StepSettings,
    fisher_diagonal: torch.Tensor | None = None,
    layer_sizes: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
) -> GSCStep:
    """Mask, short-circuit, logit update and score of one batch.

    Runs with autocast off (:func:`hf_gsc.utils.precision.full_precision`), in the dtype of ``features`` and ``head``: float32 when
    they come from a backend.

    Args:
        head: the head linearised at ``features``.
        features: the part of ``F`` the head reads, ``(B, *shape)`` (all of ``F``, or its first token for a
            first-token head).
        settings: a :class:`hf_gsc.GSCConfig` (or anything with its fields).
        fisher_diagonal: ``(d,)`` for ``selection="fisher"``, on the same coordinates as ``features``.
        layer_sizes: coordinates per layer when ``features`` joins several layers (multi-layer short-circuit).
        generator: random source of ``selection="random"``; ``None`` = seeded with ``settings.seed`` per call.
    """
    with full_precision(features.device):
        return _gsc_step(head, features, settings, fisher_diagonal, layer_sizes, generator)


def _gsc_step(
    head: LinearizedHead,
    features: torch.Tensor,
    settings: StepSettings,
    fisher_diagonal: torch.Tensor | None,
    layer_sizes: Sequence[int] | None,
    generator: torch.Generator | None,
) -> GSCStep:
    """One path for both forms: per coordinate (``P = 1`` position per column, the columns being ``F``'s
    coordinates) and per channel (a head that reads ``F`` through a mean over ``P`` positions, the columns being
    its channels: :func:`_per_channel`). The columns are ranked once, the mask is a prefix of each column's positions
    (:func:`hf_gsc.gsc_math.shortcircuit.repeated_top_k`), and the update goes through the head on the columns."""
    selection = settings.selection
    logits = head.logits
    predicted_class = logits.argmax(dim=-1)
    read = _per_channel(head, settings, fisher_diagonal, layer_sizes)
    if read is not None:
        pooled_read, fisher_diagonal = read
        positions, position_major = pooled_read.positions, pooled_read.position_major
        update_head = pooled_read.head
        head_gradient = update_head.class_gradient(predicted_class)  # u = d y_c / d pool(F), (B, C)
        gradient = ranking = pooled_read.coordinate_gradient(head_gradient)  # each coordinate's g, (B, C)
        values = pooled_read.by_channel(features)  # (B, C, P)
    else:
        positions, position_major, update_head = 1, False, head
        head_gradient = gradient = head.class_gradient(predicted_class).flatten(1)
        ranking = ranking_gradient(gradient, layer_sizes)
        values = features.flatten(1)
    if settings.mask_size == "adaptive":
        if settings.gradient_mass is None:
            raise ValueError("mask_size='adaptive' needs gradient_mass, the mass fraction calibrate_gradient_mass sets")
        k = num_masked_adaptive(ranking, settings.gradient_mass, repeats=positions)
    else:
        k = num_masked(gradient, settings.mask_ratio, repeats=positions)
    if generator is None and selection == "random":
        generator = torch.Generator().manual_seed(settings.seed)
    priority = selection_priority(ranking, selection, fisher_diagonal, generator)
    if positions == 1:
        mask = top_k_mask(priority, k)
    else:
        counts = repeated_top_k_counts(priority, k, positions, position_major)
        mask = prefix_mask(counts, positions)
    shorted = short_circuit(values, gradient, mask, settings.operation, settings.alpha, settings.clip_bound,
                            settings.beta)
    if positions == 1:
        delta = shorted - values
        if delta.shape != features.shape:
            delta = delta.view(features.shape)
        gsc_logits = moved_logits(update_head, settings.approximation, predicted_class, gradient, delta,
                                  lambda: shorted.view(features.shape))

        def coordinates() -> tuple[torch.Tensor, torch.Tensor]:
            return gradient, mask
    else:
        # The head sees F' only through its mean over positions: u . mean(F' - F) = g . (F' - F). A channel the
        # short-circuit left alone contributes exactly 0.
        gsc_logits = moved_logits(update_head, settings.approximation, predicted_class, head_gradient,
                                  (shorted - values).mean(dim=-1), lambda: shorted.mean(dim=-1))

        def coordinates() -> tuple[torch.Tensor, torch.Tensor]:
            spread = pool_adjoint(head_gradient, pooled_read.pool, pooled_read.feature_shape).flatten(1)
            return spread, pooled_read.coordinates(mask)

    return GSCStep(logits, predicted_class, gsc_logits, ood_score(gsc_logits, settings.score, settings.temperature),
                   coordinates)


def _per_channel(
    head: LinearizedHead, settings: StepSettings, fisher_diagonal: torch.Tensor | None,
    layer_sizes: Sequence[int] | None,
) -> tuple[PooledRead, torch.Tensor | None] | None:
    """The pooled read of a head that reads ``F`` through a mean over positions, with the Fisher diagonal per
    channel, where the setting reduces to per-channel quantities: the ranking is then ``O(B C)``, the short-circuit
    elementwise and the update one mean over positions, with the same mask (same tie order) and, up to float
    rounding, the same logits as the step on every coordinate. ``None`` otherwise: no pooled read, several layers,
    ``selection="random"`` (one draw per coordinate), or ``selection="fisher"`` with a diagonal that differs between
    the positions of a channel."""
    read = head.pooled_read
    # One position per channel (a 1 x 1 map: a small input to a CNN) is the step on every coordinate already; its
    # mask is then (B, C) where the pooled read holds F as (B, C, 1).
    if read is None or layer_sizes is not None or read.positions == 1:
        return None
    if settings.selection == "fisher" and fisher_diagonal is not None:
        channel_fisher = read.channel_values(fisher_diagonal)
        return None if channel_fisher is None else (read, channel_fisher)
    if settings.selection not in ("gradient", "reverse"):
        return None
    return read, None
