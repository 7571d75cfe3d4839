"""Conformal p-values: valid on fresh ID data, the threshold as a p-value cut (``set_tpr``), kept through save and
load, and what an old folder without calibration scores does."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model
from safetensors.torch import load_file, save_file
from test_pipeline import TASK, detector_dir  # noqa: F401  (fixture: a calibrated GSC folder with a processor)

from hf_gsc import AutoOODDetector, GSCForImageClassification
from hf_gsc.utils.calibration import Calibration, kept_scores
from hf_gsc.utils.conformal import conformal_p_value, p_value_cut
from hf_gsc.utils.thresholds import threshold_for


POOL = 3000  # ID images drawn from one distribution (pixels ~ N(0, 1)), scored once per method
CALIBRATION = 19  # n + 1 = 20: the p-values are multiples of 0.05, so off-grid levels catch an off-by-one


def _detector(method: str):
    model = make_tiny_model("resnet")
    if method == "gsc":
        return GSCForImageClassification(model, mask_ratio=0.1)
    return AutoOODDetector.from_pretrained(model, method=method)


def _pixels(count: int, seed: int) -> torch.Tensor:
    return torch.randn(count, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _naive_p_values(scores: torch.Tensor, calibration: torch.Tensor) -> torch.Tensor:
    """The definition, one score at a time: (1 + #{calibration <= s}) / (n + 1)."""
    return torch.tensor([(1 + sum(float(c) <= float(s) for c in calibration)) / (len(calibration) + 1)
                         for s in scores], dtype=torch.float64)


@pytest.mark.parametrize("method", ["msp", "energy", "gsc"])
def test_p_values_of_fresh_id_data_are_valid(method):
    """P(p <= a) <= a on ID data drawn like the calibration data, averaged over 200 random calibration / test splits
    of one pool (so the average estimates the probability over the calibration draw too, where the guarantee
    holds). With n = 19 calibration scores, P(p <= a) is exactly floor(20 a) / 20 for continuous scores: the
    check also bounds it from below, so a p-value that is too conservative (or constant) fails."""
    detector = _detector(method)
    with torch.no_grad():
        scores = detector.score(_pixels(POOL, seed=0)).double()
    generator = torch.Generator().manual_seed(1)
    levels = torch.tensor([0.03, 0.06, 0.12, 0.3, 0.5])
    rejected = torch.zeros(len(levels), dtype=torch.float64)
    splits = 200
    for _ in range(splits):
        order = torch.randperm(POOL, generator=generator)
        detector.set_calibration(Calibration.from_scores(scores[order[:CALIBRATION]]))
        p = detector.p_value(scores[order[CALIBRATION:]].float())
        rejected += (p[None, :] <= levels[:, None].double()).double().mean(dim=1)
    rejected /= splits
    # Standard error of the average: at most that of one pass over the whole pool, sqrt(a (1 - a) / POOL).
    tolerance = 3 * (levels * (1 - levels) / POOL).sqrt().double()
    exact = torch.floor(levels.double() * (CALIBRATION + 1)) / (CALIBRATION + 1)
    assert (rejected <= levels.double() + tolerance).all(), (method, rejected.tolist())
    assert (rejected >= exact - tolerance).all(), (method, rejected.tolist())


def test_forward_gives_the_defined_p_value_and_the_threshold_is_its_cut():
    detector = _detector("energy")
    calibration, fresh = _pixels(150, seed=2), _pixels(40, seed=3)
    threshold = detector.calibrate(calibration, tpr=0.9)
    with torch.no_grad():
        kept = detector.score(calibration).double()
        output = detector(fresh)
    assert torch.equal(detector.calibration_scores, kept.sort().values)
    assert detector.calibration_scores.dtype == torch.float64
    torch.testing.assert_close(output.p_value, _naive_p_values(output.ood_score, kept), rtol=0, atol=1e-12)
    cut = detector.p_value_cut
    assert torch.equal(output.is_ood, output.p_value <= cut)
    # The output's tuple (what Trainer.predict returns): p_value right after is_ood.
    assert list(output) == ["logits", "ood_score", "is_ood", "p_value"]
    assert threshold == threshold_for(kept, 0.9)


@pytest.mark.parametrize(("tpr", "delta"), [(0.99, None), (0.8, None), (0.9, 0.1)])
def test_set_tpr_gives_the_threshold_calibrate_gives(tpr, delta):
    detector, again = _detector("msp"), _detector("msp")
    calibration, fresh = _pixels(200, seed=4), _pixels(64, seed=5)
    detector.calibrate(calibration, tpr=0.95)
    with torch.no_grad():
        before = detector(fresh)
    threshold = detector.set_tpr(tpr, delta=delta)
    assert threshold == again.calibrate(calibration, tpr=tpr, delta=delta)
    assert detector.config.calibration["tpr"] == tpr and detector.config.calibration["delta"] == delta
    assert detector.p_value_cut == again.p_value_cut
    with torch.no_grad():
        after = detector(fresh)
    assert torch.equal(after.p_value, before.p_value)  # the p-values do not depend on tpr
    assert torch.equal(after.is_ood, after.p_value <= detector.p_value_cut)
    assert torch.equal(after.is_ood, ~(after.ood_score >= threshold))


def test_set_tpr_refuses_bad_values_and_a_detector_without_scores():
    detector = _detector("msp")
    with pytest.raises(RuntimeError, match="keeps no ID calibration scores.*calibrate"):
        detector.set_tpr(0.9)
    detector.calibrate(_pixels(120, seed=6))
    with pytest.raises(ValueError, match="tpr must be in"):
        detector.set_tpr(1.5)
    with pytest.raises(ValueError, match="delta must be in"):
        detector.set_tpr(0.9, delta=2.0)


def test_a_nan_score_gets_the_smallest_p_value_and_is_flagged():
    calibration = kept_scores(torch.tensor([3.0, 1.0, 2.0, 2.0]))
    p = conformal_p_value(torch.tensor([float("nan"), 0.5, 2.0, 9.0, float("-inf")]), calibration)
    torch.testing.assert_close(p, torch.tensor([0.2, 0.2, 0.8, 1.0, 0.2], dtype=torch.float64))
    # threshold 2.0 (ties kept): accepted iff s >= 2 iff p > cut
    assert p_value_cut(calibration, 2.0) == pytest.approx(0.4)


def test_calibration_scores_are_saved_sorted_and_loaded(tmp_path):
    detector = _detector("energy")
    detector.calibrate(_pixels(120, seed=7))
    detector.save_pretrained(tmp_path / "saved", save_base_model=True)
    state = load_file(tmp_path / "saved" / "detector_state.safetensors")
    assert state["calibration_scores"].dtype == torch.float64
    assert torch.equal(state["calibration_scores"], detector.calibration_scores)
    loaded = AutoOODDetector.from_pretrained(tmp_path / "saved")
    fresh = _pixels(16, seed=8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(fresh).p_value, detector(fresh).p_value, rtol=0, atol=0)
    assert loaded.set_tpr(0.5) == detector.set_tpr(0.5)
    # The card says what the cut means: tpr 0.95 of 120 scores flags at most 6 of them (5.0%).
    card = (tmp_path / "saved" / "README.md").read_text()
    assert "flagged when its p-value is at most 0.05785: when at most 6 of the 120 ID calibration images (5.0%)" in card


def test_a_folder_without_calibration_scores_loads_and_says_p_values_are_unavailable(tmp_path):
    detector = _detector("energy")
    detector.calibrate(_pixels(120, seed=9))
    detector.save_pretrained(tmp_path / "old", save_base_model=True)
    (tmp_path / "old" / "detector_state.safetensors").unlink()  # as saved before calibration scores were kept
    knn = AutoOODDetector.from_pretrained(make_tiny_model("resnet"), method="knn", k=3)
    knn.fit([_pixels(40, seed=15)])  # a fitted state, saved without calibration scores
    knn.calibrate(_pixels(120, seed=9))
    knn.save_pretrained(tmp_path / "old_knn", save_base_model=True)
    path = tmp_path / "old_knn" / "detector_state.safetensors"
    state = load_file(path)
    del state["calibration_scores"]
    save_file(state, path)
    for folder in ("old", "old_knn"):
        loaded = AutoOODDetector.from_pretrained(tmp_path / folder)
        assert loaded.calibration_scores is None
        with pytest.warns(UserWarning, match="p_value is None.*saved without the ID calibration scores"):
            output = loaded(_pixels(4, seed=10))
        assert output.p_value is None and output.is_ood is not None  # the decision still works
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once
            loaded(_pixels(4, seed=11))
        with pytest.raises(RuntimeError, match="saved without the ID calibration scores"):
            loaded.set_tpr(0.9)
        loaded.calibrate(_pixels(120, seed=12))  # calibrating again brings p-values back
        assert loaded(_pixels(4, seed=10)).p_value is not None


def test_clear_calibration_drops_the_scores():
    detector = _detector("msp")
    detector.calibrate(_pixels(120, seed=13))
    # One warning, when the threshold is dropped, saying why (the next forward does not repeat it).
    with pytest.warns(UserWarning, match="dropped because the temperature changed"):
        detector.clear_calibration("the temperature changed")
    assert detector.calibration_scores is None and detector.config.threshold is None
    assert detector.config.calibration is None
    assert "the temperature changed" in detector.p_value_unavailable
    output = detector(_pixels(2, seed=14))
    assert output.p_value is None and output.is_ood is None


def test_pipeline_gives_the_p_value(detector_dir):  # noqa: F811
    import transformers
    from PIL import Image

    ood = transformers.pipeline(TASK, model=str(detector_dir))
    detector = GSCForImageClassification.from_pretrained(detector_dir)
    image = Image.new("RGB", (20, 24), (120, 30, 200))
    pixel_values = detector.image_processor(images=image, return_tensors="pt")["pixel_values"]
    expected = detector(pixel_values).p_value
    result = ood(image)
    assert result["p_value"] == pytest.approx(float(expected[0]), abs=1e-12)
    assert 0 < result["p_value"] <= 1
