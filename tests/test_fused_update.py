"""``compile_update``: the compiled per-batch update against the eager forward, the tie fallback, the errors."""

from __future__ import annotations

import shutil

import pytest
import torch

from hf_gsc import GSCForImageClassification
from hf_gsc.fused_update import gsc_update, top_k_mask_with_bound
from hf_gsc.shortcircuit import _mask_from_priority, mask_size

from conftest import IMAGE_SIZE, make_tiny_model

SETTINGS = dict(alpha=0.3, clip_bound=0.2, beta=0.25)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Every detector compiles the same function; its recompile limit is shared across tests.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _counting(function):
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return wrapper, calls


def _assert_same_output(compiled, eager, exact: bool):
    check = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-9, atol=1e-9)
    assert torch.equal(compiled.predicted_class, eager.predicted_class)
    for name in ("logits", "gsc_logits", "ood_score"):
        assert check(compiled[name], eager[name]), name


@pytest.mark.parametrize(
    "arch, approximation, operation, score",
    [
        ("vit", "first_order", "zero", "energy"),
        ("deit", "exact", "clip", "msp"),
        ("swin", "first_order", "perturb", "energy"),
        ("swin", "predicted_logit", "project", "max_logit"),
        ("vit", "exact", "scale", "energy"),
    ],
)
def test_compiled_update_matches_the_eager_forward(arch, approximation, operation, score, pixel_values):
    model = make_tiny_model(arch)
    settings = dict(approximation=approximation, operation=operation, score=score, mask_ratio=0.2, **SETTINGS)
    eager = GSCForImageClassification(model, **settings)
    # aot_eager traces the same graph as inductor without generating C++ (fast); inductor is tested below.
    compiled = GSCForImageClassification(model, **settings).compile_update(backend="aot_eager", fullgraph=True)
    compiled._compiled_update, calls = _counting(compiled._compiled_update)
    with torch.no_grad():
        result, reference = compiled(pixel_values), eager(pixel_values)
    assert calls, "the compiled update was not used"
    assert not compiled._compiled_update_result(compiled.split_point.features(pixel_values)).tied
    _assert_same_output(result, reference, exact=False)


def test_compiled_update_with_inductor_matches_the_eager_forward(pixel_values):
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("inductor's CPU backend needs a C++ compiler")
    model = make_tiny_model("swin").float()
    x = pixel_values.float()
    eager = GSCForImageClassification(model)
    compiled = GSCForImageClassification(model).compile_update(dynamic=False)
    with torch.inference_mode():
        result, reference = compiled(x), eager(x)
    assert torch.equal(result.predicted_class, reference.predicted_class)
    torch.testing.assert_close(result.ood_score, reference.ood_score, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.gsc_logits, reference.gsc_logits, rtol=1e-5, atol=1e-5)


def test_ties_across_the_cut_fall_back_to_the_eager_fill():
    # A constant image makes every Swin token equal, so each |g| value appears once per token: ties everywhere.
    model = make_tiny_model("swin")
    x = torch.full((3, 3, IMAGE_SIZE, IMAGE_SIZE), 0.5, dtype=torch.float64)
    x[1] = -0.25
    eager = GSCForImageClassification(model, mask_ratio=0.1)
    compiled = GSCForImageClassification(model, mask_ratio=0.1).compile_update(backend="aot_eager")
    assert compiled._compiled_update_result(compiled.split_point.features(x)).tied
    _assert_same_output(compiled(x), eager(x), exact=True)


def test_settings_the_compiled_update_does_not_cover_run_eagerly(pixel_values):
    model = make_tiny_model("vit")
    compiled = GSCForImageClassification(model, selection="reverse").compile_update(backend="aot_eager")
    compiled._compiled_update, calls = _counting(compiled._compiled_update)
    eager = GSCForImageClassification(model, selection="reverse")
    _assert_same_output(compiled(pixel_values), eager(pixel_values), exact=True)
    compiled.config.selection = "gradient"
    output = compiled(pixel_values, output_short_circuit=True)  # F-shaped outputs: eager
    assert not calls and output.mask is not None
    compiled(pixel_values)
    assert calls


@pytest.mark.parametrize(
    "arch, settings, message",
    [
        ("resnet", {}, "affine"),
        ("convnext", {}, "averages positions before its LayerNorm"),
        ("vit", {"split_point": "penultimate"}, "affine"),
        ("vit", {"split_point": "vit.layers.0"}, "no registered closed form"),
        ("vit", {"earlier_split_point": "vit.layers.0"}, "earlier_split_point"),
    ],
)
def test_compile_update_rejects_split_points_it_does_not_cover(arch, settings, message):
    detector = GSCForImageClassification(make_tiny_model(arch), **settings)
    with pytest.raises(ValueError, match=message):
        detector.compile_update()


def test_top_k_mask_with_bound_equals_the_eager_mask_or_reports_a_tie():
    generator = torch.Generator().manual_seed(3)
    for trial in range(200):
        width = int(torch.randint(1, 30, (1,), generator=generator))
        if trial % 2:
            priority = torch.randint(0, 4, (4, width), generator=generator).double()  # many ties
        else:
            priority = torch.randn(4, width, generator=generator, dtype=torch.float64).abs()
        k = torch.randint(0, width + 1, (4,), generator=generator)
        bound = max(1, int(k.max()))
        mask, tied = top_k_mask_with_bound(priority, k, bound)
        expected = _mask_from_priority(priority, k)
        has_tie = any(
            int((row >= row.topk(size).values[-1]).sum()) != size for row, size in zip(priority, k.tolist()) if size
        )
        assert bool(tied) == has_tie, (priority, k)
        if not has_tie:
            assert torch.equal(mask, expected), (priority, k)


def test_mask_size_in_integers_for_ints_and_tensors():
    assert mask_size(64, 1, 20) == 4  # ceil(0.05 * 64)
    assert mask_size(100, 1, 20) == 5  # exactly 5, no float round-up
    assert mask_size(0, 1, 20) == 0
    assert mask_size(torch.tensor([0, 1, 20, 21, 100]), 1, 20).tolist() == [0, 1, 1, 2, 5]


def test_gsc_update_runs_uncompiled(pixel_values):
    # The pure function itself, as the compiled one would trace it: same result as the eager forward.
    model = make_tiny_model("swin")
    detector = GSCForImageClassification(model)
    split = detector.split_point
    features = split.features(pixel_values)
    update = gsc_update(features, split.bound_head(on_read_part=True), (1, 20), mask_size(features[0].numel(), 1, 20))
    reference = detector(pixel_values)
    assert not update.tied
    assert torch.equal(update.predicted_class, reference.predicted_class)
    torch.testing.assert_close(update.ood_score, reference.ood_score, rtol=0, atol=1e-12)
