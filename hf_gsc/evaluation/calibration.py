"""Threshold calibration on ID validation scores (never on test or OOD data).

A detector accepts an input as in-distribution iff ``ood_score >= threshold``. The threshold is
chosen so that a fraction ``tpr`` (0.95 by default) of the *ID validation* scores is accepted,
with exactly the rule that :func:`hf_gsc.evaluation.metrics.threshold_at_tpr` uses for FPR95, so a
calibrated threshold and the reported FPR95 agree.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..thresholds import ScoresLike, calibration_record, threshold_at_tpr


def calibrate_threshold(id_scores: ScoresLike, tpr: float = 0.95) -> float:
    """Threshold that keeps a fraction ``tpr`` of the ID scores (``score >= threshold``).

    Args:
        id_scores: 1-D ``ood_score`` values (higher = more ID) of ID *validation* samples; a numpy
            array, a torch tensor or a sequence of numbers.
        tpr: target true-positive rate (fraction of ID accepted), in ``(0, 1]``.

    Returns:
        The threshold as a Python float: the k-th largest score with ``k`` the smallest integer such
        that ``k / n >= tpr``. Ties are kept, so the achieved TPR on these scores is ``>= tpr``.

    Raises:
        ValueError: empty / non-1-D / non-finite ``id_scores``, or ``tpr`` outside ``(0, 1]``.
    """
    return threshold_at_tpr(id_scores, tpr)


def true_positive_rate(id_scores: ScoresLike, threshold: float) -> float:
    """Fraction of ``id_scores`` accepted as ID (``score >= threshold``), e.g. on the ID test split."""
    if hasattr(id_scores, "detach"):
        id_scores = id_scores.detach().cpu().double().numpy()
    scores = np.asarray(id_scores, dtype=np.float64)
    if scores.ndim != 1 or scores.size == 0:
        raise ValueError(f"id_scores must be a non-empty 1-D array; got shape {scores.shape}")
    return float(np.count_nonzero(scores >= threshold) / scores.size)


__all__ = ["calibrate_threshold", "calibration_record", "true_positive_rate"]
