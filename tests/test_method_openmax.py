"""OpenMax against OpenOOD v1.5's openmax_postprocessor with libMR, written again here: OpenOOD's numpy/scipy code,
and libMR's ``fit_high`` / ``w_score`` ported line by line from Vastlab/libMR (``MetaRecognition.cpp``: EvtGeneric,
CDF; ``weibull.c``: weibull_fit, weibull_scale_likelihood, wdfzero), with libMR's Brent tolerance as a parameter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.spatial.distance as spd
import torch
from conftest import make_tiny_model
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import get_detector
from hf_gsc.detectors.openmax import OpenMaxDetector, weibull_fit_high


LIBMR_TOL = 1e-6  # weibull.c: ``double tol = 1.000000000000000e-006``


# --------------------------------------------------------------------------- libMR, ported from its C source
def _scale_likelihood(sigma, x, xbar):
    w = [math.exp(v / sigma) for v in x]
    return sigma + xbar - sum(wi * xi for wi, xi in zip(w, x)) / sum(w)


def _wdfzero(a, b, tol, x0, mean):
    """weibull.c wdfzero: Brent's method on [a, b]."""
    fa, fb = _scale_likelihood(a, x0, mean), _scale_likelihood(b, x0, mean)
    if fa == 0:
        return a
    if fb == 0:
        return b
    assert (fa > 0) != (fb > 0)
    c, fc, d, e = 0.0, fb, 0.0, 0.0
    while fb != 0:
        if (fb > 0) == (fc > 0):
            c, fc = a, fa
            d = b - a
            e = d
        if abs(fc) < abs(fb):
            a, b, c = b, c, b
            fa, fb, fc = fb, fc, fb
        m = 0.5 * (c - b)
        tolerance = 2.0 * tol * max(abs(b), 1.0)
        if abs(m) <= tolerance or fb == 0.0:
            break
        if abs(e) < tolerance or abs(fa) <= abs(fb):
            d = e = m
        else:
            s = fb / fa
            if a == c:
                p, q = 2.0 * m * s, 1.0 - s
            else:
                q, r = fa / fc, fb / fc
                p = s * (2.0 * m * q * (q - r) - (b - a) * (r - 1.0))
                q = (q - 1.0) * (r - 1.0) * (s - 1.0)
            if p > 0:
                q = -q
            else:
                p = -p
            if 2.0 * p < 3.0 * m * q - abs(tolerance * q) and p < abs(0.5 * e * q):
                e, d = d, p / q
            else:
                d = e = m
        a, fa = b, fb
        if abs(d) > tolerance:
            b = b + d
        elif b > c:
            b = b - tolerance
        else:
            b = b + tolerance
        fb = _scale_likelihood(b, x0, mean)
    return b


def _weibull_fit(data, tol):
    """weibull.c weibull_fit (parameters only): returns (scale, shape)."""
    x = [math.log(v) for v in data]
    n = len(x)
    maxx, minx = max(x), min(x)
    span = maxx - minx
    x0 = [(v - maxx) / span for v in x]
    mean = sum(x0) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in x0) / (n - 1))
    sigmahat = math.sqrt(6.0) * std / math.pi
    if _scale_likelihood(sigmahat, x0, mean) > 0:
        upper, lower = sigmahat, 0.5 * sigmahat
        while _scale_likelihood(lower, x0, mean) > 0:
            upper, lower = lower, 0.5 * lower
    else:
        lower, upper = sigmahat, 2.0 * sigmahat
        while _scale_likelihood(upper, x0, mean) < 0:
            lower, upper = upper, 2 * upper
    sigma = _wdfzero(lower, upper, tol, x0, mean)
    mu = sigma * math.log(sum(math.exp(v / sigma) for v in x0) / n)
    return math.exp(span * mu + maxx), 1 / (span * sigma)


class LibMR:
    """libMR's ``MR()`` (translate_amount 1, complement_reject): fit_high and w_score."""

    def __init__(self, tol=LIBMR_TOL):
        self.tol = tol

    def fit_high(self, data, fit_size):
        data = sorted(data, reverse=True)[:fit_size]
        self.small_score = data[fit_size - 1]
        self.scale, self.shape = _weibull_fit([v + 1 - self.small_score for v in data], self.tol)

    def w_score(self, x):
        translated = x + 1 - self.small_score
        return 0.0 if translated < 0 else 1 - math.exp(-((translated / self.scale) ** self.shape))


# --------------------------------------------------------------------------- OpenOOD's openmax_postprocessor
def reference_fit(fit_logits, labels, num_classes, tol, tailsize=20):
    """setup: MAVs of the correctly classified logits, libMR fit_high of the 20 largest Euclidean distances."""
    models = []
    for c in range(num_classes):
        scores = fit_logits[(fit_logits.argmax(axis=1) == labels) & (labels == c)]
        mav = scores.mean(axis=0)
        distances = np.array([spd.euclidean(mav, s) for s in scores])
        mr = LibMR(tol)
        tail = np.sort(distances)[-tailsize:]
        mr.fit_high(tail, len(tail))
        models.append((mav, mr))
    return models


def reference_scores(models, test_logits, alpha=3):
    """postprocess: openmax(...) then -prob_unknown (the 'euclidean' distance, eu_weight unused)."""
    out = []
    for score in test_logits:
        ranked = score.argsort()[::-1][:alpha]
        omega = np.zeros(len(score))
        omega[ranked] = [((alpha + 1) - i) / float(alpha) for i in range(1, alpha + 1)]
        modified, unknown = [], []
        for c, (mav, mr) in enumerate(models):
            w = mr.w_score(spd.euclidean(score, mav))
            m = score[c] * (1 - w * omega[c])
            modified.append(m)
            unknown.append(score[c] - m)
        channel_unknown = np.exp(np.sum(unknown))
        out.append(-channel_unknown / (np.sum(np.exp(modified)) + channel_unknown))
    return np.array(out)


def fit_logits_and_labels(setting):  # noqa: F811
    return setting.F_fit @ setting.W.T + setting.b, setting.labels


def test_openmax_matches_openood_with_libmr_solved_exactly(setting):  # noqa: F811
    """libMR's algorithm with its Brent tolerance at 1e-15: the maximum-likelihood fit the detector solves for."""
    logits, labels = fit_logits_and_labels(setting)
    models = reference_fit(logits, labels, setting.W.shape[0], tol=1e-15)
    detector = setting.detector("openmax")
    np.testing.assert_allclose(detector.means.numpy(), [mav for mav, _ in models], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(detector.weibull_scale.numpy(), [mr.scale for _, mr in models], rtol=1e-9)
    np.testing.assert_allclose(detector.weibull_shape.numpy(), [mr.shape for _, mr in models], rtol=1e-9)
    np.testing.assert_allclose(detector.tail_minimum.numpy(), [mr.small_score for _, mr in models], rtol=1e-12)
    expected = reference_scores(models, setting.F_test @ setting.W.T + setting.b)
    np.testing.assert_allclose(setting.score("openmax"), expected, rtol=1e-9, atol=1e-12)
    assert np.ptp(expected) > 1e-3  # the scores differ between samples


def test_libmrs_own_tolerance_stays_within_its_stopping_rule(setting):  # noqa: F811
    """libMR stops Brent's method when the bracket's half-width is at most ``2 tol max(|s|, 1)`` = 2e-6 on the
    normalised scale ``s`` (< 1): its ``s`` is then within 4e-6 of the root, and its shape ``1 / (range s)`` within
    ``4e-6 / s`` relatively of the exact one; the detector's fit is inside that bound for every class."""
    logits, labels = fit_logits_and_labels(setting)
    models = reference_fit(logits, labels, setting.W.shape[0], tol=LIBMR_TOL)
    detector = setting.detector("openmax")
    shape = detector.weibull_shape.numpy()
    for k, (_, mr) in enumerate(models):
        tail = np.sort([spd.euclidean(models[k][0], s) for s in logits[(logits.argmax(1) == labels) & (labels == k)]])
        tail = tail[-20:]
        log_range = math.log(tail.max() + 1 - tail.min())
        s = 1 / (shape[k] * log_range)  # the exact normalised scale
        assert abs(mr.shape / shape[k] - 1) <= 4 * LIBMR_TOL / s * (1 + 1e-6)


def test_weibull_fit_high_is_the_maximum_likelihood_fit():
    """At the fitted (scale, shape) the Weibull log-likelihood of the shifted tail is at its maximum: moving either
    parameter by 1e-4 lowers it."""
    generator = np.random.default_rng(0)
    tail = np.sort(generator.weibull(2.0, 20) * 3.0 + 5.0)
    scale, shape, small = (v.item() for v in weibull_fit_high(torch.from_numpy(tail)[None], torch.ones(1, 20, dtype=bool)))
    data = tail + 1 - small

    def loglik(lam, k):
        return np.sum(np.log(k / lam) + (k - 1) * np.log(data / lam) - (data / lam) ** k)

    best = loglik(scale, shape)
    for dl, dk in [(1e-4, 0), (-1e-4, 0), (0, 1e-4), (0, -1e-4)]:
        assert loglik(scale * (1 + dl), shape * (1 + dk)) < best


def test_openmax_defaults_settings_and_refusals(setting):  # noqa: F811
    assert OpenMaxDetector.defaults == {"tail_size": 20, "alpha": 3}  # weibull_tail, weibull_alpha
    assert OpenMaxDetector.needs_labels and OpenMaxDetector.search_space == {}
    logits, labels = fit_logits_and_labels(setting)
    models = reference_fit(logits, labels, setting.W.shape[0], tol=1e-15, tailsize=5)
    expected = reference_scores(models, setting.F_test @ setting.W.T + setting.b, alpha=2)
    np.testing.assert_allclose(setting.score("openmax", tail_size=5, alpha=2), expected, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="alpha must be at most the model's 5 classes, got 6"):
        get_detector("openmax", setting.model, alpha=6)
    with pytest.raises(ValueError, match="tail_size must be an integer >= 2"):
        get_detector("openmax", setting.model, tail_size=1)


def test_openmax_refuses_a_class_without_two_correct_samples():
    model = make_tiny_model("vit")
    x = torch.randn(12, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        predicted = model(pixel_values=x).logits.argmax(-1)
    wrong = (predicted + 1) % 5  # nothing is classified correctly
    with pytest.raises(ValueError, match=r"openmax: classes \[0, 1, 2, 3, 4\] have fewer than 2 correctly classified"):
        get_detector("openmax", model).fit([(x, wrong)])
