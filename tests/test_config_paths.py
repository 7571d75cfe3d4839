"""One path from keyword arguments to a config for every method; passive configs (detectors pickle and copy); a
threshold that belongs to the settings and fitted state it was calibrated for; a calibration record that names what
was read; GSC shaped like its siblings (its output's first fields, ``Trainer.predict``, top-level configs).

Tiny float64 ViT of ``test_detectors.Setting`` (balanced, 128 fitting samples with labels): scores of a copy are
compared with ``torch.equal`` (same process, same device, same batch)."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
import warnings

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model
from PIL import Image
from test_detectors import MODEL_SPECIFIC, Setting
from test_pipeline import _trainer_predict
from transformers import ViTImageProcessor

import hf_gsc
from hf_gsc import DETECTORS, AutoOODDetector, DetectorConfig
from hf_gsc.detectors import get_detector


ALL_METHODS = sorted(DETECTORS)
DROPPED = "its threshold was dropped because"


@pytest.fixture(scope="module")
def setting() -> Setting:
    return Setting("vit")


def _arch(method: str) -> str:
    """The tiny ViT, or for a method that a ViT refuses (``MODEL_SPECIFIC``: BATS) the first architecture it applies to."""
    archs = MODEL_SPECIFIC.get(method, ("vit",))
    return "vit" if "vit" in archs else archs[0]


def _pixels(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)


def _calibrated(setting: Setting, method: str, **hyperparameters) -> hf_gsc.OODDetector:
    """A fitted detector calibrated on 100 random images (no small-sample warning)."""
    detector = get_detector(method, setting.model, **hyperparameters)
    if detector.needs_fit:
        detector.fit(setting.batches())
    detector.calibrate(_pixels(100, seed=11))
    return detector


# ----------------------------------------------------------------------------- pickle and deepcopy
@pytest.mark.parametrize("method", ALL_METHODS)
def test_every_detector_pickles_and_deepcopies_with_its_scores_verdicts_and_threshold(setting, method):
    detector = _calibrated(setting if _arch(method) == "vit" else Setting(_arch(method)), method)
    expected = detector(setting.x_test)
    for twin in (pickle.loads(pickle.dumps(detector)), copy.deepcopy(detector)):
        out = twin(setting.x_test)
        assert torch.equal(out.ood_score, expected.ood_score), method
        assert torch.equal(out.is_ood, expected.is_ood), method
        assert twin.config.threshold == detector.config.threshold and twin.config == detector.config
        assert twin.config is not detector.config


# ----------------------------------------------------------------------------- one path from keywords to a config
@pytest.mark.parametrize("method", ALL_METHODS)
def test_every_method_takes_the_same_keywords_and_refuses_the_same_mistakes(method):
    model = make_tiny_model(_arch(method))
    cls = DETECTORS[method]
    settings = cls.config_class.setting_names()
    builders = {"constructor": lambda **kwargs: cls(model, **kwargs),
                "get_detector": lambda **kwargs: get_detector(method, model, **kwargs),
                "AutoOODDetector": lambda **kwargs: AutoOODDetector.from_pretrained(model, method=method, **kwargs)}
    for how, build in builders.items():
        detector = build(threshold=0.5, base_model_name_or_path="user/elsewhere")
        assert detector.config.threshold == 0.5 and detector.config.base_model_name_or_path == "user/elsewhere", how
        if settings:  # a misspelt setting: TypeError naming the one meant
            with pytest.raises(TypeError, match=f"did you mean (the hyperparameter )?{settings[0]!r}"):
                build(**{settings[0] + "x": 1})
        with pytest.raises(TypeError, match=r"unknown (hyperparameters|keyword arguments) \['no_such_setting'\]"):
            build(no_such_setting=1)
        with pytest.raises(ValueError, match="threshold must be a finite number"):  # a value of the wrong type
            build(threshold="high")
        other = DETECTORS["knn" if method != "knn" else "msp"].config_class()
        with pytest.raises(TypeError, match=f"config must be a {cls.config_class.__name__}"):
            build(config=other)


def test_a_setting_of_the_wrong_type_is_a_value_error_naming_it():
    model = make_tiny_model("vit")
    for method, name in (("knn", "k"), ("gsc", "mask_ratio"), ("energy", "temperature")):
        with pytest.raises(ValueError, match=rf"\.{name} must be"):
            get_detector(method, model, **{name: "five"})


def test_the_saved_form_is_the_configs_own_and_its_keys_come_from_the_field_kinds():
    config = hf_gsc.KNNConfig(k=7, threshold=1.5)
    values = config.to_dict()
    assert tuple(values) == DetectorConfig.saved_keys()
    assert values["hyperparameters"] == {"bank_dtype": "float32", "bank_fraction": 1.0, "k": 7} and values["method"] == "knn"
    assert DetectorConfig.from_dict(values) == config
    with pytest.raises(ValueError, match="holds 'knn' settings, not GSCConfig"):
        hf_gsc.GSCConfig.from_dict(values)


def test_every_methods_config_is_exported_at_the_top_level():
    for cls in DETECTORS.values():
        assert getattr(hf_gsc, cls.config_class.__name__) is cls.config_class
        assert cls.config_class.__name__ in hf_gsc.__all__
    assert hf_gsc.GSCForImageClassification is hf_gsc.GSCDetector is DETECTORS["gsc"]


# ----------------------------------------------------------------------------- a threshold and what it depends on
def test_the_calibration_record_holds_what_the_threshold_depends_on(setting):
    detector = _calibrated(setting, "knn", k=3)
    record = detector.config.calibration
    assert record["settings"] == {"bank_dtype": "float32", "bank_fraction": 1.0, "k": 3}
    assert record["fitted_state"].startswith("sha256:") and len(record["fitted_state"]) == 71
    assert _calibrated(setting, "msp").config.calibration["fitted_state"] is None


def test_a_load_with_other_settings_drops_the_threshold_and_an_unchanged_load_keeps_it(setting, tmp_path):
    for method, changed in (("knn", {"k": 5}), ("gsc", {"mask_ratio": 0.5})):
        detector = _calibrated(setting, method, **({"k": 3} if method == "knn" else {}))
        detector.save_pretrained(tmp_path / method)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            same = AutoOODDetector.from_pretrained(tmp_path / method, model=setting.model)
        assert same.config.threshold == detector.config.threshold
        assert torch.equal(same(setting.x_test).is_ood, detector(setting.x_test).is_ood)
        with pytest.warns(UserWarning, match=f"{DROPPED} {next(iter(changed))}") as caught:
            other = AutoOODDetector.from_pretrained(tmp_path / method, model=setting.model, **changed)
            assert other.config.threshold is None and other.config.calibration is None
            assert other(setting.x_test).is_ood is None  # no second warning: the one above said it
        assert len(caught) == 1, [str(w.message) for w in caught]


def test_a_load_of_another_fitted_state_drops_the_threshold(setting, tmp_path):
    detector = _calibrated(setting, "knn", k=3)
    detector.save_pretrained(tmp_path)
    refitted = get_detector("knn", setting.model, k=3)
    refitted.fit(setting.batches(limit=64))
    from hf_gsc.settings.config import STATE_FILE
    from hf_gsc.storage.saved_format import save_state

    save_state(refitted.fitted_state(), tmp_path / STATE_FILE)
    with pytest.warns(UserWarning, match=f"{DROPPED} the fitted state changed since it was calibrated"):
        loaded = AutoOODDetector.from_pretrained(tmp_path, model=setting.model)
    assert loaded.config.threshold is None


def test_a_setting_assigned_after_calibration_or_a_refit_drops_the_threshold(setting):
    gsc = _calibrated(setting, "gsc")
    assert gsc(setting.x_test).is_ood is not None  # a forward that checked the config: the next one sees assignments
    gsc.config.mask_ratio = 0.5
    with pytest.warns(UserWarning, match=rf"{DROPPED} mask_ratio \(0.05 -> 0.5\) changed since it was calibrated"):
        assert gsc(setting.x_test).is_ood is None
    knn = _calibrated(setting, "knn", k=3)
    with pytest.warns(UserWarning, match=f"{DROPPED} the fitted state changed since it was calibrated"):
        knn.fit(setting.batches(limit=64))
    assert knn.config.threshold is None
    knn = _calibrated(setting, "knn", k=3)
    knn.fit(setting.batches())  # the same data: the same fitted state, the threshold still holds
    assert knn.config.threshold is not None and knn(setting.x_test).is_ood is not None
    knn.config.k = 5  # read when scoring: honoured, and the threshold calibrated at k=3 dropped
    with pytest.warns(UserWarning, match=rf"{DROPPED} k \(3 -> 5\) changed since it was calibrated"):
        out = knn(setting.x_test)
    assert out.is_ood is None and torch.equal(out.ood_score, get_detector("knn", setting.model, k=5).fit(
        setting.batches()).score(setting.x_test))
    knn.config.k = 500  # more neighbours than the bank holds: refused before the next score, and undone
    with pytest.raises(ValueError, match="k=500 neighbours"):
        knn(setting.x_test)
    assert knn.config.k == 5
    knn.config.bank_fraction = 0.5  # decides the fitted bank: refused and undone
    with pytest.raises(ValueError, match="assignment is undone"):
        knn(setting.x_test)
    assert knn.config.bank_fraction == 1.0
    react = _calibrated(setting, "react")
    react.config.percentile = 50.0  # what the fit computed depends on it: refused, undone, the threshold kept
    with pytest.raises(ValueError, match="assignment is undone"):
        react(setting.x_test)
    assert react.config.percentile == 90.0 and react(setting.x_test).is_ood is not None
    adascale = _calibrated(setting, "adascale_a")
    assert adascale(setting.x_test).is_ood is not None
    with pytest.raises(TypeError):  # a pair is assigned whole (which the detector sees), never edited in place
        adascale.config.percentile[0] = 70.0
    adascale.config.percentile = [70.0, 80.0]  # assigned whole: seen, and (a fit setting) refused and undone
    with pytest.raises(ValueError, match="assignment is undone"):
        adascale(setting.x_test)
    assert adascale.config.percentile == (75.0, 85.0) and adascale(setting.x_test).is_ood is not None


def test_a_folder_saved_today_loaded_with_another_setting_drops_its_threshold():
    from test_saved_today import FIXTURES

    with pytest.warns(UserWarning, match=rf"{DROPPED} k \(3 -> 5\) changed since it was calibrated"):
        knn = AutoOODDetector.from_pretrained(str(FIXTURES / "knn"), k=5)
    assert knn.config.threshold is None
    with pytest.warns(UserWarning, match=rf"{DROPPED} mask_ratio \(0.1 -> 0.5\) changed since it was calibrated"):
        gsc = AutoOODDetector.from_pretrained(str(FIXTURES / "gsc"), mask_ratio=0.5)
    assert gsc.config.threshold is None


# ----------------------------------------------------------------------------- what the calibration read
def _image_folder(folder, n: int, seed: int):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


@pytest.mark.filterwarnings("ignore:calibrate. .* ID validation samples is too few")
def test_the_calibration_record_names_what_was_read(setting, tmp_path):
    import datasets

    detector = get_detector("energy", setting.model)
    detector.image_processor = ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    plain = _image_folder(tmp_path / "data" / "test", 4, seed=0)  # a folder called test, read as it is
    detector.calibrate(plain)
    assert detector.config.calibration["source"] == f"folder {plain.resolve()}"
    assert detector.config.calibration["split"] is None
    detector.calibrate(_pixels(4, seed=1))
    assert detector.config.calibration["source"] == "tensors given by the caller"
    assert detector.config.calibration["split"] is None
    root = tmp_path / "root"
    _image_folder(root / "train", 3, seed=2), _image_folder(root / "validation", 5, seed=3)
    detector.calibrate(root)
    record = detector.config.calibration
    assert record["source"] == f"split 'validation' of dataset root {root.resolve()}"
    assert record["split"] == "validation" and record["num_samples"] == 5
    # Saved as a push writes it: the record names the folder, not the local path.
    from hf_gsc.storage.saving import save_detector

    save_detector(detector, tmp_path / "pushed", repo_id="user/energy")
    pushed = json.loads((tmp_path / "pushed" / "detector_config.json").read_text())["calibration"]
    assert pushed["source"] == "split 'validation' of dataset root root (a local path, not published)"
    assert str(tmp_path) not in (tmp_path / "pushed" / "detector_config.json").read_text()
    dataset = datasets.Dataset.from_dict({"image": [Image.open(p) for p in sorted(plain.iterdir())]})
    detector.calibrate(dataset)
    assert detector.config.calibration["source"] == "datasets.Dataset (4 rows)"
    assert detector.config.calibration["split"] is None


# ----------------------------------------------------------------------------- GSC like its siblings
def test_trainer_predict_gives_logits_ood_score_is_ood_first_for_gsc_as_for_knn(setting, tmp_path):
    model = make_tiny_model("vit").float()
    pixel_values = _pixels(6, seed=3).float()
    layouts = {}
    for method in ("gsc", "knn"):
        detector = get_detector(method, model)
        if detector.needs_fit:
            detector.fit([(x.float(), y) for x, y in setting.batches()])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 6 calibration samples
            detector.calibrate(pixel_values)
        prediction = _trainer_predict(detector, pixel_values, tmp_path / method)
        expected = detector(pixel_values)
        logits, ood_score, is_ood = prediction.predictions[:3]
        np.testing.assert_allclose(logits, expected.logits.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(ood_score, expected.ood_score.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(is_ood, expected.is_ood.numpy())
        layouts[method] = [field.name for field in dataclasses.fields(type(expected))][1:4]
    assert layouts["gsc"] == layouts["knn"] == ["logits", "ood_score", "is_ood"]
    assert issubclass(hf_gsc.GSCOutput, hf_gsc.OODDetectorOutput)
