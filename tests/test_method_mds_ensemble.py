"""MDSEns against OpenOOD v1.5's ``mds_ensemble_postprocessor.py`` (``get_MDS_stat``, ``compute_Mahalanobis_score``,
``postprocess``) with ``configs/postprocessors/mds_ensemble.yml``, written again in torch and sklearn on the tiny
models; its ``model(data, return_feature_list=True)`` is the model's ``hidden_states``."""

from __future__ import annotations

import numpy as np
import pytest
import sklearn.covariance
import torch
from conftest import IMAGE_SIZE, NUM_LABELS, float64_fit_batches, make_tiny_model

from hf_gsc import AutoOODDetector
from hf_gsc.detectors import DETECTORS, get_detector


#: float64 on both sides; the expanded distances here and OpenOOD's direct quadratic form differ by rounding
#: (measured: at most 4e-15 relative on these models).
RTOL = 1e-12


def feature_list(model, data):
    """OpenOOD's ``feature_list``: the hidden states as ``(B, C, positions)``, a transformer's tokens with the width
    as channels (OpenOOD's ``process_feature_type`` reads dimension 1 as the channels)."""
    hidden = model(pixel_values=data, output_hidden_states=True).hidden_states
    return [h if h.dim() == 4 else h.transpose(1, 2) for h in hidden]


def process_mean(feature):
    """``process_feature_type(feature, 'mean')``: ``get_torch_feature_stat(feature, only_mean=True)``."""
    feature = feature.reshape([feature.size(0), feature.size(1), -1])
    return torch.mean(feature, dim=-1)


def get_mds_stat(model, batches, num_classes, layers):
    """``get_MDS_stat`` with ``reduce_dim_list: [none]``: class means and ``EmpiricalCovariance().precision_`` of the
    class-centred features, per layer."""
    group_lasso = sklearn.covariance.EmpiricalCovariance(assume_centered=False)
    features = {layer: [] for layer in layers}
    labels = []
    with torch.no_grad():
        for data, label in batches:
            listed = feature_list(model, data)
            labels.extend(label.tolist())
            for layer in layers:
                features[layer].append(process_mean(listed[layer]).numpy())
    labels = np.array(labels)
    means, precisions = [], []
    for layer in layers:
        feature_sub = np.concatenate(features[layer])
        class_means = [feature_sub[labels == k].mean(axis=0) for k in range(num_classes)]
        X = np.concatenate([feature_sub[labels == k] - class_means[k] for k in range(num_classes)])
        group_lasso.fit(X)
        means.append(torch.tensor(np.array(class_means)))
        precisions.append(torch.tensor(group_lasso.precision_))
    return means, precisions


def compute_mahalanobis_score(model, data, num_classes, sample_mean, precision, layer, index, magnitude, std):
    """``compute_Mahalanobis_score`` for one layer: the nearest Gaussian's ``-0.5 d`` as loss, the sign of its input
    gradient divided by ``std`` (OpenOOD's 0.5 per channel), the step, and the best class's ``-0.5 d`` of the stepped
    input."""
    data = data.clone().requires_grad_(True)
    out_features = process_mean(feature_list(model, data)[layer])
    gaussian_score = torch.stack([-0.5 * torch.mm(torch.mm(out_features.data - sample_mean[index][i], precision[index]),
                                                  (out_features.data - sample_mean[index][i]).t()).diag()
                                  for i in range(num_classes)], 1)
    sample_pred = gaussian_score.max(1)[1]
    batch_sample_mean = sample_mean[index].index_select(0, sample_pred)
    zero_f = out_features - batch_sample_mean
    pure_gau = -0.5 * torch.mm(torch.mm(zero_f, precision[index]), zero_f.t()).diag()
    loss = torch.mean(-pure_gau)
    loss.backward()
    gradient = torch.ge(data.grad.data, 0)
    gradient = (gradient.double() - 0.5) * 2
    gradient = gradient / std
    temp_inputs = torch.add(data.data, gradient, alpha=-magnitude)
    with torch.no_grad():
        noise_out_features = process_mean(feature_list(model, temp_inputs)[layer])
    noise_gaussian_score = torch.stack([
        -0.5 * torch.mm(torch.mm(noise_out_features - sample_mean[index][i], precision[index]),
                        (noise_out_features - sample_mean[index][i]).t()).diag() for i in range(num_classes)], 1)
    return noise_gaussian_score.max(dim=1)[0]


def openood_mds_ensemble(model, fit_batches, data, layers, alpha, magnitude, std=0.5):
    """``setup`` (the statistics) and ``postprocess``: each layer's score, weighted by ``alpha_list``, summed."""
    means, precisions = get_mds_stat(model, fit_batches, NUM_LABELS, layers)
    scores = torch.stack([compute_mahalanobis_score(model, data, NUM_LABELS, means, precisions, layer, index,
                                                    magnitude, std) for index, layer in enumerate(layers)], 1)
    return torch.matmul(scores, torch.tensor(alpha, dtype=torch.float64)).detach().numpy()


def scored_inputs():
    return 1.5 * torch.randn(6, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(6),
                             dtype=torch.float64)


@pytest.mark.parametrize("arch", ["resnet", "vit"])
@pytest.mark.parametrize("layers, alpha, noise", [((0,), None, 0.0014), ((0, -1), (0.3, 2.0), 0.0014),
                                                  ((1, -1), None, 0.0), ((0, -1), (1.0, 1.0), 0.05)])
def test_mds_ensemble_matches_openood(arch, layers, alpha, noise):
    model, batches, inputs = make_tiny_model(arch), float64_fit_batches(), scored_inputs()
    weights = alpha or (1.0,) * len(layers)
    expected = openood_mds_ensemble(model, batches, inputs, layers, weights, noise)
    detector = get_detector("mds_ensemble", model, layers=list(layers), alpha=alpha, noise=noise).fit(batches)
    np.testing.assert_allclose(detector.score(inputs).double().numpy(), expected, rtol=RTOL)
    if noise:  # the step changes the score
        unstepped = openood_mds_ensemble(model, batches, inputs, layers, weights, 0.0)
        assert np.abs(expected - unstepped).max() > 1e-6


def test_defaults_and_the_id_only_weights():
    assert DETECTORS["mds_ensemble"].defaults == {"layers": (0,), "alpha": None, "noise": 0.0014, "image_std": 0.5}
    assert DETECTORS["mds_ensemble"].one_pass is False and DETECTORS["mds_ensemble"].fit_split == "train"
    model = make_tiny_model("resnet")
    with pytest.raises(ValueError, match=r"alpha must have one weight per layer \(2 layers \[0, -1\]\), got 1"):
        get_detector("mds_ensemble", model, layers=[0, -1], alpha=[1.0])
    with pytest.raises(ValueError, match=r"layers must be a non-empty list of distinct layer indices"):
        get_detector("mds_ensemble", model, layers=[0, 0])


def test_a_layer_out_of_range_is_named_when_the_detector_is_built():
    model = make_tiny_model("resnet")  # layers: the stem (the first stage's input) and two stages
    with pytest.raises(ValueError, match=r"layers \[5\] out of range for the 3 layers of ResNetForImageClassification"):
        get_detector("mds_ensemble", model, layers=[0, 5])


def test_the_base_model_stays_picklable():
    """The layers are captured by this library's hooks: transformers' ``output_hidden_states=True`` would install
    hooks of its own, local functions that pickle cannot write, on the shared base model."""
    import pickle

    model = make_tiny_model("vit")
    get_detector("mds_ensemble", model, layers=[0, -1]).fit(float64_fit_batches()).score(scored_inputs())
    pickle.dumps(model)


def test_a_load_with_other_layers_than_the_fitted_ones_is_refused(tmp_path):
    model = make_tiny_model("vit")
    detector = get_detector("mds_ensemble", model, layers=[0, 2]).fit(float64_fit_batches())
    detector.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"fitted on layers \[0, 2\], not \[1, 2\]"):
        AutoOODDetector.from_pretrained(tmp_path, model=model, layers=[1, 2])
    loaded = AutoOODDetector.from_pretrained(tmp_path, model=model)
    np.testing.assert_array_equal(loaded.score(scored_inputs()).numpy(), detector.score(scored_inputs()).numpy())
