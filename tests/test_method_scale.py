"""SCALE against the authors' code (kai422/SCALE ``openood/networks/scale_net.py``: ``scale`` and
``ScaleNet.forward_threshold``, the same in OpenOOD v1.5), written again in numpy, and as GSC's feature shaping."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE
from test_detectors import balanced_model, energy, reference_gsc_on_shaped, setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import get_detector
from hf_gsc.detectors.scale import scale_factor


def reference_scale(x: np.ndarray, percentile: float) -> np.ndarray:
    """The authors' scale(): s1 = the sum of a sample, k = n - int(np.round(n p / 100)) (numpy's round half to
    even), s2 = the sum after keeping its top k; the *unpruned* input times exp(s1 / s2). ``x``: (B, n)."""
    n = x.shape[1]
    k = n - int(np.round(n * percentile / 100.0))
    s1 = x.sum(axis=1)
    pruned = np.zeros_like(x)
    top = np.argsort(-x, axis=1, kind="stable")[:, :k]
    np.put_along_axis(pruned, top, np.take_along_axis(x, top, axis=1), axis=1)
    s2 = pruned.sum(axis=1)
    return x * np.exp(s1 / s2)[:, None]


# 90.625: n p / 100 = 14.5 for the ViT's n = 16, which numpy's round (the authors') takes to 14 (k = 2), not 15.
@pytest.mark.parametrize("percentile", [50.0, 65.0, 85.0, 90.625])
def test_scale_matches_the_authors_code(setting, percentile):  # noqa: F811
    shaped = reference_scale(setting.F_test, percentile)
    expected = energy(shaped @ setting.W.T + setting.b)
    np.testing.assert_allclose(setting.score("scale", percentile=percentile), expected, rtol=1e-9)


def test_default_percentile_is_the_authors(setting):  # noqa: F811
    detector = get_detector("scale", setting.model)
    assert detector.hyperparameters == {"percentile": 85.0, "split_point": "penultimate"}
    expected = energy(reference_scale(setting.F_test, 85.0) @ setting.W.T + setting.b)
    np.testing.assert_allclose(setting.score("scale"), expected, rtol=1e-9)


def test_scale_differs_from_ash_s(setting):  # noqa: F811
    """SCALE keeps the pruned activations: the same scale, applied to the whole feature."""
    assert not np.allclose(setting.score("scale", percentile=85.0), setting.score("ash_s", percentile=85.0))


def test_final_encoder_output_scales_the_whole_feature_map():
    """The authors' scale() on a (B, C, H, W) map: n = C H W; then the head (average pooling, linear)."""
    model = balanced_model("resnet")
    x = torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    with torch.no_grad():
        feature_map = model.resnet(x, output_hidden_states=True).hidden_states[-1]
    shaped = reference_scale(feature_map.flatten(1).numpy(), 70.0).reshape(feature_map.shape).mean(axis=(2, 3))
    linear = model.classifier[-1]
    logits = shaped @ linear.weight.detach().numpy().T + linear.bias.detach().numpy()
    detector = get_detector("scale", model, split_point="final_encoder_output", percentile=70.0)
    np.testing.assert_allclose(detector.score(x).numpy(), energy(logits), rtol=1e-9)


def test_zero_kept_sum_is_not_guarded_as_in_the_authors_code():
    """s2 = 0: the authors divide by it (0 / 0 = NaN for an all-zero ReLU feature); ASH-S here keeps such a sample
    unscaled, SCALE does not, and the NaN score is then OOD."""
    features = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    factor = scale_factor(features, 50.0)
    assert torch.isnan(factor[0, 0])
    assert factor[1, 0].item() == pytest.approx(math.exp(10.0 / 7.0), rel=1e-15)


@pytest.mark.parametrize("percentile, match", [(100.0, "keeps none of the 16"), (101.0, r"\[0.0, 100.0\]"),
                                               (float("nan"), "finite"), ("85", "finite number")])
def test_bad_percentile_fails_at_construction(percentile, match):
    """On the ViT (n = 16) a percentile that keeps no activation is refused when the detector is built, not at
    the first batch."""
    model = balanced_model("vit")
    with pytest.raises(ValueError, match=rf"percentile.*{match}"):
        get_detector("scale", model, percentile=percentile)


def test_gsc_with_scale_shaping_takes_the_gradient_at_the_scaled_feature(setting):  # noqa: F811
    """GSC at the penultimate feature with feature_shaping="scale": zero the top 5% |W_c| coordinates of the scaled
    feature, energy of W F'' + b (the linear head's first-order update is exact)."""
    expected = reference_gsc_on_shaped(setting, reference_scale(setting.F_test, 85.0))
    detector = get_detector("gsc", setting.model, split_point="penultimate", feature_shaping="scale")
    assert detector.config.shaping_percentile == 85.0
    with torch.no_grad():
        np.testing.assert_allclose(detector.score(setting.x_test).numpy(), expected, rtol=1e-9)
