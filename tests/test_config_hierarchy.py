"""One config hierarchy (PEFT's PeftConfig -> LoraConfig): every method's settings class derives from
DetectorConfig, which holds the type field, the threshold, the calibration record and the base-model reference."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import make_tiny_model

from hf_gsc import DETECTORS, AutoOODDetector, DetectorConfig, GSCConfig
from hf_gsc.settings.config import FITTED, PROVENANCE


COMMON = {"threshold", "calibration", "base_model_name_or_path", "base_model_revision", "hf_gsc_version"}


@pytest.mark.parametrize("method", sorted(DETECTORS))
def test_every_method_has_its_own_config_class_on_the_common_base(method):
    cls = DETECTORS[method].config_class
    assert issubclass(cls, DetectorConfig) and cls is not DetectorConfig
    assert cls.method == method  # the type field, on the class
    assert COMMON <= cls.field_names()
    assert set(cls.names(FITTED, PROVENANCE)) >= COMMON
    # the settings are the method's own fields, none of them a common one
    assert not set(cls.setting_names()) & COMMON
    others = {m: DETECTORS[m].config_class for m in DETECTORS if m != method}
    assert all(other is not cls for other in others.values())


def test_gsc_config_is_a_detector_config():
    assert issubclass(GSCConfig, DetectorConfig) and GSCConfig.method == "gsc"
    assert [f.name for f in dataclasses.fields(DetectorConfig)] == [
        f.name for f in dataclasses.fields(GSCConfig)][:len(dataclasses.fields(DetectorConfig))]


def test_a_baseline_config_has_typed_fields_and_names_itself_in_errors():
    config_class = DETECTORS["knn"].config_class
    assert config_class.__name__ == "KNNConfig"
    config = config_class(k=7)
    assert config.k == 7 and config.hyperparameters == {"bank_dtype": "float32", "bank_fraction": 1.0, "k": 7}
    with pytest.raises(ValueError, match=r"^KNNConfig\.threshold must be a finite number"):
        config.threshold = "high"
    with pytest.raises(ValueError, match=r"^GSCConfig\.mask_ratio must be in"):
        GSCConfig(mask_ratio=2.0)
    with pytest.raises(AttributeError, match="method"):
        config.method = "vim"


def test_a_built_detector_keeps_its_settings_in_its_config_and_refuses_a_new_one(tmp_path):
    detector = AutoOODDetector.from_pretrained(make_tiny_model("vit"), method="ash_p", percentile=80)
    assert type(detector.config).__name__ == "ASHPConfig" and detector.config.percentile == 80.0
    detector.config.percentile = 95.0  # a config is passive: the detector refuses it before it scores or saves
    with pytest.raises(ValueError, match="assignment is undone: build a new detector"):
        detector.score(torch.zeros(2, 3, 16, 16, dtype=torch.float64))
    assert detector.config.percentile == 80.0
    detector.config.percentile = 95.0
    with pytest.raises(ValueError, match="build a new detector"):
        detector.save_pretrained(tmp_path / "refused")
    assert detector.config.percentile == 80.0 and not (tmp_path / "refused").exists()
    detector.config.threshold = 1.5  # a fitted field, not a setting: assignable
    detector.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "detector_config.json").read_text())
    assert saved["method"] == "ash_p" and saved["hyperparameters"] == {"percentile": 80.0, "split_point": "penultimate"}
    assert saved["threshold"] == 1.5


def test_unknown_saved_hyperparameter_is_an_error_unless_a_newer_version_wrote_it(tmp_path):

    values = {"method": "knn", "hyperparameters": {"k": 3, "metric": "cosine"}, "hf_gsc_version": "0.1.0"}
    with pytest.raises(ValueError, match=r"unknown knn hyperparameters \['metric'\]"):
        DetectorConfig.from_dict(values, "saved")
    with pytest.warns(UserWarning, match="newer than the installed"):
        config = DetectorConfig.from_dict({**values, "hf_gsc_version": "99.0"}, "saved")
    assert config.hyperparameters == {"bank_dtype": "float32", "bank_fraction": 1.0, "k": 3}
