"""Threshold calibration on ID validation scores (never on test or OOD data).

A detector accepts an input as in-distribution iff ``ood_score >= threshold``. The threshold is
chosen so that a fraction ``tpr`` (0.95 by default) of the *ID validation* scores is accepted,
with exactly the rule that :func:`hf_gsc.evaluation.metrics.threshold_at_tpr` uses for FPR95, so a
calibrated threshold and the reported FPR95 agree (``method="quantile"``).

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
from typing import Any, Literal

import numpy as np

from .metrics import ScoresLike, _as_scores, threshold_at_tpr


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
    if not 0.0 < float(delta) < 1.0:
        raise ValueError(f"delta must be in (0, 1); got {delta!r}")
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
    scores = _as_scores(id_scores, "id_scores")
    k = conformal_order(scores.size, tpr, delta)
    return float(np.partition(scores, k - 1)[k - 1])


def true_positive_rate(id_scores: ScoresLike, threshold: float) -> float:
    """Fraction of ``id_scores`` accepted as ID (``score >= threshold``), e.g. on the ID test split."""
    if hasattr(id_scores, "detach"):
        id_scores = id_scores.detach().cpu().double().numpy()
    scores = np.asarray(id_scores, dtype=np.float64)
    if scores.ndim != 1 or scores.size == 0:
        raise ValueError(f"id_scores must be a non-empty 1-D array; got shape {scores.shape}")
    return float(np.count_nonzero(scores >= threshold) / scores.size)


#: How a threshold was chosen: the plain ``tpr`` quantile of the calibration scores, or the split-conformal
#: order statistic (:func:`conformal_threshold`).
CalibrationMethod = Literal["quantile", "conformal"]


def threshold_for(id_scores: ScoresLike, tpr: float = 0.95, delta: float | None = None) -> float:
    """:func:`calibrate_threshold` when ``delta`` is ``None``, else :func:`conformal_threshold` with that ``delta``."""
    return calibrate_threshold(id_scores, tpr) if delta is None else conformal_threshold(id_scores, tpr, delta)


def calibration_record(
    split: str, num_samples: int, tpr: float, delta: float | None = None, **extra: Any
) -> dict[str, Any]:
    """What a threshold was calibrated on, in the shape stored in ``GSCConfig.calibration``.

    ``method`` is ``"quantile"`` (``delta`` ``None``) or ``"conformal"`` (``delta``: the allowed probability
    that the TPR on new ID data falls below ``tpr``).
    """
    method: CalibrationMethod = "quantile" if delta is None else "conformal"
    return {"split": split, "num_samples": int(num_samples), "tpr": float(tpr), "method": method,
            "delta": None if delta is None else float(delta), **extra}


__all__ = ["CalibrationMethod", "calibrate_threshold", "calibration_record", "conformal_order", "conformal_threshold",
           "threshold_for", "true_positive_rate"]
