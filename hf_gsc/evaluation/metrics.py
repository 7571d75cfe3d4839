"""OOD-detection metrics: FPR@95%TPR, AUROC, AUPR-In and AUPR-Out.

Conventions
-----------
* **Scores** are ``ood_score`` values where *higher means more in-distribution*
  (the sign a detector's confidence has). Nothing here assumes a range: logits,
  energies, 1e30 or 1e-30 are all fine, because every metric depends only on the
  order of the scores (and on exact ties).
* **In-distribution (ID) is the positive class**, as in the Gradient
  Short-Circuit paper and most of the OOD literature since Hendrycks & Gimpel
  (2017) and Liang et al. (2018, ODIN).
* All metrics are fractions in ``[0, 1]`` returned as plain Python ``float``
  (not percentages, not numpy scalars), so they serialise to JSON unchanged.

FPR@95%TPR and ties
-------------------
The decision rule is "accept as ID if ``score >= t``". For a target TPR ``p``
(0.95 by default), :func:`threshold_at_tpr` returns

    t* = the largest t such that  #{i : id_i >= t} / n_id  >= p,

which is the k-th largest ID score with k the smallest integer such that
``k / n_id >= p`` (both sides compared as floats, exactly as ``np.mean`` would
compute the fraction). :func:`fpr_at_tpr` is then the fraction of OOD scores
with ``score >= t*``. Consequences, by design:

* A tie is never split. If several ID scores equal ``t*`` they are all
  accepted, so the achieved TPR can be *above* ``p`` (it is never below).
* Every OOD sample whose score is ``>= t*`` is a false positive, including
  OOD samples tied with ``t*``. With constant scores the FPR is therefore 1.
* There is no interpolation between ROC points. The value equals
  ``fpr[argmax(tpr >= p)]`` on ``sklearn.metrics.roc_curve(is_id, scores)``,
  which the tests check.

The same :func:`threshold_at_tpr` is meant for detector calibration on ID
validation data, so a calibrated threshold and the reported FPR95 follow one
rule.

Difference from OpenOOD
-----------------------
OpenOOD v1.5 (``openood/evaluators/metrics.py``, ``auc_and_fpr_recall``) treats
**OOD as the positive class** and ranks by the negated confidence: it calls
``roc_curve(is_ood, -conf)`` and reports the FPR at the first point where 95%
of the *OOD* samples are detected. Its "FPR@95" is therefore the fraction of
**ID** samples rejected when 95% of OOD samples are caught. Ours (and the
paper's) is the fraction of **OOD** samples accepted when 95% of ID samples are
kept. The two numbers are different quantities and in general differ; do not
compare them across the two code bases; :func:`fpr_at_tpr_ood_positive` computes OpenOOD's, and the evaluation
reports both (``fpr95`` and ``fpr95_ood_positive``). AUROC is the same under both
conventions (swapping the positive class and negating the scores leaves it
unchanged). OpenOOD also computes AUPR as the trapezoidal area under the
precision-recall curve (``metrics.auc``), whereas we use average precision
(``average_precision_score``, a step-wise sum without interpolation), which can
differ slightly.

Validation
----------
Every function accepts a 1-D numpy array, a 1-D torch tensor (detached and
moved to the CPU here) or a sequence of numbers. Scores are converted to
float64: float32 would merge distinct scores such as ``1e8 + 1e-6`` and
``1e8 + 2e-6`` into ties and change the metrics. A ``ValueError`` naming the
argument is raised for empty input, input that is not 1-D, NaN or infinite
scores, and ``tpr`` outside ``(0, 1]``. The evaluation checks its scores first
with :func:`check_finite_scores`, whose error names the method and the split.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..utils.thresholds import ScoresLike, threshold_at_tpr
from ..utils.thresholds import as_scores as _as_scores


if TYPE_CHECKING:  # imported for annotations only: evaluate is slow to import
    import evaluate

#: Folder of the ``evaluate`` metric module shipped with the package.
OOD_METRIC_PATH: Path = Path(__file__).resolve().parent / "ood_detection_metric"

#: Keys of :func:`ood_metrics`, in the order they are reported.
METRIC_NAMES: tuple[str, ...] = ("fpr95", "auroc", "aupr_in", "aupr_out")


class NonFiniteScoreError(ValueError):
    """A method gave NaN or infinite ``ood_score`` values on a split; the message names the method and the split."""


def check_finite_scores(scores: ScoresLike, method: str, split: str) -> None:
    """Refuse an evaluation whose scores hold NaN or infinite values.

    A NaN score has no rank: ``score >= threshold`` is False for it, so it would silently count as OOD in the
    TPR and as ID-or-OOD at random in a ranking, and any FPR95 or AUROC built on it would be wrong. The
    evaluation therefore stops, naming the method and the split, instead of reporting numbers.

    Raises:
        NonFiniteScoreError: naming ``method``, ``split``, how many values are not finite and an example.
    """
    if hasattr(scores, "detach") and hasattr(scores, "cpu"):
        scores = scores.detach().cpu().double().numpy()
    values = np.asarray(scores, dtype=np.float64)
    finite = np.isfinite(values)
    if not finite.all():
        bad = values[~finite]
        raise NonFiniteScoreError(
            f"method {method!r} gave {bad.size} non-finite ood_score value(s) (e.g. {bad.flat[0]!r}) of {values.size} "
            f"on split {split!r}; no threshold, FPR95 or AUROC can rank them. Check the method's hyperparameters "
            "(a temperature close to 0 overflows) and the split's images"
        )


def _labelled(id_scores: np.ndarray, ood_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate validated scores with ``is_id`` labels (1 = ID, 0 = OOD) for scikit-learn."""
    scores = np.concatenate([id_scores, ood_scores])
    is_id = np.concatenate([np.ones(id_scores.size, dtype=np.int64), np.zeros(ood_scores.size, dtype=np.int64)])
    return is_id, scores


def fpr_at_tpr(id_scores: ScoresLike, ood_scores: ScoresLike, tpr: float = 0.95) -> float:
    """Fraction of OOD samples accepted as ID at the threshold that keeps ``tpr`` of ID.

    Computed as ``mean(ood_scores >= threshold_at_tpr(id_scores, tpr))``: OOD
    scores tied with the threshold count as false positives.

    Args:
        id_scores: 1-D scores of in-distribution samples, higher = more ID.
        ood_scores: 1-D scores of out-of-distribution samples, same convention.
        tpr: target true-positive rate, in ``(0, 1]``; 0.95 gives FPR95.

    Returns:
        The false-positive rate in ``[0, 1]`` as a Python float.
    """
    ood = _as_scores(ood_scores, "ood_scores")
    threshold = threshold_at_tpr(id_scores, tpr)
    return float(np.count_nonzero(ood >= threshold) / ood.size)


def fpr_at_tpr_ood_positive(id_scores: ScoresLike, ood_scores: ScoresLike, tpr: float = 0.95) -> float:
    """OpenOOD's FPR@``tpr``: the fraction of **ID** samples flagged as OOD when ``tpr`` of the OOD samples are.

    OOD is the positive class and ``-ood_score`` the detection score (OpenOOD v1.5's
    ``roc_curve(is_ood, -conf)``, FPR at the first point with TPR >= ``tpr``). It is
    :func:`fpr_at_tpr` with the two classes swapped and the scores negated, so it follows the same
    threshold and tie rules: the threshold keeps at least ``tpr`` of the OOD samples, and an ID sample
    tied with it counts as a false positive.

    Args:
        id_scores: 1-D scores of in-distribution samples, higher = more ID.
        ood_scores: 1-D scores of out-of-distribution samples, same convention.
        tpr: target fraction of OOD samples detected, in ``(0, 1]``.

    Returns:
        The fraction of ID samples rejected, in ``[0, 1]``, as a Python float.
    """
    ids = _as_scores(id_scores, "id_scores")
    ood = _as_scores(ood_scores, "ood_scores")
    return fpr_at_tpr(-ood, -ids, tpr)


def auroc(id_scores: ScoresLike, ood_scores: ScoresLike) -> float:
    """Area under the ROC curve with ID as the positive class (``roc_auc_score``).

    Equals the probability that a random ID sample scores above a random OOD
    sample, ties counting one half. 1.0 = perfect separation, 0.5 = chance.
    """
    from sklearn.metrics import roc_auc_score  # deferred: thresholds (calibrate) need no scikit-learn

    is_id, scores = _labelled(_as_scores(id_scores, "id_scores"), _as_scores(ood_scores, "ood_scores"))
    return float(roc_auc_score(is_id, scores))


def aupr_in(id_scores: ScoresLike, ood_scores: ScoresLike) -> float:
    """Area under the precision-recall curve with ID as positive (``average_precision_score``)."""
    from sklearn.metrics import average_precision_score

    is_id, scores = _labelled(_as_scores(id_scores, "id_scores"), _as_scores(ood_scores, "ood_scores"))
    return float(average_precision_score(is_id, scores))


def aupr_out(id_scores: ScoresLike, ood_scores: ScoresLike) -> float:
    """Area under the precision-recall curve with OOD as positive.

    Uses ``average_precision_score`` on the negated scores, since a higher
    ``ood_score`` means *less* OOD. Negation is exact in floating point, so ties
    and order are preserved.
    """
    from sklearn.metrics import average_precision_score

    is_id, scores = _labelled(_as_scores(id_scores, "id_scores"), _as_scores(ood_scores, "ood_scores"))
    return float(average_precision_score(1 - is_id, -scores))


def ood_metrics(id_scores: ScoresLike, ood_scores: ScoresLike) -> dict[str, float]:
    """All four OOD metrics at once.

    Args:
        id_scores: 1-D scores of in-distribution samples, higher = more ID.
        ood_scores: 1-D scores of out-of-distribution samples, same convention.

    Returns:
        ``{"fpr95": ..., "auroc": ..., "aupr_in": ..., "aupr_out": ...}``, each a
        Python float in ``[0, 1]``; ``fpr95`` is :func:`fpr_at_tpr` at 0.95.
    """
    # Validate (and convert torch tensors) once, then reuse the arrays.
    ids = _as_scores(id_scores, "id_scores")
    ood = _as_scores(ood_scores, "ood_scores")
    return {
        "fpr95": fpr_at_tpr(ids, ood, 0.95),
        "auroc": auroc(ids, ood),
        "aupr_in": aupr_in(ids, ood),
        "aupr_out": aupr_out(ids, ood),
    }


def load_ood_metric(**load_kwargs: Any) -> evaluate.EvaluationModule:
    """Load the shipped ``evaluate`` metric module from its local path (no Hub access).

    ``evaluate.load`` treats an existing folder that contains a script of the
    same name as a local module and copies it into the modules cache without any
    network call, so this works offline. Its ``compute`` takes
    ``predictions`` = ood scores and ``references`` = 1 for ID, 0 for OOD, and
    returns the same dict as :func:`ood_metrics`.

    Args:
        **load_kwargs: passed on to ``evaluate.load`` (e.g. ``keep_in_memory=True``,
            ``cache_dir=...``, ``experiment_id=...``).
    """
    try:
        import evaluate  # deferred: importing evaluate (and datasets) takes seconds
    except ImportError:  # optional: evaluate is no longer developed upstream, and nothing else here needs it
        raise ImportError("load_ood_metric needs the evaluate package: pip install 'hf_gsc[metric]'; ood_metrics(...) "
                          "computes the same numbers without it") from None
    return evaluate.load(str(OOD_METRIC_PATH), **load_kwargs)
