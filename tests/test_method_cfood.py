"""CFOOD against OpenOOD v1.5's ``cfood_postprocessor.py`` (``setup`` and ``postprocess``, with
``configs/postprocessors/cfood.yml``), written again in torch on the tiny models' public features."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_detectors import reference_features, setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import DETECTORS, get_detector
from hf_gsc.detectors.cfood import REFERENCE_SEED


def openood_cfood(feats, test_feats, alpha, k):
    """``setup`` (the reference set, its grid of neighbour positions, each row's ``knndst``) and ``postprocess``; the
    subsample drawn with the seeded generator the detector documents (OpenOOD's ``torch.randperm`` is unseeded)."""
    feats = feats / (torch.norm(feats, dim=1, keepdim=True) + 1e-10)
    N = feats.size(0)
    n = int(alpha * N) if alpha < 1.0 else N
    if alpha < 1.0:
        ref = feats[torch.randperm(N, generator=torch.Generator().manual_seed(REFERENCE_SEED))[:n]].contiguous()
    else:
        ref = feats.contiguous()
    kval = np.concatenate((np.linspace(0.001, 0.1, 100), np.linspace(0.105, 0.5, 81), np.linspace(0.51, 0.99, 49)))
    kpos = np.array(kval * n - 1, dtype=int)
    keep = np.concatenate(([True], kpos[:-1] < kpos[1:]))
    kval, kpos = kval[keep], kpos[keep]
    knndst = torch.zeros((n, len(kpos)), dtype=feats.dtype)
    for i in range(n):
        dst = torch.sum((ref[i] - ref) ** 2, dim=1)
        knndst[i, :] = torch.sort(dst, dim=0).values[kpos + 1]
    feat = test_feats / (torch.norm(test_feats, dim=1, keepdim=True) + 1e-10)
    kval_t = torch.from_numpy(kval)
    scores = []
    for v in feat:
        dst = torch.sum((v - ref) ** 2, dim=1)
        count = (knndst >= dst.view(n, 1)).sum(dim=0).double() / float(n)
        pos = torch.nonzero(count >= k, as_tuple=False)
        scores.append(kval_t[pos[0, 0]] if pos.numel() > 0 else torch.tensor(1.0, dtype=torch.float64))
    return -torch.stack(scores).numpy(), knndst


@pytest.mark.parametrize("alpha, k", [(1.0, 0.01), (1.0, 0.05), (0.5, 0.005), (0.1, 0.01)])
def test_cfood_matches_openood(setting, alpha, k):  # noqa: F811
    """Scores are fractions of the grid: equal, not close. Three training images, moved a little, are scored too (their
    ``kappa`` is small), so that the test reaches the start of the grid and not only its end. (A training image itself
    would tie: its distance to a row is that row's distance to it, and which of two roundings of one number is larger
    is not the method.)"""
    x = torch.cat([setting.x_test, setting.x_fit[:3] * 1.01])
    train = torch.from_numpy(setting.F_fit)
    expected, knndst = openood_cfood(train, reference_features(setting.model, setting.arch, x), alpha, k)
    detector = setting.detector("cfood", alpha=alpha, k=k)
    np.testing.assert_allclose(detector.neighbour_distances.numpy(), knndst.numpy(), rtol=1e-12, atol=1e-15)
    actual = detector.score(x).double().numpy()
    np.testing.assert_array_equal(actual, expected)
    assert len(set(expected.tolist())) > 2


def test_cfood_defaults_and_grid(setting):  # noqa: F811
    assert DETECTORS["cfood"].defaults == {"alpha": 0.1, "k": 0.01}
    assert DETECTORS["cfood"].search_space == {"alpha": (0.1, 0.5, 1.0), "k": (0.001, 0.005, 0.01, 0.05)}
    detector = get_detector("cfood", setting.model)
    assert detector.min_fit_samples == 20  # int(0.1 N) >= 2 reference rows
