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

from typing import Any, Mapping

import numpy as np

from ..utils.calibration import Calibration

from ..utils.thresholds import (  # noqa: F401  (re-exported: the core holds the rules, detectors calibrate with them)
    CalibrationMethod,
    ScoresLike,
    calibration_record,
    conformal_order,
    conformal_threshold,
    threshold_at_tpr,
    threshold_for,
)


def true_positive_rate(id_scores: ScoresLike, threshold: float) -> float:
    """Fraction of ``id_scores`` accepted as ID (``score >= threshold``), e.g. on the ID test split."""
    if hasattr(id_scores, "detach"):
        id_scores = id_scores.detach().cpu().double().numpy()
    scores = np.asarray(id_scores, dtype=np.float64)
    if scores.ndim != 1 or scores.size == 0:
        raise ValueError(f"id_scores must be a non-empty 1-D array; got shape {scores.shape}")
    return float(np.count_nonzero(scores >= threshold) / scores.size)


def calibration_of(entry: Mapping[str, Any], id_validation_scores: Any,
                   depends_on: Mapping[str, Any] | None = None) -> Calibration:
    """The detector's calibration of a ``results.json`` entry (:func:`hf_gsc.evaluation.report.method_results`),
    made again from the same ID validation scores the one way (:meth:`hf_gsc.utils.calibration.Calibration.from_scores`),
    with what it depends on (``depends_on``: ``settings``, ``fitted_state``); its threshold is the entry's."""
    record = entry["calibration"]
    calibration = Calibration.from_scores(id_validation_scores, record["tpr"], record["delta"], split=record["split"],
                                          source=record.get("source"), depends_on=depends_on)
    if calibration.threshold != entry["threshold"]:
        raise RuntimeError(f"the calibration made again gives threshold {calibration.threshold!r}, results.json "
                           f"{entry['threshold']!r}: the ID validation scores changed since the results were computed")
    return calibration


__all__ = ["CalibrationMethod", "calibration_of", "calibration_record", "conformal_order", "conformal_threshold",
           "threshold_for", "true_positive_rate"]
