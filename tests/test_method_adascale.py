"""AdaSCALE-A and -L against OpenOOD's adascale_postprocessor / adascale_net (the authors' code), written again with
per-batch autograd on the models' public outputs, numpy's searchsorted for statsmodels' ECDF."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.special import logsumexp
from test_detectors import classifier, setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import DetectorBundle, fit_together, get_detector


#: Settings that matter on 16-wide features: k1 = 50% -> 8 coordinates, k2 = 25% -> 4 (the defaults 5% and 1% of
#: 16 round down to none), o = 0.1, a wide percentile range.
SETTINGS = {"percentile": [60.0, 90.0], "k1": 50.0, "k2": 25.0, "lmbda": 10.0, "o": 0.1}


def _net(setting, x):
    """OpenOOD's ``net(data, return_feature=True)`` on the tiny models: (logits, penultimate feature)."""
    if setting.arch == "vit":
        feature = setting.model.vit(x).last_hidden_state[:, 0]
    else:
        feature = setting.model.resnet(x).pooler_output.flatten(1)
    return classifier(setting.model, setting.arch)(feature), feature


def _perturbed_features(setting, data, o):
    """The authors' postprocess up to the perturbed feature (sum of predicted logits backward, perturb)."""
    data = data.clone().requires_grad_(True)
    output, feature = _net(setting, data)
    labels = output.detach().argmax(dim=1)
    output[torch.arange(len(labels)), labels].backward(torch.ones(len(labels), dtype=output.dtype))
    grad = data.grad.detach()
    b, c, h, w = data.shape
    n_pixels = int(c * h * w * o)
    abs_grad = grad.abs().view(b, c * h * w)
    _, topk_indices = torch.topk(abs_grad, n_pixels, dim=1, largest=False)
    mask = torch.zeros_like(abs_grad, dtype=torch.uint8).scatter_(1, topk_indices, 1).view(b, c, h, w)
    data_ood = data.detach() + grad.sign() * mask * 0.5
    with torch.no_grad():
        _, feature_perturbed = _net(setting, data_ood)
    return feature.detach(), feature_perturbed


def _q(feature, feature_perturbed, k1_, k2_, lmbda):
    top = torch.topk(feature, dim=1, k=k1_)[1]
    topk_feature_perturbed = torch.gather(torch.relu(feature_perturbed), 1, top)
    top = torch.topk(feature, dim=1, k=k2_)[1]
    topk_feature_shift = torch.gather((feature - feature_perturbed).abs(), 1, top)
    return (topk_feature_perturbed.sum(dim=1) + lmbda * topk_feature_shift.sum(dim=1)).numpy()


def reference_adascale(setting, logit_scaling: bool, fit_batches, x_test, settings) -> np.ndarray:
    dim = setting.F_fit.shape[1]
    k1_, k2_ = int(dim * settings["k1"] / 100), int(dim * settings["k2"] / 100)
    sum_log = np.concatenate([_q(*_perturbed_features(setting, x, settings["o"]), k1_, k2_, settings["lmbda"])
                              for x, _ in fit_batches])
    feature, feature_perturbed = _perturbed_features(setting, x_test, settings["o"])
    q = _q(feature, feature_perturbed, k1_, k2_, settings["lmbda"])
    ecdf = np.searchsorted(np.sort(sum_log), q, side="right") / sum_log.size  # statsmodels ECDF
    low, high = settings["percentile"]
    percentiles = low + (1 - ecdf) * (high - low)
    x = torch.relu(feature).numpy()  # ada_scale
    n = x.shape[1]
    scales = []
    for row, p in zip(x, percentiles):
        k = n - int(np.round(n * p / 100.0))
        scales.append(row.sum() / np.sort(row)[::-1][:k].sum())
    scales = np.array(scales)[:, None]
    W, b = setting.W, setting.b
    if logit_scaling:
        logits = (feature.numpy() @ W.T + b) * scales ** 2.0
    else:
        logits = (feature.numpy() * np.exp(scales)) @ W.T + b
    return logsumexp(logits, axis=1)


@pytest.mark.parametrize("method, logit_scaling", [("adascale_a", False), ("adascale_l", True)])
def test_adascale_matches_the_authors_code(setting, method, logit_scaling):  # noqa: F811
    batches = setting.batches()
    expected = reference_adascale(setting, logit_scaling, batches, setting.x_test, SETTINGS)
    detector = get_detector(method, setting.model, **SETTINGS)
    detector.fit(batches)
    assert detector.reference_statistic.shape == (len(setting.labels),)
    np.testing.assert_allclose(detector.score(setting.x_test).numpy(), expected, rtol=1e-9)


def test_adascale_percentile_adapts_through_the_fit(setting):  # noqa: F811
    """With ``p_min = p_max`` the fitted ECDF cannot matter: fits on different ID samples score alike. With a range
    they do not: each sample's percentile (here over a wide range, so that it moves k on 12 coordinates) follows
    where its Q' falls among the fitted ones."""
    fits = [(setting.x_fit[:16], None)], [(setting.x_fit[16:32], None)]
    x = setting.x_fit[32:48]  # ID-like samples, whose Q' fall among the fitted ones
    for percentile, alike in (([75.0, 75.0], True), ([5.0, 95.0], False)):
        first, second = (get_detector("adascale_a", setting.model, **{**SETTINGS, "percentile": percentile}).fit(fit)
                         for fit in fits)
        assert torch.equal(first.score(x), second.score(x)) == alike


def test_adascale_keeps_its_step_under_bf16_autocast(setting):  # noqa: F811
    """Under bf16 autocast the method's own passes run with autocast off: the scores equal those without autocast."""
    model = setting.model.float()
    try:
        detector = get_detector("adascale_l", model, **SETTINGS)
        x_fit = setting.x_fit.float()
        detector.fit([(x_fit[i:i + 32], None) for i in range(0, len(x_fit), 32)])
        x = setting.x_test.float()
        plain = detector.score(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = detector.score(x)
        torch.testing.assert_close(under_autocast, plain, rtol=1e-5, atol=1e-5)
    finally:
        setting.model.double()


def test_adascale_keeps_num_samples_of_the_fit(setting):  # noqa: F811
    """Above ``num_samples`` the ECDF keeps that many of the fitting samples' Q' (the authors' random subset)."""
    full = get_detector("adascale_a", setting.model, **SETTINGS)
    full.fit(setting.batches(limit=48))
    subset = get_detector("adascale_a", setting.model, **SETTINGS, num_samples=20)
    subset.fit(setting.batches(limit=48))
    kept = subset.reference_statistic
    assert kept.shape == (20,) and bool((kept[1:] >= kept[:-1]).all())
    assert bool(torch.isin(kept, full.reference_statistic).all()) and len(set(kept.tolist())) == 20


def test_adascale_scores_inside_inference_mode(setting):  # noqa: F811
    detector = get_detector("adascale_l", setting.model, **SETTINGS)
    detector.fit(setting.batches(limit=32))
    with torch.inference_mode():
        inside = detector.score(setting.x_test)
    torch.testing.assert_close(inside, detector.score(setting.x_test), rtol=1e-12, atol=0)


def test_adascale_variants_and_grid_points_share_one_perturbation(setting):  # noqa: F811
    """In one pass, detectors with the same ``o`` share the gradient step and the perturbed forward (2 forwards),
    one with another ``o`` makes its own (2 more); each scores as it does alone."""
    settings = {"a": ("adascale_a", {}), "l": ("adascale_l", {}),
                "a_70_80": ("adascale_a", {"percentile": [70.0, 80.0]}), "a_o": ("adascale_a", {"o": 0.2})}
    detectors = {name: get_detector(method, setting.model, **{**SETTINGS, **extra})
                 for name, (method, extra) in settings.items()}
    fit_together(list(detectors.values()), setting.batches(limit=32))
    alone = {name: get_detector(method, setting.model, **{**SETTINGS, **extra}).fit(setting.batches(limit=32))
             for name, (method, extra) in settings.items()}
    calls = []
    hook = setting.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        together = DetectorBundle(detectors).scores(setting.x_test)
    finally:
        hook.remove()
    assert len(calls) == 4
    for name, detector in alone.items():
        torch.testing.assert_close(together[name], detector.score(setting.x_test), rtol=1e-12, atol=0)
        torch.testing.assert_close(detectors[name].reference_statistic, detector.reference_statistic, rtol=0, atol=0)


def _rounding_edge(n: int) -> tuple[float, float, float]:
    """``(p, same, other)``: ``n p / 100`` rounds to ``m`` in float64 but to ``m + 1`` from ``float32(p)``; ``same``
    gives ``m`` and ``other`` ``m + 1`` in any precision."""
    for m in range(n // 2, n - 1):
        for step in range(1, 50):
            p = (m + 0.5) * 100 / n - step * 1e-7
            in64 = round(n * p / 100)
            in32 = int(torch.round(n * torch.tensor(p, dtype=torch.float32) / 100.0))
            if in64 == m and in32 == m + 1:
                return p, (m + 0.25) * 100 / n, (m + 0.75) * 100 / n
    raise AssertionError(f"no float32 rounding edge for n = {n}")


def test_adascale_rounds_the_percentile_in_float64_on_a_float32_model(setting):  # noqa: F811
    """The authors' percentiles are float64 (numpy): ``k = n - round(n p / 100)`` from a float64 ``p``, also for a
    float32 model, where a float32 ``p`` would round ``n p / 100`` the other way (``k`` one off)."""
    model = setting.model.float()
    try:
        edge, same, other = _rounding_edge(setting.F_fit.shape[1])
        x_fit, x = setting.x_fit[:16].float(), setting.x_test.float()
        scores = {}
        for name, p in {"edge": edge, "same": same, "other": other}.items():
            detector = get_detector("adascale_a", model, **{**SETTINGS, "percentile": [p, p]})
            scores[name] = detector.fit([(x_fit, None)]).score(x)
        torch.testing.assert_close(scores["edge"], scores["same"], rtol=0, atol=0)
        assert not torch.allclose(scores["edge"], scores["other"])
    finally:
        setting.model.double()


@pytest.mark.parametrize("bad", [[85.0, 75.0], [0.0, 50.0], [75.0], "75,85"])
def test_adascale_refuses_a_bad_percentile_range(setting, bad):  # noqa: F811
    with pytest.raises(ValueError, match="percentile must be a pair"):
        get_detector("adascale_a", setting.model, percentile=bad)
