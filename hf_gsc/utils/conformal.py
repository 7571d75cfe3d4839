"""Conformal p-values: how unusual a score is among the ID calibration scores, on a scale a person can read.

A calibrated detector keeps ``n`` ``ood_score`` values of its ID calibration images, sorted (float64): all of them,
or a sorted sample of at most :data:`hf_gsc.utils.calibration.MAX_KEPT_SCORES` (:mod:`hf_gsc.utils.calibration`,
which binds them to the threshold). The p-value of a new score ``s`` is

    p(s) = (1 + #{calibration scores <= s}) / (n + 1)

the chance that an ID image scores at most ``s``. If the new image and the calibration images are exchangeable
(drawn alike from the ID distribution), ``P(p <= a) <= a`` for every ``a`` in ``[0, 1]``, whatever the method and
however its score is scaled (split-conformal; Vovk et al., *Algorithmic Learning in a Random World*, 2005; Bates et
al., *Testing for outliers with conformal p-values*, Ann. Statist. 2023). It is marginal over the calibration draw.

The threshold a detector calibrates (:func:`hf_gsc.utils.thresholds.threshold_for`) is always one of the kept
scores, ``t`` (checked at load); an input is accepted iff ``s >= t``, that is iff ``#{calibration scores <= s} >= r`` with
``r = #{calibration scores < t} + 1``, that is iff ``p(s) > r / (n + 1)``. So the decision is the p-value cut
``p <= r / (n + 1)`` (:func:`p_value_cut`), and a new ``tpr`` needs only the kept scores, no new forward.

Pure functions on tensors; :func:`conformal_p_value` runs on the scores' device with no host synchronisation.
"""

from __future__ import annotations

import torch


def conformal_p_value(scores: torch.Tensor, calibration_scores: torch.Tensor) -> torch.Tensor:
    """``(B,)`` float64 p-values ``(1 + #{calibration_scores <= s}) / (n + 1)`` of ``scores`` (higher score = more
    in-distribution).

    Args:
        scores: ``(B,)`` ``ood_score`` values, any float dtype.
        calibration_scores: ``(n,)`` ascending float64 (:func:`hf_gsc.utils.calibration.kept_scores`), on the device of ``scores``.

    A NaN score gets the smallest p-value, ``1 / (n + 1)``: a detector treats it as OOD at every threshold (it fails
    closed), and so does any cut on the p-value.
    """
    values = scores.to(calibration_scores.dtype)
    at_or_below = torch.searchsorted(calibration_scores, values, right=True)
    at_or_below = torch.where(torch.isnan(values), torch.zeros_like(at_or_below), at_or_below)
    return (at_or_below + 1).to(calibration_scores.dtype) / (calibration_scores.numel() + 1)


def threshold_rank(calibration_scores: torch.Tensor, threshold: float) -> int:
    """``r = #{calibration_scores < threshold} + 1``: with a threshold that is one of the calibration scores (what
    ``calibrate`` and ``set_tpr`` set), ``s >= threshold`` iff at least ``r`` calibration scores are ``<= s``."""
    return int(torch.searchsorted(calibration_scores.cpu(), torch.tensor([float(threshold)], dtype=torch.float64),
                                  right=False)[0]) + 1


def p_value_cut(calibration_scores: torch.Tensor, threshold: float) -> float:
    """The p-value at and below which an input is flagged, ``r / (n + 1)`` with ``r`` from :func:`threshold_rank`:
    ``is_ood`` (``not s >= threshold``) equals ``p(s) <= p_value_cut`` for every non-NaN score ``s``."""
    return threshold_rank(calibration_scores, threshold) / (calibration_scores.numel() + 1)


__all__ = ["conformal_p_value", "p_value_cut", "threshold_rank"]
