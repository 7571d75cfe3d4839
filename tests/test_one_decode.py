"""One decode for every entry point: large JPEGs (1024x768, one turned by its EXIF orientation) reach the model as
the same pixels, and get the same scores, through ``hf-gsc evaluate``'s data path, ``fit`` / ``calibrate``'s and the
``ood-image-classification`` pipeline's (:func:`hf_gsc.utils.images.decode`, at full size)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import evaluate_argv
from PIL import Image
from safetensors.torch import load_file


ORIENTATION = 0x0112


def _photo(width: int, height: int, seed: int) -> Image.Image:
    """Smooth ramps and a disc (JPEG-like content, where a reduced-scale decode differs from the full one)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    rng = np.random.default_rng(seed)
    cx, cy = rng.uniform(0.2, 0.8) * width, rng.uniform(0.2, 0.8) * height
    disc = 255.0 * ((x - cx) ** 2 + (y - cy) ** 2 < (0.15 * min(width, height)) ** 2)
    return Image.fromarray(np.stack([255 * x / width, 255 * y / height, disc], axis=-1).astype(np.uint8))


def large_jpegs(folder: Path, count: int = 4) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        exif = Image.Exif()
        exif[ORIENTATION] = 6 if index == 0 else 1  # the first is turned by a quarter when read
        path = folder / f"{index}.jpg"
        _photo(1024, 768, index).save(path, quality=90, exif=exif)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    root = tmp_path_factory.mktemp("one_decode")
    torch.manual_seed(0)
    config = ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=16, num_hidden_layers=1,
                       num_attention_heads=2, intermediate_size=32, num_labels=2,
                       id2label={0: "a", 1: "b"}, label2id={"a": 0, "b": 1})
    ViTForImageClassification(config).save_pretrained(root / "model")
    ViTImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(root / "model")
    paths = {split: large_jpegs(root / "id" / split / "a", 2) + large_jpegs(root / "id" / split / "b", 2)
             for split in ("train", "validation", "test")}
    return {"root": root, "model": str(root / "model"), "paths": paths, "ood": large_jpegs(root / "ood")}


def _evaluation_pixels(setup) -> torch.Tensor:
    import datasets

    from hf_gsc.evaluation.loaders import make_dataloader, model_pixel_values
    from hf_gsc.evaluation.models import image_transform, load_model

    model, processor, _, _ = load_model(setup["model"])
    dataset = datasets.Dataset.from_dict({"image": setup["paths"]["test"], "label": [0] * 4}).cast_column(
        "image", datasets.Image())
    batch = next(iter(make_dataloader(dataset, image_transform(processor, model), batch_size=4)))
    return model_pixel_values(batch, "cpu")


def test_every_entry_point_gives_the_model_the_same_pixels(setup):
    import transformers

    from hf_gsc import AutoOODDetector
    from hf_gsc.utils.inputs import labelled_batches

    detector = AutoOODDetector.from_pretrained(setup["model"], method="msp")
    paths = setup["paths"]["test"]
    fit_pixels = torch.cat([pixels for pixels, _ in labelled_batches(paths, "id_validation_data",
                                                                      detector.image_processor, channels=3)])
    pipeline = transformers.pipeline("ood-image-classification", model=detector)
    served = torch.cat([pipeline.preprocess(path)["pixel_values"] for path in paths])
    evaluated = _evaluation_pixels(setup)
    assert fit_pixels.shape == (4, 3, 32, 32)
    assert torch.equal(evaluated, fit_pixels) and torch.equal(served, fit_pixels)


def test_evaluate_scores_what_the_pipeline_serves_and_calibrate_reads(setup, tmp_path):
    import transformers

    from hf_gsc import AutoOODDetector

    root = setup["root"]
    evaluate_argv(["--model", setup["model"], "--id-dataset", str(root / "id"), "--ood-dataset",
                   f"photos={root / 'ood'}", "--methods", "energy", "--output-dir", str(tmp_path),
                   "--batch-size", "1",  # one image per forward, as the pipeline serves: the same float sums
                   "--no-plots", "--no-selection"])
    scores = load_file(str(tmp_path / "scores" / "energy" / "id_test.safetensors"))["ood_score"]
    detector = AutoOODDetector.from_pretrained(setup["model"], method="energy")
    pipeline = transformers.pipeline("ood-image-classification", model=detector)
    served = torch.tensor([pipeline(path)["ood_score"] for path in setup["paths"]["test"]])
    assert torch.equal(scores.float(), served.float())
    # calibrate reads the same files as the evaluation's ID validation split: its threshold is one of their scores.
    validation = load_file(str(tmp_path / "scores" / "energy" / "id_validation.safetensors"))["ood_score"]
    threshold = detector.calibrate(setup["paths"]["validation"], tpr=1.0)
    assert threshold == pytest.approx(float(validation.min()), abs=0)
