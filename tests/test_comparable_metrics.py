"""Metrics for comparing with the field, each checked against an independent reference: OpenOOD's FPR@95 (OOD
positive) beside the paper's (ID positive), AURC and selective accuracy, the split-conformal order statistic and
its coverage over repeated calibration draws, and their place in results.json / results.md / the model card."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import stats
from sklearn.metrics import roc_curve

from hf_gsc.evaluation.calibration import calibration_record, conformal_order, conformal_threshold
from hf_gsc.evaluation.metrics import fpr_at_tpr, fpr_at_tpr_ood_positive
from hf_gsc.evaluation.report import markdown_table, method_results
from hf_gsc.evaluation.selective import aurc, risk_coverage_curve, selective_accuracy
from hf_gsc.utils.calibration import kept_scores, scores_digest
from hf_gsc.utils.thresholds import threshold_at_tpr


def _cases():
    rng = np.random.default_rng(0)
    yield rng.normal(1.0, 1.0, 200), rng.normal(0.0, 1.0, 150)
    yield rng.integers(0, 5, 97).astype(float), rng.integers(0, 4, 41).astype(float)  # many ties
    yield np.array([3.0, 2.0, 1.0]), np.array([2.0, 0.5])


# ------------------------------------------------------------------------------------------------ FPR@95


def _brute_fpr_ood_positive(ids: np.ndarray, ood: np.ndarray, tpr: float = 0.95) -> float:
    """Every candidate threshold on -score (OOD positive): the largest one that flags >= tpr of OOD; the FPR is
    the fraction of ID flagged there (ties flagged)."""
    best = None
    for t in np.unique(-ood):
        if np.mean(-ood >= t) >= tpr and (best is None or t > best):
            best = t
    return float(np.mean(-ids >= best))


@pytest.mark.parametrize("case", range(3))
def test_fpr95_ood_positive_matches_openood_and_brute_force(case):
    ids, ood = list(_cases())[case]
    got = fpr_at_tpr_ood_positive(ids, ood)
    # OpenOOD v1.5 (openood/evaluators/metrics.py): roc_curve(is_ood, -conf), FPR at the first TPR >= 0.95
    # (all ROC points kept so that no point the rule reaches is dropped).
    is_ood = np.concatenate([np.zeros(ids.size), np.ones(ood.size)])
    fpr, tpr, _ = roc_curve(is_ood, -np.concatenate([ids, ood]), drop_intermediate=False)
    assert got == pytest.approx(float(fpr[np.argmax(tpr >= 0.95)]), abs=0)
    assert got == _brute_fpr_ood_positive(ids, ood)


def test_the_two_fpr95_conventions_are_different_quantities():
    # ID scores spread widely, OOD scores tightly below them: 95% of ID kept lets in every OOD sample's tail
    # differently than 95% of OOD caught rejects ID samples.
    rng = np.random.default_rng(1)
    ids, ood = rng.normal(2.0, 2.0, 2000), rng.normal(0.0, 0.3, 2000)
    id_positive, ood_positive = fpr_at_tpr(ids, ood), fpr_at_tpr_ood_positive(ids, ood)
    assert id_positive == pytest.approx(np.mean(ood >= np.quantile(ids, 0.05)), abs=0.01)
    assert ood_positive == pytest.approx(np.mean(ids <= np.quantile(ood, 0.95)), abs=0.01)
    assert abs(id_positive - ood_positive) > 0.3
    # Swapping the classes and negating the scores maps one convention onto the other.
    assert fpr_at_tpr_ood_positive(ids, ood) == fpr_at_tpr(-ood, -ids)


# ------------------------------------------------------------------------------------------------ selective


def _direct_aurc(scores: np.ndarray, correct: np.ndarray) -> float:
    """Mean over k of the error rate of the k highest scores (no ties: one order)."""
    order = np.argsort(-scores)
    return float(np.mean([1 - correct[order[:k]].mean() for k in range(1, scores.size + 1)]))


def test_aurc_matches_a_direct_computation():
    rng = np.random.default_rng(2)
    scores = rng.normal(size=300)
    correct = rng.random(300) < 1 / (1 + np.exp(-2 * scores))  # confident samples are more often right
    assert aurc(scores, correct) == pytest.approx(_direct_aurc(scores, correct), abs=1e-12)
    # Geifman et al.'s area: sum over the curve's points of risk * coverage step (one point per sample).
    coverage, risk, _ = risk_coverage_curve(scores, correct)
    assert aurc(scores, correct) == pytest.approx(np.sum(risk * np.diff(coverage, prepend=0.0)), abs=1e-12)


def test_aurc_with_ties_is_the_mean_over_every_order_of_the_tied_samples():
    scores = np.array([3.0, 2.0, 2.0, 2.0, 1.0, 1.0, 0.0])
    correct = np.array([True, False, True, True, False, True, False])
    orders = {tuple(p) for p in itertools.permutations(range(7)) if np.all(np.diff(scores[list(p)]) <= 0)}
    expected = np.mean([np.mean([1 - correct[list(o)[:k]].mean() for k in range(1, 8)]) for o in orders])
    assert len(orders) == 3 * 2 * 1 * 2  # 3! orders of the three 2.0s times 2! of the two 1.0s
    assert aurc(scores, correct) == pytest.approx(expected, abs=1e-12)


def test_aurc_does_not_depend_on_how_tied_samples_are_ordered():
    rng = np.random.default_rng(2)
    scores = rng.normal(size=300)
    correct = rng.random(300) < 1 / (1 + np.exp(-2 * scores))
    tied = np.round(scores, 1)
    perm = rng.permutation(300)
    assert aurc(tied[perm], correct[perm]) == pytest.approx(aurc(tied, correct), abs=1e-12)
    # Ranking errors last gives less area than chance ranking, which gives about the error rate.
    assert aurc(correct.astype(float), correct) < aurc(scores, correct) < aurc(-scores, correct)
    coverage, risk, thresholds = risk_coverage_curve(tied, torch.from_numpy(correct))
    assert coverage[-1] == 1.0 and risk[-1] == pytest.approx(1 - correct.mean())
    assert np.all(np.diff(thresholds) < 0)


def test_selective_accuracy_at_a_threshold():
    scores = np.array([0.9, 0.8, 0.8, 0.1])
    correct = np.array([True, False, True, False])
    assert selective_accuracy(scores, correct, 0.8) == {"coverage": 0.75, "accuracy": pytest.approx(2 / 3)}
    assert math.isnan(selective_accuracy(scores, correct, 1.0)["accuracy"])
    with pytest.raises(ValueError, match="one entry per score"):
        aurc(scores, correct[:3])
    with pytest.raises(ValueError, match="booleans"):
        aurc(scores, np.array([0.5, 1, 1, 0]))


# ------------------------------------------------------------------------------------------------ conformal


def _reference_order(n: int, tpr: float, delta: float) -> int:
    """Largest k with P(Binomial(n, 1 - tpr) >= k) >= 1 - delta (scipy), by search over every k."""
    return max(k for k in range(1, n + 1) if stats.binom.sf(k - 1, n, 1 - tpr) >= 1 - delta)


@pytest.mark.parametrize(("n", "tpr", "delta"), [(100, 0.95, 0.05), (1000, 0.95, 0.1), (5000, 0.9, 0.01), (59, 0.95, 0.05)])
def test_conformal_order_matches_the_binomial_reference(n, tpr, delta):
    k = conformal_order(n, tpr, delta)
    assert k == _reference_order(n, tpr, delta)
    # It is below the plain quantile's rank (n - ceil(tpr n) + 1): a guarantee costs a lower threshold.
    assert k <= n - math.ceil(tpr * n) + 1
    scores = np.random.default_rng(3).permutation(n).astype(float)
    assert conformal_threshold(scores, tpr, delta) == float(k - 1)


def test_conformal_refuses_too_few_samples_and_bad_arguments():
    # (0.95)^58 > 0.05 >= (0.95)^59: 59 scores are the minimum at tpr 0.95, delta 0.05.
    assert conformal_order(59, 0.95, 0.05) == 1
    with pytest.raises(ValueError, match="at least 59 are needed"):
        conformal_order(58, 0.95, 0.05)
    for tpr in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="tpr must be in"):
            conformal_order(100, tpr, 0.05)
    for delta in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="delta must be in"):
            conformal_order(100, 0.95, delta)
    with pytest.raises(ValueError, match="n must be a positive integer"):
        conformal_order(0, 0.95, 0.05)


def test_conformal_threshold_keeps_the_tpr_with_probability_one_minus_delta():
    """Repeated calibration draws from N(0, 1): the TPR of the threshold on the distribution itself is
    P(Z >= t) = norm.sf(t). The conformal threshold keeps it >= tpr in a fraction >= 1 - delta of the draws;
    the plain quantile does in only about half of them, so the test separates the two."""
    n, tpr, delta, draws = 200, 0.9, 0.1, 4000
    rng = np.random.default_rng(4)
    samples = rng.normal(size=(draws, n))
    conformal = np.mean([stats.norm.sf(conformal_threshold(s, tpr, delta)) >= tpr for s in samples])
    quantile = np.mean([stats.norm.sf(threshold_at_tpr(s, tpr)) >= tpr for s in samples])
    exact = stats.binom.sf(conformal_order(n, tpr, delta) - 1, n, 1 - tpr)  # the guarantee's own probability
    sd = math.sqrt(exact * (1 - exact) / draws)
    assert exact >= 1 - delta
    assert abs(conformal - exact) < 4 * sd  # the binomial formula describes the draws
    assert conformal >= 1 - delta - 4 * math.sqrt(delta * (1 - delta) / draws)
    assert quantile < 0.7  # the plain quantile misses the target often: this test could not pass with it


# ------------------------------------------------------------------------------------------------ report


def _results(delta=None):
    rng = np.random.default_rng(5)
    ids, validation = rng.normal(1.0, 1.0, 300), rng.normal(1.0, 1.0, 400)
    ood = {"near_a": rng.normal(0.5, 1.0, 100), "far_a": rng.normal(-2.0, 1.0, 100),
           "far_b": rng.normal(-1.0, 1.0, 100), "extra": rng.normal(0.0, 1.0, 50)}
    correct = rng.random(300) < 0.8
    groups = {"near": ["near_a"], "far": ["far_a", "far_b"]}
    entry = method_results(ids, validation, ood, 0.95, "validation", id_test_correct=correct, delta=delta,
                           groups=groups)
    return entry, ids, validation, ood, correct


def test_method_results_report_both_conventions_groups_and_selective():
    entry, ids, validation, ood, correct = _results()
    for name, scores in ood.items():
        assert entry["ood"][name]["fpr95"] == fpr_at_tpr(ids, scores)
        assert entry["ood"][name]["fpr95_ood_positive"] == fpr_at_tpr_ood_positive(ids, scores)
    far = entry["average_by_group"]["far"]
    assert far["fpr95_ood_positive"] == pytest.approx(
        (entry["ood"]["far_a"]["fpr95_ood_positive"] + entry["ood"]["far_b"]["fpr95_ood_positive"]) / 2)
    assert entry["average_by_group"]["near"]["auroc"] == entry["ood"]["near_a"]["auroc"]
    assert entry["average"]["auroc"] == pytest.approx(np.mean([v["auroc"] for v in entry["ood"].values()]))
    assert entry["selective"]["aurc"] == pytest.approx(_direct_aurc(ids, correct), abs=1e-12)
    accepted = ids >= entry["threshold"]
    assert entry["selective"]["accuracy"] == pytest.approx(correct[accepted].mean())
    kept = entry["calibration"].pop("calibration_scores")  # the kept scores' count and digest
    assert kept == {"count": 400, "digest": scores_digest(kept_scores(validation))}
    assert entry["calibration"] == calibration_record("validation", 400, 0.95) == {
        "split": "validation", "num_samples": 400, "tpr": 0.95, "method": "quantile", "delta": None}
    assert entry["threshold"] == threshold_at_tpr(validation, 0.95)


def test_method_results_with_a_conformal_delta():
    entry, _, validation, _, _ = _results(delta=0.05)
    assert entry["calibration"]["method"] == "conformal" and entry["calibration"]["delta"] == 0.05
    assert entry["threshold"] == conformal_threshold(validation, 0.95, 0.05) < threshold_at_tpr(validation, 0.95)


def test_results_md_labels_the_conventions_and_shows_near_and_far():
    entry, *_ = _results(delta=0.05)
    results = {"model": "m", "benchmark": "b", "id_accuracy": 0.8, "methods": {"msp": entry, "energy": entry},
               "ood_groups": {"near": ["near_a"], "far": ["far_a", "far_b"]}}
    text = markdown_table(results)
    assert "FPR95 (ID+)↓ / FPR95 (OOD+)↓ / AUROC↑" in text
    assert "OOD = positive class, OpenOOD's" in text and "ID = positive class, the paper's" in text
    header = next(line for line in text.splitlines() if line.startswith("| Method | near_a"))
    assert header == ("| Method | near_a (near) | far_a (far) | far_b (far) | extra | Near-OOD avg. | Far-OOD avg. "
                      "| Average |")
    near = 100 * entry["average_by_group"]["near"]["fpr95_ood_positive"]
    assert f"{near:.2f}" in text
    assert "accuracy on accepted ID test↑ | AURC↓" in text
    assert "Split-conformal thresholds (TPR >= 95% on new ID data with probability >= 1 - 0.05)" in text


def test_model_card_eval_results_name_both_conventions():
    from hf_gsc.storage.model_card import eval_results_from

    entry, *_ = _results()
    entries = eval_results_from({"benchmark": "b", "methods": {"gsc": entry}}, "gsc")
    names = {(e.dataset_config, e.metric_type): e.metric_name for e in entries}
    assert names[("far_a", "fpr95")] == "FPR@95%TPR (ID positive)"
    assert names[("far_a", "fpr95_ood_positive")] == "FPR@95%TPR (OOD positive, OpenOOD)"
    values = {(e.dataset_config, e.metric_type): e.metric_value for e in entries}
    assert values[("far_a", "fpr95_ood_positive")] == entry["ood"]["far_a"]["fpr95_ood_positive"]
