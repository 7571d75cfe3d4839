"""Iterative short-circuit under one budget (paper ``tab:iterative_shortcircuit``), built on hf_gsc.gsc_math.shortcircuit.

Definition (one sample; the batch is handled row by row, without cross-talk):

* ``F_0 = F``, ``c = argmax head(F_0)`` (fixed for all steps: the class whose confidence is suppressed),
  ``n`` = number of coordinates the head reads at ``F_0`` (nonzero ``g_0``), budget ``k = ceil(mask_ratio * n)``
  (the same ``k`` as one-shot GSC, :func:`hf_gsc.gsc_math.shortcircuit.num_masked`).
* The budget is split over ``T`` steps: ``k_t = floor(k / T)``, plus one for the first ``k mod T`` steps
  (:func:`split_budget`), so ``sum_t k_t = k`` exactly.
* Step ``t = 0 .. T-1``: ``g_t = d y_c / dF`` at ``F_t`` (the *exact* head gradient, one backward through the
  head); among the coordinates not masked yet, mask the ``k_t`` with the largest ``|g_t|``
  (selection ``gradient``; ``reverse`` / ``random`` rank the same candidates by smallest ``|g_t|`` / at random);
  ``F_{t+1} = F_t`` with those coordinates set to 0 (operation ``zero``).
* Output: the exact logits ``head(F_T)`` and the union of the ``T`` disjoint masks (``k`` coordinates).

With ``T = 1`` this is one-shot GSC with ``approximation="exact"``. A coordinate the head stops reading at
``F_t`` (``g_t = 0``) is chosen after every read one, like :func:`hf_gsc.gsc_math.shortcircuit.short_circuit_mask`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..gsc_math.backends.autograd import linearize_with_autograd
from ..gsc_math.choices import Selection
from ..gsc_math.shortcircuit import num_masked, short_circuit, short_circuit_mask


Head = Callable[[torch.Tensor], torch.Tensor]


def split_budget(k: torch.Tensor, steps: int) -> torch.Tensor:
    """``(steps, B)`` per-step mask sizes summing to ``k`` (``(B,)``); earlier steps get the remainder."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    base, remainder = k // steps, k % steps
    index = torch.arange(steps, device=k.device).unsqueeze(1)
    return base.unsqueeze(0) + (index < remainder.unsqueeze(0)).long()


def head_gradient(
    head: Head, features: torch.Tensor, predicted_class: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, d y_c / dF)`` at ``features`` (both detached); ``c`` defaults to ``argmax`` of the logits.

    The head must be batch-separable, so one backward gives every per-sample gradient (the autograd backend's
    :func:`hf_gsc.gsc_math.backends.autograd.linearize_with_autograd`).
    """
    linearized = linearize_with_autograd(lambda f, _: head(f), features.detach(), None, keep_graph_for_jvp=False)
    c = linearized.logits.argmax(dim=-1) if predicted_class is None else predicted_class
    assert linearized.class_gradient is not None  # LinearizedHead.__post_init__ fills it
    return linearized.logits, linearized.class_gradient(c)


def iterative_short_circuit(
    head: Head,
    features: torch.Tensor,
    mask_ratio: float,
    steps: int,
    selection: Selection = "gradient",
    generator: torch.Generator | None = None,
    gradient: torch.Tensor | None = None,
    predicted_class: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the iterative zero-out short-circuit defined in the module docstring.

    Args:
        head: ``F -> logits``, batch-separable. features: ``F``, ``(B, *shape)``.
        mask_ratio: total budget as a fraction of the read coordinates. steps: ``T >= 1``.
        selection: ``gradient`` | ``reverse`` | ``random`` (ranking within each step).
        gradient, predicted_class: ``g_0`` and ``c`` when already known (saves one backward).
    Returns:
        ``(logits after, F_T, mask)``: ``(B, K)``, ``(B, *shape)`` and ``(B, d)`` bool with ``k`` coordinates per row.
    """
    if predicted_class is None or gradient is None:
        logits, gradient = head_gradient(head, features, predicted_class)
        predicted_class = logits.argmax(dim=-1) if predicted_class is None else predicted_class
    shape = features.shape
    current = features.detach().flatten(1)
    g = gradient.flatten(1)
    budget = split_budget(num_masked(g, mask_ratio), steps)
    taken = torch.zeros_like(current, dtype=torch.bool)
    for t in range(steps):
        if t > 0:
            g = head_gradient(head, current.view(shape), predicted_class)[1].flatten(1)
        if selection not in ("gradient", "reverse", "random"):
            raise ValueError(f"selection must be gradient, reverse or random, got {selection!r}")
        step_mask = short_circuit_mask(g, budget[t], selection, generator=generator, excluded=taken)
        current = short_circuit(current, g, step_mask, "zero")
        taken |= step_mask
    with torch.no_grad():
        logits_after = head(current.view(shape))
    return logits_after.detach(), current.view(shape), taken
