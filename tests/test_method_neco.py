"""NECO against the authors' code (gitlab.com/drti/neco, its ``neco()`` evaluation), written again in numpy with
sklearn's StandardScaler and PCA on the tiny models; the default ``neco_dim`` against the 90% rule of the other public
NECO postprocessors (maha-norm's OpenOOD ``neco_postprocessor.py``, the ORA authors' ``neco_score``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from numpy import linalg as LA
from sklearn.decomposition import PCA
from sklearn.preprocessing import StandardScaler
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import DETECTORS, get_detector
from hf_gsc.detectors.neco import NECODetector


#: Against the float64 reference: sklearn's SVD of the centred standardised features and the eigendecomposition of
#: their streamed covariance here agree to rounding (measured: at most 1.7e-14 relative on these models).
RTOL = 1e-12


def authors_neco(feature_id_train, feature_id_val, logit_id_val, model_architecture_type, neco_dim):
    """The authors' ``neco()``, the ID side: scaler and PCA on the training features, the norm of the first
    ``neco_dim`` PCA coordinates over the norm of the standardised vector (the raw one for DeiT / Swin), times the max
    logit for every architecture but ResNet."""
    ss = StandardScaler()
    complete_vectors_train = ss.fit_transform(feature_id_train)
    complete_vectors_test = ss.transform(feature_id_val)
    pca_estimator = PCA(feature_id_train.shape[1])
    _ = pca_estimator.fit_transform(complete_vectors_train)
    cls_test_reduced_all = pca_estimator.transform(complete_vectors_test)
    score_id_maxlogit = logit_id_val.max(axis=-1)
    if model_architecture_type in ["deit", "swin"]:
        complete_vectors_test = feature_id_val
    cls_test_reduced = cls_test_reduced_all[:, :neco_dim]
    l_ID = []
    for i in range(cls_test_reduced.shape[0]):
        sc_complet = LA.norm(complete_vectors_test[i, :])
        sc = LA.norm(cls_test_reduced[i, :])
        l_ID.append(sc / sc_complet)
    score_id = np.array(l_ID)
    if model_architecture_type != "resnet":
        score_id *= score_id_maxlogit
    return score_id


def ninety_percent_dim(feature_id_train):
    """maha-norm's / ORA's ``neco_dim``: the first cumulative explained-variance ratio at or above 0.90, plus one."""
    pca = PCA().fit(StandardScaler().fit_transform(feature_id_train))
    return int(np.where(np.cumsum(pca.explained_variance_ratio_) >= 0.90)[0][0] + 1)


@pytest.mark.parametrize("architecture_type", ["as the model", "resnet", "vit", "swin"])
@pytest.mark.parametrize("neco_dim", [3, None])
def test_neco_matches_the_authors_code(setting, architecture_type, neco_dim):  # noqa: F811
    """Each branch of the code's architecture rule, by the settings it maps to (``as the model``: the defaults)."""
    arch = setting.arch if architecture_type == "as the model" else architecture_type
    logits = setting.F_test @ setting.W.T + setting.b
    dim = neco_dim or ninety_percent_dim(setting.F_fit)
    assert 1 < dim < setting.F_fit.shape[1]
    expected = authors_neco(setting.F_fit, setting.F_test, logits, arch, dim)
    switches = {} if architecture_type == "as the model" else {"max_logit": arch != "resnet",
                                                                   "raw_norm": arch in ("deit", "swin")}
    detector = setting.detector("neco", neco_dim=neco_dim, **switches)
    assert detector.neco_dim == dim and detector.axes.shape == (setting.F_fit.shape[1],) * 2
    np.testing.assert_allclose(detector.score(setting.x_test).double().numpy(), expected, rtol=RTOL)


def test_defaults_follow_the_authors_architecture_rule(setting):  # noqa: F811
    detector = get_detector("neco", setting.model)
    assert detector.hyperparameters["max_logit"] is (setting.arch != "resnet")
    assert detector.hyperparameters["raw_norm"] is False
    assert DETECTORS["neco"].defaults == {"neco_dim": None, "max_logit": None, "raw_norm": None}
    assert NECODetector.search_space == {}


def test_neco_keeps_statistics_not_features(setting):  # noqa: F811
    """The fit streams sums: the store of every feature is never made, and the state is the scaler and the axes."""
    detector = setting.detector("neco")
    assert detector.fit_accumulator()[0] == "mean and covariance"
    np.testing.assert_allclose(detector.mean.numpy(), setting.F_fit.mean(axis=0), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(detector.scale.numpy(), StandardScaler().fit(setting.F_fit).scale_, rtol=1e-9)
    assert detector.fitted_state().keys() == {"mean", "scale", "axes", "variances"}


def test_neco_dim_changes_after_the_fit_without_another(setting):  # noqa: F811
    """Every axis is kept: assigning ``neco_dim`` on a fitted detector scores as a detector fitted with it."""
    detector = get_detector("neco", setting.model).fit(setting.batches())
    detector.config.neco_dim = 2
    np.testing.assert_allclose(detector.score(setting.x_test).double().numpy(),
                               setting.score("neco", neco_dim=2), rtol=0, atol=0)


def test_neco_dim_is_checked_against_the_feature_width(setting):  # noqa: F811
    width = setting.F_fit.shape[1]
    with pytest.raises(ValueError, match=rf"neco_dim must be at most the feature width {width}, got {width + 1}"):
        get_detector("neco", setting.model, neco_dim=width + 1)
    with pytest.raises(ValueError, match=r"NECOConfig\.max_logit must be True, False or None"):
        get_detector("neco", setting.model, max_logit=1)


def test_a_constant_feature_is_scaled_by_one_as_sklearn_does():
    from hf_gsc.detectors.neco import standard_scale
    variance = torch.tensor([0.0, 4.0, 1e-40], dtype=torch.float64)
    mean = torch.tensor([3.0, 1.0, 1.0], dtype=torch.float64)
    scaler = StandardScaler().fit(np.array([[3.0, -1.0, 1.0], [3.0, 3.0, 1.0 + 2e-20]]))
    np.testing.assert_array_equal(standard_scale(variance, mean, 2).numpy(), [1.0, 2.0, 1.0])
    np.testing.assert_array_equal(scaler.scale_, [1.0, 2.0, 1.0])
