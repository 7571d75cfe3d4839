"""Tests of the shipped reference checkpoints and of scripts/train_reference_models.py."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageClassification

from hf_gsc.data import collate, fashion_mnist, load_image_processor, prepare_dataset, reference_model_path
from hf_gsc.data.arrays import to_dataset


SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_reference_models.py"
#: Test-accuracy targets of issue #3 (full 10,000-image test set, recorded by the script; each
#: shipped model reached its target in a <= 14-minute run, see docs/data.md).
TARGETS = {"resnet": 0.91, "vit": 0.87, "swin": 0.87}
#: Recomputed here on the first 1,000 test images: allow for subset noise (1 s.d. ~1 point).
SUBSET = 1_000
SUBSET_SLACK = 0.03


def load_script():
    spec = importlib.util.spec_from_file_location("train_reference_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return load_script()


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_shipped_checkpoint_files_and_results(arch):
    path = reference_model_path(arch)
    for name in ("config.json", "model.safetensors", "preprocessor_config.json", "training_results.json"):
        assert (path / name).is_file(), name
    assert (path / "model.safetensors").stat().st_size < 8 * 2**20  # "a few MB"
    results = json.loads((path / "training_results.json").read_text())
    assert results["arch"] == arch and results["benchmark"] == "fmnist-ood"
    assert results["train_images"] == 55_000 and results["test_images"] == 10_000
    assert results["test_accuracy"] >= TARGETS[arch]
    assert results["train_time_s"] <= 15 * 60


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_shipped_checkpoint_accuracy(arch):
    """Reload with the public loaders and re-measure accuracy through the data pipeline."""
    path = reference_model_path(arch)
    model = AutoModelForImageClassification.from_pretrained(path).eval()
    assert [model.config.id2label[i] for i in range(10)] == list(fashion_mnist.LABEL_NAMES)
    assert model.config.num_channels == 1
    test = fashion_mnist.load_arrays()["test"]
    ds = prepare_dataset(to_dataset(test.images[:SUBSET], test.labels[:SUBSET]), load_image_processor(path),
                         num_channels=1, dataset_name="fashion_mnist/test")
    correct = 0
    with torch.no_grad():
        for batch in torch.utils.data.DataLoader(ds, batch_size=500, collate_fn=collate):
            correct += int((model(pixel_values=batch["pixel_values"]).logits.argmax(-1) == batch["label"]).sum())
    assert correct / SUBSET >= TARGETS[arch] - SUBSET_SLACK


def test_saved_processor_matches_training_normalisation(script):
    """Inference through AutoImageProcessor must see exactly the tensors training saw."""
    images = fashion_mnist.load_arrays()["test"].images[:8]
    processor = load_image_processor(reference_model_path("resnet"))
    processed = processor([Image.fromarray(im, mode="L") for im in images], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(processed, script.to_pixel_values(images), atol=1e-5, rtol=1e-5)


def test_augment_keeps_shape_and_content(script):
    x = script.to_pixel_values(fashion_mnist.load_arrays()["test"].images[:16])
    out = script.augment(x, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    # Each augmented image is a shifted (<= 2 px) and maybe mirrored copy: its pixel mass is close.
    background = -script.IMAGE_MEAN / script.IMAGE_STD
    mass_in, mass_out = (x - background).sum((1, 2, 3)), (out - background).sum((1, 2, 3))
    assert torch.all(mass_out <= mass_in + 1e-3) and torch.all(mass_out >= 0.8 * mass_in)
    assert not torch.equal(out, x)
    # pad=0: flips only, so every image is itself or its mirror.
    flipped_only = script.augment(x, torch.Generator().manual_seed(0), pad=0)
    same = (flipped_only == x).flatten(1).all(1)
    mirrored = (flipped_only == x.flip(3)).flatten(1).all(1)
    assert torch.all(same | mirrored) and mirrored.any() and same.any()


def test_learning_rate_schedule(script):
    assert script.learning_rate(1.0, 0.0) == 0.0
    assert script.learning_rate(1.0, 0.05) == pytest.approx(1.0)
    assert script.learning_rate(1.0, 1.0) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("arch", ["resnet", "swin"])
def test_script_smoke_run(script, tmp_path, arch):
    out = tmp_path / arch
    results = script.main(["--arch", arch, "--output-dir", str(out), "--epochs", "1", "--max-train-samples", "256",
                           "--max-eval-samples", "128", "--benchmark", "fmnist-openset", "--batch-size", "64"])
    assert results["steps"] == 4 and results["benchmark"] == "fmnist-openset"
    model = AutoModelForImageClassification.from_pretrained(out)
    assert model.config.num_labels == 6 and model.config.id2label[2] == "Dress"
    processor = load_image_processor(out)
    pixel_values = processor(Image.new("L", (28, 28)), return_tensors="pt")["pixel_values"]
    assert model(pixel_values=pixel_values).logits.shape == (1, 6)
    saved = json.loads((out / "training_results.json").read_text())
    assert saved["test_accuracy"] == results["test_accuracy"] and "torch" in saved["versions"]


@pytest.mark.parametrize("arch", sorted(TARGETS))
def test_openset_checkpoints_know_only_the_id_classes(arch):
    from hf_gsc.data import BENCHMARKS

    path = reference_model_path(arch, benchmark="fmnist-openset")
    model = AutoModelForImageClassification.from_pretrained(path)
    names = BENCHMARKS["fmnist-openset"].label_names
    assert [model.config.id2label[i] for i in range(model.config.num_labels)] == list(names)
    results = json.loads((path / "training_results.json").read_text())
    assert results["benchmark"] == "fmnist-openset" and results["train_time_s"] <= 15 * 60


def test_reference_model_path_errors():
    with pytest.raises(ValueError):
        reference_model_path("alexnet")
    with pytest.raises(ValueError):
        reference_model_path("vit", benchmark="cifar10")
