"""SCALE against OpenOOD's ScaleNet.forward_threshold / scale (the authors' code), written again in numpy, and as
GSC's feature shaping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_gsc.detectors import get_detector

from test_detectors import energy, setting  # noqa: F401  (tiny ViT and ResNet with fitting data)


def reference_scale(x: np.ndarray, percentile: float) -> np.ndarray:
    """OpenOOD's scale(): s1 = sum, keep the top k = n - round(n p / 100) for s2, multiply the *input* by exp(s1/s2)."""
    n = x.shape[1]
    k = n - int(np.round(n * percentile / 100.0))
    s1 = x.sum(axis=1)
    s2 = np.sort(x, axis=1)[:, ::-1][:, :k].sum(axis=1)
    return x * np.exp(s1 / s2)[:, None]


@pytest.mark.parametrize("percentile", [65.0, 85.0])
def test_scale_matches_the_authors_code(setting, percentile):  # noqa: F811
    shaped = reference_scale(setting.F_test, percentile)
    expected = energy(shaped @ setting.W.T + setting.b)
    np.testing.assert_allclose(setting.score("scale", percentile=percentile), expected, rtol=1e-9)


def test_scale_differs_from_ash_s(setting):  # noqa: F811
    """SCALE keeps the pruned activations: the same scale, applied to the whole feature."""
    assert not np.allclose(setting.score("scale", percentile=85.0), setting.score("ash_s", percentile=85.0))


def test_gsc_with_scale_shaping_takes_the_gradient_at_the_scaled_feature(setting):  # noqa: F811
    """GSC at the penultimate feature with feature_shaping="scale": zero the top 5% |W_c| coordinates of the scaled
    feature, energy of W F'' + b (the linear head's first-order update is exact)."""
    import math

    shaped = reference_scale(setting.F_test, 85.0)
    expected = []
    for row in shaped:
        c = np.argmax(setting.W @ row + setting.b)
        gradient = setting.W[c]
        k = math.ceil(0.05 * np.count_nonzero(gradient) - 1e-9)
        masked = row.copy()
        masked[np.argsort(-np.abs(gradient), kind="stable")[:k]] = 0.0
        expected.append(energy((setting.W @ masked + setting.b)[None])[0])
    detector = get_detector("gsc", setting.model, split_point="penultimate", feature_shaping="scale")
    assert detector.config.shaping_percentile == 85.0
    with torch.no_grad():
        np.testing.assert_allclose(detector.score(setting.x_test).numpy(), expected, rtol=1e-9)
