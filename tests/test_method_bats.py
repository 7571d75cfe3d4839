"""BATS against the authors' code (alibaba/easyrobust ``examples/ood_detection/BATS/test_ood.py``:
``iterate_data_energy`` / ``iterate_data_msp``), written again on a tiny ResNet whose last BatchNorm has random weights
(one negative) and biases: the pooled feature clipped by the two ``torch.where``, the head, then the score."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model
from scipy.special import logsumexp, softmax
from test_detectors import balanced_model, reference_features

from hf_gsc import AutoOODDetector
from hf_gsc.detectors import get_detector
from hf_gsc.detectors.bats import BATSDetector


@pytest.fixture(scope="module")
def resnet():
    model = balanced_model("resnet")
    batchnorm = model.resnet.encoder.stages[-1].layers[-1].layer[-1].normalization  # the last one, by its path
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        batchnorm.weight.copy_(0.2 + torch.rand(12, generator=generator, dtype=torch.float64))
        batchnorm.weight[5] = -0.4
        batchnorm.bias.copy_(torch.randn(12, generator=generator, dtype=torch.float64) * 0.5)
    x = 1.5 * torch.randn(10, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)
    return model, batchnorm, x


def reference_bats(model, batchnorm, x, lam, score):
    features = reference_features(model, "resnet", x)  # forward_features: the pooled feature
    feature_std, feature_mean = batchnorm.weight.detach(), batchnorm.bias.detach()
    features = torch.where(features < (feature_std * lam + feature_mean), features, feature_std * lam + feature_mean)
    features = torch.where(features > (-feature_std * lam + feature_mean), features, -feature_std * lam + feature_mean)
    linear = model.classifier[-1]
    logits = (features @ linear.weight.T + linear.bias).detach().numpy()  # forward_head
    return logsumexp(logits, axis=1) if score == "energy" else softmax(logits, axis=1).max(axis=1)


@pytest.mark.parametrize("lam, score", [(1.05, "energy"), (3.25, "energy"), (0.5, "msp")])
def test_bats_matches_the_authors_code(resnet, lam, score):
    model, batchnorm, x = resnet
    expected = reference_bats(model, batchnorm, x, lam, score)
    detector = get_detector("bats", model, lam=lam, score=score)
    np.testing.assert_allclose(detector.score(x).numpy(), expected, rtol=1e-10)
    untruncated = get_detector("energy" if score == "energy" else "msp", model).score(x).numpy()
    assert np.abs(expected - untruncated).max() > 1e-3  # the truncation changes the scores


def test_bats_reads_the_last_batchnorm_and_refuses_models_without_one(resnet):
    model, batchnorm, _ = resnet
    detector = get_detector("bats", model)
    assert torch.equal(detector.batchnorm_std, batchnorm.weight) and torch.equal(detector.batchnorm_mean, batchnorm.bias)
    assert BATSDetector.defaults == {"lam": 1.05, "score": "energy"} and not BATSDetector.needs_fit
    for arch, name in [("vit", "ViTForImageClassification"), ("convnext", "ConvNextForImageClassification")]:
        with pytest.raises(ValueError, match=rf"bats: {name} has no affine BatchNorm layer of the feature width"):
            get_detector("bats", make_tiny_model(arch))


def test_bats_saves_and_loads(resnet, tmp_path):
    model, _, x = resnet
    detector = get_detector("bats", model, lam=2.0)
    detector.calibrate(torch.randn(100, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.float64))
    detector.save_pretrained(tmp_path)
    loaded = AutoOODDetector.from_pretrained(tmp_path, model=model)
    assert loaded.method == "bats" and loaded.config.lam == 2.0
    assert torch.equal(loaded(x).ood_score, detector(x).ood_score)
    assert torch.equal(loaded(x).is_ood, detector(x).is_ood)
