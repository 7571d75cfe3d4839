"""Threshold calibration on ID validation scores (never on test or OOD data).

A detector accepts an input as in-distribution iff ``ood_score >= threshold``. The threshold is
chosen so that a fraction ``tpr`` (0.95 by default) of the *ID validation* scores is accepted,
with exactly the rule that :func:`hf_gsc.evaluation.metrics.threshold_at_tpr` uses for FPR95, so a
calibrated threshold and the reported FPR95 agree (``method="quantile"``).

The split-conformal threshold (``method="conformal"``: TPR >= ``tpr`` on new ID data with probability
>= ``1 - delta``), its derivation and its assumption are in :mod:`hf_gsc.utils.thresholds`, where it is computed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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


def accepted_fraction(scores: ScoresLike, threshold: float) -> float:
    """Fraction of ``scores`` accepted as ID (``score >= threshold``; a NaN score is not): the TPR on ID scores
    (:func:`true_positive_rate`), the FPR on OOD scores (OOD accepted as ID)."""
    if hasattr(scores, "detach"):
        scores = scores.detach().cpu().double().numpy()
    values = np.asarray(scores, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"scores must be a non-empty 1-D array; got shape {values.shape}")
    return float(np.count_nonzero(values >= threshold) / values.size)


def true_positive_rate(id_scores: ScoresLike, threshold: float) -> float:
    """Fraction of ``id_scores`` accepted as ID (``score >= threshold``), e.g. on the ID test split."""
    return accepted_fraction(id_scores, threshold)


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


__all__ = [
    "CalibrationMethod",
    "accepted_fraction",
    "calibration_of",
    "calibration_record",
    "conformal_order",
    "conformal_threshold",
    "threshold_for",
    "true_positive_rate",
]
