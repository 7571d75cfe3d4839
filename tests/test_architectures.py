"""Every registered architecture at split_point="final_encoder_output", on tiny random models (hf_gsc.classifier.architectures).

Each architecture of transformers' image-classification mapping is either registered (and tested here on a tiny
random configuration) or listed in ``NOT_APPLICABLE`` with the reason. The references are independent of the
registry's head description: the model's own ``hidden_states`` for ``F``, and the whole model replayed with the
split module's output replaced (``_replayed_logits``) for the head.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES

from hf_gsc import GSCForImageClassification
from hf_gsc.classifier.architectures import (
    ARCHITECTURES,
    NOT_APPLICABLE,
    TIMM_MODEL_TYPES,
    supported_architectures_table,
)
from hf_gsc.classifier.heads import HeadSpec, bind_head_paths
from hf_gsc.classifier.split_points import resolve_split_point
from hf_gsc.detectors.ash import default_ash_percentile
from hf_gsc.gsc_math.backends import linearize_head


NUM_LABELS = 5
_VIT = {"image_size": 32, "patch_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32}
_DINO = {"image_size": 32, "patch_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "mlp_ratio": 2}
_SWIN = {"image_size": 32, "patch_size": 4, "embed_dim": 8, "depths": [1, 1], "num_heads": [1, 2], "window_size": 4}
_TEXT = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
_TWO_STAGE_TOKENS = {"num_encoder_blocks": 2, "depths": [1, 1], "hidden_sizes": [8, 16], "patch_sizes": [7, 3], "strides": [4, 2],
                         "num_attention_heads": [1, 2], "mlp_ratios": [2, 2]}
_CVT = {"embed_dim": [8, 16], "num_heads": [1, 2], "depth": [1, 2], "patch_sizes": [7, 3], "patch_stride": [4, 2],
            "patch_padding": [2, 1], "mlp_ratio": [2.0, 2.0], "attention_drop_rate": [0.0, 0.0], "drop_rate": [0.0, 0.0],
            "drop_path_rate": [0.0, 0.0], "qkv_bias": [True, True], "cls_token": [False, True],
            "qkv_projection_method": ["dw_bn", "dw_bn"], "kernel_qkv": [3, 3], "padding_kv": [1, 1], "stride_kv": [2, 2],
            "padding_q": [1, 1], "stride_q": [1, 1]}

#: Test case -> (model type, tiny configuration, image size). BiT's two layer types give different heads.
TINY: dict[str, tuple[str, dict, int]] = {
    "beit": ("beit", _VIT, 32),
    "bit": ("bit", {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "num_groups": 2}, 32),
    "bit(bottleneck)": ("bit", {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "num_groups": 2,
                                    "layer_type": "bottleneck"}, 32),
    "clip": ("clip", {"vision_config": _VIT, "text_config": _TEXT}, 32),
    "convnext": ("convnext", {"num_stages": 2, "hidden_sizes": [8, 16], "depths": [1, 1], "image_size": 32}, 32),
    "convnextv2": ("convnextv2", {"num_stages": 2, "hidden_sizes": [8, 16], "depths": [1, 1], "image_size": 32}, 32),
    "cvt": ("cvt", _CVT, 32),
    "data2vec-vision": ("data2vec-vision", _VIT, 32),
    "deit": ("deit", _VIT, 32),
    "dinov2": ("dinov2", _DINO, 32),
    "dinov2_with_registers": ("dinov2_with_registers", dict(_DINO, num_register_tokens=2), 32),
    "donut-swin": ("donut-swin", _SWIN, 32),
    "efficientnet": ("efficientnet", {"image_size": 32, "width_coefficient": 0.1, "depth_coefficient": 0.2, "hidden_dim": 128,
                                          "kernel_sizes": [3, 3], "in_channels": [32, 16], "out_channels": [16, 24],
                                          "strides": [1, 2], "num_block_repeats": [1, 1], "expand_ratios": [1, 6]}, 32),
    "focalnet": ("focalnet", {"image_size": 32, "patch_size": 4, "embed_dim": 8, "hidden_sizes": [8, 16], "depths": [1, 1],
                                  "focal_levels": [2, 2], "focal_windows": [3, 3]}, 32),
    "hgnet_v2": ("hgnet_v2", {"stem_channels": [3, 8, 8], "stage_in_channels": [8, 16], "stage_mid_channels": [8, 8],
                                  "stage_out_channels": [16, 32], "stage_num_blocks": [1, 1], "stage_downsample": [False, True],
                                  "stage_light_block": [False, True], "stage_kernel_size": [3, 3],
                                  "stage_numb_of_layers": [2, 2], "hidden_sizes": [16, 32], "depths": [1, 1],
                                  "embedding_size": 8}, 32),
    "hiera": ("hiera", {"image_size": [32, 32], "patch_size": [3, 3], "patch_stride": [2, 2], "patch_padding": [1, 1],
                            "embed_dim": 8, "depths": [1, 1], "num_heads": [1, 2], "num_query_pool": 1, "query_stride": [2, 2],
                            "masked_unit_size": [4, 4], "masked_unit_attention": [True, False], "decoder_hidden_size": 8,
                            "decoder_depth": 1, "decoder_num_heads": 1}, 32),
    "ijepa": ("ijepa", _VIT, 32),
    "levit": ("levit", {"image_size": 64, "patch_size": 16, "hidden_sizes": [16, 24], "num_attention_heads": [1, 2],
                            "depths": [1, 1], "key_dim": [4, 4], "down_ops": [["Subsample", 4, 4, 4, 2, 2]]}, 64),
    "metaclip_2": ("metaclip_2", {"vision_config": _VIT, "text_config": _TEXT}, 32),
    "mobilenet_v1": ("mobilenet_v1", {"image_size": 64, "depth_multiplier": 0.25, "min_depth": 4}, 64),
    "mobilenet_v2": ("mobilenet_v2", {"image_size": 64, "depth_multiplier": 0.25, "min_depth": 4}, 64),
    "mobilevit": ("mobilevit", {"image_size": 64, "patch_size": 2, "hidden_sizes": [16, 16, 16],
                                    "neck_hidden_sizes": [8, 8, 8, 8, 8, 8, 16], "num_attention_heads": 2}, 64),
    "mobilevitv2": ("mobilevitv2", {"image_size": 64, "patch_size": 1, "width_multiplier": 0.25, "n_attn_blocks": [1, 1, 1],
                                        "base_attn_unit_dims": [8, 8, 8]}, 64),
    "perceiver": ("perceiver", {"num_latents": 4, "d_latents": 16, "d_model": 16, "num_blocks": 2, "num_self_attends_per_block": 1,
                                    "num_self_attention_heads": 1, "num_cross_attention_heads": 1, "image_size": 32}, 32),
    "poolformer": ("poolformer", {"hidden_sizes": [8, 16], "depths": [1, 1], "num_encoder_blocks": 2, "patch_sizes": [7, 3],
                                      "strides": [4, 2], "padding": [2, 1]}, 32),
    "pvt": ("pvt", dict(_TWO_STAGE_TOKENS, image_size=32, sequence_reduction_ratios=[2, 1], patch_sizes=[4, 2]), 32),
    "pvt_v2": ("pvt_v2", dict(_TWO_STAGE_TOKENS, image_size=32, sr_ratios=[2, 1]), 32),
    "regnet": ("regnet", {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1], "groups_width": 4}, 32),
    "resnet": ("resnet", {"embedding_size": 8, "hidden_sizes": [8, 12], "depths": [1, 1]}, 32),
    "segformer": ("segformer", dict(_TWO_STAGE_TOKENS, sr_ratios=[2, 1], decoder_hidden_size=16), 32),
    "siglip": ("siglip", {"vision_config": _VIT, "text_config": _TEXT}, 32),
    "swiftformer": ("swiftformer", {"image_size": 32, "depths": [1, 1], "embed_dims": [8, 16], "downsamples": [True, True]}, 32),
    "swin": ("swin", _SWIN, 32),
    "swinv2": ("swinv2", _SWIN, 32),
    "textnet": ("textnet", {"image_size": [32, 32], "stem_out_channels": 8, "conv_layer_kernel_sizes": [[[3, 3]], [[3, 3]]],
                                "conv_layer_strides": [[1], [2]], "hidden_sizes": [8, 8, 16]}, 32),
    "vit": ("vit", _VIT, 32),
    "vit_msn": ("vit_msn", _VIT, 32),
}
#: The other classes of a model type in the mapping: test case -> (case of the same model type, class name).
TINY_CLASSES: dict[str, tuple[str, str]] = {
    "deit(with teacher)": ("deit", "DeiTForImageClassificationWithTeacher"),
    "levit(with teacher)": ("levit", "LevitForImageClassificationWithTeacher"),
    "perceiver(fourier)": ("perceiver", "PerceiverForImageClassificationFourier"),
    "perceiver(conv)": ("perceiver", "PerceiverForImageClassificationConvProcessing"),
}
CASES = sorted(TINY) + sorted(TINY_CLASSES)


def _class_name(model_type: str) -> str:
    name = MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES[model_type]
    return name[0] if isinstance(name, tuple) else name


def _case(case: str) -> tuple[str, dict, int, str]:
    """``(model type, tiny configuration, image size, class name)`` of a test case."""
    base, class_name = TINY_CLASSES.get(case, (case, None))
    model_type, kwargs, size = TINY[base]
    return model_type, kwargs, size, class_name or _class_name(model_type)


@functools.cache
def tiny_model(case: str) -> torch.nn.Module:
    """The case's tiny float64 classifier in eval mode, built once per test run (tests must not modify it)."""
    model_type, kwargs, _, class_name = _case(case)
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(CONFIG_MAPPING[model_type](**kwargs, num_labels=NUM_LABELS))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (torch.nn.LayerNorm, torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.GroupNorm)):
                # Default norms are the identity affine map (and BatchNorm's statistics 0 and 1): random
                # ones catch a norm that is skipped or applied twice.
                if module.weight is not None:
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.normal_()
                if getattr(module, "running_var", None) is not None:
                    module.running_mean.normal_()
                    module.running_var.uniform_(0.5, 2.0)
        # Random init gives near-uniform logits; a larger classifier makes predictions and gradients distinct.
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.out_features == NUM_LABELS:
                module.weight.mul_(20.0)
    return model.double().eval()


def tiny_pixel_values(case: str, batch: int = 3, seed: int = 1) -> torch.Tensor:
    size = _case(case)[2]
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _replace_first(output, replacement: torch.Tensor):
    if isinstance(output, torch.Tensor):
        return replacement
    if isinstance(output, tuple):
        return (replacement, *output[1:])
    return type(output)(**{**output, next(iter(output)): replacement})  # a ModelOutput: its first field


def _replayed_logits(model: torch.nn.Module, module_path: str, pixel_values: torch.Tensor, features: torch.Tensor):
    """The whole model run on ``pixel_values`` with the output of ``module_path`` replaced by ``features``."""
    handle = model.get_submodule(module_path).register_forward_hook(
        lambda _m, _a, output: _replace_first(output, features)
    )
    try:
        return model(pixel_values=pixel_values).logits
    finally:
        handle.remove()


def test_every_image_classification_architecture_is_registered_or_explained():
    mapped = set(MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES)
    known = set(ARCHITECTURES) | set(NOT_APPLICABLE) | set(TIMM_MODEL_TYPES)  # timm's: tests/test_timm_models.py
    assert mapped <= known, sorted(mapped - known)
    assert not set(ARCHITECTURES) & set(NOT_APPLICABLE) and not set(TIMM_MODEL_TYPES) & (set(ARCHITECTURES) | set(NOT_APPLICABLE))
    # Every class of every registered model type is tested here.
    registered = {(mt, name) for mt, names in MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES.items() if mt in ARCHITECTURES
                  for name in (names if isinstance(names, tuple) else (names,))}
    assert registered == {_case(case)[::3] for case in CASES}


def _reference_features(case: str, model: torch.nn.Module, pixel_values: torch.Tensor, features: torch.Tensor):
    """``(what F should equal, the model's own tensor)``: the last hidden state before the final norm, from the
    model's ``hidden_states`` where it returns it, else from the base model or after the norm."""
    model_type = _case(case)[0]
    with torch.no_grad():
        hidden = model(pixel_values=pixel_values, output_hidden_states=True).hidden_states
    if model_type in ("efficientnet", "mobilenet_v2", "mobilevit"):
        # hidden_states stop at the last block; the encoder ends with a 1x1 convolution the head reads.
        with torch.no_grad():
            return features, model.base_model(pixel_values=pixel_values).last_hidden_state
    if model_type == "pvt":  # hidden_states end with the final LayerNorm's output; the one before is F
        return features, hidden[-2]
    if model_type in ("pvt_v2", "segformer"):  # the last hidden state is the normalised map only
        norm = model.get_submodule(bind_head_paths(model, ARCHITECTURES[model_type].head).layernorm)
        return norm(features), hidden[-1].flatten(2).transpose(1, 2)
    if model_type == "cvt":  # hidden_states hold the map without the CLS token
        tokens = hidden[-1].flatten(2).transpose(1, 2)
        return features[:, -tokens.shape[1] :], tokens
    if model_type == "hiera":  # hidden_states are re-rolled into image order; F is in Hiera's unrolled order
        return features.sort(dim=1).values, hidden[-1].sort(dim=1).values
    return features, hidden[-1]


@pytest.mark.parametrize("case", CASES)
def test_features_are_the_last_encoder_output_before_the_final_norm(case):
    model, pixel_values = tiny_model(case), tiny_pixel_values(case)
    split = resolve_split_point(model, "final_encoder_output")
    features = split.features(pixel_values)
    with torch.no_grad():
        actual, expected = _reference_features(case, model, pixel_values, features)
    torch.testing.assert_close(actual, expected)
    # And the head on F reproduces the model's logits.
    with torch.no_grad():
        torch.testing.assert_close(split.head(features, pixel_values), model(pixel_values=pixel_values).logits)


def _jacobian(model: torch.nn.Module, module_path: str, pixel_values: torch.Tensor, features: torch.Tensor):
    """``d logits / dF`` of one sample, ``(K, *feature_shape)``, through the whole model replayed."""
    return torch.autograd.functional.jacobian(
        lambda f: _replayed_logits(model, module_path, pixel_values, f)[0], features
    )[:, 0]


@pytest.mark.parametrize("case", CASES)
def test_head_derivatives_match_a_brute_force_jacobian(case):
    """Closed form (HeadSpec) or autograd through the head modules (ModuleHead): logits, g, J t and v^T J per
    sample equal the Jacobian of the replayed model; g is input independent exactly where the head is affine."""
    model, pixel_values = tiny_model(case), tiny_pixel_values(case, batch=2)
    split = resolve_split_point(model, "final_encoder_output")
    features = split.features(pixel_values)
    head = linearize_head(split, features, pixel_values)
    generator = torch.Generator().manual_seed(2)
    tangent = torch.randn(features.shape, generator=generator, dtype=features.dtype)
    cotangent = torch.randn(head.logits.shape, generator=generator, dtype=features.dtype)
    classes = torch.zeros(features.shape[0], dtype=torch.long)
    jacobians = [_jacobian(model, split.module_path, pixel_values[i : i + 1], features[i : i + 1]) for i in range(2)]
    for i, jacobian in enumerate(jacobians):
        flat = jacobian.flatten(1)
        torch.testing.assert_close(head.jvp(tangent)[i], flat @ tangent[i].flatten())
        torch.testing.assert_close(head.vjp(cotangent)[i].flatten(), cotangent[i] @ flat)
        torch.testing.assert_close(head.class_gradient(classes)[i], jacobian[0])
    assert split.head_is_linear == torch.allclose(jacobians[0], jacobians[1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_exact_is_the_model_on_the_short_circuited_features(case):
    model, pixel_values = tiny_model(case), tiny_pixel_values(case)
    out = GSCForImageClassification(model, mask_ratio=0.2, approximation="exact")(pixel_values, output_short_circuit=True)
    assert out.mask.any()
    with torch.no_grad():
        replayed = _replayed_logits(
            model, resolve_split_point(model).module_path, pixel_values, out.features.masked_fill(out.mask, 0.0)
        )
    torch.testing.assert_close(out.gsc_logits, replayed)


def _first_order_error(model: torch.nn.Module, pixel_values: torch.Tensor, alpha: float) -> float:
    """Largest ``|first_order - exact|`` of GSC's logits for the perturbation ``F - alpha sign(g)`` of the mask."""
    settings = {"mask_ratio": 0.2, "operation": "perturb", "alpha": alpha}
    first = GSCForImageClassification(model, **settings)(pixel_values).gsc_logits
    exact = GSCForImageClassification(model, approximation="exact", **settings)(pixel_values).gsc_logits
    return (first - exact).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_first_order_agrees_with_exact_to_second_order(case):
    model, pixel_values = tiny_model(case), tiny_pixel_values(case)
    large, small = _first_order_error(model, pixel_values, 1e-2), _first_order_error(model, pixel_values, 5e-3)
    if resolve_split_point(model).head_is_linear:
        assert large < 1e-10 and small < 1e-10  # the Taylor step of an affine head is exact
    else:
        assert 3.0 < large / small < 5.0, (large, small)  # halving the step quarters the error


@pytest.mark.parametrize("case", CASES)
def test_a_samples_outputs_do_not_depend_on_its_batch(case):
    model, pixel_values = tiny_model(case), tiny_pixel_values(case)
    detector = GSCForImageClassification(model, mask_ratio=0.1)
    batched = detector(pixel_values)
    singles = [detector(pixel_values[i : i + 1]) for i in range(pixel_values.shape[0])]
    torch.testing.assert_close(batched.gsc_logits, torch.cat([s.gsc_logits for s in singles]), atol=1e-10, rtol=0)
    torch.testing.assert_close(detector(pixel_values.flip(0)).ood_score, batched.ood_score.flip(0), atol=1e-10, rtol=0)


#: Registered entries whose head has the closed form on the last block's output: discovery must find them.
DISCOVERABLE = [
    case for case in sorted(TINY)
    if isinstance(ARCHITECTURES[TINY[case][0]].head, HeadSpec) and ARCHITECTURES[TINY[case][0]].final is None
]


@pytest.mark.parametrize("case", DISCOVERABLE)
def test_an_unregistered_architecture_of_a_known_shape_is_discovered(case, monkeypatch):
    model_type = TINY[case][0]
    model = tiny_model(case)
    registered = resolve_split_point(model)
    monkeypatch.delitem(ARCHITECTURES, model_type)
    discovered = resolve_split_point(model)
    assert discovered.module_path == registered.module_path
    assert discovered.head_spec == registered.head_spec
    pixel_values = tiny_pixel_values(case)
    torch.testing.assert_close(discovered.head(discovered.features(pixel_values)), model(pixel_values=pixel_values).logits)


@pytest.mark.parametrize("case", ["dinov2", "clip", "beit"])
def test_discovery_refuses_a_head_it_cannot_reproduce(case, monkeypatch):
    """DINOv2 reads [CLS, mean of the patch tokens] (no template fits its classifier's width); CLIP and BEiT average
    the patch tokens without the CLS token (the mean over all tokens fits the shapes but not the logits)."""
    model = tiny_model(case)
    monkeypatch.delitem(ARCHITECTURES, TINY[case][0])
    with pytest.raises(ValueError, match=r"no head of the pool / LayerNorm / linear form .* reproduces its logits"
                                         r".*split_point='penultimate' or a dotted module path"):
        resolve_split_point(model)


def test_not_applicable_architecture_says_why_and_what_to_pass():
    config = CONFIG_MAPPING["imagegpt"](vocab_size=17, n_positions=16, n_embd=8, n_layer=1, n_head=2, num_labels=3)
    model = transformers.ImageGPTForImageClassification(config)
    with pytest.raises(ValueError, match=r"does not apply to model type 'imagegpt': .*input_ids.*dotted module path"):
        resolve_split_point(model)
    assert resolve_split_point(model, "penultimate").head_is_linear  # the documented way out resolves


def test_ablation_split_points_and_ash_percentiles_come_from_the_registry():
    from hf_gsc.analysis.ablations import model_split_points

    swin = tiny_model("swin")  # stages of one block each: one and two blocks before the end are the stage before
    assert model_split_points(swin) == {
        "one_block_before": "swin.encoder.layers.0", "two_blocks_before": "swin.encoder.layers.0",
        "multi_layer_earlier": None,
    }
    vit = tiny_model("vit")
    with pytest.raises(ValueError, match="needs at least 3"):  # two blocks only
        model_split_points(vit)
    assert default_ash_percentile(vit, "s") == 95.0 and default_ash_percentile(vit, "p") == 90.0
    assert default_ash_percentile(tiny_model("resnet"), "s") == 90.0


def test_architectures_page_table_is_the_registry():
    page = (Path(__file__).resolve().parents[1] / "docs" / "architectures.md").read_text()
    assert page.startswith("# Supported architectures\n")
    assert supported_architectures_table() in page, (
        "docs/architectures.md's table is stale: paste the output of `python -m hf_gsc.classifier.architectures`"
    )


def test_head_paths_are_normalised():
    model = tiny_model("pvt_v2")
    head = bind_head_paths(model, ARCHITECTURES["pvt_v2"].head)
    assert head.layernorm == "pvt_v2.encoder.layers.1.layer_norm"
