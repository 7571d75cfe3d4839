"""ActSub against the authors' code (github.com/visinf/actsub ``actsub_openood/openood/postprocessors/
actsub_postprocessor.py``, with OpenOOD's ``scale`` and ``ash_s`` it imports), written again in torch on the tiny
models' public features."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import DETECTORS, get_detector
from hf_gsc.detectors.actsub import SAMPLE_SEED


#: float64 on both sides (measured: equal here).
RTOL = 1e-11


def openood_shaping(x, percentile, prune):
    """OpenOOD's ``scale`` (``prune=False``: the whole input scaled) and ``ash_s`` (``prune=True``: the pruned input
    scaled), which ActSub imports: ``exp(s1 / s2)``, ``s2`` the sum of the ``n - round(n p / 100)`` largest."""
    input = x.clone()
    b, c, h, w = x.shape
    s1 = x.sum(dim=[1, 2, 3])
    n = x.shape[1:].numel()
    k = n - int(np.round(n * percentile / 100.0))
    t = x.view((b, c * h * w))
    v, i = torch.topk(t, k, dim=1)
    t.zero_().scatter_(dim=1, index=i, src=v)
    s2 = x.sum(dim=[1, 2, 3])
    return (x if prune else input) * torch.exp((s1 / s2)[:, None, None, None])


def scale(x, percentile=65):
    return openood_shaping(x, percentile, prune=False)


def ash_s(x, percentile=65):
    return openood_shaping(x, percentile, prune=True)


def split_transform(M, idx):
    return M.T[:, :idx] @ M[:idx, :], M.T[:, idx:] @ M[idx:, :]


def find_c_idx(A, embs):
    _, _, V_t = torch.linalg.svd(A)
    ratios = []
    for idx in range(A.shape[1]):
        dec_t, insig_t = split_transform(V_t, idx)
        ratios.append((torch.norm(embs @ dec_t.T, dim=1).mean() - torch.norm(embs @ insig_t.T, dim=1).mean()).abs())
    return torch.tensor(ratios).argmin(0)


def f_cossim(emb, embs, k=10):
    n_emb = torch.nn.functional.normalize(emb, dim=1)
    n_embs = torch.nn.functional.normalize(embs, dim=1)
    return torch.topk(torch.matmul(n_emb, n_embs.permute(1, 0)), k, dim=1, largest=True)[0].mean(1)


def authors_actsub(train, x, W, b, func, percentile, lmbd):
    """``extract_train_samples.py`` (a tenth of the training embeddings, the seeded draw the detector documents),
    ``prep`` and ``postprocess`` with ``actsub`` (Equations 7, 9, 10)."""
    t_embs = train[torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(SAMPLE_SEED))[
        :train.shape[0] // 10]]
    c_idx = find_c_idx(W, t_embs)
    _, _, V_t = torch.linalg.svd(W)
    dec_transform, insig_transform = split_transform(V_t, c_idx)
    insig_train_samples = t_embs @ insig_transform.T
    dec = x @ dec_transform.T
    dec_act = func(dec.unsqueeze(2).unsqueeze(2), percentile=percentile).squeeze()
    dec_energy = torch.logsumexp(dec_act @ W.T + b, dim=1)
    insig_score = -(1. - f_cossim(x @ insig_transform.T, insig_train_samples)).log()
    return (dec_energy * insig_score ** lmbd).numpy(), int(c_idx)


@pytest.mark.parametrize("shaping, percentile, lmbd", [("scale", 90.0, 2.0), ("scale", 85.0, 1.0),
                                                      ("ash_s", 90.0, 0.5)])
def test_actsub_matches_the_authors_code(setting, shaping, percentile, lmbd):  # noqa: F811
    W, b = torch.from_numpy(setting.W), torch.from_numpy(setting.b)
    expected, c_idx = authors_actsub(torch.from_numpy(setting.F_fit), torch.from_numpy(setting.F_test), W, b,
                                     {"scale": scale, "ash_s": ash_s}[shaping], percentile, lmbd)
    assert 0 < c_idx < W.shape[1]  # both subspaces non-empty
    detector = setting.detector("actsub", shaping=shaping, percentile=percentile, lmbd=lmbd)
    assert detector.bank.shape == (setting.F_fit.shape[0] // 10, W.shape[1])
    np.testing.assert_allclose(detector.score(setting.x_test).double().numpy(), expected, rtol=RTOL)
    given = setting.detector("actsub", shaping=shaping, percentile=percentile, lmbd=lmbd, c_idx=c_idx)
    np.testing.assert_allclose(given.score(setting.x_test).double().numpy(), expected, rtol=RTOL)


def test_actsub_defaults_follow_the_authors_per_architecture(setting):  # noqa: F811
    assert DETECTORS["actsub"].defaults == {"shaping": "scale", "percentile": None, "lmbd": None, "c_idx": None}
    detector = get_detector("actsub", setting.model)
    # The tiny ViT's 16 features keep none at 97.5: 95 there.
    assert (detector.hyperparameters["percentile"], detector.hyperparameters["lmbd"]) == (
        (95.0, 1.0) if setting.arch == "vit" else (95.0, 2.0))
    with pytest.raises(ValueError, match=r"c_idx must be at most the feature width"):
        get_detector("actsub", setting.model, c_idx=100)
