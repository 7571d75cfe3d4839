"""What is measured is what is served: ``hf-gsc evaluate``, ``fit`` / ``calibrate`` and the pipeline turn one set of
awkward images (EXIF-rotated JPEG, 16-bit, 1-bit and boolean, CMYK, palette, RGBA, a URL) into the same pixels, so
each image gets the same score in all three, equal to the score of its upright 8-bit RGB version made by hand.

Tolerance: the evaluation scores in batches with its normalisation on the model's device and the pipeline one
image at a time; the same pixels give float32 scores that agree to rounding (``SCORE_TOLERANCE``), while different
pixels (a sideways image, a 16-bit image read as white, alpha dropped) move the score by far more."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from http_files import serve_files
from PIL import Image
from test_first_hour import save_tiny_vit

from hf_gsc import AutoOODDetector
from hf_gsc import cli as hf_gsc_cli


#: float32 scores of the same pixels through other batchings and normalisation order agree to about 1e-6.
SCORE_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
HEIGHT, WIDTH = 20, 28  # not square: a sideways image is resized differently


def _encoded(image: Image.Image, fmt: str, **save: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def _rgb(array: np.ndarray) -> Image.Image:
    """The hand-made upright 8-bit RGB image of ``array`` (H x W grey or H x W x 3)."""
    return Image.fromarray(np.repeat(array[:, :, None], 3, axis=2) if array.ndim == 2 else array, "RGB")


@pytest.fixture(scope="module")
def awkward(tmp_path_factory):
    """``{name: (file bytes, file suffix, the hand-made upright RGB image)}``."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    grey = base.mean(axis=2).round().astype(np.uint8)
    cases = {}
    # A phone photo: stored sideways, EXIF orientation 6 says "turn 90 degrees clockwise to view".
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = _encoded(Image.fromarray(np.ascontiguousarray(np.rot90(base, k=1))), "JPEG", exif=exif, quality=95)
    stored = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))  # the JPEG's own pixels, as stored
    cases["exif_rotated"] = (jpeg, ".jpg", _rgb(np.ascontiguousarray(np.rot90(stored, k=-1))))
    cases["sixteen_bit"] = (_encoded(Image.fromarray(grey.astype(np.uint16) * 257), "PNG"), ".png", _rgb(grey))
    bits = grey > 127
    cases["one_bit"] = (_encoded(Image.fromarray(bits), "PNG"), ".png", _rgb(bits.astype(np.uint8) * 255))
    cmyk = np.concatenate([255 - base, np.zeros((HEIGHT, WIDTH, 1), np.uint8)], axis=2)  # K = 0: RGB = 255 - CMY
    cases["cmyk"] = (_encoded(Image.fromarray(cmyk, "CMYK"), "TIFF"), ".tif", _rgb(base))
    palette_image = Image.fromarray(base).quantize(colors=16)
    palette = np.asarray(palette_image.getpalette(), np.uint8).reshape(-1, 3)
    cases["palette"] = (_encoded(palette_image, "PNG"), ".png", _rgb(palette[np.asarray(palette_image)]))
    alpha = np.where((np.indices((HEIGHT, WIDTH)).sum(axis=0) // 3) % 2 == 0, 255, 0).astype(np.uint8)
    rgba = np.concatenate([base, alpha[:, :, None]], axis=2)
    on_white = np.where(alpha[:, :, None] == 255, base, 255).astype(np.uint8)  # transparent pixels show white
    cases["rgba"] = (_encoded(Image.fromarray(rgba, "RGBA"), "PNG"), ".png", _rgb(on_white))
    cases["url"] = (_encoded(Image.fromarray(base), "PNG"), "url", _rgb(base))
    return cases, bits


@pytest.fixture(scope="module")
def world(tmp_path_factory, awkward):
    """The tiny RGB ViT, its energy detector, the awkward images as files (and the URL one on a loopback server)."""
    cases, bits = awkward
    root = tmp_path_factory.mktemp("image_path")
    save_tiny_vit(root / "model", num_channels=3)
    folder = root / "awkward"
    folder.mkdir()
    sources = {}
    for name, (data, suffix, _) in cases.items():
        if suffix != "url":
            sources[name] = str(folder / f"{name}{suffix}")
            Path(sources[name]).write_bytes(data)
    with serve_files({"/photo.png": cases["url"][0]}) as base_url:
        sources["url"] = f"{base_url}/photo.png"
        detector = AutoOODDetector.from_pretrained(str(root / "model"), method="energy")
        yield {"root": root, "sources": sources, "detector": detector, "bits": bits,
               "expected": {name: case[2] for name, case in cases.items()}}


def _hand_made_scores(world) -> dict[str, float]:
    detector = world["detector"]
    scores = {}
    for name, image in world["expected"].items():
        pixel_values = detector.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            scores[name] = float(detector.score(pixel_values)[0])
    return scores


def _close(got: dict[str, float], expected: dict[str, float], where: str) -> None:
    wrong = {name: (got[name], expected[name]) for name in expected
             if not np.isclose(got[name], expected[name], **SCORE_TOLERANCE)}
    assert not wrong, f"{where}: scores differ from the hand-made upright RGB image's: {wrong}"


def test_the_pipeline_scores_the_hand_made_image(world):
    import transformers

    ood = transformers.pipeline("ood-image-classification", model=world["detector"])
    names = list(world["sources"])
    outputs = ood([world["sources"][name] for name in names])
    _close({name: out["ood_score"] for name, out in zip(names, outputs)}, _hand_made_scores(world), "pipeline")
    # A boolean array is the 1-bit image: False 0, True 255.
    _close({"one_bit": ood(world["bits"])["ood_score"]}, {"one_bit": _hand_made_scores(world)["one_bit"]},
           "pipeline, boolean array")


def test_calibrate_and_fit_see_the_hand_made_image(world, recwarn):
    detector = world["detector"]
    hand_made = _hand_made_scores(world)
    # One image, tpr=1: the threshold is that image's score (threshold_at_tpr returns one of the scores).
    calibrated = {name: detector.calibrate([source], tpr=1.0) for name, source in world["sources"].items()}
    calibrated_bits = detector.calibrate([world["bits"]], tpr=1.0)
    _close(calibrated, hand_made, "calibrate")
    _close({"one_bit": calibrated_bits}, {"one_bit": hand_made["one_bit"]}, "calibrate, boolean array")
    # fit: KNN fitted on each awkward image holds the features of the hand-made one.
    model = detector.model
    for name, source in world["sources"].items():
        fitted = AutoOODDetector.from_pretrained(model, method="knn", k=1)
        fitted.image_processor = detector.image_processor
        fitted.fit([source])
        by_hand = AutoOODDetector.from_pretrained(model, method="knn", k=1)
        by_hand.image_processor = detector.image_processor
        by_hand.fit([world["expected"][name]])
        for state, tensor in by_hand.fitted_state().items():
            torch.testing.assert_close(fitted.fitted_state()[state], tensor, **SCORE_TOLERANCE,
                                       msg=lambda text, name=name: f"fit on {name}: {text}")


def test_the_evaluation_scores_the_hand_made_image(world, tmp_path):
    import datasets
    from safetensors.torch import load_file

    root = world["root"]
    names = list(world["sources"])
    # ID data: the hand-made images; the awkward ones are the OOD set, as paths and a URL in a text column.
    id_root = tmp_path / "id"
    images = list(world["expected"].values())
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog", "bird"])})
    datasets.DatasetDict({split: datasets.Dataset.from_dict(
        {"image": images, "label": [i % 3 for i in range(len(images))]}, features=features)
        for split in ("train", "validation", "test")}).save_to_disk(id_root)
    awkward = tmp_path / "awkward"
    datasets.Dataset.from_dict({"image": [world["sources"][name] for name in names]}).save_to_disk(awkward)
    hf_gsc_cli.main(["evaluate", "--model", str(root / "model"), "--id-dataset", str(id_root),
                     "--ood-dataset", f"awkward={awkward}", "--methods", "energy", "--output-dir",
                     str(tmp_path / "run"), "--batch-size", "3", "--no-plots"])
    (score_file,) = (tmp_path / "run" / "scores" / "energy").glob("*awkward*.safetensors")
    scores = load_file(str(score_file))["ood_score"].tolist()
    _close(dict(zip(names, scores)), _hand_made_scores(world), "hf-gsc evaluate")
