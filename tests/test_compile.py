"""Every detector's forward is one graph for ``torch.compile(..., fullgraph=True)``, with the eager scores.

``fullgraph=True`` raises at the first graph break (a host read such as ``Tensor.item``, a data-dependent shape or
branch, state a compiler cannot trace), so compiling with the cheap ``eager`` / ``aot_eager`` backends proves the
forward is whole; one test compiles with inductor, as a served path does. Tiny float64 models keep it fast.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model
from test_detectors import MODEL_SPECIFIC
from torch.utils._python_dispatch import TorchDispatchMode

from hf_gsc import AutoOODDetector
from hf_gsc.detectors import DETECTORS
from hf_gsc.detectors.compiled import CompiledDetector


#: Every one-pass method that applies to the ViT (a model-specific one, BATS, is on the ResNet list below).
ONE_PASS = sorted(name for name, cls in DETECTORS.items() if cls.one_pass and "vit" in MODEL_SPECIFIC.get(name, ("vit",)))
NUM_FIT = 128


def _balanced(arch: str) -> torch.nn.Module:
    """A tiny model whose classifier predicts every class on random images (the per-class fits need each); the ViT
    with one layer, since every method's compile traces it once."""
    model = make_tiny_model(arch)
    if arch == "vit":
        model.vit.layers = model.vit.layers[:1]
        model.config.num_hidden_layers = 1
    x = _images(NUM_FIT, seed=0)
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    with torch.no_grad():
        features = []
        linear.register_forward_hook(lambda _m, args, _o: features.append(args[0]))
        model(pixel_values=x)
        logits = features[0] @ linear.weight.T
        scale = 3.0 / logits.std(dim=0)
        linear.weight.mul_(scale[:, None])
        linear.bias.copy_(-logits.mean(dim=0) * scale)
    linear._forward_hooks.clear()
    return model


def _images(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.fixture(scope="module")
def fitted() -> dict[str, dict[str, object]]:
    """Every one-pass method, fitted where it needs it, on a tiny ViT (first-token head) and ResNet (pooled head)."""
    out: dict[str, dict[str, object]] = {}
    for arch in ("vit", "resnet"):
        model = _balanced(arch)
        x = _images(NUM_FIT, seed=1)
        with torch.no_grad():
            labels = model(pixel_values=x).logits.argmax(-1)
        data = [(x[i:i + 32], labels[i:i + 32]) for i in range(0, NUM_FIT, 32)]
        out[arch] = {}
        for method in ONE_PASS if arch == "vit" else POOLED_HEAD_METHODS:
            detector = AutoOODDetector.from_pretrained(model, method=method)
            if detector.needs_fit:
                detector.fit(data)
            detector.config.threshold = 0.0  # is_ood computed too
            out[arch][method] = detector
    return out


#: On the pooled head, the methods whose scoring reads the feature in a way of its own (clipping, pruning, scaling,
#: projections, neighbours); every method that applies to a ViT runs on the first-token head.
POOLED_HEAD_METHODS = ("ash_s", "bats", "knn", "react", "scale", "vim")


@pytest.mark.parametrize("arch", ["vit", "resnet"])
def test_every_one_pass_method_compiles_whole_with_the_eager_scores(fitted, arch):
    x = _images(4, seed=2)
    methods = ONE_PASS if arch == "vit" else POOLED_HEAD_METHODS
    for method in methods:
        detector = fitted[arch][method]
        torch._dynamo.reset()
        expected = detector(x)
        got = torch.compile(detector, fullgraph=True, backend="eager")(x)
        torch.testing.assert_close(got.ood_score, expected.ood_score, rtol=1e-9, atol=1e-9, msg=method)
        assert torch.equal(got.is_ood, expected.is_ood), method


@pytest.mark.parametrize("arch, approximation", [("vit", "first_order"), ("resnet", "exact"),
                                                 ("swin", "predicted_logit"), ("swin", "first_order")])
def test_gsc_compiles_whole_on_each_head_form(arch, approximation):
    """First-token head (ViT), pooled head (ResNet, per-channel step), token-mean head after a per-token LayerNorm
    (Swin, step on every coordinate), through autograd's functional transforms in aot_eager."""
    detector = AutoOODDetector.from_pretrained(make_tiny_model(arch), method="gsc", approximation=approximation)
    x = _images(4, seed=3)
    torch._dynamo.reset()
    expected = detector(x)
    compiled = torch.compile(detector, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    torch.testing.assert_close(got.ood_score, expected.ood_score, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(got.gsc_logits, expected.gsc_logits, rtol=1e-9, atol=1e-9)


def test_a_compiled_forward_compiles_once_across_calls():
    """Nothing the forward reads changes between calls (no per-call state guarded on), so new inputs of the same
    shape reuse the first graph."""
    from torch._dynamo.utils import counters

    detector = AutoOODDetector.from_pretrained(make_tiny_model("vit"), method="gsc")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(detector, fullgraph=True, backend="eager")
    for seed in range(3):
        compiled(_images(4, seed=seed))
    assert counters["stats"]["unique_graphs"] == 1


def test_two_compiled_detectors_coexist_in_one_process():
    """GSC and KNN, each on its own model, each compiled and called twice in turn, as a serving loop does."""
    torch._dynamo.reset()
    x = _images(4, seed=4)
    gsc = AutoOODDetector.from_pretrained(make_tiny_model("vit"), method="gsc")
    knn = AutoOODDetector.from_pretrained(make_tiny_model("resnet", seed=1), method="knn")
    knn.fit(_images(64, seed=5))
    expected = [gsc(x).ood_score, knn(x).ood_score]
    compiled = [torch.compile(gsc, fullgraph=True, backend="eager"), torch.compile(knn, fullgraph=True, backend="eager")]
    for _ in range(2):
        for detector, want in zip(compiled, expected):
            torch.testing.assert_close(detector(x).ood_score, want, rtol=1e-9, atol=1e-9)


class _HostReads(TorchDispatchMode):
    """Counts the ops that hand a tensor's value to the host (what makes it wait for a device)."""

    READS = {"_local_scalar_dense", "equal", "is_nonzero", "nonzero"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["vit", "resnet"])
def test_no_forward_reads_a_value_on_the_host(fitted, arch):
    x = _images(4, seed=6)
    for method, detector in fitted[arch].items():
        with _HostReads() as mode:
            detector(x)
        assert mode.reads == [], method


def test_served_path_inductor_equals_eager_and_warns_once_without_a_threshold():
    """``detector.compiled()`` (inductor, the served path): eager checks first, the eager scores, the uncalibrated
    warning that a compiled graph cannot give, and a setting assigned later honoured (a new graph)."""
    detector = AutoOODDetector.from_pretrained(make_tiny_model("resnet"), method="gsc")
    x = _images(2, seed=7)
    expected = detector(x)
    detector._warned_uncalibrated = False
    torch._dynamo.reset()
    served = detector.compiled()
    assert isinstance(served, CompiledDetector)
    with pytest.warns(UserWarning, match="has no threshold"):
        got = served(x)
    torch.testing.assert_close(got.ood_score, expected.ood_score, rtol=1e-7, atol=1e-7)
    assert got.is_ood is None
    detector.config.threshold = float(expected.ood_score.mean())  # between the two scores: one row each side
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decided = served(x).is_ood
    assert decided.tolist() == detector(x).is_ood.tolist() and decided.sum() == 1
    # The device-side finite check survives the compiler: a row holding a NaN is scored NaN and decided OOD.
    poisoned = x.clone()
    poisoned[0, 0, 0, 0] = float("nan")
    out = served(poisoned)
    assert torch.isnan(out.ood_score[0]) and out.is_ood[0] and torch.isclose(out.ood_score[1], got.ood_score[1])
    with pytest.raises(ValueError, match="channels"):
        served(torch.zeros(2, 1, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.float64))


def test_compile_mode_is_checked():
    detector = AutoOODDetector.from_pretrained(make_tiny_model("vit"), method="msp")
    with pytest.raises(ValueError, match="mode must be one of"):
        detector.compiled(mode="fast")
