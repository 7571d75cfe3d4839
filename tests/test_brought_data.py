"""Conformance of every entry point on the data users bring.

Data shapes: class folders (``train/``, ``validation/``, ``test/`` of one folder per class), and a ``DatasetDict``
saved to disk under each popular column schema (``image`` / ``label``, ``picture`` / ``cls``, ``img`` / ``label``,
``image`` / ``labels``, and CIFAR-100's ``img`` / ``fine_label`` with a ``coarse_label``, read with
``--label-column fine_label``). Images: grey PNG, 16-bit PNG, an EXIF-turned JPEG, a CMYK JPEG, in every class of
every split. Entry points: ``hf-gsc evaluate``, ``fit`` (a method without labels and one with per-class statistics),
``calibrate``, the pipeline, and ``save_pretrained`` / ``from_pretrained``.

The same images in every shape must give the same labels (the model's classes, by name), the same scores and the same
fitted state; the pipeline serves each file with the score the evaluation gave it. One tiny RGB ViT (cat, dog,
bird); each test runs in seconds.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from conftest import evaluate_argv
from PIL import Image
from safetensors.torch import load_file


#: The model's classes, in its id2label order.
CLASSES = ["cat", "dog", "bird"]
#: The folders' class names as users spell them (mapped to the model's by name).
FOLDERS = {"cat": "Cat", "dog": "dog", "bird": "BIRD"}
SPLITS = ("train", "validation", "test")
ORIENTATION = 0x0112
#: Schemas of a saved DatasetDict: (image column, label column, extra ClassLabel column, evaluate's extra flags).
SCHEMAS = {
    "image/label": ("image", "label", None, ()),
    "picture/cls": ("picture", "cls", None, ()),
    "img/label": ("img", "label", None, ()),
    "image/labels": ("image", "labels", None, ()),
    "img/fine_label": ("img", "fine_label", "coarse_label", ("--label-column", "fine_label")),
}


def _pixels(rng: np.random.Generator, size: tuple[int, int], channels: int) -> np.ndarray:
    height, width = size
    return rng.integers(0, 256, (height, width, channels) if channels > 1 else (height, width), dtype=np.uint8)


def _save(kind: str, path: Path, rng: np.random.Generator) -> Path:
    """One image of ``kind`` at ``path`` (suffix added); different content every call."""
    if kind == "grey":
        path = path.with_suffix(".png")
        Image.fromarray(_pixels(rng, (20, 20), 1), "L").save(path)
    elif kind == "png16":
        path = path.with_suffix(".png")
        Image.fromarray(rng.integers(0, 65536, (20, 20), dtype=np.uint16)).save(path)
    elif kind == "exif":
        path = path.with_suffix(".jpg")
        exif = Image.Exif()
        exif[ORIENTATION] = 6  # read turned by a quarter: 24 x 16 becomes 16 x 24
        Image.fromarray(_pixels(rng, (16, 24), 3)).save(path, quality=95, exif=exif)
    else:
        path = path.with_suffix(".jpg")
        Image.fromarray(_pixels(rng, (20, 20), 3)).convert("CMYK").save(path, quality=95)
    return path


KINDS = ("grey", "png16", "exif", "cmyk")


def _check_kinds(paths: list[Path]) -> None:
    """The files are what they claim: the modes and orientation a reader meets."""
    modes = {Image.open(path).mode for path in paths}
    assert {"L", "I;16", "RGB", "CMYK"} <= modes or {"L", "I", "RGB", "CMYK"} <= modes
    assert any(Image.open(path).getexif().get(ORIENTATION) == 6 for path in paths)


@pytest.fixture(scope="module")
def brought(tmp_path_factory):
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    root = tmp_path_factory.mktemp("brought")
    torch.manual_seed(0)
    config = ViTConfig(image_size=16, patch_size=8, num_channels=3, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=32, num_labels=3,
                       id2label=dict(enumerate(CLASSES)), label2id={name: i for i, name in enumerate(CLASSES)})
    model = ViTForImageClassification(config)
    with torch.no_grad():
        model.classifier.weight.mul_(20.0)  # distinct predictions and scores
    model.save_pretrained(root / "model")
    ViTImageProcessorPil(size={"height": 16, "width": 16}).save_pretrained(root / "model")

    rng = np.random.default_rng(0)
    files: dict[str, list[tuple[Path, str]]] = {split: [] for split in SPLITS}  # (file, model class)
    for split in SPLITS:
        for name in CLASSES:
            folder = root / "folders" / split / FOLDERS[name]
            folder.mkdir(parents=True)
            for index, kind in enumerate(KINDS * 2):  # 8 images per class and split
                files[split].append((_save(kind, folder / f"{kind}_{index}", rng), name))
    _check_kinds([path for path, _ in files["test"]])
    ood = root / "ood"
    ood.mkdir()
    for index, kind in enumerate(KINDS * 2):
        _save(kind, ood / f"{kind}_{index}", rng)
    saved = {}
    for schema, (image, label, extra, _) in SCHEMAS.items():
        features = {image: datasets.Image(), label: datasets.ClassLabel(names=CLASSES)}
        if extra is not None:
            features[extra] = datasets.ClassLabel(names=["animal", "thing"])
        splits = {}
        for split, rows in files.items():
            columns = {image: [str(path) for path, _ in rows], label: [CLASSES.index(name) for _, name in rows]}
            if extra is not None:
                columns[extra] = [0] * len(rows)
            splits[split] = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
        saved[schema] = root / schema.replace("/", "_")
        datasets.DatasetDict(splits).save_to_disk(saved[schema])
    return {"root": root, "model": str(root / "model"), "files": files, "ood": str(ood),
            "folders": str(root / "folders"), "saved": saved}


def _evaluate(brought, id_data: str, output: Path, *extra: str, batch_size: int = 8
              ) -> tuple[dict, dict[str, torch.Tensor]]:
    results = evaluate_argv(["--model", brought["model"], "--id-dataset", id_data, "--ood-dataset",
                             f"photos={brought['ood']}", "--methods", "energy", "--output-dir", str(output),
                             "--batch-size", str(batch_size), "--no-plots", "--no-selection", *extra])
    return results, load_file(str(output / "scores" / "energy" / "id_test.safetensors"))


def _pairs(scores: dict[str, torch.Tensor]) -> list[tuple[int, float]]:
    """(label, score) of every ID test row, sorted: the same images in any row order give the same list."""
    return sorted(zip(scores["labels"].tolist(), scores["ood_score"].tolist()))


@pytest.fixture(scope="module")
def folder_run(brought, tmp_path_factory):
    return _evaluate(brought, brought["folders"], tmp_path_factory.mktemp("folders"))


def test_evaluate_on_class_folders_labels_by_name(brought, folder_run):
    results, scores = folder_run
    assert results["label_check"]["mapped_by"] == "name"
    expected = sorted(CLASSES.index(name) for _, name in brought["files"]["test"])
    assert sorted(scores["labels"].tolist()) == expected
    assert results["split_sizes"]["id_test"] == len(brought["files"]["test"])


@pytest.mark.parametrize("schema", list(SCHEMAS))
def test_evaluate_on_each_schema_gives_the_class_folders_results(brought, folder_run, schema, tmp_path):
    results, scores = _evaluate(brought, str(brought["saved"][schema]), tmp_path / "run", *SCHEMAS[schema][3])
    assert _pairs(scores) == _pairs(folder_run[1])
    assert results["id_accuracy"] == folder_run[0]["id_accuracy"]
    assert results["methods"]["energy"]["ood"] == folder_run[0]["methods"]["energy"]["ood"]


def test_the_pipeline_serves_each_file_with_the_evaluations_score(brought, tmp_path):
    import transformers

    from hf_gsc import AutoOODDetector

    # Rows in file order; one image per forward, as the pipeline serves (a batch's float sums round otherwise).
    _, scores = _evaluate(brought, str(brought["saved"]["image/labels"]), tmp_path / "run", batch_size=1)
    detector = AutoOODDetector.from_pretrained(brought["model"], method="energy")
    pipeline = transformers.pipeline("ood-image-classification", model=detector)
    served = torch.tensor([pipeline(str(path))["ood_score"] for path, _ in brought["files"]["test"]])
    assert torch.equal(served, scores["ood_score"].float())


def _shapes(brought) -> dict[str, dict]:
    """Each shape as fit / calibrate take it: the class-folder root, each saved DatasetDict (read at the split they
    choose), with the keywords its schema needs."""
    shapes = {"folders": {"data": brought["folders"], "keywords": {}}}
    for schema, (image, label, extra, _) in SCHEMAS.items():
        keywords = {"label_column": label} if extra is not None else {}
        shapes[schema] = {"data": datasets.load_from_disk(brought["saved"][schema]), "keywords": keywords}
    return shapes


def test_fit_and_calibrate_on_every_shape_agree(brought):
    from hf_gsc import AutoOODDetector

    fitted = {}
    for name, shape in _shapes(brought).items():
        knn = AutoOODDetector.from_pretrained(brought["model"], method="knn", k=2)
        knn.fit(shape["data"], **shape["keywords"])
        threshold = knn.calibrate(shape["data"], **shape["keywords"])
        conjnorm = AutoOODDetector.from_pretrained(brought["model"], method="conjnorm")  # per-class statistics
        conjnorm.fit(shape["data"], **shape["keywords"])
        fitted[name] = (torch.sort(knn.bank, dim=0).values, threshold, conjnorm.prototypes)
    reference = fitted.pop("folders")
    for name, (bank, threshold, prototypes) in fitted.items():
        assert torch.equal(bank, reference[0]), name
        assert threshold == reference[1], name
        assert torch.allclose(prototypes, reference[2], rtol=0, atol=1e-6), name


def test_a_cifar100_schema_without_the_label_column_is_refused_for_per_class_fits(brought):
    from hf_gsc import AutoOODDetector

    data = datasets.load_from_disk(brought["saved"]["img/fine_label"])
    with pytest.raises(ValueError, match=r"several ClassLabel columns \(fine_label, coarse_label.*label_column="):
        AutoOODDetector.from_pretrained(brought["model"], method="conjnorm").fit(data)


def test_save_and_load_serve_the_same_scores_on_every_kind_of_image(brought, tmp_path):
    import transformers

    from hf_gsc import AutoOODDetector

    detector = AutoOODDetector.from_pretrained(brought["model"], method="knn", k=2)
    detector.fit(brought["folders"])
    detector.calibrate(brought["folders"])
    detector.save_pretrained(tmp_path / "saved")
    loaded = AutoOODDetector.from_pretrained(tmp_path / "saved")
    paths = [str(path) for path, _ in brought["files"]["test"]]
    before = [transformers.pipeline("ood-image-classification", model=detector)(path) for path in paths]
    after = [transformers.pipeline("ood-image-classification", model=loaded)(path) for path in paths]
    assert [r["ood_score"] for r in after] == [r["ood_score"] for r in before]
    assert [r["is_ood"] for r in after] == [r["is_ood"] for r in before]
