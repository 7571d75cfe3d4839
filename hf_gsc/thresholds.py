"""Thresholds on OOD scores: the one rule that turns ID validation scores into a detector's threshold.

A detector accepts an input as in-distribution iff ``ood_score >= threshold``. :func:`threshold_at_tpr` keeps a
fraction ``tpr`` of the given ID scores; the evaluation's FPR@95 uses the same rule, so a calibrated threshold and
the reported FPR agree. Pure functions of arrays: the detectors (``calibrate``) and the evaluation both use them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Union

import numpy as np

if TYPE_CHECKING:
    import torch

ScoresLike = Union[np.ndarray, "torch.Tensor", Sequence[float]]

#: Fewer ID validation samples than this give a threshold whose TPR on new data is too uncertain to rely on:
#: with n samples the accepted fraction at the 95% rule has a standard error of about sqrt(0.95 * 0.05 / n),
#: 0.03 at n = 50 and 0.01 at n = 500. ``calibrate`` warns below it.
MIN_CALIBRATION_SAMPLES = 100


def as_scores(scores: ScoresLike, name: str) -> np.ndarray:
    """Return ``scores`` as a finite, non-empty, 1-D float64 numpy array.

    ``name`` is the caller's argument name, so that the error says which of the
    two score arrays is wrong.
    """
    if hasattr(scores, "detach") and hasattr(scores, "cpu"):
        # torch tensor: detach so requires_grad tensors convert, move off the GPU,
        # and upcast before numpy (numpy has no bfloat16).
        scores = scores.detach().cpu().double().numpy()
    try:
        arr = np.asarray(scores)
    except (TypeError, ValueError) as err:  # ragged nested lists, for example
        raise ValueError(f"{name} must be a 1-D array of real scores; could not convert it: {err}") from err
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be a 1-D array of real scores; got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of scores; got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} must be non-empty; got an empty array")
    arr = arr.astype(np.float64, copy=False)
    finite = np.isfinite(arr)
    if not finite.all():
        bad = arr[~finite]
        raise ValueError(
            f"{name} must contain only finite scores; got {bad.size} NaN/inf value(s), e.g. {bad[0]!r}"
        )
    return arr


def check_tpr(tpr: float) -> float:
    """Return ``tpr`` as a float after checking it lies in ``(0, 1]``."""
    try:
        value = float(tpr)
    except (TypeError, ValueError) as err:
        raise ValueError(f"tpr must be a number in (0, 1]; got {tpr!r}") from err
    # ``not (0 < value <= 1)`` also rejects NaN.
    if not 0.0 < value <= 1.0:
        raise ValueError(f"tpr must be in (0, 1]; got {tpr!r}")
    return value


def threshold_at_tpr(id_scores: ScoresLike, tpr: float = 0.95) -> float:
    """Largest threshold ``t`` such that the fraction of ``id_scores >= t`` is at least ``tpr``.

    This is the operating point used for FPR@``tpr`` and for calibrating a
    detector on ID validation data (accept as ID iff ``score >= t``). The result
    is always one of the ``id_scores``: the k-th largest, with ``k`` the smallest
    integer such that ``k / n >= tpr``. Ties at the threshold are all kept, so
    the achieved TPR is ``>= tpr`` (see the module docstring).

    Args:
        id_scores: 1-D scores of in-distribution samples, higher = more ID.
        tpr: target true-positive rate (fraction of ID kept), in ``(0, 1]``.

    Returns:
        The threshold as a Python float.

    Raises:
        ValueError: on empty, non-1-D or non-finite ``id_scores`` or on ``tpr``
            outside ``(0, 1]``.
    """
    scores = as_scores(id_scores, "id_scores")
    target = check_tpr(tpr)
    n = scores.size
    # Smallest k with k / n >= target. ceil(target * n) can be off by one from
    # rounding (0.7 * 10 == 7.000000000000001), so settle it with the same float
    # comparison that "fraction of ID kept >= tpr" means.
    k = min(max(math.ceil(target * n), 1), n)
    while k > 1 and (k - 1) / n >= target:
        k -= 1
    while k < n and k / n < target:
        k += 1
    # k-th largest == element n - k of the ascending order; partition is O(n).
    return float(np.partition(scores, n - k)[n - k])




def calibration_record(split: str, num_samples: int, tpr: float, **extra: Any) -> dict[str, Any]:
    """What a threshold was calibrated on, in the shape stored in a detector config's ``calibration``."""
    return {"split": split, "num_samples": int(num_samples), "tpr": float(tpr), **extra}


__all__ = ["MIN_CALIBRATION_SAMPLES", "ScoresLike", "as_scores", "calibration_record", "check_tpr", "threshold_at_tpr"]
