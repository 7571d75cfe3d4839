"""``compile_update(ahead_of_time=True)``: the AOTInductor package against the eager forward, its reuse from
``package_path``, what it follows (parameters) and what makes it stale (configuration), ties, errors.

Each real compilation takes 15-20 s on 2 CPU cores, so the two packages are built once per module."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from hf_gsc import GSCForImageClassification

from conftest import IMAGE_SIZE, make_tiny_model

pytestmark = pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="AOTInductor needs a C++ compiler"
)

# ViT: first-token read part (B, D), bias; Swin: per-token LayerNorm then mean over tokens, read part (B, N, D).
SETTINGS = {
    "vit": dict(approximation="first_order", operation="zero", score="energy", mask_ratio=0.2),
    "swin": dict(approximation="exact", operation="perturb", score="msp", mask_ratio=0.1, alpha=0.3),
}


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """``{arch: (compiled detector, eager detector, package path)}``, sharing one base model per arch."""
    directory = tmp_path_factory.mktemp("packages")
    built = {}
    for arch, settings in SETTINGS.items():
        model = make_tiny_model(arch)
        path = directory / f"{arch}.pt2"
        compiled = GSCForImageClassification(model, **settings).compile_update(ahead_of_time=True, package_path=path)
        built[arch] = (compiled, GSCForImageClassification(model, **settings), path)
    return built


def _count_calls(package, monkeypatch) -> list:
    """Record each call into the loaded package (its C++ entry point), whichever of the two it uses."""
    calls = []
    name = "_boxed_run" if package._boxed_run is not None else "_runner"
    run = getattr(package, name)
    monkeypatch.setattr(package, name, lambda *args: (calls.append(1), run(*args))[1])
    return calls


def _assert_close(result, reference):
    assert torch.equal(result.predicted_class, reference.predicted_class)
    for name in ("logits", "gsc_logits", "ood_score"):
        torch.testing.assert_close(result[name], reference[name], rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("arch", sorted(SETTINGS))
@pytest.mark.parametrize("batch_size", [5, 1, 2])
def test_package_matches_the_eager_forward_at_any_batch_size(packages, arch, batch_size, monkeypatch):
    compiled, eager, _ = packages[arch]
    x = torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    calls = _count_calls(compiled._compiled_update, monkeypatch)
    with torch.inference_mode():
        result, reference = compiled(x), eager(x)
    assert calls, "the package was not used"
    _assert_close(result, reference)


def test_package_follows_changed_parameters(packages):
    # The head's tensors are inputs of the package, not constants baked into it.
    compiled, eager, _ = packages["vit"]
    x = torch.randn(4, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    weight, norm = compiled.model.classifier.weight, compiled.model.vit.layernorm.bias
    saved = weight.detach().clone(), norm.detach().clone()
    try:
        with torch.no_grad():
            weight.mul_(-1.5)
            norm.add_(0.3)
            result, reference = compiled(x), eager(x)
    finally:
        with torch.no_grad():
            weight.copy_(saved[0])
            norm.copy_(saved[1])
    _assert_close(result, reference)


def test_ties_across_the_cut_fall_back_to_the_eager_fill(packages):
    # A constant image makes every Swin token equal, so each |g| value appears once per token: ties everywhere.
    compiled, eager, _ = packages["swin"]
    x = torch.full((3, 3, IMAGE_SIZE, IMAGE_SIZE), 0.5, dtype=torch.float64)
    x[1] = -0.25
    with torch.no_grad():
        assert compiled._compiled_update_result(compiled.split_point.features(x)).tied
        result, reference = compiled(x), eager(x)
    for name in ("predicted_class", "logits", "gsc_logits", "ood_score"):
        assert torch.equal(result[name], reference[name]), name


def test_a_changed_configuration_warns_once_and_runs_eagerly(packages):
    compiled, _, _ = packages["vit"]
    x = torch.randn(4, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    compiled.config.mask_ratio = 0.3
    try:
        with pytest.warns(UserWarning, match="built for another configuration"):
            result = compiled(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compiled(x)
    finally:
        compiled.config.mask_ratio = SETTINGS["vit"]["mask_ratio"]
        compiled._warned_stale_package = False
    reference = GSCForImageClassification(compiled.model, **{**SETTINGS["vit"], "mask_ratio": 0.3})(x)
    for name in ("predicted_class", "logits", "gsc_logits", "ood_score"):
        assert torch.equal(result[name], reference[name]), name


def test_package_path_is_reused_for_the_same_configuration_only(packages, monkeypatch):
    compiled, _, path = packages["vit"]
    attempts = []

    def no_compiler(*args, **kwargs):
        attempts.append(1)
        raise OSError("no C++ compiler here")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    reloaded = GSCForImageClassification(compiled.model, **SETTINGS["vit"])
    reloaded.compile_update(ahead_of_time=True, package_path=path)
    assert not attempts
    x = torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    _assert_close(reloaded(x), compiled(x))

    other = GSCForImageClassification(compiled.model, **{**SETTINGS["vit"], "operation": "clip"})
    with pytest.raises(RuntimeError, match="compiling the GSC update ahead of time failed.*C\\+\\+ compiler"):
        other.compile_update(ahead_of_time=True, package_path=path)
    assert attempts == [1]


def test_package_path_holding_another_file_is_an_error_and_kept(tmp_path, monkeypatch):
    path = tmp_path / "weights.pt2"
    path.write_bytes(b"not a package")
    detector = GSCForImageClassification(make_tiny_model("vit"))
    with pytest.raises(ValueError, match="exists but is not an AOTInductor package"):
        detector.compile_update(ahead_of_time=True, package_path=path)

    class SomeoneElsesPackage:  # an AOTInductor package whose metadata has no GSC key
        def get_metadata(self):
            return {"AOTI_DEVICE_KEY": "cpu"}

    monkeypatch.setattr(torch._inductor, "aoti_load_package", lambda path: SomeoneElsesPackage())
    with pytest.raises(ValueError, match="not a GSC update package; it is not overwritten"):
        detector.compile_update(ahead_of_time=True, package_path=path)
    assert path.read_bytes() == b"not a package"


@pytest.mark.parametrize(
    "settings, arguments, message",
    [
        ({}, dict(ahead_of_time=True, dynamic=False), "torch.compile arguments"),
        ({}, dict(package_path="update.pt2"), "package_path needs ahead_of_time=True"),
        ({"selection": "reverse"}, dict(ahead_of_time=True), "selection='gradient' and mask_size='fixed'"),
        ({"earlier_split_point": "vit.layers.0"}, dict(ahead_of_time=True), "earlier_split_point"),
    ],
)
def test_compile_update_ahead_of_time_rejects_what_it_cannot_compile(settings, arguments, message):
    detector = GSCForImageClassification(make_tiny_model("vit"), **settings)
    with pytest.raises(ValueError, match=message):
        detector.compile_update(**arguments)
