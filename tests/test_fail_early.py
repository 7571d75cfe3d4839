"""Fail early, not late: an unfitted detector is not saved; a detector folder that lost its config says which files
it expected."""

from __future__ import annotations

import pytest
from conftest import make_tiny_model
from test_detectors import setting  # noqa: F401

from hf_gsc import AutoOODDetector
from hf_gsc.detectors import DETECTORS


@pytest.mark.parametrize("method", sorted(m for m, cls in DETECTORS.items() if cls.needs_fit is True))
def test_saving_an_unfitted_detector_is_refused_naming_fit(method, tmp_path):
    detector = AutoOODDetector.from_pretrained(make_tiny_model("vit"), method=method)
    with pytest.raises(ValueError, match=r"not fitted, so it cannot be saved: call \.fit\("):
        detector.save_pretrained(tmp_path / method)
    assert not (tmp_path / method).exists()


def test_a_folder_without_its_detector_config_names_the_files_it_expected(setting, tmp_path):  # noqa: F811
    detector = setting.detector("knn")
    detector.save_pretrained(tmp_path / "knn", save_base_model=True)
    (tmp_path / "knn" / "detector_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="holds detector_state.safetensors but no detector_config.json"):
        AutoOODDetector.from_pretrained(tmp_path / "knn")
