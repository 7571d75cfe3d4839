"""CARef and CADRef against the authors' code (github.com/LingAndZero/CADRef: ``ood_methods/CARef.py``,
``ood_methods/CADRef.py``, ``utils/get_stat.py``), written again in torch on the tiny models' public features."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import DETECTORS, get_detector


#: float64 on both sides; streamed float64 sums against per-class means (measured: at most 1.8e-15 relative).
RTOL = 1e-12


def get_features(train, W, b, num_classes):
    """``get_features``: every training feature and logit filed under its predicted class ``output.argmax(1)``."""
    output = train @ W.T + b
    p_labels = output.argmax(1)
    return ([train[p_labels == i] for i in range(num_classes)], [output[p_labels == i] for i in range(num_classes)])


def gen(output, gamma=0.1):
    M = output.shape[-1] // 10
    M = 10 if M < 10 else M
    smax = F.softmax(output, dim=1)
    probs_sorted = torch.sort(smax, dim=1).values[:, -M:]
    return 1 / torch.sum(probs_sorted ** gamma * (1 - probs_sorted) ** gamma, axis=1)


LOGIT_SCORES = {"energy": lambda o: torch.logsumexp(o, dim=1), "msp": lambda o: torch.max(F.softmax(o, dim=1), dim=1).values,
                "max_logit": lambda o: o.max(dim=1).values, "gen": gen}


def authors_caref(features, train_mean, W, b):
    logit = features @ W.T + b
    class_ids = torch.argmax(torch.softmax(logit, dim=1), dim=1)
    tm = train_mean[class_ids]
    return -((tm - features).norm(dim=1, p=1) / features.norm(dim=1, p=1))


def authors_cadref(features, train_mean, global_mean_logit_score, W, b, logit_method):
    logit = features @ W.T + b
    class_ids = torch.argmax(torch.softmax(logit, dim=1), dim=1)
    tm = train_mean[class_ids]
    dist = features - tm
    sg = W[class_ids].sign()
    ep_dist = dist * sg
    ep_dist[ep_dist < 0] = 0
    ep_error = ep_dist.norm(dim=1, p=1) / features.norm(dim=1, p=1)
    en_dist = dist * (-sg)
    en_dist[en_dist < 0] = 0
    en_error = en_dist.norm(dim=1, p=1) / features.norm(dim=1, p=1)
    logit_score = LOGIT_SCORES[logit_method](logit)
    return -(ep_error / logit_score + en_error / global_mean_logit_score)


def fitted_state(setting, logit_method="energy"):  # noqa: F811
    W, b = torch.from_numpy(setting.W), torch.from_numpy(setting.b)
    features, logits = get_features(torch.from_numpy(setting.F_fit), W, b, W.shape[0])
    assert all(len(f) for f in features)  # every class predicted: the authors' means are defined
    train_mean = torch.stack([f.mean(dim=0) for f in features])
    global_mean = torch.mean(torch.cat([LOGIT_SCORES[logit_method](o) for o in logits]), dim=0)
    return W, b, train_mean, global_mean


def test_caref_matches_the_authors_code(setting):  # noqa: F811
    W, b, train_mean, _ = fitted_state(setting)
    expected = authors_caref(torch.from_numpy(setting.F_test), train_mean, W, b).numpy()
    detector = setting.detector("caref")
    np.testing.assert_allclose(detector.class_means.numpy(), train_mean.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(detector.score(setting.x_test).double().numpy(), expected, rtol=RTOL)


@pytest.mark.parametrize("logit_method", ["energy", "msp", "max_logit", "gen"])
def test_cadref_matches_the_authors_code(setting, logit_method):  # noqa: F811
    W, b, train_mean, global_mean = fitted_state(setting, logit_method)
    expected = authors_cadref(torch.from_numpy(setting.F_test), train_mean, global_mean, W, b, logit_method).numpy()
    detector = setting.detector("cadref", logit_method=logit_method)
    np.testing.assert_allclose(detector.mean_logit_score.numpy(), [float(global_mean)], rtol=1e-12)
    np.testing.assert_allclose(detector.score(setting.x_test).double().numpy(), expected, rtol=RTOL)


def test_the_means_are_by_predicted_class_not_label(setting):  # noqa: F811
    """Half of the fitting labels are random: means by label would differ."""
    by_label = torch.stack([torch.from_numpy(setting.F_fit)[torch.from_numpy(setting.labels) == k].mean(dim=0)
                            for k in range(setting.W.shape[0])])
    assert (setting.detector("caref").class_means - by_label).abs().max() > 1e-3


def test_a_class_never_predicted_is_refused(setting):  # noqa: F811
    predicted = torch.from_numpy(setting.F_fit @ setting.W.T + setting.b).argmax(1)
    keep = predicted != 0
    with pytest.raises(ValueError, match=r"classes \[0\] have none"):
        get_detector("caref", setting.model).fit([(setting.x_fit[keep], setting.y_fit[keep])])


def test_defaults():
    assert DETECTORS["cadref"].defaults == {"logit_method": "energy"}
    assert DETECTORS["caref"].defaults == {}
