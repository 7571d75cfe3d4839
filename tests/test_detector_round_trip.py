"""Every registered detector as a first-class object: fit, calibrate, save, load (folder and loopback Hub), move,
score alone or in a bundle, and fail loudly on a wrong saved state. In-process against ``LoopbackHub.patch_client``.

The detectors are built on the balanced tiny ViT of ``test_detectors.Setting`` (64 fitting samples with labels, good
for every method); "identical" means ``torch.equal``, not close.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, NUM_LABELS
from hub_server import LoopbackHub
from PIL import Image
from safetensors.torch import load_file, save_file
from test_detectors import MODEL_SPECIFIC, Setting
from transformers import ViTImageProcessor

from hf_gsc import AutoOODDetector, DetectorBundle, GSCForImageClassification, OODDetector
from hf_gsc.detectors import DETECTORS, fit_together
from hf_gsc.settings.config import CONFIG_NAME, STATE_FILE


ALL_METHODS = sorted(DETECTORS)
BASE_REPO = "user/base-vit"
#: Samples to calibrate on: at least MIN_CALIBRATION_SAMPLES, so that calibrating does not warn.
NUM_CALIBRATION = 100
#: A Fisher-selection GSC is the GSC detector with fitted state (its ``fisher_diagonal``).
FISHER = {"selection": "fisher", "split_point": "penultimate"}


def _pixels(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)


class World:
    """One balanced tiny ViT (in memory, in a folder, and on the loopback Hub as ``user/base-vit``) and a fitted,
    calibrated detector of every method on it, built once per module; a method that does not apply to a ViT
    (``test_detectors.MODEL_SPECIFIC``: BATS) is built on the tiny ResNet instead (``user/base-resnet``)."""

    def __init__(self, root: Path, hub: LoopbackHub) -> None:
        self.setting = Setting("vit")
        self.model = self.setting.model
        self.root, self.hub = root, hub
        self.base_dir = root / "base-vit"
        self.settings = {"vit": self.setting}
        self.base_repos = {"vit": BASE_REPO}
        self._upload(self.model, BASE_REPO, self.base_dir)
        self.x_validation = _pixels(NUM_CALIBRATION, seed=7)
        self.x_test = self.setting.x_test
        self.detectors: dict[str, OODDetector] = {}
        for method in ALL_METHODS:
            detector = self.build(method)
            detector.calibrate(self.x_validation)
            self.detectors[method] = detector

    def _upload(self, model, repo_id: str, folder: Path) -> None:
        from huggingface_hub import HfApi

        model.save_pretrained(folder)
        api = HfApi(token=self.hub.token)
        api.create_repo(repo_id)
        api.upload_folder(repo_id=repo_id, folder_path=str(folder))

    def arch_of(self, method: str) -> str:
        """The tiny architecture ``method`` is built on: the ViT, or the first it applies to."""
        archs = MODEL_SPECIFIC.get(method, ("vit",))
        arch = "vit" if "vit" in archs else archs[0]
        if arch not in self.settings:
            self.settings[arch] = Setting(arch)
            self.base_repos[arch] = f"user/base-{arch}"
            self._upload(self.settings[arch].model, self.base_repos[arch], self.root / f"base-{arch}")
        return arch

    def model_of(self, method: str):
        return self.settings[self.arch_of(method)].model

    def base_repo_of(self, method: str) -> str:
        return self.base_repos[self.arch_of(method)]

    def build(self, method: str, fit: bool = True, **hyperparameters) -> OODDetector:
        """A detector on the shared model of its architecture whose base reference is the Hub copy (so that it can
        be pushed)."""
        setting = self.settings[self.arch_of(method)]
        detector = AutoOODDetector.from_pretrained(setting.model, method=method, **hyperparameters)
        detector.config.base_model_name_or_path = self.base_repos[self.arch_of(method)]
        if fit and detector.needs_fit:
            detector.fit(setting.batches())
        return detector


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("round_trip")
    with LoopbackHub() as hub, hub.patch_client(cache_dir=root / "cache", token=hub.token):
        yield World(root, hub)


def _same_output(loaded: OODDetector, detector: OODDetector, x: torch.Tensor) -> None:
    expected, got = detector(x), loaded(x)
    assert torch.equal(got.ood_score, expected.ood_score), (got.ood_score, expected.ood_score)
    assert expected.is_ood is not None and torch.equal(got.is_ood, expected.is_ood)
    assert torch.equal(got.logits, expected.logits)
    assert expected.p_value is not None and torch.equal(got.p_value, expected.p_value)


def _same_state(a: OODDetector, b: OODDetector) -> None:
    state_a, state_b = a.fitted_state(), b.fitted_state()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name].cpu(), state_b[name].cpu()), name


# ------------------------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("method", ALL_METHODS)
def test_save_load_and_hub_round_trip_is_identical(world, method, tmp_path):
    detector = world.detectors[method]
    assert detector.fitted and detector.config.threshold is not None
    assert detector.config.calibration["num_samples"] == NUM_CALIBRATION

    folder = tmp_path / method
    detector.save_pretrained(folder)
    saved = json.loads((folder / CONFIG_NAME).read_text())
    assert saved["method"] == method and saved["threshold"] == detector.config.threshold
    # The fitted tensors and, calibrated, the ID calibration scores (p-values).
    assert set(load_file(folder / STATE_FILE)) == {*detector.fitted_state(), "calibration_scores"}
    from_folder = AutoOODDetector.from_pretrained(folder, model=world.model_of(method))
    assert type(from_folder) is type(detector) and from_folder.method == method
    assert from_folder.hyperparameters == detector.hyperparameters
    _same_state(from_folder, detector)
    _same_output(from_folder, detector, world.x_test)

    repo_id = f"user/{method.replace('_', '-')}-tiny"
    detector.push_to_hub(repo_id)
    from_hub = AutoOODDetector.from_pretrained(repo_id)  # the base model comes from user/base-vit
    assert type(from_hub) is type(detector) and from_hub.model is not world.model_of(method)
    assert from_hub.config.base_model_name_or_path == world.base_repo_of(method)
    _same_state(from_hub, detector)
    _same_output(from_hub, detector, world.x_test)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_to_moves_fitted_buffers(world, method, tmp_path):
    """Fitted tensors are buffers: ``.to(dtype)`` converts them with the base model, and the moved detector
    still scores (float32 against the float64 original)."""
    detector = world.detectors[method]
    detector.save_pretrained(tmp_path)
    moved = AutoOODDetector.from_pretrained(tmp_path)  # its own copy of the base model (from user/base-vit)
    assert moved.dtype == torch.float64
    state = moved.fitted_state()
    buffers = dict(moved.named_buffers())
    for name, tensor in state.items():
        if name == "gradient_mass":  # GSC keeps it in the config: a number, not a buffer
            continue
        assert buffers.get(name) is tensor, f"{method}: fitted tensor {name!r} is not a registered buffer"
    returned = moved.to(torch.float32)
    assert returned is moved and moved.dtype == torch.float32
    for name in state:
        if name != "gradient_mass":
            assert getattr(moved, name).dtype == torch.float32, name
    scores = moved.score(world.x_test)
    assert torch.isfinite(scores).all()
    torch.testing.assert_close(scores.double(), detector.score(world.x_test), rtol=1e-3, atol=1e-3)


# -------------------------------------------------------------------------------------- alone == together
def test_alone_equals_bundle_of_every_method(world):
    """One bundle per base model: every method on the ViT, the model-specific ones on theirs."""
    by_arch: dict[str, dict[str, OODDetector]] = {}
    for method, detector in world.detectors.items():
        by_arch.setdefault(world.arch_of(method), {})[method] = detector
    assert {method for group in by_arch.values() for method in group} == set(ALL_METHODS)
    for arch, detectors in by_arch.items():
        bundle = DetectorBundle(dict(detectors))
        scores = bundle.scores(world.x_test)
        output = bundle(world.x_test)
        assert scores.keys() == set(detectors)
        for method, detector in detectors.items():
            alone = detector(world.x_test)
            assert torch.equal(scores[method], alone.ood_score), method
            assert torch.equal(output.ood_score[method], alone.ood_score), method
            assert torch.equal(output.is_ood[method], alone.is_ood), method
        assert torch.equal(output.logits, world.settings[arch].model(pixel_values=world.x_test).logits)


def test_fit_together_equals_fit_alone(world):
    fitted = [method for method in ALL_METHODS if DETECTORS[method].needs_fit is True and world.arch_of(method) == "vit"]
    assert {"knn", "vim", "mahalanobis", "gem", "she", "conjnorm", "dice", "react"} <= set(fitted)  # none missed
    together = {method: world.build(method, fit=False) for method in fitted}
    together["gsc_fisher"] = world.build("gsc", fit=False, **FISHER)
    alone_fisher = world.build("gsc", **FISHER)
    fit_together(list(together.values()), world.setting.batches())
    for method, detector in together.items():
        alone = alone_fisher if method == "gsc_fisher" else world.detectors[method]
        assert detector.fitted and detector.fitted_state(), method
        _same_state(detector, alone)
        assert torch.equal(detector.score(world.x_test), alone.score(world.x_test)), method


# ------------------------------------------------------------------------- GSC structural settings rebuild
UNCALIBRATED_GSC = pytest.mark.filterwarnings("ignore:detector 'gsc' has no threshold")
STRUCTURAL = [("split_point", "penultimate"), ("approximation", "exact"), ("approximation", "predicted_logit"),
              ("selection", "reverse"), ("selection", "random")]


@UNCALIBRATED_GSC
@pytest.mark.parametrize("name, value", STRUCTURAL, ids=[f"{n}={v}" for n, v in STRUCTURAL])
def test_assigning_a_structural_setting_rebuilds_gsc(world, name, value, tmp_path):
    detector = world.build("gsc")
    fresh = world.build("gsc", **{name: value})
    before = detector(world.x_test, output_short_circuit=True)
    setattr(detector.config, name, value)
    assert getattr(detector.config, name) == value
    after = detector(world.x_test, output_short_circuit=True)
    expected = fresh(world.x_test, output_short_circuit=True)
    assert after.features.shape == expected.features.shape
    assert torch.equal(after.ood_score, expected.ood_score)
    if name == "split_point":  # the vit feature changes from (B, 5, 16) tokens to the (B, 16) [CLS] input
        assert before.features.shape != after.features.shape
    detector.save_pretrained(tmp_path)
    loaded = GSCForImageClassification.from_pretrained(tmp_path, model=world.model)
    assert getattr(loaded.config, name) == value
    assert torch.equal(loaded.score(world.x_test), expected.ood_score)


@UNCALIBRATED_GSC
@pytest.mark.parametrize("name, value, match", [
    ("split_point", "not a path!", "dotted module path"),
    ("split_point", "vit.no_such_module", "no submodule 'no_such_module'"),
    ("approximation", "second_order", "approximation must be one of"),
    ("selection", "largest", "selection must be one of"),
])
def test_invalid_structural_value_raises_and_changes_nothing(world, name, value, match):
    detector = world.build("gsc")
    old = getattr(detector.config, name)
    before = detector(world.x_test, output_short_circuit=True)
    with pytest.raises(ValueError, match=match):
        setattr(detector.config, name, value)  # a value its field's check refuses: at once ...
        detector(world.x_test)  # ... one only the model can refuse: before the next forward, and undone
    assert getattr(detector.config, name) == old
    after = detector(world.x_test, output_short_circuit=True)
    assert after.features.shape == before.features.shape and torch.equal(after.ood_score, before.ood_score)


def test_fitted_fisher_refuses_a_new_split_point(world):
    detector = world.build("gsc", **FISHER)
    assert detector.fisher_diagonal is not None
    detector.config.split_point = "final_encoder_output"
    with pytest.raises(ValueError, match="fisher_diagonal belongs to the split point .* assignment is undone"):
        detector(world.x_test)
    assert detector.config.split_point == "penultimate"


def test_baseline_hyperparameters_are_read_only(world):
    detector = world.detectors["knn"]
    with pytest.raises(TypeError):
        detector.config.hyperparameters["k"] = 3
    with pytest.raises(AttributeError):
        detector.config.hyperparameters = {"k": 3}
    assert detector.hyperparameters == {"bank_dtype": "float32", "bank_fraction": 1.0, "k": 50}


# ----------------------------------------------------------------------------- saved state checked at load
D, K = 16, NUM_LABELS
#: method -> (tensor, a wrong shape for it) written into detector_state.safetensors.
WRONG_SHAPES = {
    "knn": ("bank", (64, D + 1)),
    "nnguide": ("bank_guide", (64, D + 1)),
    "mahalanobis": ("precision", (D, D + 1)),
    "gem": ("class_means", (K + 1, D)),
    "vim": ("origin", (D + 1,)),
    "react": ("threshold", (2,)),
    "dice": ("mean_features", (D - 1,)),
    "she": ("patterns", (K, D + 1)),
    "conjnorm": ("prototypes", (K, D - 1)),
    "gsc": ("fisher_diagonal", (D + 1,)),
    "mahalanobis_pp": ("class_means", (K + 1, D)),
    "rmds": ("background_precision", (D, D + 1)),
    "rmds_pp": ("background_mean", (D + 1,)),
}


def _saved(world, method: str, folder: Path) -> Path:
    detector = world.build("gsc", **FISHER) if method == "gsc" else world.detectors[method]
    detector.save_pretrained(folder)
    return folder / STATE_FILE


@pytest.mark.parametrize("method", sorted(WRONG_SHAPES))
def test_wrong_shape_fitted_tensor_fails_at_load(world, method, tmp_path):
    name, shape = WRONG_SHAPES[method]
    path = _saved(world, method, tmp_path)
    state = load_file(str(path))
    assert name in state and tuple(state[name].shape) != shape
    state[name] = torch.ones(shape, dtype=torch.float64)
    save_file(state, str(path))
    with pytest.raises(ValueError, match=rf"'{name}'.*shape \({shape[0]},") as caught:
        AutoOODDetector.from_pretrained(tmp_path, model=world.model)
    assert str(tuple(shape)) in str(caught.value)


@pytest.mark.parametrize("method", sorted(WRONG_SHAPES))
def test_missing_fitted_tensor_fails_at_load(world, method, tmp_path):
    name, _ = WRONG_SHAPES[method]
    path = _saved(world, method, tmp_path)
    state = {key: value for key, value in load_file(str(path)).items() if key != name}
    save_file(state, str(path))
    with pytest.raises(ValueError, match=rf"'{name}'.*missing"):
        AutoOODDetector.from_pretrained(tmp_path, model=world.model)


@pytest.mark.parametrize("method", sorted(WRONG_SHAPES))
def test_missing_state_file_fails_at_load(world, method, tmp_path):
    """A saved fitted detector (its config says which method; knn's threshold was calibrated on its bank) whose
    state file is gone must not load as a detector that is not fitted."""
    name, _ = WRONG_SHAPES[method]
    _saved(world, method, tmp_path).unlink()
    with pytest.raises(ValueError, match=rf"'{name}'"):
        AutoOODDetector.from_pretrained(tmp_path, model=world.model)


@pytest.mark.parametrize("bad, match", [(torch.full((64, D), float("nan")), "NaN"),
                                        (torch.ones(64, D, dtype=torch.int64), "floating point")])
def test_non_finite_or_integer_fitted_tensor_fails_at_load(world, tmp_path, bad, match):
    path = _saved(world, "knn", tmp_path)
    save_file({"bank": bad}, str(path))
    with pytest.raises(ValueError, match=rf"'bank'.*{match}"):
        AutoOODDetector.from_pretrained(tmp_path, model=world.model)


# --------------------------------------------------------------------------------- decisions and warnings
@pytest.mark.parametrize("method", ALL_METHODS)
def test_nan_score_is_ood(world, method, monkeypatch):
    detector = world.detectors[method]
    assert detector.config.threshold is not None
    if isinstance(detector, GSCForImageClassification):  # GSC's forward scores through step(), not score_batch()
        real_step = detector.step

        def step(batch):
            linearization, result = real_step(batch)
            ood_score = result.ood_score.clone()
            ood_score[1] = float("nan")
            return linearization, dataclasses.replace(result, ood_score=ood_score)

        monkeypatch.setattr(detector, "step", step)
    else:
        real_score_batch = detector.score_batch

        def score_batch(batch):
            scores = real_score_batch(batch).clone()
            scores[1] = float("nan")
            return scores

        monkeypatch.setattr(detector, "score_batch", score_batch)
    output = detector(world.x_test)
    assert torch.isnan(output.ood_score[1]) and torch.isfinite(output.ood_score[[0, 2]]).all()
    assert output.is_ood[1].item() is True


@pytest.mark.parametrize("method", ["gsc", "knn", "msp"])
def test_uncalibrated_forward_warns_once(world, method):
    detector = world.build(method)
    with pytest.warns(UserWarning, match="no threshold") as record:
        first = detector(world.x_test)
    assert first.is_ood is None and len([w for w in record if "no threshold" in str(w.message)]) == 1
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        second = detector(world.x_test)
    assert second.is_ood is None and not [w for w in again if "no threshold" in str(w.message)]
    assert torch.equal(first.ood_score, second.ood_score)


def test_calibrating_on_few_samples_warns(world):
    detector = world.build("energy")
    with pytest.warns(UserWarning, match="too few"):
        detector.calibrate(_pixels(NUM_CALIBRATION - 1, seed=3))
    assert detector.config.calibration["num_samples"] == NUM_CALIBRATION - 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        detector.calibrate(_pixels(NUM_CALIBRATION, seed=3))


# ------------------------------------------------------------------------------------- keywords and images
def test_mistyped_keyword_names_the_nearest_hyperparameter(world, tmp_path):
    with pytest.raises(TypeError, match="did you mean the hyperparameter 'mask_ratio'"):
        GSCForImageClassification.from_pretrained(world.base_dir, mask_ration=0.1)
    world.build("gsc").save_pretrained(tmp_path / "gsc")
    with pytest.raises(TypeError, match="did you mean the hyperparameter 'mask_ratio'"):
        AutoOODDetector.from_pretrained(tmp_path / "gsc", mask_ration=0.1)
    with pytest.raises(TypeError, match="did you mean the hyperparameter 'k'"):
        AutoOODDetector.from_pretrained(world.model, method="knn", kk=3)


@pytest.mark.parametrize("source", ["classifier", "saved"])
def test_mistyped_short_keyword_names_the_nearest_hyperparameter(world, tmp_path, source):
    folder = world.base_dir
    if source == "saved":
        folder = tmp_path / "knn"
        world.detectors["knn"].save_pretrained(folder)
    with pytest.raises(TypeError, match="'k'"):
        AutoOODDetector.from_pretrained(folder, method="knn", kk=3)


def _images(n: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)) for _ in range(n)]


@pytest.mark.parametrize("method", ["gsc", "knn"])
def test_calibrate_from_images_equals_from_pixel_values(world, method):
    import datasets

    processor = ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    images = _images(NUM_CALIBRATION)
    pixel_values = processor(images=images, return_tensors="pt")["pixel_values"]
    detector = world.detectors[method]
    detector.image_processor = processor
    try:
        expected = detector.calibrate(pixel_values)
        # Other batch sizes run other BLAS kernels (chosen by shape and CPU): the float64 scores, and so the
        # threshold (one of them), agree to about 1e-15, not bit for bit; 1e-9 is far below any real difference.
        expected = pytest.approx(expected, rel=1e-9, abs=1e-12)
        assert detector.calibrate(images, batch_size=7) == expected
        dataset = datasets.Dataset.from_dict({"image": images, "label": [i % NUM_LABELS for i in range(len(images))]},
                                             features=datasets.Features({"image": datasets.Image(),
                                                                         "label": datasets.Value("int64")}))
        assert detector.calibrate(dataset) == expected
        assert detector.config.calibration["num_samples"] == NUM_CALIBRATION
    finally:
        detector.image_processor = None
        detector.calibrate(world.x_validation)


# ------------------------------------------------------------------------------- pushing the base with it
def test_pushed_with_base_holds_no_local_path_and_can_be_pushed_again(world, tmp_path):
    detector = AutoOODDetector.from_pretrained(world.base_dir, method="knn", k=5)
    assert detector.config.base_model_name_or_path == str(world.base_dir)
    detector.fit(world.setting.batches())
    detector.calibrate(world.x_validation)
    with pytest.raises(ValueError, match="save_base_model=True"):
        detector.push_to_hub("user/knn-refused")
    detector.push_to_hub("user/knn-full", save_base_model=True)

    repo = world.hub.get_repo("user/knn-full")
    files = repo.commits[world.hub._resolve_revision(repo, "main")].files
    assert {CONFIG_NAME, STATE_FILE, "README.md", "model.safetensors", "config.json"} <= set(files)
    saved = json.loads(world.hub.read_file("user/knn-full", CONFIG_NAME))
    assert saved["base_model_name_or_path"] == "user/knn-full"
    for name in files:
        if name.endswith((".json", ".md")):
            text = world.hub.read_file("user/knn-full", name).decode()
            assert str(world.base_dir) not in text and str(world.root) not in text, name

    pulled = AutoOODDetector.from_pretrained("user/knn-full")
    assert pulled.config.base_model_name_or_path == "user/knn-full"
    _same_output(pulled, detector, world.x_test)
    pulled.push_to_hub("user/knn-again")  # no save_base_model: the base is user/knn-full
    again = json.loads(world.hub.read_file("user/knn-again", CONFIG_NAME))
    assert again["base_model_name_or_path"] == "user/knn-full"
    assert "model.safetensors" not in world.hub.get_repo("user/knn-again").commits[
        world.hub._resolve_revision(world.hub.get_repo("user/knn-again"), "main")].files
    _same_output(AutoOODDetector.from_pretrained("user/knn-again"), detector, world.x_test)


# ------------------------------------------------------------------------------------------- model card
@pytest.mark.parametrize("method", ["gsc", "knn", "odin", "vim"])
def test_model_card_names_method_hyperparameters_and_usage(world, method, tmp_path):
    detector = world.detectors[method]
    repo_id = f"user/card-{method}"
    detector.push_to_hub(repo_id)
    card = world.hub.read_file(repo_id, "README.md").decode()
    assert f"method `{method}`" in card
    assert f"ood-{method.replace('_', '-')}" in card  # the tag
    for name, value in detector.hyperparameters.items():
        assert f"| `{name}` | `{value}` |" in card, name
    assert f'pipeline("ood-image-classification", model="{repo_id}")' in card
    assert f'AutoOODDetector.from_pretrained("{repo_id}")' in card
    assert f"[`{BASE_REPO}`](https://huggingface.co/{BASE_REPO})" in card
    assert f"`{detector.config.threshold:.6g}`" in card  # as results.md writes it (the exact value: detector_config.json)
    detector.save_pretrained(tmp_path)
    for text in (card, (tmp_path / "README.md").read_text()):
        assert "github.com" not in text


@pytest.mark.parametrize("method", ["knn", "gsc"])
def test_base_model_reference_can_be_redirected_at_load(world, method, tmp_path):
    """Any saved detector whose base-model reference no longer resolves loads with base_model_name_or_path=...,
    as the error for a missing base says (the config fields every method has are keywords of from_pretrained)."""
    detector = AutoOODDetector.from_pretrained(world.base_dir, method=method, **({"k": 3} if method == "knn" else {}))
    if detector.needs_fit:
        detector.fit(world.setting.batches())
    detector.save_pretrained(tmp_path / "saved")
    moved = tmp_path / "moved"
    shutil.copytree(world.base_dir, moved)
    config = json.loads((tmp_path / "saved" / "detector_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (tmp_path / "saved" / "detector_config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="base_model_name_or_path="):
        AutoOODDetector.from_pretrained(tmp_path / "saved")
    loaded = AutoOODDetector.from_pretrained(tmp_path / "saved", base_model_name_or_path=str(moved))
    assert torch.equal(loaded.score(world.x_test), detector.score(world.x_test))


@pytest.mark.parametrize("method", ["dice", "vim", "gradnorm"])
def test_to_device_moves_the_linear_head_and_derived_tensors(world, method):
    """The penultimate methods' classifier copy and DICE's mask follow .to(device) (``meta`` stands in for a GPU):
    no per-batch copy to the features' device, no tensors left behind on the CPU."""
    import copy

    detector = copy.deepcopy(world.detectors[method]).to("meta")
    tensors = {"head": detector.head.weight, **dict(detector.named_buffers())}
    left = {name: t.device.type for name, t in tensors.items() if not name.startswith("model.") and t.device.type != "meta"}
    assert not left, left


@pytest.mark.parametrize("method", ALL_METHODS)
def test_a_detector_deep_copies_and_scores_the_same(world, method):
    """Read-only hyperparameters still copy (copy.deepcopy, as Trainer and model-averaging code do)."""
    import copy

    detector = world.detectors[method]
    twin = copy.deepcopy(detector)
    assert twin.hyperparameters == detector.hyperparameters
    assert torch.equal(twin.score(world.x_test), detector.score(world.x_test))


@pytest.mark.parametrize("method", ALL_METHODS)
def test_every_method_is_served_by_the_pipeline(world, method, tmp_path):
    """A saved detector of any method, loaded by transformers' pipeline from its folder, answers as the detector
    does on the same pixels (ood_score, is_ood, the method's name)."""
    import numpy as np
    import transformers
    from PIL import Image
    from transformers import ViTImageProcessor

    processor = ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    detector = world.detectors[method]
    detector.image_processor = processor
    try:
        detector.save_pretrained(tmp_path / method, save_base_model=True)
    finally:
        detector.image_processor = None
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (20, 20, 3), dtype=np.uint8)) for i in range(3)]
    served = transformers.pipeline("ood-image-classification", model=str(tmp_path / method))(images)
    expected = detector(processor(images=images, return_tensors="pt")["pixel_values"].to(torch.float64))
    assert [answer["method"] for answer in served] == [method] * 3
    # A score within rounding of the threshold is a tie that rounding decides (ASH-B's binarised features give many
    # equal scores, the threshold among them): is_ood is compared away from it.
    clear = [abs(score - detector.config.threshold) > 1e-9 * abs(detector.config.threshold)
             for score in expected.ood_score.tolist()]
    assert [a["is_ood"] for a, c in zip(served, clear) if c] == [o for o, c in zip(expected.is_ood.tolist(), clear) if c]
    torch.testing.assert_close(torch.tensor([answer["ood_score"] for answer in served], dtype=torch.float64),
                               expected.ood_score.double(), rtol=1e-6, atol=1e-6)
