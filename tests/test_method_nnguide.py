"""NNGuide against OpenOOD's nnguide_postprocessor (the authors' formula; faiss IndexFlatIP by brute force)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

from hf_gsc.detectors.nnguide import top_k_mean_similarity

from test_detectors import NUM_FIT, setting  # noqa: F401  (tiny ViT and ResNet with fitting data)


def normalizer(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True) + 1e-10


@pytest.mark.parametrize("k, alpha", [(5, 0.5), (10, 0.01), (3, 1.0)])
def test_nnguide_matches_the_authors_code(setting, k, alpha):  # noqa: F811
    rows = min(NUM_FIT, max(k, math.ceil(alpha * NUM_FIT)))  # the first ceil(alpha N) fitting samples, at least k
    bank_feas = normalizer(setting.F_fit[:rows])
    bank_confs = logsumexp(setting.F_fit[:rows] @ setting.W.T + setting.b, axis=-1)
    bank_guide = bank_feas * bank_confs[:, None]
    feas_norm = normalizer(setting.F_test)
    similarities = feas_norm @ bank_guide.T  # IndexFlatIP: inner products, the k largest
    conf = np.sort(similarities, axis=1)[:, ::-1][:, :k].mean(axis=1)
    expected = conf * logsumexp(setting.F_test @ setting.W.T + setting.b, axis=-1)
    np.testing.assert_allclose(setting.score("nnguide", k=k, alpha=alpha), expected, rtol=1e-9)
    assert setting.detector("nnguide", k=k, alpha=alpha).bank_guide.shape == (rows, setting.F_fit.shape[1])


def test_chunked_top_k_equals_whole_bank():
    generator = torch.Generator().manual_seed(0)
    query, bank = torch.randn(7, 5, generator=generator), torch.randn(103, 5, generator=generator)
    whole = (query @ bank.T).topk(9, dim=1).values.mean(dim=1)
    for chunk_size in (1, 8, 50, 103, 1000):
        torch.testing.assert_close(top_k_mean_similarity(query, bank, 9, chunk_size), whole)
