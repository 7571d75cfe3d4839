"""RMDS++ (``rmds_pp``) against the authors' ``rmdsn_postprocessor.py`` (github.com/mueller-mp/maha-norm), written
again in numpy with sklearn's EmpiricalCovariance (:func:`test_method_rmds.authors_scores`, relative, normalised)."""

from __future__ import annotations

import numpy as np
import pytest
from test_method_mahalanobis_pp import check_zero_feature_is_refused
from test_method_rmds import (
    ARCHS,
    FLOAT64_TOLERANCE,
    check_fit_without_some_class_raises,
    check_float32_model_is_fitted_and_scored_in_float64,
    check_matches_the_authors_code,
    check_no_hyperparameters,
    data,
    precision_of,
)


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_the_authors_code(arch):
    check_matches_the_authors_code("rmds_pp", arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_model_is_fitted_and_scored_in_float64(arch):
    check_float32_model_is_fitted_and_scored_in_float64("rmds_pp", arch)


@pytest.mark.parametrize("arch", ["resnet", "vit-affine"])
def test_background_gaussian_is_of_the_normalised_features(arch):
    """``rmds_pp = mahalanobis_pp + d_0`` with ``d_0`` under the Gaussian of all normalised training features."""
    d = data(arch)
    def normalise(f):
        return f / np.linalg.norm(f, axis=-1, keepdims=True)
    fit, test = normalise(d.F_fit), normalise(d.F_test)
    whole_mean = fit.mean(0)
    np.testing.assert_allclose(d.detector("rmds_pp").background_mean.numpy(), whole_mean, rtol=0, atol=1e-15)
    t = test - whole_mean
    d0 = np.einsum("bd,de,be->b", t, precision_of(fit - whole_mean), t)
    difference = (d.score("rmds_pp") - d.score("mahalanobis_pp")).numpy()
    np.testing.assert_allclose(difference, d0, rtol=0, atol=FLOAT64_TOLERANCE[arch] * d0.max())
    assert np.abs(d.score("rmds_pp").numpy() - d.score("rmds").numpy()).max() > 1e-2  # normalising matters here


def test_zero_feature_is_refused():
    check_zero_feature_is_refused("rmds_pp")


def test_no_hyperparameters():
    check_no_hyperparameters("rmds_pp")


def test_fit_without_some_class_raises():
    check_fit_without_some_class_raises("rmds_pp")
