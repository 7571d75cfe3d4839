"""GSCForImageClassification against a brute-force reference written independently here.

The reference takes ``F`` from ``output_hidden_states`` (not from our hooks), writes each head by hand,
and builds every per-sample quantity with ``torch.autograd.functional.jacobian`` in a Python loop.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, NUM_LABELS, make_tiny_model

from hf_gsc import GSCConfig, GSCForImageClassification
from hf_gsc.classifier.split_points import resolve_split_point


OPERATIONS = ["zero", "perturb", "project", "clip", "scale"]
APPROXIMATIONS = ["first_order", "predicted_logit", "exact"]
SETTINGS = {"alpha": 0.3, "clip_bound": 0.2, "beta": 0.25}


# --------------------------------------------------------------------------- reference
def reference_features_and_head(model, arch, x):
    """``F`` from the public hidden-state outputs, and the head written out by hand."""
    if arch == "vit":
        features = model.vit(x, output_hidden_states=True).hidden_states[-1]
        return features, lambda f: model.classifier(model.vit.layernorm(f)[:, 0])
    if arch == "resnet":
        features = model.resnet(x, output_hidden_states=True).hidden_states[-1]
        return features, lambda f: model.classifier[1](f.mean(dim=(2, 3)))
    if arch == "swin":
        stage_outputs = []
        handle = model.swin.encoder.layers[-1].register_forward_hook(lambda m, a, o: stage_outputs.append(o[0]))
        model(pixel_values=x)
        handle.remove()
        return stage_outputs[0], lambda f: model.classifier(model.swin.layernorm(f).mean(dim=1))
    raise ValueError(arch)


def reference_short_circuit(f, g, ratio, operation):
    """One sample, numpy: top-k of |g| among nonzero coordinates, ties to the lower index."""
    f, g = f.copy(), g.copy()
    n = int((g != 0).sum())
    k = math.ceil(round(ratio * n, 9))
    order = sorted(range(len(g)), key=lambda i: (-abs(g[i]), i))
    mask = np.zeros(len(g), dtype=bool)
    mask[order[:k]] = True
    out = f.copy()
    for i in np.flatnonzero(mask):
        if operation == "zero":
            out[i] = 0.0
        elif operation == "perturb":
            out[i] = f[i] - SETTINGS["alpha"] * np.sign(g[i])
        elif operation == "clip":
            out[i] = min(max(f[i], -SETTINGS["clip_bound"]), SETTINGS["clip_bound"])
        elif operation == "scale":
            out[i] = SETTINGS["beta"] * f[i]
    if operation == "project":
        gm = np.where(mask, g, 0.0)
        out = f - (f @ gm) / (gm @ gm) * gm
    return out, mask


def reference(model, arch, x, ratio, operation):
    features, head = reference_features_and_head(model, arch, x)
    rows = []
    for i in range(x.shape[0]):
        fi = features[i : i + 1].detach()
        y = head(fi)[0].detach()
        jac = torch.autograd.functional.jacobian(lambda f: head(f)[0], fi).reshape(NUM_LABELS, -1)
        c = int(y.argmax())
        g = jac[c].numpy()
        f_flat = fi.flatten().numpy()
        shorted, mask = reference_short_circuit(f_flat, g, ratio, operation)
        delta = torch.from_numpy(shorted - f_flat)
        first_order = y + jac @ delta
        predicted = y.clone()
        predicted[c] += float(g @ delta.numpy())
        exact = head(torch.from_numpy(shorted).reshape(fi.shape))[0].detach()
        rows.append({"y": y, "c": c, "g": g, "mask": mask, "first_order": first_order, "predicted_logit": predicted, "exact": exact})
    return rows


def reference_score(y: torch.Tensor, score: str, temperature: float) -> float:
    y = y.numpy()
    if score == "energy":
        z = y / temperature
        return float(temperature * (z.max() + np.log(np.exp(z - z.max()).sum())))
    if score == "msp":
        z = y / temperature
        p = np.exp(z - z.max())
        return float((p / p.sum()).max())
    return float(y.max())


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("arch", ["vit", "swin", "resnet"])
@pytest.mark.parametrize("operation", OPERATIONS)
def test_matches_bruteforce_reference(arch, operation, pixel_values):
    model = make_tiny_model(arch)
    ratio = 0.1
    expected = reference(model, arch, pixel_values, ratio, operation)
    for approximation in APPROXIMATIONS:
        for score, temperature in [("energy", 1.0), ("energy", 2.0), ("msp", 1.5), ("max_logit", 1.0)]:
            config = GSCConfig(mask_ratio=ratio, operation=operation, approximation=approximation,
                               score=score, temperature=temperature, **SETTINGS)
            out = GSCForImageClassification(model, config)(pixel_values, output_short_circuit=True)
            for i, row in enumerate(expected):
                assert int(out.predicted_class[i]) == row["c"]
                torch.testing.assert_close(out.logits[i], row["y"], atol=1e-5, rtol=0)
                np.testing.assert_allclose(out.gradient[i].flatten().numpy(), row["g"], atol=1e-5, rtol=0)
                np.testing.assert_array_equal(out.mask[i].flatten().numpy(), row["mask"])
                torch.testing.assert_close(out.gsc_logits[i], row[approximation], atol=1e-5, rtol=0)
                assert out.ood_score[i].item() == pytest.approx(
                    reference_score(row[approximation], score, temperature), abs=1e-5
                )


def test_mask_counts_only_coordinates_the_head_reads(pixel_values):
    """ViT before the final LayerNorm: only the CLS token reaches the classifier."""
    model = make_tiny_model("vit")
    out = GSCForImageClassification(model, mask_ratio=0.1)(pixel_values, output_short_circuit=True)
    hidden = model.config.hidden_size
    read = out.gradient != 0
    assert read[:, 1:].sum() == 0 and read[:, 0].sum(dim=1).eq(hidden).all()
    assert out.mask.flatten(1).sum(dim=1).eq(math.ceil(0.1 * hidden)).all()
    assert out.mask[:, 1:].sum() == 0


def test_resnet_gradient_is_input_independent_class_weight(pixel_values):
    """Pool + linear head: g = W[c] / (H*W) at every position, whatever the input."""
    model = make_tiny_model("resnet")
    out = GSCForImageClassification(model)(pixel_values, output_short_circuit=True)
    weight = model.classifier[1].weight
    height, width = out.features.shape[-2:]
    for i in range(pixel_values.shape[0]):
        expected = (weight[out.predicted_class[i]] / (height * width))[:, None, None].expand_as(out.gradient[i])
        torch.testing.assert_close(out.gradient[i], expected)


@pytest.mark.parametrize("arch, split_point", [("resnet", "final_encoder_output"), ("vit", "penultimate"),
                                               ("swin", "penultimate"), ("convnext", "penultimate")])
def test_first_order_is_exact_where_the_head_is_linear(arch, split_point, pixel_values):
    model = make_tiny_model(arch)
    assert resolve_split_point(model, split_point).head_is_linear
    first = GSCForImageClassification(model, split_point=split_point, mask_ratio=0.2)(pixel_values)
    exact = GSCForImageClassification(model, split_point=split_point, mask_ratio=0.2, approximation="exact")(pixel_values)
    torch.testing.assert_close(first.gsc_logits, exact.gsc_logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize("arch", ["vit", "swin", "convnext", "deit"])
def test_nonlinear_head_gives_input_dependent_gradient_and_taylor_error(arch, pixel_values):
    model = make_tiny_model(arch)
    assert not resolve_split_point(model, "final_encoder_output").head_is_linear
    # Three nearby images with the same predicted class: their gradients of that one class must still differ.
    noise = torch.randn(2, *pixel_values.shape[1:], generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    nearby = torch.cat([pixel_values[:1], pixel_values[:1] + 0.3 * noise])
    first = GSCForImageClassification(model, mask_ratio=0.2)(nearby, output_short_circuit=True)
    assert (first.predicted_class == first.predicted_class[0]).all()
    gradients = first.gradient.flatten(1)
    assert not torch.allclose(gradients[0], gradients[1]) and not torch.allclose(gradients[0], gradients[2])
    exact = GSCForImageClassification(model, mask_ratio=0.2, approximation="exact")(nearby)
    assert (first.gsc_logits - exact.gsc_logits).abs().max() > 1e-8


@pytest.mark.parametrize("arch", ["vit", "swin", "resnet", "convnext", "deit"])
@pytest.mark.parametrize("split_point", ["final_encoder_output", "penultimate"])
def test_zero_mask_ratio_leaves_logits_unchanged(arch, split_point, pixel_values):
    model = make_tiny_model(arch)
    for approximation in APPROXIMATIONS:
        out = GSCForImageClassification(model, split_point=split_point, mask_ratio=0.0,
                                        approximation=approximation)(pixel_values)
        torch.testing.assert_close(out.gsc_logits, out.logits, atol=1e-10, rtol=0)
        torch.testing.assert_close(out.logits, model(pixel_values=pixel_values).logits, atol=1e-10, rtol=0)


@pytest.mark.parametrize("arch", ["vit", "swin", "resnet", "convnext", "deit"])
def test_batch_invariance(arch, pixel_values):
    detector = GSCForImageClassification(make_tiny_model(arch), mask_ratio=0.1)
    batched = detector(pixel_values)
    singles = [detector(pixel_values[i : i + 1]) for i in range(pixel_values.shape[0])]
    torch.testing.assert_close(batched.gsc_logits, torch.cat([s.gsc_logits for s in singles]), atol=1e-10, rtol=0)
    reordered = detector(pixel_values.flip(0))
    torch.testing.assert_close(reordered.ood_score, batched.ood_score.flip(0), atol=1e-10, rtol=0)


def test_inference_mode_no_grad_and_frozen_base(pixel_values):
    model = make_tiny_model("vit")
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    detector = GSCForImageClassification(model)
    detector.train()
    assert not model.training
    reference_out = detector(pixel_values)
    with torch.inference_mode():
        inference_out = detector(pixel_values)
    with torch.no_grad():
        no_grad_out = detector(pixel_values)
    torch.testing.assert_close(inference_out.ood_score, reference_out.ood_score)
    torch.testing.assert_close(no_grad_out.ood_score, reference_out.ood_score)
    for name, parameter in model.named_parameters():
        assert parameter.grad is None, name
        assert not parameter.requires_grad, name
        torch.testing.assert_close(parameter, before[name], atol=0, rtol=0)


def _modules_seeing_backward(model, pixel_values, **config):
    touched = []
    for name, module in model.named_modules():
        if name:
            module.register_full_backward_pre_hook(lambda m, g, name=name: touched.append(name))
    GSCForImageClassification(model, **config)(pixel_values)
    return touched


def test_backward_runs_through_the_head_only(pixel_values):
    """No backbone module may see a backward pass. At the final encoder output the head's derivatives are in
    closed form, so nothing does; at an earlier block autograd runs through the remaining block and head."""
    assert _modules_seeing_backward(make_tiny_model("vit"), pixel_values) == []
    touched = _modules_seeing_backward(
        make_tiny_model("vit"), pixel_values, split_point="vit.layers.0", approximation="exact"
    )
    head_modules = ("vit.layers.1", "vit.layernorm", "classifier")
    assert touched and all(name.startswith(head_modules) for name in touched), touched
    assert "vit.layers.1" in touched


def test_earlier_block_split_points(pixel_values):
    """Registered blocks run directly; Swin stages replay the model. The head reproduces the model's logits, and
    for a small move of ``F`` (half the coordinates scaled by ``1 - eps``) the first-order update is exact to
    second order: its error is a small fraction of the move of the logits."""
    eps = 1e-3
    for arch, path in [("vit", "vit.layers.0"), ("swin", "swin.encoder.layers.0"), ("resnet", "resnet.encoder.stages.0")]:
        model = make_tiny_model(arch)
        split = resolve_split_point(model, path)
        features = split.features(pixel_values)
        torch.testing.assert_close(split.head(features, pixel_values), model(pixel_values=pixel_values).logits)
        settings = {"split_point": path, "mask_ratio": 0.5, "operation": "scale", "beta": 1 - eps}
        first = GSCForImageClassification(model, **settings)(pixel_values)
        exact = GSCForImageClassification(model, **settings, approximation="exact")(pixel_values)
        moved = (exact.gsc_logits - exact.logits).abs().max()
        assert moved > 1e-6, arch
        assert (first.gsc_logits - exact.gsc_logits).abs().max() < 0.01 * moved, arch


def test_threshold_sets_is_ood(pixel_values):
    model = make_tiny_model("vit")
    scores = GSCForImageClassification(model)(pixel_values).ood_score
    threshold = float(scores.median())
    out = GSCForImageClassification(model, threshold=threshold)(pixel_values)
    assert out.is_ood.tolist() == (scores < threshold).tolist()
    assert GSCForImageClassification(model)(pixel_values).is_ood is None


def test_half_precision_model_runs():
    model = make_tiny_model("vit").to(torch.bfloat16)
    out = GSCForImageClassification(model)(torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE))
    assert out.ood_score.dtype == torch.float32 and torch.isfinite(out.ood_score).all()


def test_inputs_follow_a_dtype_change_after_wrapping(pixel_values):
    detector = GSCForImageClassification(make_tiny_model("swin"))
    detector.to(torch.bfloat16)  # after wrapping: float64 pixel values must now be cast to bfloat16
    out = detector(pixel_values)
    # The backbone ran in bf16 (float64 inputs would not reach it otherwise); the step after it runs in float32.
    assert out.logits.dtype == torch.float32 and torch.isfinite(out.ood_score).all()


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "shape_or_value, message",
    [
        ((2, 1, IMAGE_SIZE, IMAGE_SIZE), "channels"),
        ((2, 3, IMAGE_SIZE + 4, IMAGE_SIZE), "spatial size"),
        ((0, 3, IMAGE_SIZE, IMAGE_SIZE), "empty batch"),
        ((3, IMAGE_SIZE, IMAGE_SIZE), r"\(B, C, H, W\)"),
    ],
)
def test_bad_pixel_values(shape_or_value, message):
    detector = GSCForImageClassification(make_tiny_model("vit"))
    x = torch.zeros(*shape_or_value, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        detector(x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_pixel_values_fail_closed_in_the_forward_and_raise_in_a_fit(bad):
    """The forward reads no value on the host: a row that is not finite gets a NaN score, decided OOD, and the other
    rows keep theirs; fitting (here GSC's Fisher) reads the values first and names the rows."""
    detector = GSCForImageClassification(make_tiny_model("vit"))
    x = torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    clean = detector(x).ood_score
    x[1, 0, 2, 2] = bad
    detector.config.threshold = float(clean.min()) - 1.0
    out = detector(x)
    assert torch.isnan(out.ood_score[1]) and out.is_ood.tolist() == [False, True, False]
    torch.testing.assert_close(out.ood_score[[0, 2]], clean[[0, 2]])
    with pytest.raises(ValueError, match=r"NaN or infinite values in batch rows \[1\]"):
        detector.fit_fisher([(x, torch.zeros(3, dtype=torch.long))])


def test_pixel_values_must_be_a_tensor():
    with pytest.raises(TypeError, match="pixel_values must be a torch.Tensor"):
        GSCForImageClassification(make_tiny_model("resnet"))([[0.0]])


def test_unknown_architecture_names_supported_ones():
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 6), torch.nn.ReLU())
            self.classifier = torch.nn.Linear(6, 3)

        def forward(self, pixel_values):
            from transformers.modeling_outputs import ImageClassifierOutput

            return ImageClassifierOutput(logits=self.classifier(self.body(pixel_values)))

    with pytest.raises(ValueError, match=r"module path.*Registered model types: .*convnext, .*resnet, .*swin, .*vit"):
        GSCForImageClassification(Toy())
    # The documented ways out work.
    x = torch.randn(2, 3, 2, 2)
    assert GSCForImageClassification(Toy(), split_point="penultimate")(x).ood_score.shape == (2,)
    assert GSCForImageClassification(Toy(), split_point="body.1")(x).ood_score.shape == (2,)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("mask_ratio", 1.5, r"mask_ratio must be in \[0.0, 1.0\]"),
        ("mask_ratio", float("nan"), "mask_ratio must be a finite number"),
        ("mask_ratio", "5%", "mask_ratio must be a finite number"),
        ("operation", "erase", "operation must be one of"),
        ("approximation", "second_order", "approximation must be one of"),
        ("score", "entropy", "score must be one of"),
        ("selection", "fisher?", "selection must be one of"),
        ("temperature", 0.0, "temperature must be in"),
        ("beta", 2.0, "beta must be in"),
        ("alpha", -1.0, "alpha must be in"),
        ("threshold", float("inf"), "threshold must be a finite number"),
        ("split_point", "vit.layers[0]; import os", "split_point must be one of"),
        ("seed", 1.5, "seed must be an int"),
    ],
)
def test_invalid_config_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        GSCConfig(**{field: value})


def test_bad_split_point_path():
    with pytest.raises(ValueError, match="has no submodule 'layerz'"):
        GSCForImageClassification(make_tiny_model("vit"), split_point="vit.layerz.0")
    with pytest.raises(ValueError, match="index 7 out of range"):
        GSCForImageClassification(make_tiny_model("vit"), split_point="vit.layers.7")


def test_config_json_round_trip(tmp_path):
    """The config a detector saves (detector_config.json) comes back equal; a legacy gsc_config.json still reads."""
    from hf_gsc.storage.saved_format import read_config

    config = GSCConfig(mask_ratio=0.1, operation="perturb", threshold=1.5, calibration={"split": "validation"})
    GSCForImageClassification(make_tiny_model("vit"), config).save_pretrained(tmp_path)
    saved = read_config(tmp_path)
    assert (saved.mask_ratio, saved.operation, saved.threshold, saved.calibration) == (0.1, "perturb", 1.5, {"split": "validation"})
    (tmp_path / "gsc_config.json").write_text(json.dumps(dataclasses.asdict(config)))
    assert GSCConfig.from_json_file(tmp_path / "gsc_config.json") == config
    (tmp_path / "gsc_config.json").write_text('{"mask_ratio": 0.1, "evil": 1}')
    with pytest.raises(ValueError, match=r"unknown GSCConfig fields \['evil'\]"):
        GSCConfig.from_json_file(tmp_path / "gsc_config.json")


def test_calibrate_keeps_the_requested_fraction_of_id(pixel_values):
    from hf_gsc.utils.calibration import scores_digest

    generator = torch.Generator().manual_seed(3)
    validation = torch.randn(40, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)
    detector = GSCForImageClassification(make_tiny_model("resnet"))
    threshold = detector.calibrate([validation[:25], (validation[25:], torch.zeros(15))], tpr=0.9)
    scores = detector(validation).ood_score
    assert threshold == detector.config.threshold
    # 36 of 40 = 90% accepted: the threshold is the 36th largest score.
    assert threshold == pytest.approx(scores.sort(descending=True).values[35].item(), abs=1e-12)
    assert (~detector(validation).is_ood).sum() == 36
    # Tensors: read as given, so no split is claimed; the settings it depends on are recorded.
    assert detector.config.calibration == {"split": None, "source": "tensors given by the caller", "num_samples": 40,
                                          "tpr": 0.9, "method": "quantile", "delta": None,
                                          "settings": detector.calibration_settings(), "fitted_state": None,
                                          "calibration_scores": {"count": 40,
                                                                 "digest": scores_digest(detector.calibration_scores)}}
    with pytest.raises(ValueError, match="empty"):
        detector.calibrate([])
    with pytest.raises(TypeError, match="batch 0 must be a tensor"):
        detector.calibrate([42])
    with pytest.raises(ValueError, match="holds images, but the detector has no image_processor"):
        detector.calibrate(["cat.png"])


# --------------------------------------------------------------------------- beyond the paper
def test_adaptive_mask_size_matches_reference_and_calibrates_mean_ratio(pixel_values):
    model = make_tiny_model("vit")
    detector = GSCForImageClassification(model, mask_size="adaptive", gradient_mass=0.3)
    out = detector(pixel_values, output_short_circuit=True)
    for i in range(pixel_values.shape[0]):
        magnitude = np.sort(np.abs(out.gradient[i].flatten().numpy()))[::-1]
        cumulative = np.cumsum(magnitude) / magnitude.sum()
        expected_k = int(np.argmax(cumulative >= 0.3 - 1e-12)) + 1
        assert int(out.mask[i].sum()) == expected_k
        chosen = np.abs(out.gradient[i].flatten().numpy())[out.mask[i].flatten().numpy()]
        assert chosen.min() >= magnitude[expected_k - 1]

    validation = torch.randn(30, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    calibrated = GSCForImageClassification(model, mask_size="adaptive", mask_ratio=0.2)
    with pytest.raises(RuntimeError, match="calibrate_gradient_mass"):
        calibrated(pixel_values)
    mass = calibrated.calibrate_gradient_mass([validation[:16], validation[16:]])
    mask = calibrated(validation, output_short_circuit=True).mask.flatten(1)
    mean_ratio = (mask.sum(dim=1) / model.config.hidden_size).double().mean().item()
    assert 0 < mass < 1 and abs(mean_ratio - 0.2) <= 1.0 / model.config.hidden_size + 1e-9


def test_fisher_selection_uses_fitted_diagonal_and_round_trips(pixel_values, tmp_path):
    model = make_tiny_model("vit")
    detector = GSCForImageClassification(model, selection="fisher", mask_ratio=0.25)
    with pytest.raises(RuntimeError, match="fit_fisher"):
        detector(pixel_values)
    generator = torch.Generator().manual_seed(8)
    train = [(torch.randn(8, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64),
              torch.randint(0, NUM_LABELS, (8,), generator=generator)) for _ in range(3)]
    fisher = detector.fit_fisher(train)

    # Reference: per-sample autograd of the cross-entropy, squared and averaged.
    features, head = reference_features_and_head(model, "vit", torch.cat([x for x, _ in train]))
    labels = torch.cat([y for _, y in train])
    expected = torch.zeros(features[0].numel(), dtype=torch.float64)
    for i in range(features.shape[0]):
        f = features[i : i + 1].detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(torch.nn.functional.cross_entropy(head(f), labels[i : i + 1]), f)
        expected += grad.flatten() ** 2
    torch.testing.assert_close(fisher, expected / features.shape[0])

    out = detector(pixel_values, output_short_circuit=True)
    for i in range(pixel_values.shape[0]):
        g = out.gradient[i].flatten()
        read = g != 0
        priority = torch.where(read, g.abs() / fisher.sqrt().clamp_min(1e-300), torch.tensor(-1.0, dtype=g.dtype))
        k = math.ceil(0.25 * int(read.sum()))
        assert set(out.mask[i].flatten().nonzero().flatten().tolist()) == set(priority.topk(k).indices.tolist())

    detector.save_pretrained(tmp_path / "fisher")
    loaded = GSCForImageClassification.from_pretrained(tmp_path / "fisher", model=model)
    torch.testing.assert_close(loaded(pixel_values).ood_score, out.ood_score, atol=0, rtol=0)
    with pytest.raises(ValueError, match="needs labels"):
        GSCForImageClassification(model, selection="fisher").fit_fisher([pixel_values])


@pytest.mark.parametrize("arch, earlier", [("vit", "vit.layers.0"), ("resnet", "resnet.encoder.stages.-2")])
def test_multi_layer_short_circuit_matches_reference(arch, earlier, pixel_values):
    """Shared budget over two layers; first order = y + J1 d1 + J2 d2 with J from autograd per sample."""
    model = make_tiny_model(arch)
    ratio = 0.1
    outs = {a: GSCForImageClassification(model, earlier_split_point=earlier, mask_ratio=ratio, approximation=a)(
        pixel_values, output_short_circuit=True) for a in APPROXIMATIONS}
    out = outs["first_order"]
    if arch == "vit":
        hidden = model.vit(pixel_values, output_hidden_states=True).hidden_states
        f1, f2 = hidden[1], hidden[2]
        def blocks(f):
            return model.vit.layers[1](f)
        def head(f):
            return model.classifier(model.vit.layernorm(f)[:, 0])
    else:
        hidden = model.resnet(pixel_values, output_hidden_states=True).hidden_states
        f1, f2 = hidden[-2], hidden[-1]
        def blocks(f):
            return model.resnet.encoder.stages[-1](f)
        def head(f):
            return model.classifier[1](f.mean(dim=(2, 3)))
    d1 = f1[0].numel()
    for i in range(pixel_values.shape[0]):
        x1, x2 = f1[i : i + 1].detach(), f2[i : i + 1].detach()
        def joint(a, b):
            return head(blocks(a) + b - x2)[0]
        y = joint(x1, x2).detach()
        c = int(y.argmax())
        j1, j2 = torch.autograd.functional.jacobian(joint, (x1, x2))
        g1, g2 = j1[c].flatten(), j2[c].flatten()
        torch.testing.assert_close(out.gradient[i], torch.cat([g1, g2]), atol=1e-8, rtol=1e-6)
        # Shared budget, per-layer RMS-normalised ranking, zero operation.
        normalised = []
        for g in (g1, g2):
            rms = (g.pow(2).sum() / (g != 0).sum()).sqrt()
            normalised.append(g / rms)
        ranking = torch.cat(normalised).abs()
        n = int((ranking != 0).sum())
        k = math.ceil(ratio * n)
        expected_mask = torch.zeros_like(ranking, dtype=torch.bool)
        expected_mask[sorted(range(len(ranking)), key=lambda j: (-ranking[j].item(), j))[:k]] = True
        assert torch.equal(out.mask[i], expected_mask)
        assert out.mask[i, :d1].any() or out.mask[i, d1:].any()
        delta = torch.where(expected_mask, -torch.cat([x1.flatten(), x2.flatten()]), torch.zeros(()).double())
        jac = torch.cat([j1.reshape(NUM_LABELS, -1), j2.reshape(NUM_LABELS, -1)], dim=1)
        torch.testing.assert_close(out.gsc_logits[i], y + jac @ delta, atol=1e-6, rtol=1e-6)
        exact = joint(x1 + delta[:d1].view_as(x1), x2 + delta[d1:].view_as(x2)).detach()
        torch.testing.assert_close(outs["exact"].gsc_logits[i], exact, atol=1e-8, rtol=1e-6)
        predicted = y.clone()
        predicted[c] += torch.cat([g1, g2]) @ delta
        torch.testing.assert_close(outs["predicted_logit"].gsc_logits[i], predicted, atol=1e-8, rtol=1e-6)
    zero = GSCForImageClassification(model, earlier_split_point=earlier, mask_ratio=0.0)(pixel_values)
    torch.testing.assert_close(zero.gsc_logits, zero.logits, atol=1e-10, rtol=0)


def test_multi_layer_rejects_unsupported_settings():
    with pytest.raises(ValueError, match="before the last one"):
        GSCForImageClassification(make_tiny_model("vit"), earlier_split_point="vit.layers.-1")
    with pytest.raises(ValueError, match="not supported for model type 'swin'.*supported model types"):
        GSCForImageClassification(make_tiny_model("swin"), earlier_split_point="swin.encoder.layers.0")
    with pytest.raises(ValueError, match="needs split_point='final_encoder_output', got 'penultimate'"):
        GSCForImageClassification(make_tiny_model("vit"), split_point="penultimate", earlier_split_point="vit.layers.0")


@pytest.mark.parametrize("split_point", ["final_encoder_output", "penultimate"])
def test_affine_heads_follow_config_and_weight_changes(split_point, pixel_values):
    """A detector reads its configuration and the model's weights on every call: nothing stale is kept."""
    model = make_tiny_model("resnet" if split_point == "final_encoder_output" else "vit")
    gsc = GSCForImageClassification(model, split_point=split_point, mask_ratio=0.05)
    gsc(pixel_values)
    gsc.config.mask_ratio = 0.3
    fresh = GSCForImageClassification(model, split_point=split_point, mask_ratio=0.3)
    torch.testing.assert_close(gsc(pixel_values).gsc_logits, fresh(pixel_values).gsc_logits)
    with torch.no_grad():  # in place, as load_state_dict does; a new ranking of |W[c]|
        weight = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1].weight
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(9), dtype=weight.dtype))
    out = gsc(pixel_values, output_short_circuit=True)
    fresh = GSCForImageClassification(model, split_point=split_point, mask_ratio=0.3)
    reference = fresh(pixel_values, output_short_circuit=True)
    torch.testing.assert_close(out.gsc_logits, reference.gsc_logits)
    assert torch.equal(out.mask, reference.mask)


def test_output_behaves_like_a_model_output(pixel_values):
    """GSCOutput skips ModelOutput's per-instance checks; it must still index, iterate and tuple like one."""
    out = GSCForImageClassification(make_tiny_model("vit"))(pixel_values)
    assert list(out.keys()) == ["logits", "ood_score", "gsc_logits", "predicted_class"]  # None fields left out
    assert out["ood_score"] is out.ood_score and out[0] is out.logits
    assert len(out.to_tuple()) == 4
    full = GSCForImageClassification(make_tiny_model("vit"), threshold=0.0)(pixel_values, output_short_circuit=True)
    assert list(full.keys()) == ["logits", "ood_score", "is_ood", "gsc_logits", "predicted_class", "features",
                                 "gradient", "mask"]
