"""RMDS, Mahalanobis++ and RMDS++ against their authors' code (OpenOOD's rmds_postprocessor; maha-norm's
mdsn_ / rmdsn_postprocessor), written again with numpy and sklearn's EmpiricalCovariance."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.covariance import EmpiricalCovariance

from test_detectors import NUM_LABELS, setting  # noqa: F401  (tiny ViT and ResNet with fitting data)


def _reference(features_fit, labels, features_test, relative: bool) -> np.ndarray:
    class_mean = np.stack([features_fit[labels == c].mean(axis=0) for c in range(NUM_LABELS)])
    centred = np.concatenate([features_fit[labels == c] - class_mean[c] for c in range(NUM_LABELS)])
    precision = EmpiricalCovariance(assume_centered=False).fit(centred).precision_
    class_scores = np.stack([-np.einsum("bd,de,be->b", features_test - mu, precision, features_test - mu)
                             for mu in class_mean], axis=1)
    if relative:
        whole_mean = features_fit.mean(axis=0)
        whole_precision = EmpiricalCovariance(assume_centered=False).fit(features_fit - whole_mean).precision_
        tensor1 = features_test - whole_mean
        background = -np.einsum("bd,de,be->b", tensor1, whole_precision, tensor1)
        class_scores = class_scores - background[:, None]
    return class_scores.max(axis=1)


def _normalised(features: np.ndarray) -> np.ndarray:
    return features / np.linalg.norm(features, axis=-1, keepdims=True)


@pytest.mark.parametrize("method, normalised, relative", [
    ("rmds", False, True), ("mahalanobis_pp", True, False), ("rmds_pp", True, True)])
def test_matches_the_authors_code(setting, method, normalised, relative):  # noqa: F811
    prepare = _normalised if normalised else (lambda f: f)
    expected = _reference(prepare(setting.F_fit), setting.labels, prepare(setting.F_test), relative)
    np.testing.assert_allclose(setting.score(method), expected, rtol=1e-6)


def test_normalisation_changes_the_scores(setting):  # noqa: F811
    if setting.arch == "vit":  # LayerNorm features all have norm sqrt(D): normalising is one global scale, to which
        return                  # Mahalanobis distances are invariant
    assert not np.allclose(setting.score("mahalanobis_pp"), setting.score("mahalanobis"))
    assert not np.allclose(setting.score("rmds_pp"), setting.score("rmds"))


def test_rmds_background_is_the_covariance_of_all_features(setting):  # noqa: F811
    detector = setting.detector("rmds")
    mean = setting.F_fit.mean(axis=0)
    covariance = EmpiricalCovariance(assume_centered=False).fit(setting.F_fit)
    np.testing.assert_allclose(detector.background_mean.numpy(), mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(detector.background_precision.numpy(), covariance.precision_, rtol=1e-5,
                               atol=1e-7 * np.abs(covariance.precision_).max())
