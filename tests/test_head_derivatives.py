"""Closed-form head derivatives (hf_gsc.head_derivatives) against autograd and torch.func.jvp."""

from __future__ import annotations

import pytest
import torch

from hf_gsc.head_derivatives import POOLS, layer_norm_jacobian_product, layer_norm_statistics, pool, pool_adjoint
from hf_gsc.split_points import linearize_with_autograd, resolve_split_point

from conftest import make_tiny_model

FEATURE_SHAPES = {"first_token": (5, 6), "mean_tokens": (5, 6), "mean_spatial": (6, 3, 2), "identity": (6,)}


@pytest.mark.parametrize("kind", POOLS)
def test_pool_adjoint_is_the_transpose_of_pool(kind):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, *FEATURE_SHAPES[kind], generator=generator, dtype=torch.float64)
    v = torch.randn_like(pool(x, kind))
    left = (pool(x, kind) * v).sum(dim=-1)
    right = (x * pool_adjoint(v, kind, x.shape[1:])).flatten(1).sum(dim=1)
    torch.testing.assert_close(left, right)


def test_layer_norm_jacobian_product_matches_autograd():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=generator, dtype=torch.float64) * 3 + 1
    u = torch.randn(4, 7, generator=generator, dtype=torch.float64)
    normalized, rstd = layer_norm_statistics(x, 1e-5)
    torch.testing.assert_close(normalized, torch.nn.functional.layer_norm(x, (7,), eps=1e-5))
    _, tangent = torch.func.jvp(lambda t: torch.nn.functional.layer_norm(t, (7,), eps=1e-5), (x,), (u,))
    torch.testing.assert_close(layer_norm_jacobian_product(u, normalized, rstd), tangent)


def _with_random_layer_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Default LayerNorms are weight 1, bias 0; random affine parameters catch a misplaced weight."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.copy_(torch.rand(module.weight.shape, generator=generator, dtype=module.weight.dtype) + 0.5)
                module.bias.copy_(torch.randn(module.bias.shape, generator=generator, dtype=module.bias.dtype))
    return model


@pytest.mark.parametrize("arch", ["vit", "deit", "swin", "resnet", "convnext"])
@pytest.mark.parametrize("split_point", ["final_encoder_output", "penultimate"])
def test_closed_form_head_matches_autograd(arch, split_point, pixel_values):
    model = _with_random_layer_norms(make_tiny_model(arch))
    split = resolve_split_point(model, split_point)
    assert split.head_spec is not None
    features = split.features(pixel_values)
    closed = split.linearize(features)
    reference = linearize_with_autograd(lambda f, _: split.head_spec.bind(model)(f), features, None)
    generator = torch.Generator().manual_seed(5)
    cotangent = torch.randn(closed.logits.shape, generator=generator, dtype=features.dtype)
    tangent = torch.randn(features.shape, generator=generator, dtype=features.dtype)

    torch.testing.assert_close(closed.logits, model(pixel_values=pixel_values).logits)
    torch.testing.assert_close(closed.logits, reference.logits)
    torch.testing.assert_close(closed.vjp(cotangent), reference.vjp(cotangent))
    torch.testing.assert_close(closed.jvp(tangent), reference.jvp(tangent))
    torch.testing.assert_close(closed.function(features), closed.logits)
    step = 1e-6  # central difference in float64: an independent check of J t
    difference = (closed.function(features + step * tangent) - closed.function(features - step * tangent)) / (2 * step)
    torch.testing.assert_close(closed.jvp(tangent), difference, rtol=1e-5, atol=1e-6)


def test_closed_form_is_used_only_where_the_head_has_the_registered_form(pixel_values):
    model = make_tiny_model("vit")
    assert resolve_split_point(model, "vit.layers.-1").head_spec is not None  # the last block = final output
    assert resolve_split_point(model, "vit.layers.0").head_spec is None  # a block precedes the head: autograd


def test_autograd_head_frees_its_graph_unless_a_jvp_is_needed(pixel_values):
    model = make_tiny_model("vit")
    model.set_attn_implementation("eager")  # J t through attention needs its double backward, which SDPA lacks
    split = resolve_split_point(model, "vit.layers.0")
    features = split.features(pixel_values)
    kept = split.linearize(features, pixel_values)
    classes = kept.logits.argmax(dim=-1)
    gradient = kept.class_gradient(classes)
    tangent = torch.randn(features.shape, generator=torch.Generator().manual_seed(2), dtype=features.dtype)
    # Forward mode as the reference (a finite difference is too noisy here: eager attention runs softmax in float32).
    reference = torch.func.jvp(split.head, (features,), (tangent,))[1]
    torch.testing.assert_close(kept.jvp(tangent), reference)  # J t by two reverse passes, after the vjp
    freed = split.linearize(features, pixel_values, keep_graph_for_jvp=False)
    torch.testing.assert_close(freed.class_gradient(classes), gradient)
    with pytest.raises(RuntimeError, match="keep_graph_for_jvp=False"):
        freed.jvp(tangent)
