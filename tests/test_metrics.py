"""Tests for hf_gsc.evaluation.metrics and the shipped `evaluate` metric module.

Every metric is checked against a direct scikit-learn computation and against
a brute-force implementation written here from the definitions (loops over
thresholds and pairs), so that a wrong class orientation, a ``>`` instead of
``>=``, a percentile-style interpolated threshold or a float32 conversion each
make some test fail.
"""

from __future__ import annotations

import math
import socket

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score, roc_curve

from hf_gsc.evaluation.metrics import (
    METRIC_NAMES,
    OOD_METRIC_PATH,
    aupr_in,
    aupr_out,
    auroc,
    fpr_at_tpr,
    fpr_at_tpr_ood_positive,
    load_ood_metric,
    ood_metrics,
    threshold_at_tpr,
)


# --------------------------------------------------------------------------- #
# Reference implementations, written from the definitions and independent of  #
# hf_gsc.evaluation.metrics.                                                  #
# --------------------------------------------------------------------------- #


def brute_threshold(id_scores, tpr, extra_candidates=()) -> float:
    """Largest t among all observed scores with fraction(id >= t) >= tpr, by exhaustive search."""
    id_list = [float(x) for x in id_scores]
    best = -math.inf
    for t in set(id_list) | {float(x) for x in extra_candidates}:
        kept = sum(1 for x in id_list if x >= t) / len(id_list)
        if kept >= tpr and t > best:
            best = t
    return best


def brute_fpr(id_scores, ood_scores, tpr=0.95) -> float:
    """Fraction of OOD with score >= the brute-force threshold (OOD scores are candidates too)."""
    t = brute_threshold(id_scores, tpr, extra_candidates=ood_scores)
    return sum(1 for x in ood_scores if x >= t) / len(ood_scores)


def brute_auroc(id_scores, ood_scores) -> float:
    """P(id > ood) + 0.5 * P(id == ood) over all pairs (Mann-Whitney U statistic)."""
    wins = 0.0
    for a in id_scores:
        for b in ood_scores:
            wins += 1.0 if a > b else 0.5 if a == b else 0.0
    return wins / (len(id_scores) * len(ood_scores))


def brute_average_precision(pos_scores, neg_scores) -> float:
    """Sum over distinct thresholds (descending) of (recall step) * precision, no interpolation."""
    ap, prev_recall = 0.0, 0.0
    for t in sorted(set(pos_scores) | set(neg_scores), reverse=True):
        tp = sum(1 for x in pos_scores if x >= t)
        fp = sum(1 for x in neg_scores if x >= t)
        recall = tp / len(pos_scores)
        ap += (recall - prev_recall) * tp / (tp + fp)
        prev_recall = recall
    return ap


def sklearn_metrics(id_scores, ood_scores) -> dict[str, float]:
    """The four metrics straight from scikit-learn, FPR95 read off the full ROC curve."""
    scores = np.concatenate([id_scores, ood_scores]).astype(np.float64)
    is_id = np.r_[np.ones(len(id_scores), int), np.zeros(len(ood_scores), int)]
    fpr, tpr, _ = roc_curve(is_id, scores, drop_intermediate=False)
    return {
        "fpr95": float(fpr[np.argmax(tpr >= 0.95)]),
        "auroc": float(roc_auc_score(is_id, scores)),
        "aupr_in": float(average_precision_score(is_id, scores)),
        "aupr_out": float(average_precision_score(1 - is_id, -scores)),
    }


def brute_metrics(id_scores, ood_scores) -> dict[str, float]:
    id_list, ood_list = [float(x) for x in id_scores], [float(x) for x in ood_scores]
    # AUPR-Out: OOD positive, ranked by -score, i.e. the same as ranking by score reversed.
    return {
        "fpr95": brute_fpr(id_list, ood_list),
        "auroc": brute_auroc(id_list, ood_list),
        "aupr_in": brute_average_precision(id_list, ood_list),
        "aupr_out": brute_average_precision([-x for x in ood_list], [-x for x in id_list]),
    }


# --------------------------------------------------------------------------- #
# Score sets                                                                  #
# --------------------------------------------------------------------------- #

_rng = np.random.default_rng(0)
# Small integers: many ties within and across ID and OOD, and exactly representable after
# scaling by 1e30 / 1e-30 or adding to 1e8 in steps of 1e-6, so those variants must give
# exactly the same metrics as the integers themselves.
_TIED_ID = _rng.integers(0, 8, size=120).astype(np.float64) + 2.0
_TIED_OOD = _rng.integers(0, 8, size=90).astype(np.float64)

CASES: dict[str, tuple[np.ndarray, np.ndarray]] = {
    "random": (_rng.normal(1.0, 1.0, 200), _rng.normal(0.0, 1.0, 150)),
    "ties": (_TIED_ID, _TIED_OOD),
    "constant": (np.full(40, 3.0), np.full(25, 3.0)),
    "single_sample": (np.array([1.0]), np.array([0.0])),
    "single_sample_reversed": (np.array([0.0]), np.array([1.0])),
    "single_sample_tied": (np.array([0.5]), np.array([0.5])),
    "perfect": (np.linspace(1.0, 2.0, 30), np.linspace(-2.0, 0.5, 20)),
    "reversed": (np.linspace(-2.0, 0.5, 30), np.linspace(1.0, 2.0, 20)),
    "huge": (_TIED_ID * 1e30, _TIED_OOD * 1e30),
    "tiny": (_TIED_ID * 1e-30, _TIED_OOD * 1e-30),
    # Gaps of 1e-6 on top of 1e8: distinct in float64 (ulp ~1.5e-8), all equal in float32.
    "shifted": (1e8 + 1e-6 * _TIED_ID, 1e8 + 1e-6 * _TIED_OOD),
}


# --------------------------------------------------------------------------- #
# Pure functions                                                              #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("name", CASES)
def test_ood_metrics_match_sklearn_and_brute_force(name: str) -> None:
    id_scores, ood_scores = CASES[name]
    got = ood_metrics(id_scores, ood_scores)

    assert list(got) == list(METRIC_NAMES) == ["fpr95", "auroc", "aupr_in", "aupr_out"]
    for key, value in got.items():
        assert type(value) is float, f"{key} is {type(value)}, expected a plain float"
        assert 0.0 <= value <= 1.0
    # Same library calls on the same float64 data: must agree to the last bit.
    assert got == sklearn_metrics(id_scores, ood_scores)
    # FPR95 is a ratio of counts, exact either way; the areas are sums, equal up to rounding.
    brute = brute_metrics(id_scores, ood_scores)
    assert got["fpr95"] == brute["fpr95"]
    for key in ("auroc", "aupr_in", "aupr_out"):
        assert got[key] == pytest.approx(brute[key], abs=1e-12), key


@pytest.mark.parametrize("name", CASES)
def test_individual_functions_agree_with_ood_metrics(name: str) -> None:
    id_scores, ood_scores = CASES[name]
    assert ood_metrics(id_scores, ood_scores) == {
        "fpr95": fpr_at_tpr(id_scores, ood_scores),
        "auroc": auroc(id_scores, ood_scores),
        "aupr_in": aupr_in(id_scores, ood_scores),
        "aupr_out": aupr_out(id_scores, ood_scores),
    }


@pytest.mark.parametrize("name", ["huge", "tiny", "shifted"])
def test_extreme_magnitudes_give_the_same_metrics_as_unscaled_scores(name: str) -> None:
    # Scaling by a positive constant or shifting keeps every order and tie here, so the metrics
    # must not move. float32 conversion (shifted) or tolerance-based tie detection (tiny) breaks this.
    assert ood_metrics(*CASES[name]) == ood_metrics(*CASES["ties"])
    # And the case is a real test: the integer scores give neither 0/1 nor constant-score values.
    assert 0.0 < ood_metrics(*CASES["ties"])["auroc"] < 1.0


def test_hand_computed_extremes() -> None:
    # Average precision is a float sum of recall steps: 1 - 1e-16 is a correct result.
    perfect = {"fpr95": 0.0, "auroc": 1.0, "aupr_in": pytest.approx(1.0), "aupr_out": pytest.approx(1.0)}
    assert ood_metrics(*CASES["perfect"]) == perfect
    reversed_ = ood_metrics(*CASES["reversed"])
    assert reversed_["fpr95"] == 1.0 and reversed_["auroc"] == 0.0
    # Constant scores: one operating point that accepts everything.
    assert ood_metrics(*CASES["constant"]) == {
        "fpr95": 1.0,
        "auroc": 0.5,
        "aupr_in": pytest.approx(40 / 65),
        "aupr_out": pytest.approx(25 / 65),
    }
    assert ood_metrics([1.0], [0.0]) == {"fpr95": 0.0, "auroc": 1.0, "aupr_in": 1.0, "aupr_out": 1.0}
    assert ood_metrics([0.0], [1.0]) == {"fpr95": 1.0, "auroc": 0.0, "aupr_in": 0.5, "aupr_out": 0.5}


def test_aupr_out_ranks_ood_by_negated_score() -> None:
    # Asymmetric case where AUPR-In and AUPR-Out differ: catches AUPR-Out computed with ID as
    # positive, or with OOD as positive but un-negated scores.
    id_scores, ood_scores = [3.0, 2.0, 0.5], [1.0, 0.0]
    assert aupr_in(id_scores, ood_scores) == pytest.approx((1 + 1 + 3 / 4) / 3)
    assert aupr_out(id_scores, ood_scores) == pytest.approx((1 + 2 / 3) / 2)


@pytest.mark.parametrize(
    ("tpr", "expected"),
    [
        (1.0, 1.0),
        (0.95, 1.0),  # needs 9.5 of 10 kept -> all 10; np.percentile would interpolate to 1.45
        (0.9, 2.0),
        (0.7, 4.0),
        (0.05, 10.0),
    ],
)
def test_threshold_on_distinct_scores(tpr: float, expected: float) -> None:
    scores = np.arange(10.0, 0.0, -1.0)  # not sorted ascending: order must not matter
    assert threshold_at_tpr(scores, tpr) == expected
    assert type(threshold_at_tpr(scores, tpr)) is float


def test_threshold_count_is_not_thrown_off_by_float_rounding() -> None:
    # 0.28 * 25 == 7.000000000000001, so a naive ceil(tpr * n) asks for 8 samples although
    # 7 / 25 >= 0.28 already holds: the threshold must be the 7th largest score, not the 8th.
    scores = np.arange(1.0, 26.0)
    assert threshold_at_tpr(scores, 0.28) == 19.0
    assert threshold_at_tpr(scores, 0.56) == 12.0  # 0.56 * 25 == 14.000000000000002


def test_threshold_keeps_whole_ties() -> None:
    id_scores = [0.0] * 5 + [1.0] * 15
    # 95% of 20 = 19 samples: only t = 0 keeps that many; the 5 tied zeros are all kept (100%).
    assert threshold_at_tpr(id_scores, 0.95) == 0.0
    # 15/20 = 0.75 exactly: t = 1 suffices and is larger.
    assert threshold_at_tpr(id_scores, 0.75) == 1.0
    assert threshold_at_tpr(id_scores, 0.76) == 0.0


def test_ood_tied_with_threshold_is_a_false_positive() -> None:
    id_scores = np.arange(1.0, 21.0)  # 95% of 20 -> keep 19 -> t = 2
    ood_scores = [2.0, 1.999, 3.0, 0.0]  # 2.0 (tied) and 3.0 are accepted as ID
    assert threshold_at_tpr(id_scores) == 2.0
    assert fpr_at_tpr(id_scores, ood_scores) == 0.5


@pytest.mark.parametrize("seed", range(5))
def test_threshold_and_fpr_match_brute_force_on_random_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for n in (1, 2, 3, 7, 19, 20, 21, 40):
        id_scores = rng.integers(0, 5, n).astype(float)
        ood_scores = rng.integers(0, 6, 9).astype(float)
        for tpr in (0.05, 0.5, 0.7, 0.9, 0.95, 0.99, 1.0):
            t = threshold_at_tpr(id_scores, tpr)
            assert t == brute_threshold(id_scores, tpr), (n, tpr)
            # Defining property: keeps >= tpr of ID, and nothing above t does.
            assert np.mean(id_scores >= t) >= tpr
            above = id_scores[id_scores > t]
            assert above.size == 0 or np.mean(id_scores >= above.min()) < tpr
            assert fpr_at_tpr(id_scores, ood_scores, tpr) == brute_fpr(list(id_scores), list(ood_scores), tpr)


def test_inputs_may_be_torch_tensors_or_lists() -> None:
    id_scores, ood_scores = CASES["shifted"]
    expected = ood_metrics(id_scores, ood_scores)
    assert ood_metrics(torch.from_numpy(id_scores), torch.from_numpy(ood_scores)) == expected
    assert ood_metrics(list(id_scores), list(ood_scores)) == expected
    # requires_grad tensors are detached rather than rejected.
    id_t = torch.tensor([2.0, 3.0], requires_grad=True)
    assert ood_metrics(id_t, torch.tensor([1.0])) == ood_metrics([2.0, 3.0], [1.0])
    assert threshold_at_tpr(torch.tensor([1.0, 2.0, 3.0]), 0.6) == 2.0


# --------------------------------------------------------------------------- #
# Errors                                                                      #
# --------------------------------------------------------------------------- #

_GOOD = np.array([1.0, 2.0, 3.0])
_SCORE_FUNCTIONS = [fpr_at_tpr, auroc, aupr_in, aupr_out, ood_metrics]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (np.array([]), "non-empty"),
        ([], "non-empty"),
        (np.ones((3, 2)), "1-D"),
        (np.ones((3, 1)), "1-D"),
        (np.float64(1.0), "1-D"),
        (np.array([1.0, np.nan]), "finite"),
        (np.array([1.0, np.inf]), "finite"),
        (np.array([-np.inf, 1.0]), "finite"),
        (torch.tensor([1.0, float("nan")]), "finite"),
        (np.array(["a", "b"]), "real scores"),
    ],
)
@pytest.mark.parametrize("function", _SCORE_FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("position", ["id_scores", "ood_scores"])
def test_invalid_scores_raise_value_error_naming_the_argument(function, position: str, bad, message: str) -> None:
    args = (bad, _GOOD) if position == "id_scores" else (_GOOD, bad)
    with pytest.raises(ValueError, match=message) as info:
        function(*args)
    assert str(info.value).startswith(position)


@pytest.mark.parametrize("bad", [np.array([]), np.ones((2, 2)), np.array([np.nan, 1.0])])
def test_threshold_at_tpr_rejects_invalid_id_scores(bad) -> None:
    with pytest.raises(ValueError, match="^id_scores"):
        threshold_at_tpr(bad)


@pytest.mark.parametrize("tpr", [0.0, -0.1, 1.0000001, 2.0, float("nan"), float("inf"), "high"])
def test_tpr_outside_unit_interval_raises(tpr) -> None:
    with pytest.raises(ValueError, match="^tpr must"):
        threshold_at_tpr(_GOOD, tpr)
    with pytest.raises(ValueError, match="^tpr must"):
        fpr_at_tpr(_GOOD, _GOOD, tpr)


# --------------------------------------------------------------------------- #
# evaluate module                                                             #
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def metric():
    # keep_in_memory: no Arrow cache files written for predictions/references.
    return load_ood_metric(keep_in_memory=True)


def _module_metrics(id_scores, ood_scores) -> dict[str, float]:
    """What the evaluate module reports: :func:`ood_metrics` and OpenOOD's OOD-positive FPR95."""
    return {**ood_metrics(id_scores, ood_scores),
            "fpr95_ood_positive": fpr_at_tpr_ood_positive(id_scores, ood_scores, 0.95)}


def _as_evaluate_inputs(id_scores, ood_scores, seed: int = 0):
    """Interleave ID and OOD samples in a random order, as a real evaluation loop would."""
    scores = np.concatenate([id_scores, ood_scores])
    labels = np.r_[np.ones(len(id_scores), int), np.zeros(len(ood_scores), int)]
    order = np.random.default_rng(seed).permutation(len(scores))
    return scores[order], labels[order]


@pytest.mark.parametrize("name", ["random", "ties", "constant", "single_sample_reversed", "huge", "tiny", "shifted"])
def test_evaluate_module_equals_pure_functions(metric, name: str) -> None:
    id_scores, ood_scores = CASES[name]
    predictions, references = _as_evaluate_inputs(id_scores, ood_scores)
    assert metric.compute(predictions=predictions.tolist(), references=references.tolist()) == _module_metrics(
        id_scores, ood_scores
    )


def test_evaluate_module_accumulates_torch_batches(metric) -> None:
    id_scores, ood_scores = CASES["shifted"]
    predictions, references = _as_evaluate_inputs(id_scores, ood_scores, seed=1)
    for chunk in np.array_split(np.arange(len(predictions)), 4):
        metric.add_batch(
            predictions=torch.from_numpy(predictions[chunk]), references=torch.from_numpy(references[chunk])
        )
    assert metric.compute() == _module_metrics(id_scores, ood_scores)


@pytest.mark.parametrize(
    ("predictions", "references", "message"),
    [
        ([1.0, 2.0, 3.0], [1, 0, 2], "^references must be 1"),
        ([1.0, 2.0], [1, 1], "^references must contain both classes"),
        ([1.0, 2.0], [0, 0], "^references must contain both classes"),
        ([1.0, float("nan")], [1, 0], "^predictions must contain only finite"),
    ],
)
def test_evaluate_module_rejects_bad_inputs(metric, predictions, references, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        metric.compute(predictions=predictions, references=references)


def test_evaluate_module_info(metric) -> None:
    assert OOD_METRIC_PATH.is_dir()
    assert set(metric.features) == {"predictions", "references"}
    # float64 predictions: float32 would turn the "shifted" case into ties.
    assert metric.features["predictions"].dtype == "float64"
    assert "Gradient Short-Circuit" in metric.citation
    assert "OpenOOD" in metric.description


def test_evaluate_load_needs_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    # Loading from a local folder or script path must not touch the Hub: make every socket
    # connection fail and load both ways. (Done in-process: a fresh interpreter would spend
    # ~10 s importing evaluate on a small machine.)
    import evaluate

    def refuse(*args, **kwargs):
        raise OSError("network access attempted while loading the local OOD metric")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    by_folder = evaluate.load(str(OOD_METRIC_PATH), keep_in_memory=True)
    by_script = evaluate.load(str(OOD_METRIC_PATH / "ood_detection_metric.py"), keep_in_memory=True)
    kwargs = {"predictions": [0.9, 0.4, 0.5, 0.1], "references": [1, 1, 0, 0]}
    expected = _module_metrics([0.9, 0.4], [0.5, 0.1])
    assert expected["fpr95_ood_positive"] == 0.5  # catching both OOD (0.5, 0.1) needs t <= 0.5: ID 0.4 is rejected
    assert by_folder.compute(**kwargs) == by_script.compute(**kwargs) == expected


def test_the_metrics_work_without_evaluate() -> None:
    """evaluate is optional (the ``metric`` extra): the evaluation's metrics never import it, and the one function
    that needs it says which extra installs it."""
    import subprocess
    import sys

    script = ("import sys; sys.modules['evaluate'] = None\n"
              "from hf_gsc.evaluation.metrics import load_ood_metric, ood_metrics\n"
              "print(ood_metrics([0.9, 0.4], [0.5, 0.1])['auroc'])\n"
              "try:\n    load_ood_metric()\nexcept ImportError as error:\n    print(error)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    auroc, message = done.stdout.strip().splitlines()[-2:]
    assert float(auroc) == 0.75
    assert message.startswith("load_ood_metric needs the evaluate package: pip install 'hf_gsc[metric]'")
