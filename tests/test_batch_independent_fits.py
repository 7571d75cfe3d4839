"""A fitted statistic does not depend on how the fitting data is batched: on a random ViT with hidden size 32
(final-LayerNorm features, whose covariance is singular) the precision matrix fitted at batch 32, 96 and in one
batch agree to float rounding (a plain pseudo-inverse kept a near-zero eigenvalue that rounding decided)."""

from __future__ import annotations

import pytest
import torch
from transformers import ViTConfig, ViTForImageClassification

from hf_gsc.detectors import get_detector
from hf_gsc.detectors.penultimate import PRECISION_RCOND, tied_precision


NUM = 192


@pytest.fixture(scope="module")
def data():
    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=32, num_labels=4)).eval()
    images = torch.randn(NUM, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    labels = torch.arange(NUM) % 4
    return model, images, labels


@pytest.mark.parametrize("method", ["mahalanobis", "gem", "mahalanobis_pp", "rmds", "rmds_pp"])
def test_precision_does_not_depend_on_the_batch_size(data, method):
    model, images, labels = data
    fitted = {}
    for size in (32, 96, NUM):
        detector = get_detector(method, model)
        detector.fit([(images[i:i + size], labels[i:i + size]) for i in range(0, NUM, size)])
        fitted[size] = detector
    for size in (32, 96):
        for name in fitted[NUM].state_names:
            torch.testing.assert_close(getattr(fitted[size], name), getattr(fitted[NUM], name), rtol=1e-5, atol=1e-7,
                                       msg=lambda m, name=name, size=size: f"{name} at batch {size}: {m}")
        torch.testing.assert_close(fitted[size].score(images[:8]), fitted[NUM].score(images[:8]), rtol=1e-5, atol=0)


def test_the_rank_cutoff_is_stated_and_inverts_a_well_conditioned_covariance():
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(6, 6, generator=generator, dtype=torch.float64)
    covariance = a @ a.T + 0.1 * torch.eye(6, dtype=torch.float64)
    torch.testing.assert_close(tied_precision(covariance), torch.linalg.inv(covariance))
    singular = covariance.clone()
    direction = torch.ones(6, dtype=torch.float64) / 6 ** 0.5
    projector = torch.eye(6, dtype=torch.float64) - torch.outer(direction, direction)
    singular = projector @ covariance @ projector + 1e-14 * torch.outer(direction, direction)  # noise-level eigenvalue
    precision = tied_precision(singular)
    assert abs(float(direction @ precision @ direction)) < 1e-6  # the noise direction is dropped, not inverted
    assert PRECISION_RCOND == 1e-10
