"""Pure tensor math of Gradient Short-Circuit: masks, short-circuit operations, logit updates.

Nothing here knows about models, files or data. Every function works on flattened features:
``F`` and ``g`` have shape ``(B, d)``, a batch of ``B`` samples with ``d`` feature coordinates each.
Each sample is handled on its own: no output row depends on another row of the batch.

The mask ratio counts the coordinates the head actually reads, i.e. those with a nonzero gradient.
For a ViT split before the final LayerNorm only the CLS token reaches the classifier, so
``n = hidden_size`` and not ``num_tokens * hidden_size``; for a ResNet split before pooling every
coordinate is read (``g = W[c] / (H*W)``), so ``n = C*H*W``. Per sample ``k = ceil(mask_ratio * n)``.
"""

from __future__ import annotations

import fractions
import functools
import math
from typing import TypeVar

import torch

from .choices import OPERATIONS, SELECTIONS, Operation, Selection


@functools.lru_cache(maxsize=64)
def _as_fraction(ratio: float) -> tuple[int, int]:
    fraction = fractions.Fraction(ratio).limit_denominator(1_000_000)
    return fraction.numerator, fraction.denominator


def num_masked(gradient: torch.Tensor, mask_ratio: float, repeats: int = 1) -> torch.Tensor:
    """Per-sample mask size ``k = ceil(mask_ratio * n)``, ``n`` = number of nonzero gradient coordinates.

    ``mask_ratio`` is read as the nearest fraction ``p / q`` with ``q <= 10**6`` and ``k`` is computed in
    integers, so ``0.05 * 100`` is exactly 5 (float arithmetic gives 5.000000000000001 and would round up).

    Args:
        gradient: ``(B, d)``.
        mask_ratio: fraction in ``[0, 1]``.
        repeats: each column of ``gradient`` stands for this many coordinates with its value (a pooled head's
            channels, see :class:`hf_gsc.classifier.head_jacobians.PooledRead`).
    Returns:
        ``(B,)`` int64.
    """
    numerator, denominator = _as_fraction(float(mask_ratio))
    n = torch.count_nonzero(gradient, dim=1)
    return _mask_sizes(gradient.shape[1], numerator, denominator, repeats, gradient.device).index_select(0, n)


#: A count: a Python int, or an int64 tensor of counts.
Count = TypeVar("Count", int, torch.Tensor)


def mask_size(n: Count, numerator: int, denominator: int) -> Count:
    """``k = ceil(n * numerator / denominator)`` in integer arithmetic, for an int or an int64 tensor ``n``."""
    return (n * numerator + (denominator - 1)) // denominator


@functools.lru_cache(maxsize=16)
def _mask_sizes(d: int, numerator: int, denominator: int, repeats: int, device: torch.device) -> torch.Tensor:
    """:func:`mask_size` of ``n * repeats`` for ``n = 0 .. d``, ``(d + 1,)`` int64 (a lookup is one op per batch
    instead of four)."""
    return mask_size(torch.arange(d + 1, dtype=torch.int64, device=device) * repeats, numerator, denominator)


@functools.lru_cache(maxsize=16)
def _rank_starts(d: int, repeats: int, device: torch.device) -> torch.Tensor:
    """``(d,)`` int64 ``r * repeats`` for ranks ``r = 0 .. d - 1``: the coordinates before rank ``r``."""
    return torch.arange(d, dtype=torch.int64, device=device) * repeats


def num_masked_adaptive(gradient: torch.Tensor, gradient_mass: float, repeats: int = 1) -> torch.Tensor:
    """Per-sample mask size: the smallest ``k`` whose top-``k`` ``|g|`` hold ``gradient_mass`` of the total ``|g|``.

    A sample whose gradient is concentrated on few coordinates gets a small mask, a diffuse one a large
    mask (a fixed ``mask_ratio`` treats both alike).

    Args:
        gradient: ``(B, d)``.
        gradient_mass: fraction in ``[0, 1]``; 0 gives ``k = 0``.
        repeats: each column stands for this many coordinates with its value (as in :func:`num_masked`); the
            prefix sums are then taken per column, ``q`` coordinates of a column adding ``q |g|``, so the
            coordinates are never expanded.
    Returns:
        ``(B,)`` int64, at most the number of nonzero coordinates.
    """
    magnitude = gradient.abs().double().sort(dim=1, descending=True).values
    if repeats == 1:
        cumulative = magnitude.cumsum(dim=1)
        total = cumulative[:, -1:]
        # Number of prefixes still short of the target, plus the one that reaches it.
        k = (cumulative < gradient_mass * total * (1 - 1e-12)).sum(dim=1) + 1
    else:
        # |g| * repeats is exact in float64 (a float32 value times an integer below 2**29).
        blocks = magnitude * repeats
        ends = blocks.cumsum(dim=1)
        total = ends[:, -1:]
        target = gradient_mass * total * (1 - 1e-12)
        before = ends - blocks
        # Per column, the prefixes before + q |g| (q = 1 .. repeats) still short of the target: q < (target -
        # before) / |g|; a zero column adds nothing, so its prefixes are short exactly when `before` is.
        short = ((target - before) / magnitude).ceil().sub(1).clamp(0, repeats)
        short = torch.where(magnitude > 0, short, (before < target).double() * repeats)
        k = short.sum(dim=1).long() + 1
    k = torch.where(torch.as_tensor(gradient_mass > 0) & (total[:, 0] > 0), k, torch.zeros_like(k))
    return torch.minimum(k, (gradient != 0).sum(dim=1) * repeats)


def gradient_mass_for_mean_ratio(gradient: torch.Tensor, mask_ratio: float, iterations: int = 40) -> float:
    """The ``gradient_mass`` whose :func:`num_masked_adaptive` sizes average ``mask_ratio`` of each row's read
    (nonzero) coordinates over the rows of ``gradient`` ``(N, d)``: bisection on ``[0, 1]``, since the mean
    ratio grows with the mass. Returns the upper end of the final bracket (a mean ratio of at least the target).
    """
    read = (gradient != 0).sum(dim=1).clamp_min(1).double()

    def mean_ratio(mass: float) -> float:
        return float((num_masked_adaptive(gradient, mass) / read).mean())

    low, high = 0.0, 1.0
    for _ in range(iterations):
        middle = (low + high) / 2
        low, high = (middle, high) if mean_ratio(middle) < mask_ratio else (low, middle)
    return high


def top_k_mask(priority: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mask of the ``k[i]`` highest-priority coordinates per row; ties go to the lower index. The one top-k of GSC:
    :func:`repeated_top_k` with one position per column.

    It never reads ``k`` on the host, so a GPU never waits and a compiler takes the step whole
    (``torch.compile(..., fullgraph=True)``). :func:`top_k_mask_by_topk` gives the same mask from a partial ``topk``,
    reading ``max(k)`` and a tie check on the host.

    Args:
        priority: ``(B, d)`` float; ``-inf`` marks coordinates that must not be chosen (``k[i]`` never exceeds
            the number of finite ones in the callers).
        k: ``(B,)`` int64 mask sizes.
    Returns:
        ``(B, d)`` bool with ``k[i]`` coordinates in row ``i``.
    """
    return repeated_top_k(priority, k)


def repeated_top_k(priority: torch.Tensor, k: torch.Tensor, repeats: int = 1,
                   position_major: bool = False) -> torch.Tensor:
    """The top ``k[i]`` coordinates of a priority that repeats over ``repeats`` positions per column, ties to the
    lower flattened index: one stable descending sort of the ``C`` columns, the cut made in rank order and sent back
    to the columns by one scatter; no host read, no branch on the data.

    With ``repeats == 1`` (a priority per coordinate) this is :func:`top_k_mask`, ``(B, C)`` bool; otherwise
    :func:`repeated_top_k_counts`, ``(B, C)`` int64 prefix lengths. The column at rank ``r`` has ``r * repeats``
    coordinates before it when ties are taken column by column (channel-major), so its count is
    ``clamp(k - r * repeats, 0, repeats)``; position-major ties at the cut share what is left of ``k`` position by
    position (:func:`_share_tied_cut`).
    """
    columns = priority.shape[1]
    if columns == 0:
        return torch.zeros_like(priority, dtype=torch.bool if repeats == 1 else torch.int64)
    values, order = priority.sort(dim=1, descending=True, stable=True)
    k = k.to(priority.device).unsqueeze(1)
    starts = _rank_starts(columns, repeats, priority.device)
    if repeats == 1:
        in_rank_order = starts < k
    else:
        in_rank_order = (k - starts).clamp(0, repeats)
        if position_major:
            in_rank_order = _share_tied_cut(values, in_rank_order, k, repeats)
    # order is a permutation, so every entry is written: the scattered copy starts from any tensor of the shape.
    return in_rank_order.scatter(1, order, in_rank_order)


def top_k_mask_by_topk(priority: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """:func:`top_k_mask` from a partial ``topk``: each row's ``k[i]``-th largest value ``v``; everything above ``v``
    is kept and the ties at ``v`` are filled in index order, without sorting all ``d`` coordinates."""
    sizes = k.tolist()
    k_min, k_max = (min(sizes), max(sizes)) if sizes else (0, 0)
    if k_max == 0:
        return torch.zeros_like(priority, dtype=torch.bool)
    top_values = priority.topk(k_max, dim=1, sorted=True).values
    if k_min == k_max:  # every row has the same size (they read the same coordinates): no gather
        kth = top_values.narrow(1, k_max - 1, 1)
    else:
        kth = top_values.gather(1, (k - 1).clamp(min=0).unsqueeze(1))
    at_least = priority >= kth
    # Common case, checked exactly: no row has a tie across its cut, so "at least the k-th value" is the mask.
    if torch.equal(at_least.sum(dim=1), k):
        return at_least
    above = priority > kth
    tied = priority == kth
    room = k.unsqueeze(1) - above.sum(dim=1, keepdim=True)
    mask = above | (tied & (tied.cumsum(dim=1) <= room))
    return mask & (k > 0).unsqueeze(1)


def _share_tied_cut(values: torch.Tensor, counts: torch.Tensor, k: torch.Tensor, repeats: int) -> torch.Tensor:
    """Position-major counts in rank order: the columns tied at the value of the ``k``-th coordinate (ranks ``A ..
    A + T - 1``) take the ``room = k - repeats * A`` coordinates left position by position, the ``j``-th of them
    ``ceil((room - j) / T)``; columns above and below the cut keep ``counts`` (all or nothing)."""
    columns = values.shape[1]
    cut = ((k - 1).clamp(min=0) // repeats).clamp(max=columns - 1)  # rank of the k-th coordinate's column
    kth = values.gather(1, cut)
    tied = values == kth
    above = (values > kth).sum(dim=1, keepdim=True)
    ties = tied.sum(dim=1, keepdim=True).clamp_min(1)  # >= 1 unless the value is NaN (a row scored NaN anyway)
    within = _rank_starts(columns, 1, values.device) - above
    shared = ((k - repeats * above - within + ties - 1) // ties).clamp(0, repeats)
    return torch.where(tied, shared, counts)


def short_circuit_mask(
    gradient: torch.Tensor,
    k: torch.Tensor,
    selection: Selection = "gradient",
    fisher_diagonal: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    excluded: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask of the ``k[i]`` coordinates to short-circuit in each row.

    Args:
        gradient: ``g``, ``(B, d)``.
        k: ``(B,)`` mask sizes, from :func:`num_masked` or :func:`num_masked_adaptive`.
        selection: ``gradient`` = largest ``|g|`` (the paper); ``fisher`` = largest ``|g_i| / sqrt(lambda_i)``
            (the optimum of the paper's Theorem A.4.1 under a diagonal Fisher ``lambda``); ``reverse`` =
            smallest nonzero ``|g|``; ``random`` = uniformly among the read coordinates (ablation controls).
        fisher_diagonal: ``(d,)`` nonnegative ``lambda``, required for ``selection="fisher"``.
        generator: random source for ``selection="random"``.
        excluded: ``(B, d)`` bool, coordinates never chosen (those an iterative short-circuit already took);
            ``k[i]`` must not exceed the number of the others.
    Returns:
        ``(B, d)`` bool. Coordinates with ``g = 0`` (not read by the head) are chosen after every read one.
    """
    priority = selection_priority(gradient, selection, fisher_diagonal, generator)
    if excluded is not None:
        priority = priority.masked_fill(excluded, -math.inf)
    return top_k_mask(priority, k)


def selection_priority(
    gradient: torch.Tensor,
    selection: Selection = "gradient",
    fisher_diagonal: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The value :func:`short_circuit_mask` ranks, ``(B, d)``, coordinate by coordinate (see its ``selection``);
    unread coordinates (``g = 0``) get a value below every read one."""
    magnitude = gradient.abs()
    if selection == "gradient":
        # Unread coordinates (|g| = 0) already rank after every read one.
        return magnitude
    if selection == "fisher":
        if fisher_diagonal is None:
            raise ValueError("selection='fisher' needs the diagonal Fisher: fit it on ID training data first")
        scale = fisher_diagonal.to(magnitude).sqrt().clamp_min(torch.finfo(magnitude.dtype).tiny)
        priority = magnitude / scale
    elif selection == "reverse":
        priority = -magnitude
    elif selection == "random":
        noise = torch.rand(gradient.shape, generator=generator, device="cpu").to(gradient.device)
        priority = noise.to(magnitude.dtype)
    else:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    # The lowest finite value: after every read coordinate, before every excluded one (-inf).
    return torch.where(gradient != 0, priority, torch.finfo(priority.dtype).min)


def repeated_top_k_counts(priority: torch.Tensor, k: torch.Tensor, repeats: int, position_major: bool) -> torch.Tensor:
    """:func:`top_k_mask` of a priority that repeats over positions, as a count per channel, without expanding it.

    The coordinates are ``(channel, position)`` pairs, ``repeats`` positions a channel, all with the channel's
    priority; flattened, coordinate ``(c, p)`` is ``c * repeats + p`` (channel-major, ``(B, C, H, W)``) or
    ``p * C + c`` (``position_major``, ``(B, N, D)``). Ties go to the lower flattened index, so the mask of each
    channel is always a prefix of its positions; this returns the prefix lengths: channels above the ``k``-th
    coordinate's value are whole, those below are empty, and the channels tied at that value share what is left of
    ``k`` in index order: channel by channel (channel-major), or position by position across the tied channels
    (position-major).

    Args:
        priority: ``(B, C)`` per channel (finite). k: ``(B,)`` int64 mask sizes, at most ``C * repeats``.
    Returns:
        ``(B, C)`` int64 counts in ``[0, repeats]`` summing to ``k`` per row; the mask is
        ``position < counts[:, c]`` (:func:`prefix_mask`).
    """
    counts = repeated_top_k(priority, k, repeats, position_major)
    return counts.long() if repeats == 1 else counts


def prefix_mask(counts: torch.Tensor, repeats: int) -> torch.Tensor:
    """``(B, C)`` counts -> ``(B, C, repeats)`` bool, ``position < counts``."""
    return _rank_starts(repeats, 1, counts.device) < counts.unsqueeze(-1)


def diagonal_fisher_sum(loss_gradient: torch.Tensor) -> torch.Tensor:
    """Sum over the batch of squared per-sample loss gradients ``(dl/dF)^2``: ``(B, d) -> (d,)`` float64.

    Divided by the number of samples this is the empirical diagonal Fisher ``lambda`` of the feature.
    """
    return loss_gradient.double().pow(2).sum(dim=0)


def short_circuit(
    features: torch.Tensor,
    gradient: torch.Tensor,
    mask: torch.Tensor,
    operation: Operation = "zero",
    alpha: float = 0.1,
    clip_bound: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """``F' = S(F, g)`` on the masked coordinates; unmasked coordinates are returned unchanged.

    Operations (paper Sec. 3.2, plus clip and scale):
        zero:    ``F'_i = 0``
        perturb: ``F'_i = F_i - alpha * sign(g_i)``
        project: remove the component of ``F`` along ``g`` restricted to the mask,
                 ``F' = F - <F_m, g_m> g_m / |g_m|^2`` (with ``mask_ratio=1`` this is the paper's projection)
        clip:    ``F'_i = clamp(F_i, -clip_bound, clip_bound)``
        scale:   ``F'_i = beta * F_i``

    Args:
        features: ``F``, ``(B, d)``. gradient: ``g``, ``(B, d)``. mask: ``(B, d)`` bool. Any shape ``(B, ...)``
            works the same (sums run over all but the batch dimension), with ``gradient`` broadcast to it: a pooled
            head's ``F`` as ``(B, C, P)`` with ``g`` as ``(B, C)`` or ``(B, C, 1)``.
    Returns:
        ``F'``, the shape of ``features``, same dtype.
    """
    if operation == "zero":
        return features.masked_fill(mask, 0.0)
    if gradient.dim() < features.dim():  # a pooled head's per-channel g, (B, C), against F as (B, C, P) or (B, C, H, W)
        gradient = gradient.reshape(*gradient.shape, *(1,) * (features.dim() - gradient.dim()))
    if operation == "perturb":
        return features - alpha * torch.sign(gradient) * mask
    if operation == "project":
        g_masked = gradient * mask
        sample = tuple(range(1, features.dim()))
        norm_sq = (g_masked * g_masked).sum(dim=sample, keepdim=True)
        coefficient = (features * g_masked).sum(dim=sample, keepdim=True) / norm_sq.clamp_min(torch.finfo(norm_sq.dtype).tiny)
        return features - coefficient * g_masked
    if operation == "clip":
        return torch.where(mask, features.clamp(-clip_bound, clip_bound), features)
    if operation == "scale":
        return torch.where(mask, beta * features, features)
    raise ValueError(f"operation must be one of {OPERATIONS}, got {operation!r}")


def predicted_logit_update(
    logits: torch.Tensor, predicted_class: torch.Tensor, gradient: torch.Tensor, delta: torch.Tensor
) -> torch.Tensor:
    """The paper's O(d) update: only ``y_c`` moves, by ``g . (F' - F)``; other logits stay.

    Args:
        logits: ``(B, K)``; predicted_class: ``(B,)``; gradient, delta: ``(B, d)``.
    Returns:
        ``(B, K)``.
    """
    step = (gradient * delta).sum(dim=1, keepdim=True).to(logits.dtype)
    return logits.scatter_add(1, predicted_class.unsqueeze(1), step)
