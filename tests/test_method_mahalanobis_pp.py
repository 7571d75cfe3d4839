"""Mahalanobis++ (``mahalanobis_pp``) against the authors' ``mdsn_postprocessor.py`` (github.com/mueller-mp/maha-norm),
written again in numpy with sklearn's EmpiricalCovariance (:func:`test_method_rmds.authors_scores`, ``normalise``);
its ``beta`` setting (``z / ||z||^beta``, Janiak et al., arXiv:2510.15202) against the same code with the
normalisation raised to that power."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import NUM_LABELS
from safetensors.torch import load_file
from test_detectors import ToyClassifier
from test_method_rmds import (
    ARCHS,
    FLOAT64_TOLERANCE,
    authors_scores,
    check_fit_without_some_class_raises,
    check_float32_model_is_fitted_and_scored_in_float64,
    check_matches_the_authors_code,
    data,
)

from hf_gsc import AutoOODDetector
from hf_gsc.detectors import DETECTORS, get_detector
from hf_gsc.detectors.backbone_pass import fit_together


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


def radially_scaled_reference(features: np.ndarray, beta: float) -> np.ndarray:
    """The paper's ``phi_beta(z) = z / ||z||^beta``, as the maha-norm code's ``feats / torch.norm(feats, dim=-1,
    keepdim=True)`` raised to ``beta``."""
    return features / np.linalg.norm(features, axis=-1, keepdims=True) ** beta


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("beta", [0.5, 2.0, -0.5])
def test_radially_scaled_matches_the_authors_code_with_the_power(arch, beta):
    """``beta``: the mdsn code on ``z / ||z||^beta`` (mds on the scaled features), fitted and scored alike."""
    d = data(arch)
    expected = authors_scores(radially_scaled_reference(d.F_fit, beta), d.labels,
                              radially_scaled_reference(d.F_test, beta), relative=False, normalise=False)
    actual = get_detector("mahalanobis_pp", d.model, beta=beta).fit(d.batches()).score(d.x_test)
    np.testing.assert_allclose(actual.numpy(), expected, rtol=0,
                               atol=FLOAT64_TOLERANCE[arch] * np.abs(expected).max())
    if arch == "resnet":  # the setting does change the scores where the norms vary
        assert np.abs(actual.numpy() - d.score("mahalanobis_pp").numpy()).max() > 1e-3 * np.abs(expected).max()


def test_beta_defaults_to_the_published_normalisation_and_zero_is_mahalanobis():
    d = data("resnet")
    assert DETECTORS["mahalanobis_pp"].defaults == {"beta": 1.0}
    assert DETECTORS["mahalanobis_pp"].search_space == {}
    plain = get_detector("mahalanobis_pp", d.model, beta=0.0).fit(d.batches()).score(d.x_test)
    torch.testing.assert_close(plain, d.score("mahalanobis"), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match=r"MahalanobisPPConfig\.beta must be a finite number, got inf"):
        get_detector("mahalanobis_pp", d.model, beta=float("inf"))


def test_detectors_of_different_beta_fitted_together_keep_their_own_statistics():
    """The shared pass keeps one set of sums per feature shaping: two ``beta`` fitted in one pass (and rmds_pp, whose
    normalisation is ``beta = 1``) each score as when fitted alone."""
    d = data("resnet")
    detectors = [get_detector("mahalanobis_pp", d.model), get_detector("mahalanobis_pp", d.model, beta=0.5),
                 get_detector("rmds_pp", d.model)]
    fit_together(detectors, d.batches())
    alone = get_detector("mahalanobis_pp", d.model, beta=0.5).fit(d.batches())
    torch.testing.assert_close(detectors[1].score(d.x_test), alone.score(d.x_test), rtol=0, atol=0)
    torch.testing.assert_close(detectors[0].score(d.x_test), d.score("mahalanobis_pp"), rtol=0, atol=0)
    torch.testing.assert_close(detectors[2].score(d.x_test), d.score("rmds_pp"), rtol=0, atol=0)


def test_a_zero_feature_is_allowed_where_beta_divides_by_no_positive_power():
    generator = torch.Generator().manual_seed(0)
    model = ToyClassifier()
    labels = torch.arange(40) % 4
    x = torch.randn(40, 1, 1, 16, generator=generator, dtype=torch.float64).abs() + 0.1
    x[5] = -1.0  # relu(-1) = 0: a zero feature
    with pytest.raises(ValueError, match=r"z / \|\|z\|\|_2\^beta, beta = 0\.5"):
        get_detector("mahalanobis_pp", model, beta=0.5).fit([(x, labels)])
    assert torch.isfinite(get_detector("mahalanobis_pp", model, beta=-1.0).fit([(x, labels)]).score(x[:8])).all()


def test_fit_without_some_class_raises():
    check_fit_without_some_class_raises("mahalanobis_pp")


def test_beta_one_saves_as_before_the_setting_and_another_beta_is_refused_at_load(tmp_path):
    """A state fitted with ``beta = 1`` is saved as before ``beta`` existed (no ``fitted_beta`` tensor, no ``beta`` in
    the calibration record), so such a folder, without ``beta`` among its settings too, loads with its threshold;
    loading a fitted state with another ``beta`` than its own is refused, naming it (its means and precision are of
    other features)."""
    d = data("resnet")
    detector = get_detector("mahalanobis_pp", d.model).fit(d.batches())
    detector.calibrate(d.x_fit[:100])
    detector.save_pretrained(tmp_path / "one")
    saved = json.loads((tmp_path / "one" / "detector_config.json").read_text())
    assert saved["hyperparameters"] == {"beta": 1.0} and saved["calibration"]["settings"] == {}
    assert set(load_file(str(tmp_path / "one" / "detector_state.safetensors"))) == {"class_means", "precision",
                                                                                   "calibration_scores"}
    saved["hyperparameters"] = {}
    (tmp_path / "one" / "detector_config.json").write_text(json.dumps(saved))
    old = AutoOODDetector.from_pretrained(tmp_path / "one", model=d.model)
    assert old.config.beta == 1.0 and old.config.threshold == detector.config.threshold
    torch.testing.assert_close(old.score(d.x_test), detector.score(d.x_test), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"fitted state is of z / \|\|z\|\|\^beta with beta=1, but beta=0\.5; "
                                         r"load it with beta=1"):
        AutoOODDetector.from_pretrained(tmp_path / "one", model=d.model, beta=0.5)
    get_detector("mahalanobis_pp", d.model, beta=0.5).fit(d.batches()).save_pretrained(tmp_path / "half")
    assert load_file(str(tmp_path / "half" / "detector_state.safetensors"))["fitted_beta"].tolist() == [0.5]
    with pytest.raises(ValueError, match=r"with beta=0\.5, but beta=1; load it with beta=0\.5"):
        AutoOODDetector.from_pretrained(tmp_path / "half", model=d.model, beta=1.0)
    assert AutoOODDetector.from_pretrained(tmp_path / "half", model=d.model).config.beta == 0.5
