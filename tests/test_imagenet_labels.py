"""Label maps as real models carry them: ImageNet-1k's 1,000 names as transformers' configs hold them in ``id2label``
(``tests/fixtures/imagenet_1k_labels.json``; ``crane`` is class 134, the bird, and class 517, the machine), names that
differ only in case or spacing, and ``hf-gsc evaluate`` / ``Detector.fit`` on class folders of some of those classes.

The tiny model predicts one class (``goldfish``) for every image (its classifier is zero but for that class's bias),
so the right ID accuracy is the share of ``goldfish`` images, and any other mapping of the folders gives another."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import evaluate_argv
from PIL import Image

from hf_gsc.evaluation.errors import InputError


NAMES = json.loads((Path(__file__).parent / "fixtures" / "imagenet_1k_labels.json").read_text())["names"]
TENCH, GOLDFISH = NAMES[0], NAMES[1]
#: Images per class folder of each split: 3 goldfish and 1 tench in test, so the right accuracy is 75%.
COUNTS = {GOLDFISH: 3, TENCH: 1}


def test_the_fixture_is_imagenet_1k_as_configs_hold_it():
    assert len(NAMES) == 1000 and NAMES[0] == "tench, Tinca tinca" and NAMES[999].startswith("toilet tissue")
    assert [i for i, name in enumerate(NAMES) if name == "crane"] == [134, 517]
    assert len(set(NAMES)) == 999


def save_imagenet_vit(folder: Path, predicted: int = 1) -> Path:
    """A random 16 px RGB ViT with ImageNet-1k's 1,000 names in id2label (label2id as transformers builds it: one
    entry per name) that predicts class ``predicted`` for every image."""
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    torch.manual_seed(0)
    config = ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=32, num_labels=1000,
                       id2label=dict(enumerate(NAMES)), label2id={name: i for i, name in enumerate(NAMES)})
    model = ViTForImageClassification(config)
    with torch.no_grad():
        model.classifier.weight.mul_(1e-3)
        model.classifier.bias.zero_()
        model.classifier.bias[predicted] = 10.0
    model.save_pretrained(folder)
    ViTImageProcessorPil(do_resize=True, size={"height": 16, "width": 16}).save_pretrained(folder)
    return folder


def class_folders(root: Path, counts: dict[str, int], splits=("train", "validation", "test")) -> Path:
    rng = np.random.default_rng(0)
    for split in splits:
        for name, count in counts.items():
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    root = tmp_path_factory.mktemp("imagenet")
    ood = root / "ood"
    ood.mkdir()
    rng = np.random.default_rng(1)
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(ood / f"{i}.png")
    return {"model": str(save_imagenet_vit(root / "model")), "ood": str(ood),
            "id": str(class_folders(root / "id", COUNTS)),
            "crane": str(class_folders(root / "crane", {**COUNTS, "crane": 1}))}


def _argv(imagenet, id_data: str, output: Path, *extra: str) -> list[str]:
    return ["--model", imagenet["model"], "--id-dataset", id_data, "--ood-dataset", f"noise={imagenet['ood']}",
            "--methods", "msp,energy", "--output-dir", str(output), "--batch-size", "4", "--no-plots",
            "--no-selection", *extra]


def test_evaluate_on_imagenet_names_maps_the_class_folders_and_reports_the_right_accuracy(imagenet, tmp_path):
    results = evaluate_argv(_argv(imagenet, imagenet["id"], tmp_path / "run"))
    check = results["label_check"]
    assert check["mapped_by"] == "name" and check["model_index"] == {GOLDFISH: 1, TENCH: 0}
    assert results["id_accuracy"] == pytest.approx(COUNTS[GOLDFISH] / sum(COUNTS.values()))
    assert "ID test accuracy: 75.00%" in (tmp_path / "run" / "results.md").read_text()


def test_a_name_the_model_holds_twice_is_refused_naming_both_classes_and_the_way_out(imagenet, tmp_path):
    with pytest.raises(InputError, match=r"'crane' is model class 134 \('crane'\) and 517 \('crane'\).*"
                                         r"--label-map crane=134"):
        evaluate_argv(_argv(imagenet, imagenet["crane"], tmp_path / "refused"))
    # The way out: the crane folder's class by index. Crane images are not goldfish: 3 right of 5.
    results = evaluate_argv(_argv(imagenet, imagenet["crane"], tmp_path / "run", "--label-map", "crane=134"))
    assert results["label_check"]["model_index"] == {GOLDFISH: 1, TENCH: 0, "crane": 134}
    assert results["id_accuracy"] == pytest.approx(3 / 5)


def test_fit_on_class_folders_of_imagenet_names(imagenet):
    from hf_gsc import AutoOODDetector
    from hf_gsc.utils.image_data import image_rows

    detector = AutoOODDetector.from_pretrained(imagenet["model"], method="mahalanobis")  # fits per-class statistics
    with pytest.raises(ValueError, match=r"id_train_batches.*'crane' is model class 134 \('crane'\) and 517"):
        detector.fit(str(Path(imagenet["crane"]) / "train"))
    # Unique names are labelled by name, with the model's indices (what fit reads), from id2label's names.
    rows = image_rows(str(Path(imagenet["id"]) / "train"), "id_train_batches", NAMES, need_labels=True)
    assert sorted(rows.labels) == [0, 1, 1, 1]
    assert all(label == (1 if GOLDFISH in str(path) else 0) for path, label in zip(rows.sources, rows.labels))


def test_names_that_differ_only_in_case_or_spacing():
    from hf_gsc.utils.label_names import ambiguous_names, label_mapping

    model = ["Crane", "crane", "sea lion", "Sea_Lion ", "dog"]
    assert label_mapping(["crane", "Crane", "dog"], model) == [1, 0, 4]  # spelled exactly as one: that one
    assert label_mapping(["DOG"], model) == [4]  # unique by the compared form
    assert label_mapping(["sea-lion"], model) is None  # names two classes, spelled as neither
    assert ambiguous_names(["sea-lion", "dog"], model) == {"sea-lion": [2, 3]}
    assert ambiguous_names(["sea-lion"], model, {"sea-lion": "2"}) == {}
    assert label_mapping(["sea-lion"], model, {"sea-lion": "3"}) == [3]


def test_generic_label_names_are_not_matched_by_name():
    from hf_gsc.evaluation.labels import model_class_names

    config = type("Config", (), {"id2label": {i: f"LABEL_{i}" for i in range(1000)}})()
    assert model_class_names(config) is None
