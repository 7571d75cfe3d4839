"""Serving: ``transformers.pipeline("ood-image-classification", model=DETECTOR)`` and ``Trainer.predict``."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from conftest import IMAGE_SIZE, make_tiny_model
from hub_server import LoopbackHub
from huggingface_hub import HfApi
from PIL import Image
from transformers import ViTImageProcessor

import hf_gsc  # noqa: F401  (registers the task)
from hf_gsc import GSCForImageClassification


TASK = "ood-image-classification"


@pytest.fixture
def detector_dir(tmp_path) -> Path:
    """A calibrated detector saved without its base (referenced by folder), and the base with a processor."""
    base = tmp_path / "base"
    make_tiny_model("vit").float().save_pretrained(base)
    ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(base)
    detector = GSCForImageClassification.from_pretrained(base, mask_ratio=0.1)
    detector.calibrate(torch.randn(8, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0)))
    detector.save_pretrained(tmp_path / "detector")
    return tmp_path / "detector"


def _images(count: int, seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (20 + i, 24, 3), dtype=np.uint8)) for i in range(count)]


def _expected(detector: GSCForImageClassification, images) -> tuple[list[float], list[bool], list[str]]:
    pixel_values = detector.image_processor(images=images, return_tensors="pt")["pixel_values"]
    output = detector(pixel_values)
    labels = detector.model.config.id2label
    return output.ood_score.tolist(), output.is_ood.tolist(), [labels[int(c)] for c in output.predicted_class]


def _check(results, expected) -> None:
    scores, is_ood, top = expected
    assert [r["ood_score"] for r in results] == pytest.approx(scores, rel=1e-5, abs=1e-6)
    assert [r["is_ood"] for r in results] == is_ood
    assert [r["predictions"][0]["label"] for r in results] == top
    assert all(len(r["predictions"]) == 3 for r in results)


def test_pipeline_from_a_folder_takes_images_paths_and_arrays(detector_dir, tmp_path):
    ood = transformers.pipeline(TASK, model=str(detector_dir))
    detector = GSCForImageClassification.from_pretrained(detector_dir)
    images = _images(5)
    _check(ood(images, batch_size=2, top_k=3), _expected(detector, images))

    paths = []
    for index, image in enumerate(images[:2]):
        paths.append(str(tmp_path / f"image{index}.png"))
        image.save(paths[-1])
    arrays = [np.asarray(image) for image in images[2:]]
    _check(ood(paths + arrays, batch_size=3, top_k=3), _expected(detector, images))
    single = ood(images[0], top_k=3)
    assert isinstance(single, dict) and single["ood_score"] == pytest.approx(_expected(detector, images[:1])[0][0], rel=1e-5)


def test_pipeline_from_a_hub_id_with_the_base_saved(detector_dir, tmp_path):
    detector = GSCForImageClassification.from_pretrained(detector_dir)
    with LoopbackHub() as hub, hub.patch_client(cache_dir=tmp_path / "cache", token=hub.token):
        detector.push_to_hub("user/gsc-served", save_base_model=True)
        assert "model.safetensors" in HfApi(token=hub.token).list_repo_files("user/gsc-served")
        ood = transformers.pipeline(TASK, model="user/gsc-served")
    images = _images(3, seed=1)
    _check(ood(images, batch_size=2, top_k=3), _expected(detector, images))


def test_pipeline_rejects_bad_arguments(detector_dir):
    with pytest.raises(TypeError, match="model must be a saved OOD detector"):
        transformers.pipeline(TASK, model=make_tiny_model("vit"), image_processor=ViTImageProcessor())
    ood = transformers.pipeline(TASK, model=str(detector_dir))
    with pytest.raises(TypeError, match=r"unknown arguments \['topk'\]"):
        ood(_images(1), topk=3)
    with pytest.raises(ValueError, match="top_k must be a positive int, got 0"):
        ood(_images(1), top_k=0)


def test_pipeline_shared_by_threads(detector_dir):
    """Four threads share one pipeline (one detector); each gets what it gets alone."""
    ood = transformers.pipeline(TASK, model=str(detector_dir))
    inputs = [_images(4, seed=seed) for seed in range(4)]
    expected = [[r["ood_score"] for r in ood(images, batch_size=2)] for images in inputs]
    results: dict[int, list] = {}

    def serve(index: int) -> None:
        try:
            results[index] = [[r["ood_score"] for r in ood(inputs[index], batch_size=2)] for _ in range(10)]
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            results[index] = [repr(error)]

    threads = [threading.Thread(target=serve, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results[index] == [expected[index]] * 10 for index in range(4)), results


def _trainer_predict(detector, pixel_values: torch.Tensor, tmp_path) -> Any:
    """``transformers.Trainer.predict`` of ``detector`` on ``pixel_values``, labelled 0, 1, 2, 0, ..., batches of 4."""
    from torch.utils.data import Dataset

    class Images(Dataset):
        def __len__(self) -> int:
            return len(pixel_values)

        def __getitem__(self, index: int) -> dict:
            return {"pixel_values": pixel_values[index], "labels": index % 3}

    arguments = transformers.TrainingArguments(output_dir=str(tmp_path / "trainer"), per_device_eval_batch_size=4,
                                               report_to=[], use_cpu=True)
    return transformers.Trainer(model=detector, args=arguments).predict(Images())


def test_trainer_predict_keeps_labels(detector_dir, tmp_path):
    detector = GSCForImageClassification.from_pretrained(detector_dir)
    pixel_values = torch.randn(6, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(3))
    prediction = _trainer_predict(detector, pixel_values, tmp_path)
    assert prediction.label_ids.tolist() == [0, 1, 2, 0, 1, 2]
    logits, ood_score, gsc_logits = prediction.predictions[:3]  # every method's fields first, then GSC's
    expected = detector(pixel_values)
    np.testing.assert_allclose(ood_score, expected.ood_score.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logits, expected.logits.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("calibrated", [False, True], ids=["uncalibrated", "calibrated"])
def test_trainer_predict_layout_of_a_detector(calibrated, tmp_path):
    """The layout OODDetectorOutput's docstring states: predictions = (logits, ood_score[, is_ood, p_value])."""
    from hf_gsc import AutoOODDetector

    detector = AutoOODDetector.from_pretrained(make_tiny_model("vit").float(), method="energy")
    pixel_values = torch.randn(6, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(3))
    if calibrated:  # on other images: a scored image's own calibration score would tie with it, and which side of
        # the tie float32 rounding puts it (batches of 4 here, of 6 below) would decide its p-value
        detector.calibrate(torch.randn(6, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(4)))
    prediction = _trainer_predict(detector, pixel_values, tmp_path)
    expected = detector(pixel_values)
    assert prediction.label_ids.tolist() == [0, 1, 2, 0, 1, 2]
    assert len(prediction.predictions) == (4 if calibrated else 2)
    logits, ood_score = prediction.predictions[:2]
    np.testing.assert_allclose(logits, expected.logits.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ood_score, expected.ood_score.numpy(), rtol=1e-5, atol=1e-6)
    assert ood_score.dtype == np.float32
    if calibrated:
        np.testing.assert_array_equal(prediction.predictions[2], expected.is_ood.numpy())
        np.testing.assert_allclose(prediction.predictions[3], expected.p_value.numpy(), rtol=1e-12)


def test_pipeline_with_a_compiled_forward_gives_the_eager_results(detector_dir, monkeypatch):
    """``compile_mode`` serves through the detector's compiled forward (compiled here with dynamo's eager backend,
    which traces the same whole graph as inductor in a fraction of the time: tests/test_compile.py compiles with
    inductor), with the eager pipeline's results."""
    from torch._dynamo.utils import counters

    from hf_gsc.detectors.interface import OODDetector

    modes = []
    original = OODDetector.compiled
    monkeypatch.setattr(OODDetector, "compiled",
                        lambda self, mode="default", **_: modes.append(mode) or original(self, mode=mode, backend="eager"))
    torch._dynamo.reset()
    counters.clear()
    ood = transformers.pipeline(TASK, model=str(detector_dir), compile_mode="reduce-overhead")
    detector = GSCForImageClassification.from_pretrained(detector_dir)
    images = _images(4)
    _check(ood(images, batch_size=2, top_k=3), _expected(detector, images))
    assert modes == ["reduce-overhead"] and counters["stats"]["unique_graphs"] >= 1
    with pytest.raises(ValueError, match="mode must be one of"):
        transformers.pipeline(TASK, model=str(detector_dir), compile_mode="fastest")
