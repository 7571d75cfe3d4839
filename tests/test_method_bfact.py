"""BFAct against the OptFS authors' implementation (github.com/Qinyu-Allen-Zhao/OptFSOOD ``detector/bfact.py``,
``use_surrogate=False``), written again in numpy and torch on the tiny models' public features."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc import AutoOODDetector
from hf_gsc.detectors import DETECTORS


#: float64 on both sides (measured: equal here).
RTOL = 1e-12


def softcap(x, threshold, n):
    return (1 / ((1 + ((x / threshold) ** (2 * n))) ** 0.5)) * x


def optfs_bfact(feature_train, features, W, b, percentile, n):
    """``setup``: ``np.percentile`` of every flattened training activation; ``postprocess``: the energy of the logits
    of the soft-capped feature."""
    threshold = np.percentile(feature_train.flatten(), percentile)
    output = softcap(torch.from_numpy(features), threshold, n) @ torch.from_numpy(W).T + torch.from_numpy(b)
    return torch.logsumexp(output, dim=1).numpy(), threshold


@pytest.mark.parametrize("percentile, order", [(95.0, 2), (90.0, 1), (99.0, 4)])
def test_bfact_matches_the_optfs_authors_code(setting, percentile, order):  # noqa: F811
    expected, threshold = optfs_bfact(setting.F_fit, setting.F_test, setting.W, setting.b, percentile, order)
    detector = setting.detector("bfact", percentile=percentile, order=order)
    assert float(detector.threshold[0]) == pytest.approx(threshold, rel=1e-15)
    np.testing.assert_allclose(detector.score(setting.x_test).double().numpy(), expected, rtol=RTOL)
    plain = np.log(np.exp(setting.F_test @ setting.W.T + setting.b).sum(axis=1))
    assert np.abs(plain - expected).max() > 1e-6  # the filter changes the score


def test_bfact_defaults_grid_and_a_load_at_another_percentile(setting, tmp_path):  # noqa: F811
    assert DETECTORS["bfact"].defaults == {"percentile": 95.0, "order": 2}
    assert len(DETECTORS["bfact"].search_space["percentile"]) == 19 and DETECTORS["bfact"].fit_split == "train"
    setting.detector("bfact").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"fitted at percentile=95, not 90"):
        AutoOODDetector.from_pretrained(tmp_path, model=setting.model, percentile=90.0)
    loaded = AutoOODDetector.from_pretrained(tmp_path, model=setting.model, order=3)  # the order applies at scoring
    expected, _ = optfs_bfact(setting.F_fit, setting.F_test, setting.W, setting.b, 95.0, 3)
    np.testing.assert_allclose(loaded.score(setting.x_test).double().numpy(), expected, rtol=RTOL)
