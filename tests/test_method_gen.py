"""GEN against OpenOOD's gen_postprocessor (the authors' formula), and exact where float32 rounds 1 - p to 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_gsc.detectors import get_detector
from hf_gsc.detectors.gen import gen_score

from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)


def reference_gen(logits: np.ndarray, gamma: float, top: int) -> np.ndarray:
    """OpenOOD's generalized_entropy: softmax, sort ascending, keep the last M, -sum p^g (1 - p)^g (float64)."""
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    kept = np.sort(probabilities, axis=1)[:, -top:]
    return -np.sum(kept ** gamma * (1 - kept) ** gamma, axis=1)


@pytest.mark.parametrize("gamma, top", [(0.1, 100), (0.5, 3), (2.0, 1)])
def test_gen_matches_openood(setting, gamma, top):  # noqa: F811
    logits = setting.F_test @ setting.W.T + setting.b
    expected = reference_gen(logits, gamma, top)
    np.testing.assert_allclose(setting.score("gen", gamma=gamma, top=top), expected, rtol=1e-9)


def test_gen_keeps_the_confident_sample_apart():
    """Logit gaps of 40 and 45: float32 softmax gives p = 1 exactly for both, so 1 - p = 0 and both would score 0;
    the exact complement (the other probabilities' mass) keeps them apart, and in the right order."""
    logits = torch.tensor([[40.0, 0.0, 0.0], [45.0, 0.0, 0.0]])
    assert torch.equal(torch.softmax(logits, dim=-1)[:, 0], torch.ones(2))  # float32 loses 1 - p
    scores = gen_score(logits, gamma=0.1, top=100)
    complement = 2 * np.exp(-np.array([40.0, 45.0]))  # 1 - p_max to float64 precision (p_max ~ 1 - 2e^-gap)
    p_small = np.exp(-np.array([40.0, 45.0])) / (1 + 2 * np.exp(-np.array([40.0, 45.0])))
    expected = -((1 - complement) ** 0.1 * complement ** 0.1 + 2 * p_small ** 0.1 * (1 - p_small) ** 0.1)
    np.testing.assert_allclose(scores.numpy(), expected, rtol=1e-6)
    assert scores[1] > scores[0]  # more confident = more in-distribution


def test_gen_rejects_bad_settings():
    from conftest import make_tiny_model

    with pytest.raises(ValueError, match="gamma"):
        get_detector("gen", make_tiny_model("vit"), gamma=0.0)
    with pytest.raises(ValueError, match="top"):
        get_detector("gen", make_tiny_model("vit"), top=0)
