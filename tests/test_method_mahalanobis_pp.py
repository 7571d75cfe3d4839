"""Mahalanobis++ (``mahalanobis_pp``) against the authors' ``mdsn_postprocessor.py`` (github.com/mueller-mp/maha-norm),
written again in numpy with sklearn's EmpiricalCovariance (:func:`test_method_rmds.authors_scores`, ``normalise``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import NUM_LABELS
from test_detectors import ToyClassifier
from test_method_rmds import (ARCHS, FLOAT64_TOLERANCE, check_fit_without_some_class_raises,
                              check_float32_model_is_fitted_and_scored_in_float64, check_matches_the_authors_code,
                              check_no_hyperparameters, data)
from hf_gsc.detectors import get_detector


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_the_authors_code(arch):
    check_matches_the_authors_code("mahalanobis_pp", arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_model_is_fitted_and_scored_in_float64(arch):
    check_float32_model_is_fitted_and_scored_in_float64("mahalanobis_pp", arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_normalisation_is_what_differs_from_mahalanobis(arch):
    """Where the feature norms vary (ResNet, affine-LayerNorm ViT) normalising changes the scores; where every
    feature has the same norm (plain final LayerNorm: ``||z|| = sqrt(D)``) it is one global scale, to which
    Mahalanobis distances are invariant, so the scores are Mahalanobis's."""
    d = data(arch)
    plain, normalised = d.score("mahalanobis").numpy(), d.score("mahalanobis_pp").numpy()
    if arch == "vit":
        norms = np.linalg.norm(d.F_fit, axis=-1)
        assert norms.std() < 1e-8 * norms.mean()
        np.testing.assert_allclose(normalised, plain, rtol=1e-6)  # the norms vary by the LayerNorm epsilon
    else:
        assert np.abs(normalised - plain).max() > 1e-2 * np.abs(plain).max()


def test_fitted_class_means_are_of_the_normalised_features():
    d = data("resnet")
    normalised = d.F_fit / np.linalg.norm(d.F_fit, axis=-1, keepdims=True)
    expected = np.stack([normalised[d.labels == c].mean(0) for c in range(NUM_LABELS)])
    np.testing.assert_allclose(d.detector("mahalanobis_pp").class_means.numpy(), expected, rtol=0, atol=1e-15)


def check_zero_feature_is_refused(method: str) -> None:
    """A fitting feature ``z = 0`` has no direction (the authors' code makes it NaN): the fit says so, naming the
    method, instead of failing in the eigendecomposition. Scoring one gives NaN, decided as OOD."""
    generator = torch.Generator().manual_seed(0)
    model = ToyClassifier()  # feature relu(x), 16-d, 4 classes
    labels = torch.arange(40) % 4
    x = torch.randn(40, 1, 1, 16, generator=generator, dtype=torch.float64).abs() + 0.1
    zero = x.clone()
    zero[5] = -1.0  # relu(-1) = 0: a zero feature
    with pytest.raises(ValueError, match=rf"detector '{method}' L2-normalises .* every ID fitting feature must be "
                                         r"finite and non-zero; a fitting batch has 1 of 20 zero or not finite"):
        get_detector(method, model).fit([(x[:20], labels[:20]), (zero[20:], labels[20:]), (zero[:20], labels[:20])])
    detector = get_detector(method, model).fit([(x[:20], labels[:20]), (x[20:], labels[20:])])
    scores = detector.score(zero[:8])
    assert torch.isfinite(scores[torch.arange(8) != 5]).all() and torch.isnan(scores[5])
    detector.config.threshold = float(scores[0])
    assert bool(detector.decide(scores)[5])


def test_zero_feature_is_refused():
    check_zero_feature_is_refused("mahalanobis_pp")


def test_no_hyperparameters():
    check_no_hyperparameters("mahalanobis_pp")


def test_fit_without_some_class_raises():
    check_fit_without_some_class_raises("mahalanobis_pp")
