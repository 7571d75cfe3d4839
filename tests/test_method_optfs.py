"""OptFS against the authors' code (github.com/Qinyu-Allen-Zhao/OptFSOOD ``detector/ours.py``: ``setup`` with the
fixed weight, ``get_lc_fv_list``, ``postprocess``), written again in numpy and torch on the tiny models' public
features."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import DETECTORS


#: float64 on both sides; theta from per-batch sums against per-sample sums then a mean (measured: at most 7e-16
#: relative on the scores, 1.2e-13 absolute on theta of norm 1000).
RTOL = 1e-12


def authors_optfs(feature, w, b, feature_test, use_ood_score):
    pred = np.argmax(feature @ w.T + b, axis=1)
    left_b = np.quantile(feature, 1e-3)
    right_b = np.quantile(feature, 1 - 1e-3)
    width = (right_b - left_b) / 100.0
    left_boundary = np.arange(left_b, right_b, width)
    lc = w[pred] * feature
    lc_fv_list = []
    for edge in left_boundary:
        mask = (feature >= edge) & (feature < edge + width)
        lc_fv_list.append(np.mean(np.sum(mask * lc, axis=1)))
    lc_fv_list = np.array(lc_fv_list)
    theta = torch.from_numpy((lc_fv_list / np.linalg.norm(lc_fv_list, 2) * 1000)[np.newaxis, :])
    feature_t = torch.from_numpy(feature_test)
    output = feature_t @ torch.from_numpy(w).T + torch.from_numpy(b)
    pred_t = torch.max(torch.softmax(output, dim=1), dim=1)[1]
    feat_p = torch.zeros_like(feature_t)
    for i, x in enumerate(left_boundary):
        mask = (feature_t >= x) & (feature_t < x + width)
        feat_p += mask * feature_t * theta[0][i]
    if use_ood_score == "energy":
        return torch.logsumexp(feat_p @ torch.from_numpy(w).T + torch.from_numpy(b), dim=1).numpy(), theta[0].numpy()
    return torch.sum(torch.from_numpy(w)[pred_t] * feat_p, dim=1).numpy(), theta[0].numpy()


@pytest.mark.parametrize("ood_score", ["vanilla", "energy"])
def test_optfs_matches_the_authors_code(setting, ood_score):  # noqa: F811
    expected, theta = authors_optfs(setting.F_fit, setting.W, setting.b, setting.F_test, ood_score)
    detector = setting.detector("optfs", ood_score=ood_score)
    np.testing.assert_allclose(detector.theta.numpy(), theta, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(detector.score(setting.x_test).double().numpy(), expected, rtol=RTOL)


def test_optfs_defaults():
    assert DETECTORS["optfs"].defaults == {"ood_score": "vanilla"}
    assert DETECTORS["optfs"].fit_split == "train"
