"""hf_gsc.analysis: TopKRatio, iterative short-circuit, head-only variants, approximation error, tiny end-to-end run."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model
from torch.utils.data import DataLoader
from transformers import ViTConfig, ViTForImageClassification

from hf_gsc import GSCForImageClassification
from hf_gsc.analysis import (
    approximation_outputs,
    error_stats,
    gsc_logits,
    head_context,
    head_gradient,
    iterative_short_circuit,
    split_budget,
    top_fraction_ratio,
    top_k_ratio,
    variant_grid,
)
from hf_gsc.analysis.cli import run_one
from hf_gsc.classifier.split_points import resolve_split_point
from hf_gsc.gsc_math.shortcircuit import num_masked


REPO = Path(__file__).resolve().parents[1]


def numpy_top_k_ratio(gradient: np.ndarray, ks: list[int]) -> np.ndarray:
    out = np.empty((gradient.shape[0], len(ks)))
    for i, row in enumerate(np.abs(gradient)):
        ordered = np.sort(row)[::-1]
        for j, k in enumerate(ks):
            out[i, j] = ordered[:k].sum() / ordered.sum() if ordered.sum() > 0 else np.nan
    return out


# ------------------------------------------------------------------------------ gradient concentration
def test_top_k_ratio_matches_numpy_reference():
    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(7, 40, generator=generator)
    gradient[gradient.abs() < 0.3] = 0  # unread coordinates
    gradient[3] = 0  # an all-zero row: ratio undefined
    ks = [0, 1, 2, 5, 13, 40, 100]
    got = top_k_ratio(gradient, ks).numpy()
    expected = numpy_top_k_ratio(gradient.double().numpy(), ks)
    np.testing.assert_allclose(got, expected, rtol=1e-12, equal_nan=True)
    assert np.isnan(got[3]).all()
    finite = np.delete(got, 3, axis=0)
    assert (finite[:, 0] == 0).all() and np.allclose(finite[:, -2:], 1.0)
    assert (np.diff(finite, axis=1) >= -1e-15).all()  # nondecreasing in k


def test_top_k_ratio_shapes_and_errors():
    gradient = torch.randn(3, 2, 4, 5)  # flattened to (3, 40)
    assert top_k_ratio(gradient, [1, 3]).shape == (3, 2)
    with pytest.raises(ValueError):
        top_k_ratio(gradient, [-1])
    with pytest.raises(ValueError):
        top_k_ratio(gradient, [1.5])


def test_top_fraction_ratio_counts_read_coordinates():
    generator = torch.Generator().manual_seed(1)
    gradient = torch.randn(5, 50, generator=generator)
    gradient[:, 30:] = 0  # n = 30 read coordinates per row
    fractions = [0.01, 0.1, 0.5, 1.0]
    got = top_fraction_ratio(gradient, fractions)
    ks = [math.ceil(f * 30 - 1e-9) for f in fractions]
    np.testing.assert_allclose(got.numpy(), numpy_top_k_ratio(gradient.double().numpy(), ks), rtol=1e-12)


# ------------------------------------------------------------------------------ iterative short-circuit
@pytest.mark.parametrize("k", [[0, 1, 5, 6, 7, 100]])
@pytest.mark.parametrize("steps", [1, 2, 3, 4])
def test_split_budget_accounting(k, steps):
    k = torch.tensor(k)
    budget = split_budget(k, steps)
    assert budget.shape == (steps, len(k))
    assert torch.equal(budget.sum(dim=0), k)
    assert (budget.max(dim=0).values - budget.min(dim=0).values <= 1).all()
    assert (budget[:-1] >= budget[1:]).all()  # earlier steps take the remainder
    with pytest.raises(ValueError):
        split_budget(k, 0)


def _reference_iterative(head, features, mask_ratio, steps):
    """Per sample, plain loops: re-take the exact gradient at F_t, zero the top-k_t unmasked |g_t|."""
    outputs, masks = [], []
    for x in features:
        x = x.unsqueeze(0).clone()
        logits = head(x)
        c = int(logits.argmax())
        f = x.detach().flatten()
        g = torch.autograd.functional.jacobian(lambda v: head(v.view_as(x))[0, c], f)
        k = math.ceil((g != 0).sum().item() * mask_ratio - 1e-9)
        sizes = [k // steps + (1 if t < k % steps else 0) for t in range(steps)]
        taken = torch.zeros_like(f, dtype=torch.bool)
        for t, size in enumerate(sizes):
            if t > 0:
                g = torch.autograd.functional.jacobian(lambda v: head(v.view_as(x))[0, c], f)
            priority = torch.where(taken, -torch.inf, torch.where(g != 0, g.abs(), -1.0))
            chosen = torch.argsort(priority, descending=True, stable=True)[:size]
            taken[chosen] = True
            f = f.clone()
            f[chosen] = 0
        outputs.append(head(f.view_as(x))[0].detach())
        masks.append(taken)
    return torch.stack(outputs), torch.stack(masks)


@pytest.mark.parametrize("arch", ["vit", "resnet"])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_iterative_matches_reference_and_spends_the_budget(arch, steps, pixel_values):
    model = make_tiny_model(arch)
    split = resolve_split_point(model, "final_encoder_output")
    features = split.features(pixel_values)
    head = lambda f: split.head(f, pixel_values)  # noqa: E731
    mask_ratio = 0.3
    logits, shorted, mask = iterative_short_circuit(head, features, mask_ratio, steps)
    _, g0 = head_gradient(head, features)
    k = num_masked(g0.flatten(1), mask_ratio)
    assert torch.equal(mask.sum(dim=1), k)
    assert (shorted.flatten(1)[mask] == 0).all()
    assert torch.equal(shorted.flatten(1)[~mask], features.flatten(1)[~mask])
    expected_logits, expected_mask = _reference_iterative(head, features, mask_ratio, steps)
    assert torch.equal(mask, expected_mask)
    torch.testing.assert_close(logits, expected_logits)


def test_iterative_one_step_is_one_shot_exact(pixel_values):
    model = make_tiny_model("vit")
    detector = GSCForImageClassification(model, mask_ratio=0.25, approximation="exact")
    context = head_context(detector.split_point, pixel_values)
    one_step = gsc_logits(context, mask_ratio=0.25, approximation="exact", steps=1)
    iterative = iterative_short_circuit(context.head, context.features, 0.25, 1)[0]
    torch.testing.assert_close(one_step, detector(pixel_values).gsc_logits)
    torch.testing.assert_close(iterative, one_step)


def test_iterative_equals_one_shot_for_a_linear_head(pixel_values):
    """ResNet at the final encoder output: g = W[c]/(HW) does not change as F changes, so steps do not matter."""
    model = make_tiny_model("resnet")
    context = head_context(resolve_split_point(model, "final_encoder_output"), pixel_values)
    one = gsc_logits(context, mask_ratio=0.2, approximation="exact", steps=1)
    for steps in (2, 3):
        torch.testing.assert_close(gsc_logits(context, mask_ratio=0.2, approximation="exact", steps=steps), one)
    with pytest.raises(ValueError):
        gsc_logits(context, steps=2, approximation="first_order")


# ------------------------------------------------------------------------------ head-only variants
@pytest.mark.parametrize("arch", ["vit", "resnet", "swin"])
@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"operation": "perturb", "alpha": 0.3},
        {"operation": "project", "mask_ratio": 0.1},
        {"operation": "clip", "clip_bound": 0.5, "approximation": "exact"},
        {"selection": "reverse", "approximation": "predicted_logit"},
        {"operation": "scale", "beta": 0.25, "mask_ratio": 0.2},
    ],
)
def test_head_only_variant_equals_detector(arch, settings, pixel_values):
    model = make_tiny_model(arch)
    detector = GSCForImageClassification(model, **settings)
    context = head_context(detector.split_point, pixel_values)
    torch.testing.assert_close(gsc_logits(context, **settings), detector(pixel_values).gsc_logits)


def test_head_only_variant_at_an_earlier_block_equals_detector(pixel_values):
    model = make_tiny_model("vit")
    detector = GSCForImageClassification(model, split_point="vit.layers.0", mask_ratio=0.1)
    context = head_context(detector.split_point, pixel_values)
    torch.testing.assert_close(gsc_logits(context, mask_ratio=0.1), detector(pixel_values).gsc_logits)


# ------------------------------------------------------------------------------ approximation error
def test_approximation_outputs_first_order_exact_for_linear_head(pixel_values):
    model = make_tiny_model("resnet")
    context = head_context(resolve_split_point(model, "final_encoder_output"), pixel_values)
    out = approximation_outputs(context, mask_ratio=0.2)
    torch.testing.assert_close(out["first_order/energy"], out["exact/energy"])
    assert not torch.allclose(out["base/energy"], out["exact/energy"])

    vit = make_tiny_model("vit")
    context = head_context(resolve_split_point(vit, "final_encoder_output"), pixel_values)
    out = approximation_outputs(context, mask_ratio=0.2)
    assert (out["first_order/energy"] - out["exact/energy"]).abs().max() > 1e-6  # LayerNorm head: an approximation
    stats = error_stats(torch.tensor([1.0, -3.0]).abs())
    assert stats == {"mean": 2.0, "std": 1.0, "max": 3.0, "num_samples": 2}


# ------------------------------------------------------------------------------ end to end
def _tiny_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(
        image_size=IMAGE_SIZE, patch_size=4, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=32, num_channels=3, num_labels=5,
    ))
    with torch.no_grad():
        model.classifier.weight.mul_(20.0)
    return model.eval()


@pytest.fixture
def one_thread():
    """The machine is shared: one intra-op thread is several times faster than two under contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_run_ablations_end_to_end(tmp_path, one_thread):
    script = runpy.run_path(str(REPO / "scripts" / "run_ablations.py"))
    assert callable(script["main"])
    model = _tiny_vit()
    generator = torch.Generator().manual_seed(0)

    def batches(n, labelled, shift=0.0):
        """A DataLoader of {"pixel_values", "labels"} batches of 8, as the evaluation's loop reads them."""
        x = torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator) + shift
        y = torch.randint(0, 5, (n,), generator=generator) if labelled else torch.full((n,), -1)
        return DataLoader(list(zip(x, y)), batch_size=8, collate_fn=lambda rows: {
            "pixel_values": torch.stack([row[0] for row in rows]), "labels": torch.stack([row[1] for row in rows])})

    data = {"id_test": batches(12, True), "far": batches(10, False, 2.0), "near": batches(10, False, 0.5)}
    summary = run_one(model, data, tmp_path, "tiny", "tiny vit")
    grid = variant_grid(model)
    assert set(summary["tables"]) == set(grid)
    assert set(summary["tables"]) >= {"mask_ratio", "operation", "selection", "iterative", "split_point", "gsc_ash"}
    written = json.loads((tmp_path / "tiny.json").read_text())
    assert written["num_samples"] == {"id_test": 12, "far": 10, "near": 10}
    for row in written["variants"].values():
        assert set(row["per_ood_split"]) == {"far", "near"}
        assert 0.0 <= row["mean"]["auroc"] <= 1.0
    errors = written["approximation_error"]
    assert set(errors) == {"final_encoder_output", "vit.layers.-3"}
    assert set(errors["final_encoder_output"]["errors"]) == {"first_order", "predicted_logit"}
    assert set(written["gradient_concentration"]) == {"final_encoder_output", "penultimate"}
    md = (tmp_path / "tiny.md").read_text()
    assert "### iterative" in md and "approximation error" in md
    assert (tmp_path / "tiny_concentration.png").stat().st_size > 1000
    # The command line rebuilds the cross-model summary from the JSON files.
    assert script["main"].__module__ == "hf_gsc.analysis.cli"
    from hf_gsc.analysis.cli import main

    assert main(["--summary-only", "--output-dir", str(tmp_path)]) == 0
    assert "### split point" in (tmp_path / "summary.md").read_text()
