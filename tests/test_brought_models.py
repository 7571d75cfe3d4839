"""Conformance of the models users bring: every entry point over a matrix of model kinds.

Kinds: transformers' ViT, ResNet, Swin and ConvNeXt (tiny random configurations) and timm's families
(``tests/timm_families.py``, as ``TimmWrapperForImageClassification``; skipped without timm, run by
``make test-timm``), each with an ImageNet-shaped label map of 1,000 generic class names. Each is saved as a model
folder with its own image processor (transformers' PIL processor; timm's ``TimmWrapperImageProcessor`` built from the
``pretrained_cfg`` in its ``config.json``, as a Hub checkpoint carries it).

Entry points: ``hf-gsc evaluate`` on class folders named by some of the 1,000 classes (its ID accuracy checked
against the model run directly), ``fit`` and ``calibrate`` on the same folder tree, the
``ood-image-classification`` pipeline (grey and RGB images; a grey image is converted to the channels the processor
normalises), ``save_pretrained`` / ``from_pretrained`` (same scores and threshold after the round trip).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import evaluate_argv
from timm_families import FAMILIES, import_timm, make_timm_model

from hf_gsc import AutoOODDetector


NUM_CLASSES = 1000
# ImageNet-1k's names as Hub classifiers' configs carry them ("crane" twice: 134 and 517)
ID2LABEL = dict(enumerate(json.loads((Path(__file__).parent / "fixtures" / "imagenet_1k_labels.json").read_text())["names"]))
FOLDER_CLASSES = [3, 500, 999]  # the ID folders' classes, named as the model names them
PER_CLASS = {"train": 4, "validation": 4, "test": 4}
IMAGE_SIDE = 40  # every processor resizes: the images need not be the model's size

TRANSFORMERS_KINDS = ["vit", "resnet", "swin", "convnext"]
TIMM_KINDS = [f"timm_{family}" for family in sorted(FAMILIES)]


def _transformers_model(kind: str) -> torch.nn.Module:
    import transformers

    # label2id as Hub configs hold it: one "crane" (the last, 517) survives the inversion
    labels = {"num_labels": NUM_CLASSES, "id2label": ID2LABEL, "label2id": {v: k for k, v in ID2LABEL.items()}}
    config = {
        "vit": lambda: transformers.ViTConfig(image_size=32, patch_size=16, hidden_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=32, **labels),
        "resnet": lambda: transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                    layer_type="basic", **labels),
        "swin": lambda: transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=8, depths=[1, 1],
                                                num_heads=[1, 2], window_size=4, **labels),
        "convnext": lambda: transformers.ConvNextConfig(image_size=32, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], **labels),
    }[kind]()
    torch.manual_seed(0)
    return transformers.AutoModelForImageClassification.from_config(config).eval()


def _save_kind(kind: str, folder: Path) -> None:
    """The model of ``kind`` and its image processor, saved in ``folder``."""
    if kind.startswith("timm_"):
        import_timm()
        # float32, as checkpoints are; the timm processor is built from the pretrained_cfg in config.json
        make_timm_model(kind[len("timm_"):], id2label=ID2LABEL, dtype=torch.float32).save_pretrained(folder)
        return
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    _transformers_model(kind).save_pretrained(folder)
    ViTImageProcessorPil(do_resize=True, size={"height": 32, "width": 32}, image_mean=[0.5] * 3,
                         image_std=[0.5] * 3).save_pretrained(folder)


def _image(rng: np.random.Generator, grey: bool):
    from PIL import Image

    shape = (IMAGE_SIDE, IMAGE_SIDE) if grey else (IMAGE_SIDE, IMAGE_SIDE, 3)
    return Image.fromarray(rng.integers(0, 256, shape).astype(np.uint8), "L" if grey else "RGB")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Class folders (train / validation / test, one grey image in each class folder) and an OOD folder."""
    root = tmp_path_factory.mktemp("brought_data")
    rng = np.random.default_rng(0)
    for split, count in PER_CLASS.items():
        for index in FOLDER_CLASSES:
            folder = root / "id" / split / ID2LABEL[index]
            folder.mkdir(parents=True)
            for i in range(count):
                _image(rng, grey=i == 0).save(folder / f"{i:02d}.png")
    (root / "ood").mkdir()
    for i in range(6):
        _image(rng, grey=i % 3 == 0).save(root / "ood" / f"{i:02d}.png")
    return {"id": root / "id", "ood": root / "ood"}


_SAVED: dict[str, Path] = {}


@pytest.fixture(params=TRANSFORMERS_KINDS + TIMM_KINDS)
def kind(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """``(kind, its saved model folder)``, saved once per module run."""
    name = request.param
    if name not in _SAVED:
        folder = tmp_path_factory.mktemp(f"brought_{name}")
        _save_kind(name, folder)
        _SAVED[name] = folder
    return name, _SAVED[name]


def _load(folder: Path, method: str, **settings):
    return AutoOODDetector.from_pretrained(str(folder), method=method, **settings)


def _direct_accuracy(folder: Path, test_root: Path) -> float:
    """The model run directly on the ID test images (decoded to RGB, its own processor), against the folders'
    class indices in its label map."""
    from PIL import Image
    from transformers import AutoModelForImageClassification

    from hf_gsc.utils.image_processors import load_image_processor

    model = AutoModelForImageClassification.from_pretrained(folder).eval()
    processor = load_image_processor(folder)
    correct = total = 0
    for class_folder in sorted(test_root.iterdir()):
        images = [Image.open(path).convert("RGB") for path in sorted(class_folder.iterdir())]
        with torch.no_grad():
            predicted = model(**processor(images=images, return_tensors="pt")).logits.argmax(-1)
        index = next(i for i in FOLDER_CLASSES if ID2LABEL[i] == class_folder.name)
        correct += int((predicted == index).sum())
        total += len(images)
    return correct / total


def test_evaluate(kind, data, tmp_path):
    """hf-gsc evaluate on class folders of 3 of the model's 1,000 classes: every method scores every image, and the
    ID accuracy is the model's own on those folders."""
    name, folder = kind
    result = evaluate_argv(["--model", str(folder), "--id-dataset", str(data["id"]), "--ood-dataset",
                            f"noise={data['ood']}", "--methods", "gsc,msp,knn", "--hyperparameter", "knn.k=5",
                            "--output-dir", str(tmp_path / "run"), "--batch-size", "8", "--no-plots"])
    assert result["skipped"] == {} and sorted(result["methods"]) == ["gsc", "knn", "msp"], result["skipped"]
    assert result["id_accuracy"] == pytest.approx(_direct_accuracy(folder, data["id"] / "test"), abs=1e-9)
    sizes = result["split_sizes"]
    assert sizes["id_test"] == len(FOLDER_CLASSES) * PER_CLASS["test"] and sizes["ood"] == {"noise": 6}


def test_fit_calibrate_pipeline_and_round_trip(kind, data, tmp_path):
    """fit (train split, labels by folder name through the 1,000-name map), calibrate (validation split), the
    pipeline on grey and RGB images, and save_pretrained / from_pretrained keeping scores and threshold."""
    import transformers

    name, folder = kind
    for method, settings in (("knn", {"k": 5}), ("gsc", {})):
        detector = _load(folder, method, **settings)
        detector.fit(str(data["id"]))
        if method == "knn":
            assert detector.fitted and detector.bank.shape[0] == len(FOLDER_CLASSES) * PER_CLASS["train"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 12 validation images: "too few for a threshold to mean much"
            detector.calibrate(str(data["id"]))
        assert detector.config.threshold is not None

        images = sorted((data["id"] / "test" / ID2LABEL[3]).iterdir())
        grey = images[0]  # a grey PNG: converted to the 3 channels the model's processor normalises
        pipe = transformers.pipeline("ood-image-classification", model=detector)
        served = pipe([str(path) for path in images])
        assert all(np.isfinite(item["ood_score"]) and item["is_ood"] is not None for item in served)
        from PIL import Image

        opened = [Image.open(path) for path in images]
        assert opened[0].mode == "L"
        pixel_values = detector.image_processor(images=opened, return_tensors="pt")["pixel_values"]
        direct = detector(pixel_values=pixel_values.to(detector.dtype)).ood_score
        np.testing.assert_allclose([item["ood_score"] for item in served], direct.double().numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=f"{name} {method}: pipeline against the detector ({grey.name})")

        saved = tmp_path / f"{method}_detector"
        detector.save_pretrained(str(saved), save_base_model=True)
        loaded = AutoOODDetector.from_pretrained(str(saved))
        assert loaded.method == method and loaded.config.threshold == pytest.approx(detector.config.threshold)
        reloaded = loaded(pixel_values=pixel_values.to(loaded.dtype)).ood_score
        np.testing.assert_allclose(reloaded.double().numpy(), direct.double().numpy(), rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("kind", ["timm_resnet", "timm_vit"], indirect=True)
def test_evaluate_every_method_on_timm(kind, data, tmp_path):
    """--methods all on a timm model: the run completes; a method left out is left out for the data's size (12 ID
    training images for 1,000 classes), never for the architecture, but where a method reads a part the model lacks:
    BATS the BatchNorm before its head, RankFeat and MDSEns a list of encoder blocks (a timm model is read at
    forward_features' output only), each refused when built, naming what is missing."""
    from hf_gsc.detectors import DETECTORS

    name, folder = kind
    result = evaluate_argv(["--model", str(folder), "--id-dataset", str(data["id"]), "--ood-dataset",
                            f"noise={data['ood']}", "--methods", "all", "--output-dir", str(tmp_path / "run"),
                            "--batch-size", "8", "--no-plots"])
    assert sorted([*result["methods"], *result["skipped"]]) == sorted(DETECTORS)
    assert {"gsc", "gsc_ash", "odin", "adascale_a", "react", "ash_s", "msp"} <= set(result["methods"])
    too_few = {method: reason for method, reason in result["skipped"].items() if "NotEnoughSamplesError" in reason}
    lacking = {"bats": "has no affine BatchNorm layer", "rankfeat": "exposes no list of them",
               "mds_ensemble": "exposes no list of them", "nac": "exposes no list of them"}
    no_part = {method: reason for method, reason in result["skipped"].items()
               if method in lacking and lacking[method] in reason}
    assert {**too_few, **no_part} == result["skipped"], result["skipped"]


def test_odin_steps_in_pixel_units_of_the_models_processor(kind):
    """ODIN's image_std (its epsilon is a step in [0, 1] pixel units) is the std the model's processor normalises by:
    transformers' image_std, timm's data_config std (TimmWrapperImageProcessor has no image_std)."""
    from hf_gsc.detectors import DETECTORS
    from hf_gsc.utils.image_processors import load_image_processor

    name, folder = kind
    processor = load_image_processor(folder)
    expected = list(processor.data_config["std"]) if name.startswith("timm_") else [0.5] * 3
    assert DETECTORS["odin"].model_defaults(processor)["image_std"] == pytest.approx(expected)
