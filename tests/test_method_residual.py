"""Residual against OpenOOD v1.5's ``residual_postprocessor.py`` (with ``configs/postprocessors/residual.yml``),
written again in numpy and sklearn on the tiny models."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.linalg import norm, pinv
from sklearn.covariance import EmpiricalCovariance
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import DETECTORS, get_detector


#: Against the float64 reference: the second moment from streamed sums and ``eigh`` here, from the centred features
#: and ``np.linalg.eig`` there (measured: at most 3e-13 relative on these models).
RTOL = 1e-11


def openood_residual(feature_id_train, feature_ood, w, b, dim):
    """``setup`` (on the ID validation features) and ``postprocess``: ``-||(z - u) NS||``."""
    u = -np.matmul(pinv(w), b)
    ec = EmpiricalCovariance(assume_centered=True)
    ec.fit(feature_id_train - u)
    eig_vals, eigen_vectors = np.linalg.eig(ec.covariance_)
    NS = np.ascontiguousarray((eigen_vectors.T[np.argsort(eig_vals * -1)[dim:]]).T)
    return -norm(np.matmul(feature_ood - u, NS), axis=-1)


@pytest.mark.parametrize("principal_dim", [None, 2, 5])
def test_residual_matches_openood(setting, principal_dim):  # noqa: F811
    width = setting.F_fit.shape[1]
    dim = principal_dim or width // 2  # the ViM authors' rule below 768 features
    expected = openood_residual(setting.F_fit, setting.F_test, setting.W, setting.b, dim)
    detector = setting.detector("residual", principal_dim=principal_dim)
    assert detector.residual_space.shape == (width, width - dim)
    np.testing.assert_allclose(detector.score(setting.x_test).double().numpy(), expected, rtol=RTOL)


def test_residual_defaults_fit_split_and_width_check(setting):  # noqa: F811
    assert DETECTORS["residual"].defaults == {"principal_dim": None}
    assert DETECTORS["residual"].fit_split == "validation"
    width = setting.F_fit.shape[1]
    with pytest.raises(ValueError, match=rf"principal_dim must be below the feature width {width}, got {width}"):
        get_detector("residual", setting.model, principal_dim=width)


def test_residual_shares_neco_s_streamed_moments(setting):  # noqa: F811
    """Both read the mean and covariance of every feature: one accumulator when fitted in one pass."""
    neco, residual = get_detector("neco", setting.model), get_detector("residual", setting.model)
    assert neco.fit_accumulator()[0] == residual.fit_accumulator()[0] == "mean and covariance"
