"""Temperature scaling against OpenOOD v1.5's temp_scaling_postprocessor (the authors' optimiser), written again on
the tiny models: every logit concatenated, ``nn.CrossEntropyLoss``, ``LBFGS([T = 1.5], lr=0.01, max_iter=50)``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar
from scipy.special import log_softmax, softmax
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import get_detector
from hf_gsc.detectors.temp_scaling import TempScalingDetector


def reference_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    """OpenOOD's setup, on the whole set at once."""
    logits, labels = torch.from_numpy(logits), torch.from_numpy(labels)
    temperature = torch.nn.Parameter(torch.ones(1, dtype=torch.float64) * 1.5)
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.LBFGS([temperature], lr=0.01, max_iter=50)

    def eval():
        optimizer.zero_grad()
        loss = criterion(logits / temperature, labels)
        loss.backward()
        return loss

    optimizer.step(eval)
    return temperature.item()


def test_temp_scaling_matches_openood(setting):  # noqa: F811
    fit_logits = setting.F_fit @ setting.W.T + setting.b
    temperature = reference_temperature(fit_logits, setting.labels)
    detector = setting.detector("temp_scaling")
    assert detector.temperature.item() == pytest.approx(temperature, rel=1e-10)
    assert abs(temperature - 1.5) > 1e-3  # the fit moved it
    test_logits = setting.F_test @ setting.W.T + setting.b
    np.testing.assert_allclose(setting.score("temp_scaling"), softmax(test_logits / temperature, axis=1).max(axis=1),
                               rtol=1e-9)


def test_the_temperature_is_the_optimisers_not_the_nll_minimum(setting):  # noqa: F811
    """The code's lr=0.01 LBFGS step lowers the NLL from T = 1.5 without reaching its minimum: the temperature kept
    is the code's (documented), which a minimiser would not give."""
    fit_logits = setting.F_fit @ setting.W.T + setting.b

    def nll(t):
        return -log_softmax(fit_logits / t, axis=1)[np.arange(len(setting.labels)), setting.labels].mean()

    best = minimize_scalar(nll, bounds=(0.05, 100), method="bounded", options={"xatol": 1e-10}).x
    fitted = setting.detector("temp_scaling").temperature.item()
    assert nll(fitted) < nll(1.5)
    assert abs(fitted - best) > 1e-3


def test_temp_scaling_does_not_depend_on_the_batches(setting):  # noqa: F811
    one = get_detector("temp_scaling", setting.model).fit(setting.batches(size=128))
    many = get_detector("temp_scaling", setting.model).fit(setting.batches(size=7))
    assert one.temperature.item() == pytest.approx(many.temperature.item(), rel=1e-12)


def test_temp_scaling_needs_labels_in_range(setting):  # noqa: F811
    assert TempScalingDetector.needs_labels and TempScalingDetector.defaults == {}
    bad = [(setting.x_fit[:8], torch.full((8,), 99))]
    with pytest.raises(ValueError, match=r"labels must be class indices in \[0, 5\)"):
        get_detector("temp_scaling", setting.model).fit(bad)
