"""Errors a user meets when loading, saving and configuring detectors: each one clear message naming the
argument or file and what was expected (issue #16's list; undecodable data is tested with the data layer)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from conftest import IMAGE_SIZE, NUM_LABELS, make_tiny_model
from hub_server import LoopbackHub

from hf_gsc import GSCConfig, GSCForImageClassification
from hf_gsc.settings.config import CONFIG_NAME, STATE_FILE
from hf_gsc.storage.saved_format import save_state


@pytest.fixture
def base_dir(tmp_path) -> Path:
    directory = tmp_path / "base-vit"
    make_tiny_model("vit").save_pretrained(directory)
    return directory


@pytest.fixture
def fisher_dir(base_dir, tmp_path) -> Path:
    """A saved detector with a fitted diagonal Fisher (selection="fisher")."""
    detector = GSCForImageClassification.from_pretrained(base_dir, selection="fisher")
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(6, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)
    detector.fit_fisher([(images, torch.arange(6) % NUM_LABELS)])
    directory = tmp_path / "fisher-detector"
    detector.save_pretrained(directory)
    return directory


def test_calibrate_none_names_the_argument(base_dir):  # error 1
    detector = GSCForImageClassification.from_pretrained(base_dir)
    with pytest.raises(TypeError, match="id_validation_data is None; pass a"):
        detector.calibrate(None)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("mask_ratio", 1.5, r"GSCConfig.mask_ratio must be in \[0.0, 1.0\], got 1.5"),
        ("mask_ratio", math.nan, "GSCConfig.mask_ratio must be a finite number, got nan"),
        ("temperature", 0.0, r"GSCConfig.temperature must be in \[0.001, inf\], got 0.0"),
        ("operation", "erase", "GSCConfig.operation must be one of"),
        ("split_point", 3, "split_point"),
    ],
)
def test_assignment_is_validated_like_construction(base_dir, field, value, message):  # error 2
    detector = GSCForImageClassification.from_pretrained(base_dir)
    before = getattr(detector.config, field)
    with pytest.raises(ValueError, match=message):
        setattr(detector.config, field, value)
    assert getattr(detector.config, field) == before
    with pytest.raises(ValueError, match=message):
        GSCConfig(**{field: value})


def test_folder_without_any_config(tmp_path):  # error 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"holds neither detector_config.json \(a saved detector\) nor config.json"):
        GSCForImageClassification.from_pretrained(tmp_path / "empty")


def test_referenced_base_folder_is_gone(base_dir, tmp_path):  # error 4
    saved = tmp_path / "detector"
    GSCForImageClassification.from_pretrained(base_dir).save_pretrained(saved)
    base_dir.rename(tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match="names the base model .* a local folder that does not exist") as error:
        GSCForImageClassification.from_pretrained(saved)
    assert "base_model_name_or_path=" in str(error.value) and "model=" in str(error.value)
    # The remedy the message names works.
    loaded = GSCForImageClassification.from_pretrained(saved, base_model_name_or_path=str(tmp_path / "moved"))
    assert loaded.config.base_model_name_or_path == str(tmp_path / "moved")


def test_truncated_state_file_is_named(fisher_dir):  # error 5
    path = fisher_dir / STATE_FILE
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError, match=f"{path} is not a readable safetensors file"):
        GSCForImageClassification.from_pretrained(fisher_dir)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda f: f[:-1], r"'fisher_diagonal' in .* has shape \({n},\), expected \({m},\): the feature at split_point"),
        (lambda f: torch.full_like(f, math.nan), "'fisher_diagonal' in .* holds NaN or infinite values"),
        (lambda f: -f, "'fisher_diagonal' in .* holds negative values"),
        (lambda f: f.view(1, -1), r"'fisher_diagonal' in .* has shape \(1, {n}\), expected \(\*\)"),
        (lambda f: f.long(), r"'fisher_diagonal' in .* must be floating point, got torch.int64"),
    ],
)
def test_fisher_is_checked_on_load(fisher_dir, corrupt, message):  # error 6
    path = fisher_dir / STATE_FILE
    state = GSCForImageClassification.from_pretrained(fisher_dir).fitted_state()
    fisher = corrupt(state["fisher_diagonal"].clone())
    save_state({"fisher_diagonal": fisher}, path)
    with pytest.raises(ValueError, match=message.format(n=fisher.numel(), m=state["fisher_diagonal"].numel())) as error:
        GSCForImageClassification.from_pretrained(fisher_dir)
    assert str(path) in str(error.value)


def test_missing_directory_says_so():  # error 7
    with pytest.raises(FileNotFoundError, match="'/no/such/dir': no such directory, and not a Hub repo id"):
        GSCForImageClassification.from_pretrained("/no/such/dir")


def test_failed_push_names_no_temporary_folder(base_dir, tmp_path):  # error 8
    detector = GSCForImageClassification.from_pretrained(base_dir)
    from hf_gsc.storage.publish_results import HubError

    with LoopbackHub() as hub, hub.patch_client(cache_dir=tmp_path / "cache", offline=True):
        with pytest.raises(HubError) as error:
            detector.push_to_hub("user/never", save_base_model=True)
    message = str(error.value)
    assert "HF_HUB_OFFLINE=1" in message and "The detector in memory is unchanged" in message
    assert "/tmp" not in message and "intact" not in message


def test_truncated_saved_fit_is_fitted_again(tmp_path):  # error 10
    from hf_gsc.evaluation.fitting import _load_fit

    directory = tmp_path / "detectors" / "react"
    directory.mkdir(parents=True)
    (directory / "fit.json").write_text(json.dumps({"fingerprint": "abc"}))
    save_state({"threshold": torch.tensor([1.0, 2.0])}, directory / STATE_FILE)
    assert set(_load_fit(directory, "abc")) == {"threshold"}
    (directory / STATE_FILE).write_bytes((directory / STATE_FILE).read_bytes()[:20])
    assert _load_fit(directory, "abc") is None


def test_config_from_a_newer_version_loads_with_a_warning(base_dir, tmp_path):
    saved = tmp_path / "detector"
    GSCForImageClassification.from_pretrained(base_dir, mask_ratio=0.2).save_pretrained(saved)
    values = json.loads((saved / CONFIG_NAME).read_text())
    (saved / CONFIG_NAME).write_text(json.dumps({**values, "hf_gsc_version": "99.0.0", "new_option": 3}))
    with pytest.warns(UserWarning, match=r"written by hf_gsc 99.0.0, newer than the installed hf_gsc 0\.\d+\.\d+; "
                                         r"ignoring .*\['new_option'\]"):
        loaded = GSCForImageClassification.from_pretrained(saved)
    assert loaded.config.mask_ratio == 0.2
    # Unknown fields from this same version are a mistake, not a newer format.
    (saved / CONFIG_NAME).write_text(json.dumps({**values, "new_option": 3}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"unknown keys \['new_option'\]"):
            GSCForImageClassification.from_pretrained(saved)


def test_missing_card_template_leaves_no_half_written_folder(base_dir, tmp_path, monkeypatch):
    from hf_gsc.storage import model_card

    monkeypatch.setattr(model_card, "TEMPLATE", tmp_path / "nowhere" / "ood_detector.md")
    with pytest.raises(FileNotFoundError, match="model card template ood_detector.md not found at .*nowhere"):
        GSCForImageClassification.from_pretrained(base_dir).save_pretrained(tmp_path / "detector")
    assert not (tmp_path / "detector").exists()


@pytest.mark.parametrize("length", ["one", "d+3", "d+channels"])
@pytest.mark.parametrize("processor", [True, False], ids=["with-processor", "without-processor"])
def test_fisher_of_a_model_without_a_fixed_input_size_is_checked(length, processor, tmp_path):
    """A ResNet's config fixes no input size: its saved image processor gives the size at load. Without one, a length
    that is no multiple of the feature's channels is refused at load, and the first forward refuses any other wrong
    length (a length-1 Fisher broadcast silently into wrong scores, d+3 failed deep inside)."""
    from transformers import ViTImageProcessor

    detector = GSCForImageClassification.from_pretrained(make_tiny_model("resnet").float(), selection="fisher")
    images = torch.randn(6, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0))
    detector.fit_fisher([(images, torch.arange(6) % NUM_LABELS)])
    d = detector.fisher_diagonal.numel()
    channels = detector.model.config.hidden_sizes[-1]  # the final map is (channels, h, w)
    if processor:
        detector.image_processor = ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    detector.save_pretrained(tmp_path, save_base_model=True)
    n = {"one": 1, "d+3": d + 3, "d+channels": d + channels}[length]
    save_state({"fisher_diagonal": torch.ones(n)}, tmp_path / STATE_FILE)
    if processor:
        with pytest.raises(ValueError, match=rf"'fisher_diagonal' in .* has shape \({n},\), expected \({d},\)"):
            GSCForImageClassification.from_pretrained(tmp_path)
        return
    if length != "d+channels":
        with pytest.raises(ValueError, match=rf"'fisher_diagonal' in .* has shape \({n},\), but the feature .* has "
                                             rf"{channels} values per spatial position"):
            GSCForImageClassification.from_pretrained(tmp_path)
        return
    loaded = GSCForImageClassification.from_pretrained(tmp_path)  # a whole number of positions: known at the forward
    with pytest.raises(ValueError, match=rf"'fisher_diagonal' has shape \({n},\), but the feature .* has {d} coord"):
        loaded.score(images[:2])
    with pytest.raises(ValueError, match="'fisher_diagonal' has shape"):
        loaded(images[:2])


@pytest.mark.parametrize("method", ["kNN", "Mahalanobis", "VIM"])
def test_a_method_in_another_case_gets_a_did_you_mean(method, base_dir):
    from hf_gsc import AutoOODDetector
    from hf_gsc.detectors import get_detector

    expected = f"unknown method {method!r} \\(did you mean {method.lower()!r} instead of {method!r}\\?\\)"
    with pytest.raises(ValueError, match=expected):
        get_detector(method, make_tiny_model("vit"))
    with pytest.raises(ValueError, match=expected):
        AutoOODDetector.from_pretrained(base_dir, method=method)
