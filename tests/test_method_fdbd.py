"""fDBD against OpenOOD v1.5's fdbd_postprocessor (the authors' code), written again in numpy on the tiny models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import get_detector
from hf_gsc.detectors.fdbd import FDBDDetector, boundary_denominators


def openood_denominator_matrix(W: np.ndarray) -> np.ndarray:
    """OpenOOD's setup loop: row p holds ||w_j - w_p|| for every j, and 1 at j = p."""
    num_classes = W.shape[0]
    matrix = np.zeros((num_classes, num_classes))
    for p in range(num_classes):
        denominator = np.linalg.norm(W - W[p, :], axis=1)
        denominator[p] = 1
        matrix[p, :] = denominator
    return matrix


def reference_fdbd(features: np.ndarray, W: np.ndarray, b: np.ndarray, train_mean: np.ndarray,
                   distance_as_normalizer: bool) -> np.ndarray:
    """OpenOOD's postprocess: |y - max y| over the predicted row of the matrix, summed, over ||z - mu|| or ||z||."""
    output = features @ W.T + b
    values, nn_idx = output.max(axis=1), output.argmax(axis=1)
    logits_sub = np.abs(output - values[:, None])
    normaliser = np.linalg.norm(features - train_mean, axis=1) if distance_as_normalizer \
        else np.linalg.norm(features, axis=1)
    return np.sum(logits_sub / openood_denominator_matrix(W)[nn_idx], axis=1) / normaliser


@pytest.mark.parametrize("distance_as_normalizer", [True, False])
def test_fdbd_matches_openood(setting, distance_as_normalizer):  # noqa: F811
    expected = reference_fdbd(setting.F_test, setting.W, setting.b, setting.F_fit.mean(axis=0),
                              distance_as_normalizer)
    scores = setting.score("fdbd", distance_as_normalizer=distance_as_normalizer)
    np.testing.assert_allclose(scores, expected, rtol=1e-10)


def test_fdbd_fits_the_mean_of_every_training_feature_whatever_the_batches(setting):  # noqa: F811
    detector = get_detector("fdbd", setting.model).fit(setting.batches(size=7, limit=40))
    np.testing.assert_allclose(detector.train_mean.numpy(), setting.F_fit[:40].mean(axis=0), rtol=1e-12, atol=1e-14)
    assert detector.fitted_state().keys() == {"train_mean"}


def test_boundary_denominators_are_direct_differences_for_close_weight_rows():
    """40 classes (torch.cdist switches to |a|^2 + |b|^2 - 2 a.b above 25 rows) whose weight rows are 1e-6 apart
    at norm ~30: the expanded form cancels every digit there; OpenOOD's direct norm does not."""
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(1, 64, generator=generator, dtype=torch.float64) * 4
    weight = base + 1e-6 * torch.randn(40, 64, generator=generator, dtype=torch.float64)
    predicted = torch.tensor([0, 5, 39, 5])
    expected = openood_denominator_matrix(weight.numpy())[predicted.numpy()]
    np.testing.assert_allclose(boundary_denominators(weight, predicted).numpy(), expected, rtol=1e-12)


def test_fdbd_keeps_no_class_by_class_matrix(setting):  # noqa: F811
    """Only the predicted rows are computed, per batch: nothing K x K is held (3.8 GB at 21841 classes)."""
    detector = setting.detector("fdbd")
    num_classes = setting.W.shape[0]
    assert all(buffer.shape != (num_classes, num_classes) for buffer in detector.buffers())


def test_fdbd_defaults_and_grid_are_openoods():
    assert FDBDDetector.defaults == {"distance_as_normalizer": True}  # fdbd.yml postprocessor_args
    assert FDBDDetector.search_space == {"distance_as_normalizer": (True, False)}


@pytest.mark.parametrize("value", ["yes", 1, 0, None])
def test_fdbd_refuses_a_non_boolean_normaliser(setting, value):  # noqa: F811
    with pytest.raises(ValueError, match=r"FDBDConfig\.distance_as_normalizer must be True or False"):
        get_detector("fdbd", setting.model, distance_as_normalizer=value)
