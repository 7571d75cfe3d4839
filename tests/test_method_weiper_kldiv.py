"""WeiPer+KLD against the authors' code (github.com/mgranz/weiper, ``weiper_kldiv_postprocessor.py`` and
``weiper_kldiv/utils.py``), written again here on the tiny models in float64: the perturbed head built as
``calculate_weiper_space`` builds it (torch's generator seeded as the detector's), ``batch_histogram`` with bins and
``probability=True``, the ``UniformKernel`` convolution, the symmetric ``kldiv``, and ``setup`` as a mean of per-batch
mean densities over equal batches. One difference from the code, documented in the class: the one perturbed head drawn
at the fit is passed to every call (the code's ``W_tilde=`` keyword is swallowed and a new head drawn per batch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc import AutoOODDetector
from hf_gsc.detectors import get_detector
from hf_gsc.detectors.weiper_kldiv import WeiPerKLDivDetector


# --------------------------------------------------------------------------- the authors' utils.py, in float64
def linspace(start, stop, num):
    steps = torch.arange(num, dtype=torch.float32) / (num - 1)
    return start[None] + steps * (stop - start)[None]


def batch_histogram(samples, n_bins, bins_min_max):
    """The bins_min_max / probability=True path: samples (n_dims, n_samples) -> (n_bins, n_samples)."""
    low, high = bins_min_max
    bins = linspace(low, high + 1e-8, n_bins + 1)[:, None].repeat(1, samples.shape[1])
    bins = torch.cat([bins, torch.ones(1, bins.shape[-1], dtype=bins.dtype) * np.inf], dim=0)
    bins = torch.cat([-torch.ones(1, bins.shape[-1], dtype=bins.dtype) * np.inf, bins], dim=0)
    density = torch.logical_and(samples[None] < bins[1:, None], samples[None] >= bins[:-1, None])
    density = density.to(torch.float64).mean(dim=1)
    return density[1:-1] / density.sum(dim=0)[None]


def calculate_density(latents, low, high, n_bins):
    return torch.cat([batch_histogram(chunk.T, n_bins, (low, high)) for chunk in latents.split(100, dim=0)], dim=-1)


def uniform_kernel(size):
    kernel = torch.nn.Conv1d(100, 100, size, padding="same", padding_mode="replicate").double()
    kernel.weight.data = torch.zeros_like(kernel.weight.data)
    kernel.weight.data[range(100), range(100)] = torch.ones(1, 100, size, dtype=torch.float64) / size
    kernel.bias.data = torch.zeros_like(kernel.bias)
    return kernel


def kldiv(p, q, eps, kernel):
    q_ = kernel(q.T).T + eps
    p_ = (p + eps).clone()
    p_ /= p_.sum(dim=0)
    q_ /= q_.sum(dim=0)
    q_p = q_.log()[:, None] - p_.log()[..., None]
    return -(p_[..., None] * q_p).sum(dim=0) - (q_[:, None] * (-q_p)).sum(dim=0)


def calculate_uncertainty(density, train_mean, kernel, eps):
    out = []
    for dens_t in density.split(100, dim=-1):
        s = dens_t.shape[-1]
        if s < 100:
            dens_t = torch.cat([dens_t, torch.ones(dens_t.shape[0], 100 - s, dtype=dens_t.dtype)], dim=-1)
        out.append(kldiv(train_mean, dens_t, eps, kernel)[:, :s])
    return torch.cat(out, dim=-1)[0]


def weiper_space(W, b, latents, seed, distance, n_repeats):
    """calculate_weiper_space: randn_like from torch's generator, seeded as the detector's generator."""
    torch.manual_seed(seed)
    perturbs = [distance * F.normalize(torch.randn_like(W), dim=1) for _ in range(n_repeats)]
    perturbs = [p * W.norm(dim=1)[:, None] for p in perturbs]
    fc = torch.nn.Linear(W.shape[1], n_repeats * W.shape[0]).double()
    fc.weight.data = torch.cat([W + p for p in perturbs], dim=0)
    fc.bias.data = torch.cat([b for _ in range(n_repeats)], dim=0)
    return fc


def reference_weiper(setting, hp, seed=0, batch=16):  # noqa: F811
    W, b = torch.from_numpy(setting.W), torch.from_numpy(setting.b)
    fc = weiper_space(W, b, None, seed, hp["perturbation_distance"], hp["n_repeats"])
    fit = torch.from_numpy(setting.F_fit)
    batches = fit.split(batch)
    with torch.no_grad():
        low, high = min(x.min() for x in batches), max(x.max() for x in batches)
        wlow = min(fc(x).min() for x in batches)
        whigh = max(fc(x).max() for x in batches)
        n_bins = hp["n_bins"]
        train = sum(calculate_density(x, low, high, n_bins).mean(dim=-1) for x in batches) / len(batches)
        wtrain = sum(calculate_density(fc(x), wlow, whigh, n_bins).mean(dim=-1) for x in batches) / len(batches)
        test = torch.from_numpy(setting.F_test)
        weiper = fc(test)
        dens = calculate_density(test, low, high, n_bins)
        wdens = calculate_density(weiper, wlow, whigh, n_bins)
        K = setting.W.shape[0]
        msp = torch.cat([weiper[:, i * K:(i + 1) * K].softmax(dim=-1).max(dim=-1)[0][:, None]
                         for i in range(hp["n_repeats"])], dim=-1).mean(dim=-1)
        u = calculate_uncertainty(dens, train[:, None], uniform_kernel(hp["smoothing"]), 0.01)
        uw = calculate_uncertainty(wdens, wtrain[:, None], uniform_kernel(hp["smoothing_perturbed"]), 0.025)
        return (-(u + hp["lambda_1"] * uw - hp["lambda_2"] * msp)).numpy(), fc, (train, wtrain)


DEFAULTS = {"n_repeats": 100, "perturbation_distance": 1.8, "n_bins": 100, "lambda_1": 2.5, "lambda_2": 0.1,
            "smoothing": 4, "smoothing_perturbed": 15}


@pytest.mark.parametrize("changes", [{}, {"n_bins": 20, "smoothing": 4, "smoothing_perturbed": 7, "lambda_2": 1.0},
                                     {"n_repeats": 7, "perturbation_distance": 2.4, "n_bins": 30, "smoothing": 6}])
def test_weiper_kldiv_matches_the_authors_code(setting, changes):  # noqa: F811
    hp = {**DEFAULTS, **changes}
    expected, fc, (train, wtrain) = reference_weiper(setting, hp)
    detector = setting.detector("weiper_kldiv", **changes)
    torch.testing.assert_close(detector.perturbed_weight, fc.weight.data, rtol=0, atol=0)
    np.testing.assert_allclose(detector.feature_density.numpy(), train.numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(detector.perturbed_density.numpy(), wtrain.numpy(), rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(detector.score(setting.x_test).numpy(), expected, rtol=1e-9)
    assert np.ptp(expected) > 1e-3


def test_the_perturbed_head_is_drawn_again_at_load(setting, tmp_path):  # noqa: F811
    detector = setting.detector("weiper_kldiv", n_repeats=5, seed=3)
    detector.save_pretrained(tmp_path)
    loaded = AutoOODDetector.from_pretrained(tmp_path, model=setting.model)
    assert loaded.config.seed == 3
    torch.testing.assert_close(loaded.perturbed_weight, detector.perturbed_weight, rtol=0, atol=0)
    torch.testing.assert_close(loaded.score(setting.x_test), detector.score(setting.x_test), rtol=1e-12, atol=0)
    other = setting.detector("weiper_kldiv", n_repeats=5, seed=4)
    assert not torch.equal(other.perturbed_weight, detector.perturbed_weight)


def test_weiper_kldiv_defaults_and_refusals(setting):  # noqa: F811
    assert WeiPerKLDivDetector.defaults == {**DEFAULTS, "seed": 0}
    assert WeiPerKLDivDetector.search_space == {}
    with pytest.raises(ValueError, match="smoothing must be at most n_bins=10, got 40"):
        get_detector("weiper_kldiv", setting.model, n_bins=10, smoothing=40, smoothing_perturbed=5)
    with pytest.raises(ValueError, match="perturbation_distance must be in"):
        get_detector("weiper_kldiv", setting.model, perturbation_distance=0.0)
