"""One score dtype: ``ood_score`` is float32 for every method whatever the base model's dtype, float64 only for a
float64 base model; a threshold calibrated on a bf16 model is not rounded to bf16."""

from __future__ import annotations

import pytest
import torch
from conftest import IMAGE_SIZE, NUM_LABELS
from test_detectors import balanced_model

from hf_gsc.detectors import DETECTORS, get_detector


NUM = 128


def _batches(dtype: torch.dtype):
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(NUM, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64).to(dtype)
    labels = torch.arange(NUM) % NUM_LABELS
    return [(images[i:i + 16], labels[i:i + 16]) for i in range(0, NUM, 16)]


def _detector(method: str, dtype: torch.dtype):
    model = balanced_model("resnet").to(dtype)  # random images predicted as every class
    detector = get_detector(method, model)
    if detector.needs_fit:  # labelled by the model's predictions, so that SHE has correct samples of every class
        with torch.no_grad():
            detector.fit([(images, model(pixel_values=images).logits.argmax(-1)) for images, _ in _batches(dtype)])
    return detector


@pytest.mark.parametrize("method", sorted(DETECTORS))
@pytest.mark.parametrize("dtype, expected", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                             (torch.float64, torch.float64)], ids=["bf16", "fp32", "fp64"])
def test_ood_score_dtype(method, dtype, expected):
    detector = _detector(method, dtype)
    images = _batches(dtype)[0][0]
    with torch.no_grad():
        assert detector.score(images).dtype == expected
    assert detector(images).ood_score.dtype == expected


def test_threshold_of_a_bf16_model_keeps_float32_digits():
    detector = _detector("knn", torch.bfloat16)
    threshold = detector.calibrate(torch.cat([images for images, _ in _batches(torch.bfloat16)]))
    scores = detector.score(_batches(torch.bfloat16)[0][0])
    assert scores.dtype == torch.float32
    assert isinstance(threshold, float) and threshold == detector.config.threshold
    assert threshold in set(torch.cat([detector.score(b) for b, _ in _batches(torch.bfloat16)]).double().tolist())
