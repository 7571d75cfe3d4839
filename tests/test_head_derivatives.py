"""Closed-form head derivatives (hf_gsc.classifier.head_jacobians) against autograd and torch.func.jvp."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from hf_gsc.classifier.head_jacobians import (
    POOLS,
    layer_norm_jacobian_product,
    layer_norm_statistics,
    pool,
    pool_adjoint,
)
from hf_gsc.classifier.split_points import HeadSpec, resolve_split_point
from hf_gsc.gsc_math.backends import linearize_head
from hf_gsc.gsc_math.backends.autograd import linearize_with_autograd


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


def _module_head(model: torch.nn.Module, spec: HeadSpec):
    """The registered head run through the model's own modules (its LayerNorm and Linear, nothing folded)."""
    linear = model.get_submodule(spec.classifier)
    norm = model.get_submodule(spec.layernorm) if spec.layernorm is not None else torch.nn.Identity()

    def head(features: torch.Tensor, _pixel_values=None) -> torch.Tensor:
        if spec.norm_before_pool:
            return linear(pool(norm(features), spec.pool))
        return linear(norm(pool(features, spec.pool)))

    return head


@pytest.mark.parametrize("arch", ["vit", "deit", "swin", "resnet", "convnext"])
@pytest.mark.parametrize("split_point", ["final_encoder_output", "penultimate"])
def test_closed_form_head_matches_autograd(arch, split_point, pixel_values):
    model = _with_random_layer_norms(make_tiny_model(arch))
    split = resolve_split_point(model, split_point)
    assert split.head_spec is not None
    features = split.features(pixel_values)
    closed = linearize_head(split, features)
    reference = linearize_with_autograd(_module_head(model, split.head_spec), features, None)
    generator = torch.Generator().manual_seed(5)
    cotangent = torch.randn(closed.logits.shape, generator=generator, dtype=features.dtype)
    tangent = torch.randn(features.shape, generator=generator, dtype=features.dtype)

    torch.testing.assert_close(closed.logits, model(pixel_values=pixel_values).logits)
    torch.testing.assert_close(closed.logits, reference.logits)
    torch.testing.assert_close(closed.vjp(cotangent), reference.vjp(cotangent))
    torch.testing.assert_close(closed.jvp(tangent), reference.jvp(tangent))
    torch.testing.assert_close(closed.function(features), closed.logits)
    moved = features + tangent
    torch.testing.assert_close(closed.function(moved), reference.function(moved))
    step = 1e-6  # central difference in float64 of the module head: an independent check of J t
    head = _module_head(model, split.head_spec)
    difference = (head(features + step * tangent) - head(features - step * tangent)) / (2 * step)
    torch.testing.assert_close(closed.jvp(tangent), difference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["vit", "deit", "swin", "resnet", "convnext"])
def test_head_on_its_read_part_matches_the_full_head(arch, pixel_values):
    """ViT and DeiT read the first token only: the head restricted to it gives the same logits and products."""
    model = _with_random_layer_norms(make_tiny_model(arch))
    split = resolve_split_point(model, "final_encoder_output")
    assert split.read_pool == ("first_token" if arch in ("vit", "deit") else "identity")
    features = split.features(pixel_values)
    full = linearize_head(split, features)
    part = split.linearize_read_part(pool(features, split.read_pool))
    classes = full.logits.argmax(dim=-1)
    tangent = torch.randn(features.shape, generator=torch.Generator().manual_seed(4), dtype=features.dtype)
    torch.testing.assert_close(part.logits, full.logits)
    spread = pool_adjoint(part.class_gradient(classes), split.read_pool, features.shape[1:])
    torch.testing.assert_close(spread, full.class_gradient(classes))
    # Only the read part of a tangent moves the logits.
    torch.testing.assert_close(part.jvp(pool(tangent, split.read_pool)), full.jvp(tangent))


def test_folded_head_follows_parameter_changes(pixel_values):
    """The LayerNorm is folded into the classifier once per parameter version; a stale fold gives old logits."""
    model = make_tiny_model("swin")
    split = resolve_split_point(model, "final_encoder_output")
    features = split.features(pixel_values)
    linearize_head(split, features)
    with torch.no_grad():
        model.swin.layernorm.weight.mul_(1.5)  # in place, as load_state_dict does
        model.swin.layernorm.bias.add_(0.25)
    torch.testing.assert_close(linearize_head(split, features).logits, _module_head(model, split.head_spec)(features))
    model.classifier = torch.nn.Linear(model.classifier.in_features, 3).double()  # a replaced module
    torch.testing.assert_close(split.head(features), _module_head(model, split.head_spec)(features))


def test_closed_form_is_used_only_where_the_head_has_the_registered_form(pixel_values):
    model = make_tiny_model("vit")
    assert resolve_split_point(model, "vit.layers.-1").head_spec is not None  # the last block = final output
    assert resolve_split_point(model, "vit.layers.0").head_spec is None  # a block precedes the head: autograd


def test_autograd_head_frees_its_graph_unless_a_jvp_is_needed(pixel_values):
    model = make_tiny_model("vit")
    model.set_attn_implementation("eager")  # J t through attention needs its double backward, which SDPA lacks
    split = resolve_split_point(model, "vit.layers.0")
    features = split.features(pixel_values)
    kept = linearize_head(split, features, pixel_values)
    classes = kept.logits.argmax(dim=-1)
    gradient = kept.class_gradient(classes)
    tangent = torch.randn(features.shape, generator=torch.Generator().manual_seed(2), dtype=features.dtype)
    # Forward mode as the reference (a finite difference is too noisy here: eager attention runs softmax in float32).
    reference = torch.func.jvp(split.head, (features,), (tangent,))[1]
    torch.testing.assert_close(kept.jvp(tangent), reference)  # J t by two reverse passes, after the vjp
    freed = linearize_head(split, features, pixel_values, keep_graph=False)
    torch.testing.assert_close(freed.class_gradient(classes), gradient)
    with pytest.raises(RuntimeError, match="keep_graph_for_jvp=False"):
        freed.jvp(tangent)
