"""GSC's whole per-batch update after the backbone as one pure function of tensors, for ``torch.compile``.

After the backbone, eager GSC runs 25-35 small ops (head, gradient, mask, short-circuit, logit update,
score). Next to a small backbone on a CPU their dispatch and Python cost, not their arithmetic, is GSC's
overhead; compiled, they fuse into a few kernels (:meth:`hf_gsc.GSCForImageClassification.compile_update`).

:func:`gsc_update` computes what the eager forward computes for a registered closed-form head
(:class:`hf_gsc.head_derivatives.PoolNormLinearHead`), ``selection="gradient"`` and ``mask_size="fixed"``,
with two differences in control flow, so that it traces into one graph with no data-dependent branch:

* the mask size ``k = ceil(mask_ratio * n)`` is computed per sample in integer arithmetic and the top-k
  runs with its static upper bound ``ceil(mask_ratio * d)``;
* ties across a sample's cut (two coordinates with the same ``|g|``, one in the mask and one not) are
  detected, not filled: the result says ``tied`` and the caller reruns the eager path, which fills them
  in index order. For continuous features this does not happen in practice.

The last step, :func:`updated_logits` (``y + J(F' - F)``, ``y_c + g·(F' - F)`` or ``head(F')``), is shared with
the eager forward.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .head_derivatives import LinearizedHead, PoolNormLinearHead
from .scores import ood_score
from .shortcircuit import mask_size, predicted_logit_update, short_circuit


class UpdateOutput(NamedTuple):
    """``logits`` ``(B, K)``; ``predicted_class`` ``(B,)``; ``gsc_logits`` ``(B, K)``; ``ood_score`` ``(B,)``;
    ``tied``: 0-d bool, some sample has a tie across its cut (then the other fields are not to be used)."""

    logits: torch.Tensor
    predicted_class: torch.Tensor
    gsc_logits: torch.Tensor
    ood_score: torch.Tensor
    tied: torch.Tensor


def top_k_mask_with_bound(priority: torch.Tensor, k: torch.Tensor, k_bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of the ``k[i]`` largest priorities per row, ``k[i] <= k_bound``, and whether a row ties across its cut.

    Args:
        priority: ``(B, d)``. k: ``(B,)`` int64. k_bound: ``1 <= k_bound <= d``, at least ``max(k)``.
    Returns:
        ``(mask (B, d) bool, tied 0-d bool)``. Where ``tied`` is false the mask equals
        :func:`hf_gsc.shortcircuit.short_circuit_mask`'s; where it is true the mask must not be used.
    """
    top_values = priority.topk(k_bound, dim=1, sorted=True).values
    kth = top_values.gather(1, (k - 1).clamp(min=0).unsqueeze(1))
    mask = (priority >= kth) & (k > 0).unsqueeze(1)
    return mask, (mask.sum(dim=1) != k).any()


def gsc_update(
    read_part: torch.Tensor,
    head: PoolNormLinearHead,
    mask_ratio: tuple[int, int],
    k_bound: int,
    operation: str = "zero",
    alpha: float = 0.1,
    clip_bound: float = 1.0,
    beta: float = 0.5,
    approximation: str = "first_order",
    score: str = "energy",
    temperature: float = 1.0,
) -> UpdateOutput:
    """GSC after the backbone: logits, gradient of the predicted class, mask, short-circuit, update, score.

    Args:
        read_part: ``pool(F, read)``, the part of ``F`` the head reads, ``(B, *shape)``; ``head`` maps it to
            the logits.
        mask_ratio: ``(p, q)``, the mask ratio as an exact fraction (see :func:`hf_gsc.shortcircuit.num_masked`).
        k_bound: the :func:`hf_gsc.shortcircuit.mask_size` of a fully read sample of ``read_part``, ``>= 1``.
        operation, alpha, clip_bound, beta, approximation, score, temperature: as in :class:`hf_gsc.GSCConfig`.
    """
    linear = head.linearize(read_part)
    logits = linear.logits
    predicted_class = logits.argmax(dim=-1)
    gradient = linear.class_gradient(predicted_class).flatten(1)
    k = mask_size(torch.count_nonzero(gradient, dim=1), *mask_ratio)
    mask, tied = top_k_mask_with_bound(gradient.abs(), k, k_bound)
    features = read_part.flatten(1)
    shorted = short_circuit(features, gradient, mask, operation, alpha, clip_bound, beta)
    gsc_logits = updated_logits(linear, approximation, predicted_class, gradient, features, shorted, read_part.shape)
    return UpdateOutput(logits, predicted_class, gsc_logits, ood_score(gsc_logits, score, temperature), tied)


def updated_logits(
    linear: LinearizedHead,
    approximation: str,
    predicted_class: torch.Tensor,
    gradient: torch.Tensor,
    features: torch.Tensor,
    shorted: torch.Tensor,
    shape: torch.Size,
) -> torch.Tensor:
    """``gsc_logits`` ``(B, K)`` after moving ``F`` to ``F'``, by the configured approximation (eager and compiled).

    Args:
        linear: the head linearized at ``F``. gradient, features, shorted: ``g``, ``F``, ``F'`` flattened,
            ``(B, d)``. shape: the shape ``linear`` takes, ``(B, *shape)`` with ``d`` coordinates per sample.
    """
    if approximation == "first_order":
        return linear.logits + linear.jvp((shorted - features).view(shape))
    if approximation == "predicted_logit":
        return predicted_logit_update(linear.logits, predicted_class, gradient, shorted - features)
    return linear.function(shorted.view(shape))
