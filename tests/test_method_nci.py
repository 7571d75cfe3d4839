"""NCI against OpenOOD v1.5's nci_postprocessor (the authors' code), written again in numpy on the tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import get_detector
from hf_gsc.detectors.nci import NCIDetector, nci_score
from hf_gsc.detectors.penultimate import LinearHead


def reference_nci(features: np.ndarray, W: np.ndarray, b: np.ndarray, train_mean: np.ndarray, alpha: float
                  ) -> np.ndarray:
    """OpenOOD's postprocess: sum(w[nn_idx] * (z - mu)) / ||z - mu|| + alpha ||z||_1, nn_idx the logits' arg max."""
    nn_idx = (features @ W.T + b).argmax(axis=1)
    centred = features - train_mean
    return np.sum(W[nn_idx] * centred, axis=1) / np.linalg.norm(centred, axis=1) \
        + alpha * np.linalg.norm(features, ord=1, axis=1)


@pytest.mark.parametrize("alpha", [0.0001, 0.1, 0.0])
def test_nci_matches_openood(setting, alpha):  # noqa: F811
    expected = reference_nci(setting.F_test, setting.W, setting.b, setting.F_fit.mean(axis=0), alpha)
    np.testing.assert_allclose(setting.score("nci", alpha=alpha), expected, rtol=1e-10)


def test_nci_predicts_with_the_bias_and_aligns_without_it():
    """The bias moves the arg max from class 0 to class 1 (logits 2 and 5): the proximity is then to w_1, and the
    bias itself is not added to it."""
    head = LinearHead(torch.eye(2, dtype=torch.float64), torch.tensor([0.0, 5.0], dtype=torch.float64))
    features = torch.tensor([[2.0, 0.0], [0.0, -3.0]], dtype=torch.float64)
    scores = nci_score(features, head, train_mean=torch.zeros(2, dtype=torch.float64), alpha=0.5)
    # Row 1: y = (0, 2), class 1, w_1 . z / ||z|| = -1.
    assert scores.tolist() == [0.0 + 0.5 * 2.0, -1.0 + 0.5 * 3.0]


def test_nci_fits_the_mean_of_every_training_feature_whatever_the_batches(setting):  # noqa: F811
    detector = get_detector("nci", setting.model).fit(setting.batches(size=7, limit=40))
    np.testing.assert_allclose(detector.train_mean.numpy(), setting.F_fit[:40].mean(axis=0), rtol=1e-12, atol=1e-14)
    assert detector.fitted_state().keys() == {"train_mean"}


def test_nci_defaults_and_grid_are_openoods():
    assert NCIDetector.defaults == {"alpha": 0.0001}  # nci.yml postprocessor_args
    assert NCIDetector.search_space == {"alpha": (0.0001, 0.001, 0.01, 0.1)}


@pytest.mark.parametrize("alpha", [-0.1, float("inf"), True, "0.1"])
def test_nci_rejects_a_bad_alpha(setting, alpha):  # noqa: F811
    with pytest.raises(ValueError, match="alpha must be"):
        get_detector("nci", setting.model, alpha=alpha)
