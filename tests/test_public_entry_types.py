"""Types checked the same way in every public entry: a string where a number belongs is refused as the settings
refuse ``k="5"`` (not converted), data that is no data names the argument and what it takes, a source that is no
folder, id or model names ``pretrained_model_name_or_path``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model

from hf_gsc import AutoOODDetector, GSCForImageClassification, KNNConfig


@pytest.fixture(scope="module")
def calibrated():
    detector = GSCForImageClassification(make_tiny_model("resnet").float(), mask_ratio=0.2)
    detector.calibrate(torch.randn(40, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0)))
    return detector


def test_set_tpr_refuses_a_string_as_a_setting_does(calibrated):
    with pytest.raises(ValueError, match=r"KNNConfig\.k must be an integer >= 1, got '5'"):
        KNNConfig(k="5")
    with pytest.raises(ValueError, match=r"tpr must be a number, got '0\.9' \(str\)"):
        calibrated.set_tpr("0.9")
    with pytest.raises(ValueError, match=r"tpr must be a number, got True"):
        calibrated.set_tpr(True)
    with pytest.raises(ValueError, match=r"delta must be a number, got '0\.1'"):
        calibrated.set_tpr(0.9, delta="0.1")
    with warnings.catch_warnings():  # refused before any forward: no "too few samples" warning first
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"tpr must be a number, got '0\.9'"):
            calibrated.calibrate(torch.randn(4, 3, IMAGE_SIZE, IMAGE_SIZE), tpr="0.9")
        with pytest.raises(ValueError, match=r"delta must be a number, got '0\.1'"):
            calibrated.calibrate(torch.randn(4, 3, IMAGE_SIZE, IMAGE_SIZE), delta="0.1")
    # Numbers of every kind are numbers.
    for tpr in (0.9, np.float32(0.9), torch.tensor(0.9), 1):
        calibrated.set_tpr(tpr)


@pytest.mark.parametrize("bad", [42, 3.5, object()])
def test_fit_and_calibrate_name_the_argument_and_what_it_takes(calibrated, bad):
    knn = AutoOODDetector.from_pretrained(make_tiny_model("resnet").float(), method="knn", k=1)
    with pytest.raises(TypeError, match=r"^id_train_batches must be data, got .*; pass a \(N, C, H, W\) tensor"):
        knn.fit(bad)
    with pytest.raises(TypeError, match=r"^id_validation_data must be data, got .*a datasets\.Dataset, a dataset root"):
        calibrated.calibrate(bad)


@pytest.mark.parametrize("entry", [AutoOODDetector.from_pretrained, GSCForImageClassification.from_pretrained])
def test_from_pretrained_names_its_source_argument(entry):
    with pytest.raises(TypeError, match=r"^pretrained_model_name_or_path must be a saved detector or image classifier"
                                        r".*got int 42"):
        entry(42)
