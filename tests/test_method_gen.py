"""GEN against the authors' generalized entropy (OpenOOD v1.5 gen_postprocessor, XixiLiu95/GEN benchmark.py),
written again: in numpy on the tiny models, and with 500-digit decimals where float32 or float64 would round."""

from __future__ import annotations

from decimal import Decimal, localcontext

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import get_detector
from hf_gsc.detectors.gen import GENDetector, gen_score


def reference_gen(logits: np.ndarray, gamma: float, top: int) -> np.ndarray:
    """The authors' generalized_entropy: softmax, sort ascending, keep the last M, -sum p^g (1 - p)^g (float64)."""
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    kept = np.sort(probabilities, axis=1)[:, -top:]
    return -np.sum(kept ** gamma * (1 - kept) ** gamma, axis=1)


def exact_gen(logits, gamma: float, top: int) -> list[float]:
    """The same formula at 500 significant digits (``decimal``): neither ``1 - p`` nor ``p`` rounds for logit gaps
    below ~1000."""
    scores = []
    with localcontext() as context:
        context.prec = 500
        for row in np.asarray(logits, dtype=np.float64):
            values = [Decimal(float(v)) for v in row]  # exact: every float is a decimal
            largest = max(values)
            weights = [(v - largest).exp() for v in values]
            total = sum(weights)
            kept = sorted(w / total for w in weights)[-top:]
            g = Decimal(gamma)
            scores.append(float(-sum(p ** g * (1 - p) ** g for p in kept)))
    return scores


@pytest.mark.parametrize("gamma, top", [(0.1, 100), (0.5, 3), (2.0, 1), (10.0, 5), (0.01, 1000)])
def test_gen_matches_the_authors_formula(setting, gamma, top):  # noqa: F811
    logits = setting.F_test @ setting.W.T + setting.b
    expected = reference_gen(logits, gamma, top)
    np.testing.assert_allclose(setting.score("gen", gamma=gamma, top=top), expected, rtol=1e-12)


def test_gen_keeps_confident_samples_apart_on_a_float32_model():
    """A float32 model with logit gaps of 28 to 43: float32 softmax gives p_max = 1, so the authors' formula in
    float32 loses the (1 - p_max)^gamma term, a third of each score here; the detector's float32 scores are the
    exact ones, rounded once."""
    model = make_tiny_model("vit").float()
    with torch.no_grad():
        model.classifier.weight.mul_(20.0)
        model.classifier.bias.mul_(20.0)
    x = torch.randn(8, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(pixel_values=x).logits
    assert logits.dtype == torch.float32
    probabilities = torch.softmax(logits, dim=-1)
    assert torch.equal(probabilities.amax(dim=-1), torch.ones(8))  # float32 rounds every 1 - p_max to 0
    expected = np.array(exact_gen(logits.double().numpy(), 0.1, 100))
    float32_formula = -(probabilities ** 0.1 * (1 - probabilities) ** 0.1).sum(dim=-1)
    assert np.abs(float32_formula.double().numpy() / expected - 1).min() > 0.3  # the naive float32 score is a third off

    scores = get_detector("gen", model).score(x)
    assert scores.dtype == torch.float32
    np.testing.assert_allclose(scores.double().numpy(), expected, rtol=2e-7)
    assert (np.argsort(scores.numpy(), kind="stable") == np.argsort(expected, kind="stable")).all()


def test_gen_is_exact_where_float64_probabilities_underflow():
    """Gaps of 800 and 900: the small probabilities (e^-800) are below float64's range, yet p^0.01 ~ e^-8 is not;
    the log-space terms give the exact scores, which still order the two samples."""
    logits = torch.tensor([[800.0, 0.0, 0.0], [900.0, 0.0, 0.0], [2.0, 1.0, -1.0]], dtype=torch.float64)
    assert (torch.softmax(logits, dim=-1)[:2, 1:] == 0).all()  # what a float64 softmax would work with
    scores = gen_score(logits, gamma=0.01, top=100)
    np.testing.assert_allclose(scores.numpy(), exact_gen(logits.numpy(), 0.01, 100), rtol=1e-13)
    assert scores[1] > scores[0] > scores[2]  # more confident = more in-distribution


def test_gen_takes_every_class_when_m_exceeds_them_and_a_single_class_scores_zero():
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5]], dtype=torch.float64)
    assert torch.equal(gen_score(logits, 0.5, 4), gen_score(logits, 0.5, 1000))
    np.testing.assert_allclose(gen_score(logits, 0.5, 2).numpy(), exact_gen(logits.numpy(), 0.5, 2), rtol=1e-13)
    assert gen_score(torch.tensor([[7.0]], dtype=torch.float64), 0.1, 100).item() == 0.0  # p = 1: 1 * 0^gamma


def test_gen_defaults_and_grid_are_openoods():
    assert GENDetector.defaults == {"gamma": 0.1, "top": 100}  # gen.yml postprocessor_args gamma, M
    assert GENDetector.search_space == {"gamma": (0.01, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0),
                                        "top": (10, 50, 100, 200, 500, 1000)}
    assert GENDetector.reads_logits and GENDetector.one_pass and not GENDetector.needs_fit


@pytest.mark.parametrize("settings, name", [
    ({"gamma": 0.0}, "gamma"), ({"gamma": -0.1}, "gamma"), ({"gamma": float("nan")}, "gamma"),
    ({"gamma": True}, "gamma"), ({"gamma": "0.1"}, "gamma"),
    ({"top": 0}, "top"), ({"top": 2.5}, "top"), ({"top": True}, "top"),
])
def test_gen_rejects_bad_settings(settings, name):
    with pytest.raises(ValueError, match=f"{name} must be"):
        get_detector("gen", make_tiny_model("vit"), **settings)
