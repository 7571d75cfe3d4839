"""A calibration is one value, bound at load: kept scores that do not belong to the saved threshold and record
(shifted, of another count, of another dtype, under a threshold that is not their cut, edited) never load silently;
whatever loads keeps ``is_ood == (p_value <= p_value_cut)``; at most ``MAX_KEPT_SCORES`` are kept."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model
from safetensors.torch import load_file, save_file

from hf_gsc import AutoOODDetector
from hf_gsc.utils.calibration import MAX_KEPT_SCORES, Calibration, UnboundCalibration, kept_scores
from hf_gsc.utils.thresholds import threshold_for


def _pixels(count: int, seed: int) -> torch.Tensor:
    return torch.randn(count, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An MSP detector calibrated on 200 ID images, saved with its base weights."""
    folder = tmp_path_factory.mktemp("bound") / "msp"
    detector = AutoOODDetector.from_pretrained(make_tiny_model("resnet"), method="msp")
    detector.calibrate(_pixels(200, seed=0))
    detector.save_pretrained(folder, save_base_model=True)
    return folder


def _copy(saved, tmp_path):
    import shutil

    return shutil.copytree(saved, tmp_path / "copy")


def _edit_scores(folder, edit):
    path = folder / "detector_state.safetensors"
    state = load_file(path)
    state["calibration_scores"] = edit(state["calibration_scores"])
    save_file(state, path)


def _holds_the_promise(detector):
    """``is_ood == (p_value <= p_value_cut)`` for whatever loaded, on fresh images and on the threshold itself."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output = detector(_pixels(64, seed=1))
    if output.p_value is not None and output.is_ood is not None:
        assert torch.equal(output.is_ood, output.p_value <= detector.p_value_cut)
        at = torch.tensor([detector.config.threshold], dtype=torch.float64)
        assert bool(detector.calibration.p_value(at) <= detector.p_value_cut) is False  # the threshold is accepted
    return output


@pytest.mark.parametrize(("probe", "edit", "named"), [
    ("shifted by +1", lambda scores: scores + 1, "threshold"),
    ("100 where the record says 200", lambda scores: scores[::2].clone(), "100 calibration scores where the record "
                                                                           "says 200"),
    ("one score edited", lambda scores: torch.cat([scores[:10], scores[10:11] + 1e-9, scores[11:]]), "digest"),
])
def test_scores_that_do_not_belong_to_the_threshold_drop_it_with_one_warning(saved, tmp_path, probe, edit, named):
    folder = _copy(saved, tmp_path)
    _edit_scores(folder, edit)
    with pytest.warns(UserWarning, match="threshold was dropped because .*does not hold one calibration") as caught:
        loaded = AutoOODDetector.from_pretrained(folder)
    assert named in str(caught[0].message), (probe, str(caught[0].message))
    assert loaded.calibration is None and loaded.config.threshold is None and loaded.calibration_scores is None
    output = _holds_the_promise(loaded)
    assert output.is_ood is None and output.p_value is None


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float32])
def test_kept_scores_of_another_dtype_are_refused(saved, tmp_path, dtype):
    folder = _copy(saved, tmp_path)
    _edit_scores(folder, lambda scores: scores.round().to(dtype))
    with pytest.raises(ValueError, match=f"calibration_scores must be a 1-D float64 tensor.*got {dtype}"):
        AutoOODDetector.from_pretrained(folder)


def test_a_threshold_that_is_not_the_cut_of_the_scores_is_dropped(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    config = json.loads((folder / "detector_config.json").read_text())
    config["threshold"] = 1e308
    (folder / "detector_config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="threshold 1e\\+308, where the scores' cut for tpr 0.95 is"):
        loaded = AutoOODDetector.from_pretrained(folder)
    assert loaded.calibration is None
    _holds_the_promise(loaded)


def test_an_untouched_folder_loads_bound_without_a_word(saved):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = AutoOODDetector.from_pretrained(saved)
    record = loaded.config.calibration
    assert record["calibration_scores"]["count"] == 200 == loaded.calibration_scores.numel()
    assert loaded.config.threshold == threshold_for(loaded.calibration_scores, 0.95)
    output = _holds_the_promise(loaded)
    assert output.p_value is not None


def test_a_threshold_assigned_by_hand_drops_the_scores_that_do_not_belong_to_it(saved):
    loaded = AutoOODDetector.from_pretrained(saved)
    loaded.config.threshold = 0.5
    output = _holds_the_promise(loaded)
    assert torch.equal(output.is_ood, ~(output.ood_score >= 0.5))
    assert loaded.calibration_scores is None and loaded.config.calibration is None
    assert "set by hand" in loaded.p_value_unavailable


def test_from_pretrained_with_a_threshold_keeps_it_without_the_saved_record(saved):
    loaded = AutoOODDetector.from_pretrained(saved, threshold=0.25)
    assert loaded.config.threshold == 0.25 and loaded.config.calibration is None
    _holds_the_promise(loaded)


def test_at_most_max_kept_scores_are_kept_a_sorted_sample_with_its_count_in_the_record():
    n = 3 * MAX_KEPT_SCORES + 7
    scores = torch.randn(n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    calibration = Calibration.from_scores(scores, tpr=0.95)
    kept = calibration.scores
    assert kept.numel() == MAX_KEPT_SCORES and kept.dtype == torch.float64
    assert torch.equal(kept, kept_scores(scores)) and bool((kept[1:] >= kept[:-1]).all())
    assert calibration.record["num_samples"] == n and calibration.record["calibration_scores"]["count"] == kept.numel()
    assert calibration.threshold == threshold_for(kept, 0.95)
    # The sample's p-values differ from those of all n scores by at most about 1 / m.
    probe = torch.linspace(-3, 3, 101, dtype=torch.float64)
    full = (1 + torch.searchsorted(scores.sort().values, probe, right=True)) / (n + 1)
    assert float((calibration.p_value(probe) - full).abs().max()) <= 2 / MAX_KEPT_SCORES
    again = Calibration.from_dict(calibration.to_dict(), kept)
    assert again.threshold == calibration.threshold
    # The model card says how many were kept of how many read.
    from hf_gsc.storage.model_card import p_value_sentence

    sentence = p_value_sentence(calibration.p_value_cut, calibration.record)
    assert f"of the {MAX_KEPT_SCORES} kept ID calibration scores (a sorted sample of {n})" in sentence


def test_a_folder_with_more_kept_scores_than_the_format_keeps_is_refused_before_reading_them(saved, tmp_path):
    folder = _copy(saved, tmp_path)
    _edit_scores(folder, lambda scores: torch.linspace(0, 1, MAX_KEPT_SCORES + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=f"keeps {MAX_KEPT_SCORES + 1} calibration scores, more than"):
        AutoOODDetector.from_pretrained(folder)


def test_scores_without_a_threshold_do_not_load():
    with pytest.raises(UnboundCalibration, match="no threshold"):
        Calibration.from_dict({"threshold": None, "calibration": None}, torch.zeros(3, dtype=torch.float64))
