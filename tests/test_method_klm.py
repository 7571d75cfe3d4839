"""KL matching against OpenOOD v1.5's kl_matching_postprocessor (the authors' code), written again with numpy and
scipy on the tiny models: templates by predicted class, one-hot for a class never predicted, ``-min_k entropy(p, q_k)``."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch
from sklearn.metrics import pairwise_distances_argmin_min
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import get_detector
from hf_gsc.detectors.klm import KLMDetector, kl_to_templates


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def reference_templates(fit_logits: np.ndarray, num_classes: int) -> np.ndarray:
    """OpenOOD's setup: the mean softmax of the samples predicted as each class, or e_i for a class without one."""
    probabilities, predicted = softmax(fit_logits), fit_logits.argmax(axis=1)
    templates = []
    for i in range(num_classes):
        if (predicted == i).sum() == 0:
            one_hot = np.zeros(num_classes)
            one_hot[i] = 1
            templates.append(one_hot)
        else:
            templates.append(probabilities[predicted == i].mean(0))
    return np.array(templates)


def reference_klm(test_logits: np.ndarray, templates: np.ndarray) -> np.ndarray:
    """OpenOOD's postprocess: -pairwise_distances_argmin_min(softmax, templates, metric=scipy.stats.entropy)[1]."""
    return -pairwise_distances_argmin_min(softmax(test_logits), templates,
                                          metric=lambda p, q: scipy.stats.entropy(p, q))[1]


def test_klm_matches_openood(setting):  # noqa: F811
    fit_logits = setting.F_fit @ setting.W.T + setting.b
    templates = reference_templates(fit_logits, setting.W.shape[0])
    detector = setting.detector("klm")
    np.testing.assert_allclose(detector.templates.numpy(), templates, rtol=1e-12, atol=1e-15)
    expected = reference_klm(setting.F_test @ setting.W.T + setting.b, templates)
    np.testing.assert_allclose(setting.score("klm"), expected, rtol=1e-9, atol=1e-12)


def test_klm_gives_a_never_predicted_class_a_one_hot_template(setting):  # noqa: F811
    """Fitted on the samples predicted as the most frequent class only: every other template is one-hot, and its
    divergence infinite (no softmax entry is 0), so the score is the divergence to the one class seen."""
    fit_logits = setting.F_fit @ setting.W.T + setting.b
    predicted = fit_logits.argmax(axis=1)
    common = np.bincount(predicted).argmax()
    rows = torch.from_numpy(np.flatnonzero(predicted == common))
    detector = get_detector("klm", setting.model).fit([(setting.x_fit[rows], setting.y_fit[rows])])
    templates = reference_templates(fit_logits[predicted == common], setting.W.shape[0])
    assert (templates.max(axis=1) == 1).sum() == setting.W.shape[0] - 1
    np.testing.assert_allclose(detector.templates.numpy(), templates, rtol=1e-12, atol=1e-15)
    expected = reference_klm(setting.F_test @ setting.W.T + setting.b, templates)
    assert np.isfinite(expected).all()
    np.testing.assert_allclose(detector.score(setting.x_test).numpy(), expected, rtol=1e-9, atol=1e-12)


def test_kl_follows_scipy_where_probabilities_are_zero():
    """A zero in ``p`` counts 0 (``0 log 0``); a zero in ``q`` where ``p`` is positive gives infinity."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.25, 0.5], [1.0, 0.0, 0.0]], dtype=torch.float64)
    expected = np.array([[scipy.stats.entropy(a, b) for b in q.numpy()] for a in p.numpy()])
    assert np.isinf(expected).sum() == 2
    # sum p log p - p . log q cancels about log(K) / KL digits of the direct sum (here 1e-16 absolute).
    np.testing.assert_allclose(kl_to_templates(p, q).numpy(), expected, rtol=1e-12)


def test_klm_fits_without_labels_and_has_no_settings(setting):  # noqa: F811
    assert not KLMDetector.needs_labels and KLMDetector.defaults == {} and KLMDetector.search_space == {}
    images = [setting.x_fit[:64], setting.x_fit[64:]]  # no labels: templates are by prediction
    unlabelled = get_detector("klm", setting.model).fit(images)
    torch.testing.assert_close(unlabelled.templates, setting.detector("klm").templates, rtol=1e-12, atol=1e-15)


def test_klm_refuses_a_fit_on_no_sample(setting):  # noqa: F811
    with pytest.raises(ValueError, match="klm"):
        get_detector("klm", setting.model).fit([])
