"""The edges of a saved folder: a relative base reference is the folder's, not the working directory's; JSON nested
too deeply is a ValueError naming the file; a base model without a name or path is said at save and at load."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model

from hf_gsc import AutoOODDetector


@pytest.mark.parametrize("reference", ["../models/vit3", "bases/vit3"])
def test_a_relative_base_reference_is_resolved_against_the_detector_folder(tmp_path, monkeypatch, reference):
    folder = tmp_path / "detector"
    base = (folder / reference).resolve()
    make_tiny_model("vit").save_pretrained(base)
    detector = AutoOODDetector.from_pretrained(str(base), method="msp")
    detector.save_pretrained(folder)
    config = json.loads((folder / "detector_config.json").read_text())
    config["base_model_name_or_path"] = reference  # a folder written elsewhere, by hand or by another tool
    (folder / "detector_config.json").write_text(json.dumps(config))
    elsewhere = tmp_path / "somewhere" / "else"
    (elsewhere / reference).mkdir(parents=True)  # the same name under the working directory is not the base
    monkeypatch.chdir(elsewhere)
    loaded = AutoOODDetector.from_pretrained(folder)
    assert loaded.config.base_model_name_or_path == str(base)
    x = torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE)
    torch.testing.assert_close(loaded.score(x), detector.score(x))


@pytest.mark.parametrize("name", ["detector_config.json", "results.json"])
def test_json_nested_too_deeply_is_a_value_error_naming_the_file(tmp_path, name):
    detector = AutoOODDetector.from_pretrained(make_tiny_model("resnet"), method="msp")
    detector.save_pretrained(tmp_path / "detector", save_base_model=True)
    deep = "[" * 100_000 + "]" * 100_000
    if name == "detector_config.json":
        (tmp_path / "detector" / name).write_text(deep)
        with pytest.raises(ValueError, match="detector_config.json is nested too deeply"):
            AutoOODDetector.from_pretrained(tmp_path / "detector")
    else:
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / name).write_text(deep)
        with pytest.raises(ValueError, match="results.json is nested too deeply"):
            detector.save_pretrained(tmp_path / "other", results_dir=tmp_path / "run")


def test_a_base_without_name_or_path_warns_at_save_and_the_load_error_names_model(tmp_path):
    model = make_tiny_model("resnet")
    assert not getattr(model.config, "_name_or_path", None)
    detector = AutoOODDetector.from_pretrained(model, method="msp")
    with pytest.warns(UserWarning, match="base model has no name or path.*save_base_model=True"):
        detector.save_pretrained(tmp_path / "detector")
    with pytest.raises(ValueError, match=r"names no base model.*model=<the loaded classifier>.*save_base_model=True"):
        AutoOODDetector.from_pretrained(tmp_path / "detector")
    loaded = AutoOODDetector.from_pretrained(tmp_path / "detector", model=model)  # the way out it names
    assert loaded.method == "msp"
