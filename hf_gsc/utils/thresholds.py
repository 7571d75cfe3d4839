"""Thresholds on OOD scores: the one rule that turns ID validation scores into a detector's threshold.

A detector accepts an input as in-distribution iff ``ood_score >= threshold``. :func:`threshold_at_tpr` keeps a
fraction ``tpr`` of the given ID scores; the evaluation's FPR@95 uses the same rule, so a calibrated threshold and
the reported FPR agree. :func:`conformal_threshold` picks a lower order statistic that keeps at least ``tpr``
of new ID data with probability at least ``1 - delta`` (split-conformal: the derivation and its assumption below).
Pure functions of arrays: the detectors (``calibrate``) and the evaluation both use them.

Split-conformal thresholds (``method="conformal"``)
---------------------------------------------------
The quantile threshold reaches ``tpr`` on the validation scores, but on new ID data its TPR falls below
``tpr`` about half the time. :func:`conformal_threshold` picks a lower order statistic so that the TPR on new ID
data is at least ``tpr`` with probability at least ``1 - delta`` over the draw of the ``n`` calibration samples.

With ``s_(1) <= ... <= s_(n)`` the sorted calibration scores, ``alpha = 1 - tpr`` and the threshold
``t = s_(k)`` (accept iff ``score >= t``), the TPR on new data is ``1 - F(t^-)``, where ``F`` is the ID score
distribution. For continuous ``F``, ``F(s_(k))`` follows ``Beta(k, n - k + 1)``, so

    P(TPR >= tpr) = P(F(s_(k)) <= alpha) = P(Binomial(n, alpha) >= k).

The threshold is the largest ``k`` (the strictest threshold, hence the lowest FPR) with
``P(Binomial(n, alpha) >= k) >= 1 - delta``, i.e. ``k = 1 + max{j : BinomialCDF(j; n, alpha) <= delta}``. Ties
or a discrete ``F`` only raise the TPR, so the guarantee still holds. It needs ``n >= log(delta) / log(tpr)``
calibration samples (else even the smallest score is not low enough; an error says so).

Assumption: the calibration scores and the new ID scores are independent draws from one distribution (the
calibration split is a random sample of the data the detector will see). The guarantee is about the TPR of
the fixed threshold on that distribution; under exchangeability alone only the weaker marginal statement
``P(new score >= s_(k)) >= tpr`` for ``k = floor((n + 1) * alpha)`` holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, Union

import numpy as np


if TYPE_CHECKING:
    import torch

ScoresLike = Union[np.ndarray, "torch.Tensor", Sequence[float]]

#: Fewer ID validation samples than this give a threshold whose TPR on new data is too uncertain to rely on:
#: with n samples the accepted fraction at the 95% rule has a standard error of about sqrt(0.95 * 0.05 / n),
#: 0.03 at n = 50 and 0.01 at n = 500. ``calibrate`` warns below it.
MIN_CALIBRATION_SAMPLES = 100
#: Why fewer than :data:`MIN_CALIBRATION_SAMPLES` are a poor threshold: the end of the warning that ``calibrate`` and
#: ``hf-gsc evaluate`` give.
TOO_FEW_FOR_A_THRESHOLD = (f"too few for a threshold to mean much (at least {MIN_CALIBRATION_SAMPLES}; with n samples "
                           "the accepted fraction on new data varies by about sqrt(tpr*(1-tpr)/n))")


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


def check_number(name: str, value: Any) -> float:
    """``value`` as a float, refused (naming ``name``) unless it is a number: an int, a float, a NumPy or 0-d torch
    number. A string (``"0.9"``) or a bool is refused as the settings' checks refuse ``k="5"``, not converted."""
    if isinstance(value, (str, bytes, bool)) or not hasattr(value, "__float__"):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    try:
        return float(value)
    except (TypeError, ValueError) as err:  # a tensor of more than one element
        raise ValueError(f"{name} must be a number, got {value!r}") from err


def check_delta(delta: float | None) -> float | None:
    """``delta`` as a float after checking it is a number in ``(0, 1)``; ``None`` (no conformal guarantee) as it is."""
    if delta is None:
        return None
    value = check_number("delta", delta)
    if not 0.0 < value < 1.0:
        raise ValueError(f"delta must be in (0, 1); got {delta!r}")
    return value


def check_tpr(tpr: object) -> float:
    """Return ``tpr`` as a float after checking it is a number (:func:`check_number`) in ``(0, 1]``."""
    value = check_number("tpr", tpr)
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




def conformal_order(n: int, tpr: float, delta: float) -> int:
    """The rank ``k`` (1 = smallest) of the split-conformal threshold among ``n`` calibration scores.

    ``k = 1 + max{j : P(Binomial(n, 1 - tpr) <= j) <= delta}`` (see the module docstring).

    Raises:
        ValueError: ``n < 1``, ``tpr`` outside ``(0, 1)``, ``delta`` outside ``(0, 1)``, or ``n`` too small for
            the guarantee (fewer than ``log(delta) / log(tpr)`` samples).
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive integer (the number of calibration scores); got {n!r}")
    if not 0.0 < float(tpr) < 1.0:
        raise ValueError(f"tpr must be in (0, 1) for a conformal threshold; got {tpr!r}")
    check_delta(delta)
    alpha = 1.0 - float(tpr)
    j = np.arange(n + 1)
    # Binomial pmf in log space: n is up to about 10^5 here, where the direct product under/overflows.
    log_pmf = (math.lgamma(n + 1) - _lgamma(j + 1) - _lgamma(n - j + 1)
               + j * math.log(alpha) + (n - j) * math.log1p(-alpha))
    cdf = np.cumsum(np.exp(log_pmf))
    below = np.flatnonzero(cdf <= float(delta))
    if below.size == 0:
        needed = math.ceil(math.log(float(delta)) / math.log(float(tpr)))
        raise ValueError(
            f"{n} calibration scores cannot guarantee TPR >= {tpr} with probability >= 1 - {delta}: "
            f"at least {needed} are needed (or a larger delta / lower tpr)"
        )
    return int(below[-1]) + 1


def _lgamma(values: np.ndarray) -> np.ndarray:
    return np.array([math.lgamma(v) for v in values.tolist()])


def conformal_threshold(id_scores: ScoresLike, tpr: float = 0.95, delta: float = 0.05) -> float:
    """Split-conformal threshold: TPR >= ``tpr`` on new ID data with probability >= ``1 - delta``.

    Args:
        id_scores: 1-D ``ood_score`` values (higher = more ID) of ID *validation* samples.
        tpr: guaranteed true-positive rate, in ``(0, 1)``.
        delta: allowed probability (over the calibration draw) that the TPR falls below ``tpr``, in ``(0, 1)``.

    Returns:
        The ``k``-th smallest score as a Python float, ``k`` from :func:`conformal_order`.

    Raises:
        ValueError: bad ``id_scores`` (empty, not 1-D, non-finite), ``tpr`` or ``delta``, or too few scores.
    """
    scores = as_scores(id_scores, "id_scores")
    k = conformal_order(scores.size, tpr, delta)
    return float(np.partition(scores, k - 1)[k - 1])


#: How a threshold was chosen: the plain ``tpr`` quantile of the calibration scores, or the split-conformal
#: order statistic (:func:`conformal_threshold`).
CalibrationMethod = Literal["quantile", "conformal"]


def threshold_for(id_scores: ScoresLike, tpr: float = 0.95, delta: float | None = None) -> float:
    """:func:`threshold_at_tpr` when ``delta`` is ``None``, else :func:`conformal_threshold` with that ``delta``."""
    return threshold_at_tpr(id_scores, tpr) if delta is None else conformal_threshold(id_scores, tpr, delta)


def calibration_record(
    split: str | None, num_samples: int, tpr: float, delta: float | None = None, **extra: Any
) -> dict[str, Any]:
    """What a threshold was calibrated on: the record of :class:`hf_gsc.utils.calibration.Calibration` (stored in
    every detector's ``DetectorConfig.calibration``), before the kept scores' count and digest are added.

    ``method`` is ``"quantile"`` (``delta`` ``None``) or ``"conformal"`` (``delta``: the allowed probability
    that the TPR on new ID data falls below ``tpr``).
    """
    method: CalibrationMethod = "quantile" if delta is None else "conformal"
    return {"split": split, "num_samples": int(num_samples), "tpr": float(tpr), "method": method,
            "delta": None if delta is None else float(delta), **extra}


__all__ = [
    "MIN_CALIBRATION_SAMPLES",
    "TOO_FEW_FOR_A_THRESHOLD",
    "CalibrationMethod",
    "ScoresLike",
    "as_scores",
    "calibration_record",
    "check_delta",
    "check_number",
    "check_tpr",
    "conformal_order",
    "conformal_threshold",
    "threshold_at_tpr",
    "threshold_for",
]
