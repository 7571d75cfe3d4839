"""Why GSC flagged an input: the short-circuited coordinates and what each did to the predicted logit.

GSC moves ``F`` to ``F'`` on the masked coordinates and scores the updated logits. To first order the predicted
logit ``y_c`` moves by ``g . (F' - F)`` (``g = d y_c / dF``), a sum over coordinates, so coordinate ``i`` contributes

    contribution_i = g_i (F'_i - F_i)          (0 off the mask)

and the contributions add up to ``gsc_logits[c] - logits[c]`` under the ``first_order`` and ``predicted_logit``
updates (under ``exact`` they are its first-order part). Where the head reads ``F`` position by position (a pooled
convolutional map ``(C, H, W)``, a mean over tokens ``(N, D)`` laid out on a grid), the contributions summed over
the channels of each position give a map over positions, resized to the input image; a head that reads one token
only (ViT's CLS) has no such map, and the explanation says so.

:func:`explain_short_circuit` is a pure function of the step's tensors; :meth:`hf_gsc.GSCForImageClassification.explain`
runs it on a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..utils.scores import ood_score
from .shortcircuit import short_circuit


#: How the head reads ``F``, as the explanation reports it, and whether a map over positions exists.
READS = {
    "mean_spatial": "a mean over the positions of a convolutional map: one map value per position",
    "mean_tokens": "a mean over tokens laid out on a grid: one map value per token",
    "first_token": "the first token only (CLS): no map over positions, the coordinates' contributions only",
    "map": "a convolutional map (autograd head): one map value per position",
    "vector": "a vector without positions: the coordinates' contributions only",
}


@dataclass(frozen=True)
class GSCExplanation:
    """What :func:`explain_short_circuit` returns for a batch of ``B`` inputs.

    Attributes:
        predicted_class: ``(B,)`` ``c = argmax logits``, the class whose gradient chose the mask.
        score_before: ``(B,)`` the score of the base logits (the same score function as ``ood_score``).
        score_after: ``(B,)`` ``ood_score``, the score of the logits after the short-circuit.
        logit_change: ``(B,)`` ``gsc_logits[c] - logits[c]``.
        coordinates: ``(B, top_k)`` int64 indices into ``F`` flattened (unravel with ``feature_shape``), the
            short-circuited coordinates with the largest ``|contribution|`` first; ``-1`` pads a shorter mask.
        contributions: ``(B, top_k)`` ``g_i (F'_i - F_i)`` of those coordinates (0 where padded).
        total_contribution: ``(B,)`` the sum over every short-circuited coordinate.
        feature_shape: ``F``'s shape without the batch dimension.
        head_reads: which entry of :data:`READS` describes the head: ``mean_spatial``, ``mean_tokens``,
            ``first_token``, ``map`` or ``vector``.
        position_map: ``(B, h, w)`` the contributions summed over the channels of each position of ``F``, or
            ``None`` where the head does not read ``F`` position by position.
        image_map: ``(B, H, W)`` ``position_map`` resized (bilinear) to the input images' size, or ``None``.
    """

    predicted_class: torch.Tensor
    score_before: torch.Tensor
    score_after: torch.Tensor
    logit_change: torch.Tensor
    coordinates: torch.Tensor
    contributions: torch.Tensor
    total_contribution: torch.Tensor
    feature_shape: tuple[int, ...]
    head_reads: str
    position_map: torch.Tensor | None
    image_map: torch.Tensor | None

    def to_dict(self, index: int = 0, id2label: dict[int, str] | None = None,
                image_size: tuple[int, int] | None = None) -> dict[str, Any]:
        """Input ``index``'s explanation as plain Python values: what the pipeline returns under ``"explanation"``
        (``explain=True``), in the same names and forms as the attributes, one input's row of each:

        * ``predicted_class`` (int) and, with ``id2label``, ``predicted_label``;
        * ``score_before``, ``score_after``, ``logit_change``, ``total_contribution`` (floats);
        * ``coordinates`` (flat indices into ``F``, largest ``|contribution|`` first, the ``-1`` padding dropped;
          :func:`unravel` gives each one's index in ``feature_shape``) and ``contributions`` (floats, the same order);
        * ``feature_shape`` (list), ``head_reads`` (a key of :data:`READS`), ``description`` (the sentence);
        * ``position_map`` (``(h, w)`` float32 NumPy array, or ``None``) and ``image_map``: that map resized to
          ``image_size`` (``(H, W)``; default the ``image_map`` attribute's size), or ``None``.
        """
        kept = [(int(i), float(c)) for i, c in zip(self.coordinates[index].tolist(), self.contributions[index].tolist())
                if int(i) >= 0]
        predicted = int(self.predicted_class[index])
        position_map = None if self.position_map is None else self.position_map[index:index + 1]
        if position_map is None:
            image_map = None
        elif image_size is not None:
            image_map = resized_map(position_map, image_size)[0].float().numpy()
        else:
            image_map = None if self.image_map is None else self.image_map[index].float().numpy()
        return {
            "predicted_class": predicted,
            **({"predicted_label": id2label.get(predicted, str(predicted))} if id2label is not None else {}),
            "score_before": float(self.score_before[index]),
            "score_after": float(self.score_after[index]),
            "logit_change": float(self.logit_change[index]),
            "total_contribution": float(self.total_contribution[index]),
            "coordinates": [i for i, _ in kept],
            "contributions": [c for _, c in kept],
            "feature_shape": list(self.feature_shape),
            "head_reads": self.head_reads,
            "description": self.description,
            "position_map": None if position_map is None else position_map[0].float().numpy(),
            "image_map": image_map,
        }

    @property
    def description(self) -> str:
        """One sentence: how the head reads ``F`` and whether there is a map."""
        if self.position_map is None and self.head_reads in ("mean_spatial", "mean_tokens", "map"):
            return (f"The head reads {READS[self.head_reads].split(':')[0]}, but its positions do not form a grid of "
                    "the image's shape: the coordinates' contributions only.")
        return f"The head reads {READS[self.head_reads]}."


def coordinate_contributions(gradient: torch.Tensor, features: torch.Tensor, shorted: torch.Tensor) -> torch.Tensor:
    """``g_i (F'_i - F_i)``, elementwise, any shape: each coordinate's first-order change of the predicted logit."""
    return gradient * (shorted - features)


def position_grid(positions: int, image_size: tuple[int, int]) -> tuple[int, int] | None:
    """``(h, w)`` with ``h * w = positions`` and ``h / w`` closest to the image's aspect ratio (tokens of a Swin or
    any patch grid); ``None`` where no factorisation is near it (within a factor 2)."""
    height, width = image_size
    best = None
    for h in range(1, positions + 1):
        if positions % h:
            continue
        w = positions // h
        distance = abs(math.log((h / w) / (height / width)))
        if best is None or distance < best[0]:
            best = (distance, (h, w))
    return None if best is None or best[0] > math.log(2) else best[1]


def position_map(contributions: torch.Tensor, head_reads: str, image_size: tuple[int, int]) -> torch.Tensor | None:
    """``(B, h, w)`` contributions summed over each position's channels: ``(B, C, H, W)`` maps (``mean_spatial``,
    ``map``) over ``C``, ``(B, N, D)`` tokens (``mean_tokens``) over ``D`` and laid on a grid
    (:func:`position_grid`), channels-last ``(B, H, W, C)`` maps (``mean_tokens``) over ``C``; ``None`` for the other
    heads."""
    if head_reads in ("mean_spatial", "map") and contributions.ndim == 4:
        return contributions.sum(dim=1)
    if head_reads == "mean_tokens" and contributions.ndim == 4:  # a channels-last (B, H, W, C) map
        return contributions.sum(dim=3)
    if head_reads == "mean_tokens" and contributions.ndim == 3:
        grid = position_grid(contributions.shape[1], image_size)
        if grid is not None:
            return contributions.sum(dim=2).reshape(contributions.shape[0], *grid)
    return None


def unravel(index: int, shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """A flat index of ``F`` as its index in ``shape`` (channel, row, column for a map; token, channel for tokens)."""
    position = []
    for size in reversed(shape):
        index, rest = divmod(index, size)
        position.append(rest)
    return tuple(reversed(position))


def resized_map(position_values: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
    """``(B, h, w) -> (B, H, W)`` bilinear, for drawing over the image (values per position, not per pixel)."""
    return torch.nn.functional.interpolate(position_values[:, None].double(), size=tuple(image_size),
                                           mode="bilinear", align_corners=False)[:, 0]


def explain_short_circuit(
    features: torch.Tensor,
    gradient: torch.Tensor,
    mask: torch.Tensor,
    logits: torch.Tensor,
    gsc_logits: torch.Tensor,
    settings: Any,
    head_reads: str,
    image_size: tuple[int, int],
    top_k: int = 10,
) -> GSCExplanation:
    """The explanation of one GSC step.

    Args:
        features: ``F``, ``(B, *feature_shape)``.
        gradient: ``g = d y_c / dF`` on all of ``F`` (0 where the head does not read), same shape.
        mask: bool, the short-circuited coordinates, same shape.
        logits, gsc_logits: ``(B, K)`` before and after the short-circuit.
        settings: the :class:`hf_gsc.GSCConfig` of the step (``operation``, ``alpha``, ``clip_bound``, ``beta``,
            ``score``, ``temperature``).
        head_reads: a key of :data:`READS`.
        image_size: ``(H, W)`` of the input images, for ``image_map``.
        top_k: coordinates listed per input (at least 1).
    """
    if head_reads not in READS:
        raise ValueError(f"head_reads must be one of {sorted(READS)}, got {head_reads!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    batch = features.shape[0]
    flat_features, flat_gradient, flat_mask = features.flatten(1), gradient.flatten(1), mask.flatten(1)
    shorted = short_circuit(flat_features, flat_gradient, flat_mask, settings.operation, settings.alpha,
                            settings.clip_bound, settings.beta)
    contributions = coordinate_contributions(flat_gradient, flat_features, shorted).masked_fill(~flat_mask, 0.0)
    count = min(top_k, contributions.shape[1])
    # Largest |contribution| first among the masked coordinates; unmasked ones rank after every masked one.
    priority = contributions.abs().masked_fill(~flat_mask, -1.0)
    order = priority.topk(count, dim=1).indices
    chosen = flat_mask.gather(1, order)
    predicted_class = logits.argmax(dim=-1)
    rows = torch.arange(batch, device=logits.device)
    by_position = position_map(contributions.view_as(features), head_reads, image_size)
    return GSCExplanation(
        predicted_class=predicted_class,
        score_before=ood_score(logits, settings.score, settings.temperature),
        score_after=ood_score(gsc_logits, settings.score, settings.temperature),
        logit_change=gsc_logits[rows, predicted_class] - logits[rows, predicted_class],
        coordinates=order.masked_fill(~chosen, -1),
        contributions=contributions.gather(1, order).masked_fill(~chosen, 0.0),
        total_contribution=contributions.sum(dim=1),
        feature_shape=tuple(features.shape[1:]),
        head_reads=head_reads,
        position_map=by_position,
        image_map=None if by_position is None else resized_map(by_position, image_size),
    )


__all__ = [
    "READS",
    "GSCExplanation",
    "coordinate_contributions",
    "explain_short_circuit",
    "position_grid",
    "position_map",
    "resized_map",
]
