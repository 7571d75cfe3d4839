"""Approximation error (paper ``tab:approx_error``): how far the cheap logit updates land from the exact head pass.

For one short-circuit (``F -> F'``), per sample and score ``s`` (energy, MSP)::

    err_first_order     = |s(y + J (F' - F))        - s(head(F'))|
    err_predicted_logit = |s(y + e_c g.(F' - F))   - s(head(F'))|

summarised by mean, std and max over ID and OOD samples, with the ID accuracy of each logit estimate.
Where the head is affine in ``F`` (ResNet final encoder output, any ``penultimate`` split) the first-order
update *is* the exact pass, so its error is floating-point noise; ``predicted_logit`` still differs because it
moves only ``y_c``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..detectors.gsc import GSCConfig
from ..gsc_math.choices import Approximation, Operation
from ..gsc_math.step import gsc_step
from ..utils.score_names import Score
from .context import HeadContext, scores_of


APPROXIMATIONS: tuple[Approximation, ...] = ("exact", "first_order", "predicted_logit")
ERROR_SCORES: tuple[Score, ...] = ("energy", "msp")


def approximation_outputs(
    context: HeadContext, mask_ratio: float = 0.05, operation: Operation = "zero"
) -> dict[str, torch.Tensor]:
    """Scores and predictions of every approximation for one batch (top-|g| mask, ``operation``).

    Returns ``{"<approximation>/<score>": (B,) float64, "<approximation>/prediction": (B,) int64,
    "base/<score>", "base/prediction"}`` on the CPU.
    """
    def step_logits(approximation: Approximation) -> torch.Tensor:
        settings = GSCConfig(mask_ratio=mask_ratio, operation=operation, approximation=approximation)
        return gsc_step(context.linearization.head, context.features, settings).gsc_logits

    out: dict[str, torch.Tensor] = {}
    for name, logits in [("base", context.logits)] + [
        (approximation, step_logits(approximation)) for approximation in APPROXIMATIONS
    ]:
        for score in ERROR_SCORES:
            out[f"{name}/{score}"] = scores_of(logits, score)
        out[f"{name}/prediction"] = logits.argmax(dim=-1).cpu()
    return out


def error_stats(errors: torch.Tensor) -> dict[str, float]:
    """``{"mean", "std", "max", "num_samples"}`` of absolute errors ``(N,)`` (population std)."""
    errors = errors.double()
    return {
        "mean": float(errors.mean()),
        "std": float(errors.std(unbiased=False)) if errors.numel() > 1 else 0.0,
        "max": float(errors.max()),
        "num_samples": int(errors.numel()),
    }


def summarise_errors(
    outputs: Mapping[str, Mapping[str, torch.Tensor]],
    id_split: str,
    ood_splits: Sequence[str],
    labels: torch.Tensor | None = None,
) -> dict:
    """Error table of one split point.

    Args:
        outputs: data split -> concatenated :func:`approximation_outputs`.
        id_split: the ID split's name; ood_splits: OOD split names (pooled into "OOD").
        labels: ID labels ``(N,)`` for the accuracies (``None``: no accuracy).
    Returns:
        ``{"errors": {approximation: {score: {"ID": stats, "OOD": stats}}}, "id_accuracy": {...}}``.
    """
    groups = {"ID": [id_split], "OOD": list(ood_splits)}
    errors: dict = {}
    for approximation in ("first_order", "predicted_logit"):
        errors[approximation] = {}
        for score in ERROR_SCORES:
            errors[approximation][score] = {}
            for group, splits in groups.items():
                diff = torch.cat([
                    (outputs[s][f"{approximation}/{score}"] - outputs[s][f"exact/{score}"]).abs() for s in splits
                ])
                errors[approximation][score][group] = error_stats(diff)
    accuracy = None
    if labels is not None:
        keep = labels >= 0
        accuracy = {
            name: float((outputs[id_split][f"{name}/prediction"][keep] == labels[keep]).double().mean())
            for name in ("base", *APPROXIMATIONS)
        }
    return {"errors": errors, "id_accuracy": accuracy}
