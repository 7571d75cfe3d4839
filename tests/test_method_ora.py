"""ORA against the authors' OpenOOD postprocessor (github.com/berkerdemirel/OpenOOD,
``openood/postprocessors/ora_postprocessor.py``), written again in numpy, class by class as the code loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import DETECTORS
from hf_gsc.detectors.ora import ora_score, relative_angles
from hf_gsc.detectors.penultimate import LinearHead


#: The code's arccos of a clamped cosine loses about half the digits where an angle is near 0 or pi (an error of
#: ``eps / sin(angle)``); elsewhere the two agree to rounding. Measured on these models: at most 6.1e-15.
ATOL = 1e-12


def normalize(x: np.ndarray) -> np.ndarray:
    """``F.normalize(x, p=2, dim=1)``: ``x / max(||x||, 1e-12)``."""
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def authors_setup(train_features, train_labels, num_classes):
    """``ORAPostprocessor.setup``: the mean of the class means of the training features."""
    class_sum = np.zeros((num_classes, train_features.shape[1]))
    class_count = np.zeros(num_classes)
    np.add.at(class_sum, train_labels, train_features)
    np.add.at(class_count, train_labels, 1.0)
    return (class_sum / np.maximum(class_count, 1)[:, None]).mean(axis=0)


def authors_postprocess(mean_of_class_means, features, W, b, aggregation):
    """``ORAPostprocessor.postprocess``'s score."""
    num_classes = W.shape[0]
    output = features @ W.T + b
    preds = output.argmax(axis=1)
    max_logits = output.max(axis=1)
    norm_centered_feats = normalize(features - mean_of_class_means)
    trajectory = np.zeros((features.shape[0], num_classes))
    with np.errstate(divide="ignore", invalid="ignore"):
        for c in range(num_classes):
            logit_diff = max_logits - output[:, c]
            weight_diff = W[preds] - W[c]
            weight_diff_norm_sq = (weight_diff * weight_diff).sum(axis=1)
            scale = (logit_diff / weight_diff_norm_sq)[:, None]
            feats_db = features - scale * weight_diff
            norm_centered_db = normalize(feats_db - mean_of_class_means)
            cos_sim = (norm_centered_feats * norm_centered_db).sum(axis=1)
            trajectory[:, c] = np.arccos(np.clip(cos_sim, -1.0, 1.0)) / np.pi
    if aggregation == "min":
        return np.where(np.isnan(trajectory), np.inf, trajectory).min(axis=1)
    trajectory = np.nan_to_num(trajectory, nan=0.0)
    return trajectory.max(axis=1) if aggregation == "max" else trajectory.mean(axis=1)


@pytest.mark.parametrize("aggregation", ["mean", "max", "min"])
def test_ora_matches_the_authors_postprocessor(setting, aggregation):  # noqa: F811
    centre = authors_setup(setting.F_fit, setting.labels, setting.W.shape[0])
    expected = authors_postprocess(centre, setting.F_test, setting.W, setting.b, aggregation)
    actual = setting.score("ora", aggregation=aggregation)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=ATOL)
    assert np.ptp(expected) > 1e-3  # the scores differ between the test images


def test_ora_centre_is_the_mean_of_the_training_class_means(setting):  # noqa: F811
    """Not the mean of the features (the classes are unbalanced here), and from the training data only."""
    detector = setting.detector("ora")
    class_means = np.stack([setting.F_fit[setting.labels == c].mean(0) for c in range(setting.W.shape[0])])
    np.testing.assert_allclose(detector.centre.numpy(), class_means.mean(0), rtol=1e-12, atol=1e-14)
    assert not np.allclose(class_means.mean(0), setting.F_fit.mean(0), rtol=1e-6)
    assert DETECTORS["ora"].defaults == {"aggregation": "mean"}
    assert DETECTORS["ora"].search_space == {"aggregation": ("mean", "max", "min")}


def test_undefined_angles_are_the_codes():
    """The predicted class and a class with the same weight row (the code's 0 / 0) count 0 in the mean and are left
    out of the min; a feature at the centre has angle 1/2 to every boundary (``F.normalize`` of zero)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    weight[3] = weight[1]
    head = LinearHead(weight, torch.randn(4, generator=generator, dtype=torch.float64))
    centre = torch.randn(6, generator=generator, dtype=torch.float64)
    features = torch.randn(5, 6, generator=generator, dtype=torch.float64)
    features[4] = centre
    angles, defined = relative_angles(features, head, centre)
    predicted = head(features).argmax(dim=-1)
    for row, p in enumerate(predicted.tolist()):
        expected = [c != p and not (p in (1, 3) and c in (1, 3)) for c in range(4)]
        assert defined[row].tolist() == expected
    assert torch.equal(angles[4][defined[4]], torch.full_like(angles[4][defined[4]], 0.5))
    for aggregation in ("mean", "max", "min"):
        expected = authors_postprocess(centre.numpy(), features.numpy(), weight.numpy(), head.bias.numpy(),
                                       aggregation)
        np.testing.assert_allclose(ora_score(features, head, centre, aggregation).numpy(), expected, rtol=0,
                                   atol=ATOL)
