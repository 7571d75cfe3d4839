"""NAC against its authors' code (github.com/BierOne/ood_coverage: ``openood/postprocessors/nac_postprocessor.py``,
``openood/postprocessors/nac/coverage.py`` ``KMNC`` / ``Estimator`` / ``logspace``, ``nac/utils.py``
``get_state_func`` / ``StatePooling``, ``nac/instr_state.py`` ``kl_grad``, ``configs/postprocessors/nac/*/nac_imagenet.yml``),
written again here in numpy and torch on the tiny float64 models.

The reference reads its layers with forward hooks of its own on the modules the authors name (ResNet ``avgpool``: a
transformers ResNet's ``resnet.pooler``, a ``(B, C, 1, 1)`` map; ViT ``encoder.ln``: ``vit.layernorm``, its first token;
ResNet ``layerN``: ``resnet.encoder.stages.N-1``; ViT ``encoder_layer_i.ln_2``: ``vit.layers.i.layernorm_after``),
takes each layer's gradient with its own backward (``retain_graph`` until the last, as ``assess``), and compares the
states with the interval edges as dense boolean masks (``Estimator.update`` / ``ood_test``).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, NUM_LABELS, float64_fit_batches, make_tiny_model
from transformers import ResNetConfig, ResNetForImageClassification

from hf_gsc import AutoOODDetector
from hf_gsc.detectors import DETECTORS, get_detector
from hf_gsc.detectors.nac import coverage_edges


#: float64 on both sides; the scores are means of the same coverage values, summed in another order.
RTOL = 1e-12


# --------------------------------------------------------------------------- the authors' code, written again
def logspace(base=10, num=100):
    """``coverage.logspace``."""
    num = int(num / 2)
    x = np.linspace(1, np.sqrt(base), num=num)
    x_l = np.emath.logn(base, x)
    x_r = (1 - x_l)[::-1]
    x = np.concatenate([x_l[:-1], x_r])
    x[-1] += 1e-2
    return torch.from_numpy(np.append(x, 1.2))


class Estimator:
    """``coverage.Estimator`` (``update``, ``get_score`` with ``method='avg'``, ``ood_test``), counts in float64."""

    def __init__(self, neuron_num, M, min_activated):  # the authors' O, the "minimum activated number"
        self.M, self.O, self.N = M, min_activated, neuron_num
        self.thresh = logspace(1e3, M).view(M, -1).repeat(1, neuron_num)
        self.t_act = torch.zeros(M - 1, neuron_num, dtype=torch.float64)

    def update(self, states):
        b_act = (states.unsqueeze(1) >= self.thresh[:self.M - 1].unsqueeze(0)) & \
                (states.unsqueeze(1) < self.thresh[1:self.M].unsqueeze(0))
        self.t_act += b_act.sum(dim=0)

    def get_score(self):
        self.n_coverage = torch.min(self.t_act / self.O, torch.ones_like(self.t_act))

    def ood_test(self, states):
        b_act = (states.unsqueeze(1) >= self.thresh[:self.M - 1].unsqueeze(0)) & \
                (states.unsqueeze(1) < self.thresh[1:self.M].unsqueeze(0))
        return (b_act * self.n_coverage.unsqueeze(0)).sum(dim=1).mean(dim=1)


def sigmoid(x, sig_alpha=1.0):
    """``nac/utils.sigmoid``."""
    return 1 / (1 + torch.exp(-sig_alpha * x))


def state_pooling(hidden, pooling_method):
    """``StatePooling``: ``avg_pooling`` (a sum over the map) for a ResNet, ``pooling_vit_mlp`` (a sum over the tokens,
    or the first token for ``encoder.ln``) for a ViT; a vector as it is (``transform`` pools only ``dim > 2``)."""
    if hidden.dim() == 4:
        return hidden.sum(dim=[2, 3])
    if hidden.dim() == 3:
        return hidden[:, 0] if pooling_method == "first" else hidden.sum(dim=1)
    return hidden


def kl_grad(b_state, outputs, retain_graph=False):
    """``instr_state.kl_grad``."""
    num_classes = outputs.shape[-1]
    targets = torch.ones_like(outputs) / num_classes
    loss = torch.sum(-targets * torch.log_softmax(outputs, dim=-1), dim=-1)
    return torch.autograd.grad(loss.sum(), b_state, retain_graph=retain_graph)[0]


def layer_states(model, x, modules, firsts, alphas):
    """``KMNC.assess`` / ``assess_ood`` for one batch: the retained layer outputs, each layer's ``kl_grad``, both pooled,
    ``sigmoid(o*g_kl)``."""
    retained, handles = {}, []
    for name in modules:
        handles.append(model.get_submodule(name).register_forward_hook(
            lambda _m, _i, out, name=name: retained.__setitem__(name, out if isinstance(out, torch.Tensor) else out[0])))
    try:
        p = model(pixel_values=x).logits
        states = []
        for j, (name, first, alpha) in enumerate(zip(modules, firsts, alphas)):
            b_state = retained[name]
            b_kl_grad = kl_grad(b_state, p, retain_graph=j != len(modules) - 1)
            method = "first" if first else "avg"
            o, g = state_pooling(b_state.detach(), method), state_pooling(b_kl_grad.detach(), method)
            states.append(sigmoid(o * g, sig_alpha=alpha))
        return states
    finally:
        for handle in handles:
            handle.remove()


def authors_nac(model, fit_batches, x, modules, firsts, layer_kwargs):
    """``NACPostprocessor.setup`` (``build_nac``: ``KMNC.assess`` on the fitting data, ``update``) and ``inference``
    (``assess_ood``: each layer's ``ood_test`` divided by the layer count, summed). The model's parameters require the
    gradient, as the authors' do."""
    model = copy.deepcopy(model).requires_grad_(True)
    alphas = [kwargs["sig_alpha"] for kwargs in layer_kwargs]
    estimators = None
    for data, _ in fit_batches:
        states = layer_states(model, data, modules, firsts, alphas)
        if estimators is None:
            estimators = [Estimator(s.shape[1], kwargs["M"], kwargs["O"]) for s, kwargs in zip(states, layer_kwargs)]
        for estimator, state in zip(estimators, states):
            estimator.update(state)
    for estimator in estimators:
        estimator.get_score()
    scores = torch.zeros(x.shape[0], dtype=torch.float64)
    for estimator, state in zip(estimators, layer_states(model, x, modules, firsts, alphas)):
        scores += estimator.ood_test(state) / len(modules)
    return scores.numpy()


# --------------------------------------------------------------------------- the data
def scored_inputs():
    """Four fitting images, and eight others at three scales."""
    other = torch.randn(8, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    return torch.cat([float64_fit_batches()[0][0][:4], other * torch.tensor([0.5, 1.0, 2.0, 3.0] * 2)[:, None, None, None]])


#: The authors' layer names on the tiny models, as the reference reads them: (module, first token only).
AUTHORS_LAYERS = {
    "resnet": {"avgpool": ("resnet.pooler", False), "layer1": ("resnet.encoder.stages.0", False)},
    "vit": {"layer_norm": ("vit.layernorm", True), "layer_1": ("vit.layers.1.layernorm_after", False),
            "layer_0": ("vit.layers.0.layernorm_after", False)},
}
#: The same layers as this library names them.
OUR_LAYERS = {
    "resnet": {"avgpool": "penultimate", "layer1": "resnet.encoder.stages.0"},
    "vit": {"layer_norm": "penultimate", "layer_1": "vit.layers.1.layernorm_after",
            "layer_0": "vit.layers.0.layernorm_after"},
}


def compare(arch, layers, kwargs):
    model, batches, inputs = make_tiny_model(arch), float64_fit_batches(), scored_inputs()
    modules, firsts = zip(*(AUTHORS_LAYERS[arch][layer] for layer in layers))
    expected = authors_nac(model, batches, inputs, modules, firsts, kwargs)
    detector = get_detector("nac", model, layers=[OUR_LAYERS[arch][layer] for layer in layers],
                            bins=[k["M"] for k in kwargs], min_count=[k["O"] for k in kwargs],
                            alpha=[k["sig_alpha"] for k in kwargs]).fit(batches)
    np.testing.assert_allclose(detector.score(inputs).double().numpy(), expected, rtol=RTOL)
    return expected


@pytest.mark.parametrize("arch, layers, kwargs", [
    ("resnet", ["avgpool"], [{"O": 10, "M": 50, "sig_alpha": 3000}]),
    ("resnet", ["avgpool", "layer1"], [{"O": 2, "M": 20, "sig_alpha": 5.0}, {"O": 5, "M": 100, "sig_alpha": 0.01}]),
    ("vit", ["layer_norm"], [{"O": 3, "M": 50, "sig_alpha": 100}]),
    ("vit", ["layer_norm", "layer_1", "layer_0"],
     [{"O": 4, "M": 50, "sig_alpha": 10}, {"O": 2, "M": 500, "sig_alpha": 1}, {"O": 10, "M": 1000, "sig_alpha": 10}]),
])
def test_nac_matches_the_authors_code(arch, layers, kwargs):
    expected = compare(arch, layers, kwargs)
    # Informative inputs: the scores differ from sample to sample (not every state in one interval).
    assert np.ptp(expected) > 1e-3


@pytest.mark.parametrize("arch", ["resnet", "vit"])
def test_the_defaults_are_the_authors_imagenet_settings(arch):
    """The tiny ResNet has two stages (the authors' ``avgpool`` and ``layer1`` stand in), the tiny ViT two blocks
    (``layer_norm``, ``layer_1``, ``layer_0``): the first entries of the authors' ImageNet ``layer_kwargs``."""
    resnet = [{"O": 10, "M": 50, "sig_alpha": 3000}, {"O": 500, "M": 50, "sig_alpha": 300}]
    vit = [{"O": 500, "M": 50, "sig_alpha": 100}, {"O": 50, "M": 500, "sig_alpha": 1},
           {"O": 10, "M": 500, "sig_alpha": 10}]
    kwargs = resnet if arch == "resnet" else vit
    layers = list(AUTHORS_LAYERS[arch])
    detector = get_detector("nac", make_tiny_model(arch))
    assert detector.hyperparameters == {
        "layers": tuple(OUR_LAYERS[arch][layer] for layer in layers), "bins": tuple(k["M"] for k in kwargs),
        "min_count": tuple(float(k["O"]) for k in kwargs), "alpha": tuple(float(k["sig_alpha"]) for k in kwargs)}
    model, batches, inputs = make_tiny_model(arch), float64_fit_batches(), scored_inputs()
    modules, firsts = zip(*(AUTHORS_LAYERS[arch][layer] for layer in layers))
    expected = authors_nac(model, batches, inputs, modules, firsts, kwargs)
    np.testing.assert_allclose(get_detector("nac", model).fit(batches).score(inputs).double().numpy(), expected,
                               rtol=RTOL)


def test_a_four_stage_resnet_reads_the_authors_four_layers():
    """ResNet-50's ``avgpool``, ``layer3``, ``layer2``, ``layer1`` with their ImageNet ``layer_kwargs``, in that order."""
    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(embedding_size=4, hidden_sizes=[4, 4, 4, 6], depths=[1, 1, 1, 1],
                                                      num_labels=NUM_LABELS)).eval()
    detector = get_detector("nac", model)
    assert detector.hyperparameters == {
        "layers": ("penultimate", "resnet.encoder.stages.2", "resnet.encoder.stages.1", "resnet.encoder.stages.0"),
        "bins": (50, 50, 500, 1000), "min_count": (10.0, 500.0, 50.0, 5000.0), "alpha": (3000.0, 300.0, 0.01, 1.0)}


def test_coverage_edges_are_the_authors_logspace():
    for bins in (4, 50, 500, 1000):
        np.testing.assert_allclose(coverage_edges(bins).numpy(), logspace(1e3, bins).numpy(), rtol=1e-15, atol=1e-16)


def test_settings_are_checked_when_the_detector_is_built():
    assert DETECTORS["nac"].defaults == {"layers": None, "bins": None, "min_count": None, "alpha": None}
    assert DETECTORS["nac"].one_pass is False and DETECTORS["nac"].fit_split == "train"
    assert DETECTORS["nac"].search_space == {}
    model = make_tiny_model("resnet")
    with pytest.raises(ValueError, match=r"bins must have one value per layer \(2 layers"):
        get_detector("nac", model, bins=[50])
    with pytest.raises(ValueError, match=r"bins must hold even integers >= 4"):
        get_detector("nac", model, bins=[50, 51])
    with pytest.raises(ValueError, match=r"min_count must hold finite numbers > 0"):
        get_detector("nac", model, min_count=[0, 1])
    with pytest.raises(ValueError, match=r"layer 'resnet.encoder.stages.7' cannot be read"):
        get_detector("nac", model, layers=["penultimate", "resnet.encoder.stages.7"])
    with pytest.raises(ValueError, match=r"the authors publish settings for 4 layers, and 5 are read"):
        get_detector("nac", model, layers=["penultimate", "resnet.encoder.stages.0", "resnet.encoder.stages.1",
                                           "resnet.embedder", "resnet.pooler"])


def test_a_model_without_an_encoder_is_refused_with_the_reason():
    from test_detectors import ToyClassifier

    with pytest.raises(ValueError, match=r"nac reads layers inside the encoder by default"):
        get_detector("nac", ToyClassifier())


def test_min_count_applies_without_a_refit_and_a_load_with_other_bins_is_refused(tmp_path):
    model, batches, inputs = make_tiny_model("vit"), float64_fit_batches(), scored_inputs()
    kwargs = [{"O": 4, "M": 50, "sig_alpha": 10}, {"O": 2, "M": 500, "sig_alpha": 1}]
    layers = ["penultimate", "vit.layers.1.layernorm_after"]
    detector = get_detector("nac", model, layers=layers, bins=[50, 500], min_count=[4, 2], alpha=[10, 1]).fit(batches)
    detector.config.min_count = (8.0, 1.0)
    modules = ("vit.layernorm", "vit.layers.1.layernorm_after")
    expected = authors_nac(model, batches, inputs, modules, (True, False),
                           [dict(kwargs[0], O=8), dict(kwargs[1], O=1)])
    np.testing.assert_allclose(detector.score(inputs).double().numpy(), expected, rtol=RTOL)
    with pytest.raises(ValueError, match=r"config.alpha was set"):
        detector.config.alpha = (1.0, 1.0)
        detector.score(inputs)
    detector.save_pretrained(tmp_path)
    loaded = AutoOODDetector.from_pretrained(tmp_path, model=model)
    np.testing.assert_allclose(loaded.score(inputs).double().numpy(), expected, rtol=RTOL)
    with pytest.raises(ValueError, match=r"counted with bins \[50, 500\]"):
        AutoOODDetector.from_pretrained(tmp_path, model=model, bins=[50, 100])


def test_a_timm_model_is_refused_when_built_naming_the_reason(monkeypatch):
    """A timm model is read at ``forward_features``' output only (``encoder_blocks``): its stages are not listed, so the
    default layers cannot be chosen (``tests/test_timm_models.py`` checks the words on real timm models)."""
    import hf_gsc.classifier.architectures as architectures

    monkeypatch.setattr(architectures, "is_timm_model", lambda model: True)
    with pytest.raises(ValueError, match=r"nac reads layers inside the encoder by default: .*exposes no list of them.*"
                                         r"timm models are read at forward_features' output only.*pass layers="):
        get_detector("nac", make_tiny_model("resnet"))


def test_a_layer_the_logits_do_not_depend_on_is_refused_naming_it():
    """A transformers ViT's ``pooler`` (absent here: ``add_pooling_layer=False``) or any module off the path to the
    logits has no gradient: named, not a raw autograd error."""
    model = make_tiny_model("vit")
    model.unused = torch.nn.Linear(16, 16).double()
    original = model.vit.forward

    def forward(*args, **kwargs):
        output = original(*args, **kwargs)
        model.unused(output.last_hidden_state)  # run, and thrown away
        return output

    model.vit.forward = forward
    detector = get_detector("nac", model, layers=["penultimate", "unused"], bins=[50, 50], min_count=[1, 1],
                            alpha=[1, 1])
    with pytest.raises(ValueError, match=r"do not depend on the output of layers \['unused'\]"):
        detector.fit(float64_fit_batches())
