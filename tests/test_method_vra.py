"""VRA against OpenOOD v1.5's ``vra_postprocessor.py`` (with ``configs/postprocessors/vra.yml``), written again in
numpy on the tiny models."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import logsumexp
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc import AutoOODDetector
from hf_gsc.detectors import DETECTORS, get_detector


def openood_vra(activation_log, features, W, b, percentile_high, percentile_low):
    """``setup``: both percentiles of every flattened ID activation; ``postprocess``: the energy of the logits of the
    feature clipped into ``[low, high]``."""
    threshold_high = np.percentile(activation_log.flatten(), percentile_high)
    threshold_low = np.percentile(activation_log.flatten(), percentile_low)
    feature = features.clip(min=threshold_low, max=threshold_high)
    return logsumexp(feature @ W.T + b, axis=1), (threshold_low, threshold_high)


@pytest.mark.parametrize("percentiles", [(90.0, 10.0), (99.0, 1.0), (85.0, 15.0)])
def test_vra_matches_openood(setting, percentiles):  # noqa: F811
    high, low = percentiles
    expected, thresholds = openood_vra(setting.F_fit, setting.F_test, setting.W, setting.b, high, low)
    detector = setting.detector("vra", percentile_high=high, percentile_low=low)
    assert detector.thresholds.tolist() == pytest.approx(list(thresholds), rel=1e-15)
    np.testing.assert_allclose(detector.score(setting.x_test).double().numpy(), expected, rtol=1e-12)
    clipped = (setting.F_test < thresholds[0]) | (setting.F_test > thresholds[1])
    assert clipped.any() and not clipped.all()  # both bounds act on these features


def test_vra_raises_low_activations_to_the_low_threshold_not_to_zero(setting):  # noqa: F811
    """OpenOOD's clip, not the VRA authors' zeroing below ``low``: the two give different scores where ``low`` is not 0
    (a ReLU ResNet's lower percentiles are 0: the percentile is taken above its share of zeros)."""
    percentile_low = min(100.0 * float(np.mean(setting.F_fit <= 0)) + 10.0, 80.0)
    expected, (low, high) = openood_vra(setting.F_fit, setting.F_test, setting.W, setting.b, 90.0, percentile_low)
    assert low != 0
    zeroed = np.where(setting.F_test < low, 0.0, np.minimum(setting.F_test, high))
    zeroing = logsumexp(zeroed @ setting.W.T + setting.b, axis=1)
    actual = setting.score("vra", percentile_low=percentile_low)
    np.testing.assert_allclose(actual, expected, rtol=1e-12)
    assert np.abs(actual - zeroing).max() > 1e-6


def test_vra_defaults_grid_and_fit_split(setting):  # noqa: F811
    assert DETECTORS["vra"].defaults == {"percentile_high": 90.0, "percentile_low": 10.0}
    assert DETECTORS["vra"].search_space == {"percentile_high": (85.0, 90.0, 95.0, 99.0),
                                             "percentile_low": (1.0, 5.0, 10.0, 15.0)}
    assert DETECTORS["vra"].fit_split == "validation"
    with pytest.raises(ValueError, match=r"percentile_low \(50\.0\) must be at most percentile_high \(40\.0\)"):
        get_detector("vra", setting.model, percentile_high=40.0, percentile_low=50.0)


def test_a_load_with_other_percentiles_than_the_fitted_ones_is_refused(setting, tmp_path):  # noqa: F811
    """The thresholds are values at the fitted percentiles; loading them with others would score with thresholds that
    are not theirs."""
    setting.detector("vra").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"fitted at percentile_low=10, percentile_high=90, not 10, 95"):
        AutoOODDetector.from_pretrained(tmp_path, model=setting.model, percentile_high=95.0)
    loaded = AutoOODDetector.from_pretrained(tmp_path, model=setting.model)
    np.testing.assert_array_equal(loaded.score(setting.x_test).numpy(), setting.score("vra"))
