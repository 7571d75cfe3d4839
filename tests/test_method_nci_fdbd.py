"""NCI and fDBD against OpenOOD v1.5's nci_postprocessor / fdbd_postprocessor, written again in numpy."""

from __future__ import annotations

import numpy as np
import pytest

from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)


@pytest.mark.parametrize("alpha", [0.0001, 0.1])
def test_nci_matches_openood(setting, alpha):  # noqa: F811
    mean = setting.F_fit.mean(axis=0)
    logits = setting.F_test @ setting.W.T + setting.b
    w = setting.W[logits.argmax(axis=1)]
    centred = setting.F_test - mean
    expected = np.sum(w * centred, axis=1) / np.linalg.norm(centred, axis=1) \
        + alpha * np.linalg.norm(setting.F_test, ord=1, axis=1)
    np.testing.assert_allclose(setting.score("nci", alpha=alpha), expected, rtol=1e-9)


@pytest.mark.parametrize("distance_as_normalizer", [True, False])
def test_fdbd_matches_openood(setting, distance_as_normalizer):  # noqa: F811
    W, b = setting.W, setting.b
    num_classes = b.shape[0]
    denominator_matrix = np.zeros((num_classes, num_classes))
    for p in range(num_classes):  # OpenOOD's setup loop
        denominator = np.linalg.norm(W - W[p, :], axis=1)
        denominator[p] = 1
        denominator_matrix[p, :] = denominator
    output = setting.F_test @ W.T + b
    values, nn_idx = output.max(axis=1), output.argmax(axis=1)
    logits_sub = np.abs(output - values[:, None])
    normaliser = np.linalg.norm(setting.F_test - setting.F_fit.mean(axis=0), axis=1) if distance_as_normalizer \
        else np.linalg.norm(setting.F_test, axis=1)
    expected = np.sum(logits_sub / denominator_matrix[nn_idx], axis=1) / normaliser
    np.testing.assert_allclose(setting.score("fdbd", distance_as_normalizer=distance_as_normalizer), expected,
                               rtol=1e-9)


def test_fdbd_refuses_a_non_boolean_normaliser(setting):  # noqa: F811
    from hf_gsc.detectors import get_detector

    with pytest.raises(ValueError, match="distance_as_normalizer must be True or False"):
        get_detector("fdbd", setting.model, distance_as_normalizer="yes")
