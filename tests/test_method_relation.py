"""Relation against OpenOOD v1.5's ``relation_postprocessor.py`` (``normalize``, ``kernel``, ``get_relation``, with
``configs/postprocessors/relation.yml``), written again in torch on the tiny models' public features."""

from __future__ import annotations

from math import ceil

import numpy as np
import pytest
import torch
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import DETECTORS
from hf_gsc.detectors.relation import relation_score


#: float64 on both sides; sums over the bank in another order (measured: at most 2.3e-16 relative on these models).
RTOL = 1e-12


def normalize(feat):
    return feat / torch.sqrt((feat ** 2).sum(-1) + 1e-10).reshape(-1, 1)


def kernel(feat, feat_t, prob, prob_t, split=2):
    size = ceil(len(feat_t) / split)
    rel_full = []
    for i in range(split):
        feat_t_ = feat_t[i * size:(i + 1) * size]
        prob_t_ = prob_t[i * size:(i + 1) * size]
        dot = torch.clamp(torch.matmul(feat, feat_t_.transpose(1, 0)), min=0.)
        rel_full.append(dot * torch.matmul(prob, prob_t_.transpose(1, 0)))
    return torch.cat(rel_full, dim=-1)


def get_relation(feat, feat_t, prob, prob_t, pow=1, chunk=50, thres=0.03):
    score = []
    for i in range(ceil(feat.shape[0] / chunk)):
        rel = kernel(feat[i * chunk:(i + 1) * chunk], feat_t, prob[i * chunk:(i + 1) * chunk], prob_t)
        rel_mask = (rel.abs() > thres) * rel
        score.append((rel_mask.sign() * (rel_mask.abs() ** pow)).sum(-1))
    return torch.cat(score, dim=0)


def openood_relation(setting, pow):  # noqa: F811
    """``setup``: the normalised training features and softmax probabilities; ``postprocess``: ``get_relation``."""
    W, b = torch.from_numpy(setting.W), torch.from_numpy(setting.b)
    train, test = torch.from_numpy(setting.F_fit), torch.from_numpy(setting.F_test)
    prob_train = torch.softmax(train @ W.T + b, dim=1)
    prob = torch.softmax(test @ W.T + b, dim=1)
    return get_relation(normalize(test), normalize(train), prob, prob_train, pow=pow).numpy()


@pytest.mark.parametrize("power", [1.0, 2.0, 6.0])
def test_relation_matches_openood(setting, power):  # noqa: F811
    expected = openood_relation(setting, power)
    detector = setting.detector("relation", power=power)
    assert detector.bank.shape == setting.F_fit.shape
    np.testing.assert_allclose(detector.score(setting.x_test).double().numpy(), expected, rtol=RTOL)


def test_the_cutoff_drops_edges_and_power_changes_after_the_fit(setting):  # noqa: F811
    detector = setting.detector("relation")
    detector.config.power = 2.0  # not structural: the bank is the same
    np.testing.assert_allclose(detector.score(setting.x_test).double().numpy(), openood_relation(setting, 2.0),
                               rtol=RTOL)
    detector.config.power = 1.0
    features = torch.nn.functional.normalize(torch.randn(3, 4, dtype=torch.float64), dim=1)
    probabilities = torch.softmax(torch.randn(3, 2, dtype=torch.float64), dim=1)
    everything = relation_score(features, probabilities, features, probabilities, 1.0, 0.0, chunk_rows=2)
    cut = relation_score(features, probabilities, features, probabilities, 1.0, 0.4, chunk_rows=2)
    relation = (features @ features.T).clamp(min=0) * (probabilities @ probabilities.T)
    np.testing.assert_allclose(everything.numpy(), relation.sum(1).numpy(), rtol=1e-14)
    np.testing.assert_allclose(cut.numpy(), (relation * (relation > 0.4)).sum(1).numpy(), rtol=1e-14)


def test_relation_defaults_and_grid():
    assert DETECTORS["relation"].defaults == {"power": 1.0, "cutoff": 0.03}
    assert DETECTORS["relation"].search_space == {"power": (1.0, 2.0, 4.0, 6.0, 8.0)}
    assert DETECTORS["relation"].fit_split == "train"
