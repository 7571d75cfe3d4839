"""Selective classification: the base model's ID accuracy when a detector abstains on low-``ood_score`` inputs.

A detector that accepts an input iff ``ood_score >= t`` turns the classifier into a selective classifier: it
answers on the accepted inputs and abstains on the rest. On the ID test split, with ``correct[i]`` telling whether
the base model's prediction of sample ``i`` is right:

* **coverage** at ``t`` = fraction of ID test samples accepted (``score >= t``);
* **selective risk** at ``t`` = error rate of the base model on the accepted samples
  (1 - selective accuracy);
* the **risk-coverage curve** has one point per distinct score: accepting every sample whose score is at least
  that score. Samples with tied scores are accepted or rejected together, so the curve does not depend on the
  order of tied samples;
* **AURC** (area under the risk-coverage curve, Geifman et al., 2019) is ``mean_k risk(top k)`` over
  ``k = 1..n``, the risk of the ``k`` highest-scoring samples. Where scores tie, the order inside a tie is
  arbitrary, so ``risk(top k)`` is its expectation over the orders of the tied samples (the tie's error rate
  fills the places taken from it); without ties this is the usual value, and it never depends on how tied
  samples happen to be ordered. Lower is better; a perfect ranking (all errors last) gives the smallest value
  for that error rate, a random ranking about the error rate itself.

OOD inputs play no part here: these numbers say how well ``ood_score`` ranks the model's own ID mistakes.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .metrics import ScoresLike, _as_scores


def _as_correct(correct: Any, size: int) -> np.ndarray:
    if hasattr(correct, "detach"):
        correct = correct.detach().cpu().numpy()
    arr = np.asarray(correct)
    if arr.ndim != 1 or arr.size != size:
        raise ValueError(f"correct must be a 1-D array with one entry per score ({size}); got shape {arr.shape}")
    if arr.dtype.kind not in "biu" or not np.isin(arr, (0, 1)).all():
        raise ValueError(f"correct must hold booleans (or 0/1); got dtype {arr.dtype}")
    return arr.astype(bool)


def risk_coverage_curve(scores: ScoresLike, correct: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The risk-coverage curve of ID samples ranked by ``scores`` (higher = accepted first).

    Args:
        scores: 1-D ``ood_score`` of the ID test samples.
        correct: 1-D booleans, whether the base model classified each sample correctly.

    Returns:
        ``(coverage, risk, thresholds)``, one entry per distinct score in decreasing order: accepting every
        sample with ``score >= thresholds[j]`` covers ``coverage[j]`` of the samples with error rate ``risk[j]``.
    """
    values = _as_scores(scores, "scores")
    right = _as_correct(correct, values.size)
    order = np.argsort(-values, kind="stable")
    sorted_scores, errors = values[order], np.cumsum(~right[order])
    # The last index of each run of equal scores: a tie is accepted as a whole.
    last = np.flatnonzero(np.append(sorted_scores[1:] != sorted_scores[:-1], True))
    accepted = last + 1
    return accepted / values.size, errors[last] / accepted, sorted_scores[last]


def aurc(scores: ScoresLike, correct: Any) -> float:
    """Area under the risk-coverage curve (see the module docstring); a fraction in ``[0, 1]``, lower is better."""
    values = _as_scores(scores, "scores")
    wrong = ~_as_correct(correct, values.size)
    order = np.argsort(-values, kind="stable")
    sorted_scores, sorted_wrong = values[order], wrong[order].astype(np.float64)
    # Runs of equal scores: start (samples before the run), size and error count of the run of each position.
    starts_mask = np.append(True, sorted_scores[1:] != sorted_scores[:-1])
    run = np.cumsum(starts_mask) - 1
    run_start = np.flatnonzero(starts_mask)
    run_size = np.diff(np.append(run_start, values.size))
    run_errors = np.add.reduceat(sorted_wrong, run_start)
    errors_before = np.cumsum(run_errors) - run_errors
    k = np.arange(1, values.size + 1)
    expected_errors = errors_before[run] + (k - run_start[run]) * run_errors[run] / run_size[run]
    return float(np.mean(expected_errors / k))


def selective_accuracy(scores: ScoresLike, correct: Any, threshold: float) -> dict[str, float]:
    """Coverage and base-model accuracy on the ID samples accepted at ``threshold`` (``score >= threshold``).

    Returns ``{"coverage": ..., "accuracy": ...}``; ``accuracy`` is NaN when no sample is accepted.
    """
    values = _as_scores(scores, "scores")
    right = _as_correct(correct, values.size)
    if not math.isfinite(float(threshold)):
        raise ValueError(f"threshold must be a finite number; got {threshold!r}")
    accepted = values >= threshold
    count = int(accepted.sum())
    return {"coverage": count / values.size, "accuracy": float(right[accepted].mean()) if count else math.nan}


__all__ = ["aurc", "risk_coverage_curve", "selective_accuracy"]
