"""GSC's step after the backbone runs in float32 whatever the backbone runs in (a bf16 model, or CPU bf16
autocast), and every entry point moves ``pixel_values`` to the model's device.

Tiny ViT / ResNet detectors: closed-form heads (final encoder output, penultimate), an autograd head (an earlier
block) and the multi-layer short-circuit, each in bf16 against the same weights in float32.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_tiny_model

from hf_gsc import GSCForImageClassification
from hf_gsc.gsc_math.step import GSCStep, gsc_step


#: (architecture, GSC settings): the backends a detector can get.
CASES = {
    "vit-closed-form": ("vit", {}),  # LayerNorm folded into the classifier
    "vit-penultimate-exact": ("vit", {"split_point": "penultimate", "approximation": "exact"}),
    "vit-autograd-block": ("vit", {"split_point": "vit.layers.0"}),
    "vit-multi-layer": ("vit", {"earlier_split_point": "vit.layers.0"}),
    "resnet-closed-form": ("resnet", {}),
    "resnet-autograd-stage": ("resnet", {"split_point": "resnet.encoder.stages.-1", "approximation": "predicted_logit"}),
}


def _float_model(arch: str) -> torch.nn.Module:
    return make_tiny_model(arch).float()


@pytest.fixture
def images(pixel_values: torch.Tensor) -> torch.Tensor:
    return pixel_values.float()


@pytest.mark.parametrize("arch, settings", CASES.values(), ids=CASES.keys())
def test_bf16_model_scores_in_float32_close_to_the_float32_model(arch, settings, images) -> None:
    model = _float_model(arch)
    reference = GSCForImageClassification(copy.deepcopy(model), **settings)(images)
    bf16 = GSCForImageClassification(copy.deepcopy(model).to(torch.bfloat16), **settings)(images)
    for name in ("ood_score", "gsc_logits", "logits"):
        assert getattr(bf16, name).dtype == torch.float32, name
    # The bf16 backbone's own rounding (8-bit mantissa) is what remains.
    torch.testing.assert_close(bf16.ood_score, reference.ood_score, atol=0.05 * reference.ood_score.abs().mean().item(), rtol=0)


def _recording_step(monkeypatch: pytest.MonkeyPatch) -> list[GSCStep]:
    import hf_gsc.detectors.gsc

    steps: list[GSCStep] = []

    def record(*args, **kwargs) -> GSCStep:
        steps.append(gsc_step(*args, **kwargs))
        return steps[-1]

    monkeypatch.setattr(hf_gsc.detectors.gsc, "gsc_step", record)
    return steps


@pytest.mark.parametrize("arch, settings", CASES.values(), ids=CASES.keys())
def test_step_runs_in_float32_under_bf16_autocast(arch, settings, images, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``torch.autocast("cpu", bfloat16)`` (what ``accelerator.autocast()`` does with bf16) the backbone
    runs in bf16, and every output of the step stays float32."""
    model = _float_model(arch)
    reference = GSCForImageClassification(copy.deepcopy(model), **settings)(images)
    steps = _recording_step(monkeypatch)
    detector = GSCForImageClassification(model, **settings)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = detector(images)
    (step,) = steps
    for name in ("logits", "gradient", "gsc_logits", "ood_score"):
        assert getattr(step, name).dtype == torch.float32, name
    assert output.ood_score.dtype == torch.float32
    torch.testing.assert_close(output.ood_score, reference.ood_score, atol=0.05 * reference.ood_score.abs().mean().item(), rtol=0)


def test_gsc_step_turns_autocast_off(images) -> None:
    """The step itself: a first-order update (a matmul, which autocast would run in bf16) stays float32."""
    detector = GSCForImageClassification(_float_model("vit"))
    linearization = detector.backend.linearize(images)
    reference = gsc_step(linearization.head, linearization.read_part, detector.config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step = gsc_step(linearization.head, linearization.read_part, detector.config)
    assert step.gsc_logits.dtype == torch.float32 and step.ood_score.dtype == torch.float32
    torch.testing.assert_close(step.gsc_logits, reference.gsc_logits, atol=1e-6, rtol=1e-6)


def test_entry_points_move_pixel_values_to_the_model_device(monkeypatch: pytest.MonkeyPatch, images) -> None:
    """``forward``, ``calibrate``, ``fit_fisher`` and ``calibrate_gradient_mass`` hand the backend ``pixel_values`` on
    the model's device (``meta`` stands in for a GPU: the batch arrives there or stays on the CPU)."""
    detector = GSCForImageClassification(_float_model("vit"))
    monkeypatch.setattr(GSCForImageClassification, "device", property(lambda self: torch.device("meta")))
    seen: list[torch.device] = []

    class Reached(Exception):
        pass

    def run_backbone(model, pixel_values, *args, **options):
        seen.append(pixel_values.device)
        raise Reached

    import hf_gsc.detectors.backbone_pass
    import hf_gsc.detectors.interface

    for module in (hf_gsc.detectors.interface, hf_gsc.detectors.backbone_pass):  # a detector's own passes, and its fits
        monkeypatch.setattr(module, "run_backbone", run_backbone)
    labels = torch.zeros(images.shape[0], dtype=torch.long)
    for call in (lambda: detector(images), lambda: detector.calibrate(images),
                 lambda: detector.fit_fisher([(images, labels)]), lambda: detector.calibrate_gradient_mass(images)):
        with pytest.raises(Reached):
            call()
    assert seen == [torch.device("meta")] * 4


# ------------------------------------------------------------------ ODIN and ASH under bf16 autocast
def test_odin_under_bf16_autocast_equals_float32(images) -> None:
    """ODIN's input step (``epsilon / std``) is below bf16's resolution: the detector runs it, and both forwards,
    in float32 with autocast off, so bf16 autocast gives the float32 scores."""
    from hf_gsc.detectors import get_detector

    detector = get_detector("odin", _float_model("resnet"), image_std=[0.229, 0.224, 0.225])
    reference = detector.score(images)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_autocast = detector.score(images)
    assert under_autocast.dtype == torch.float32
    torch.testing.assert_close(under_autocast, reference, atol=1e-9, rtol=1e-6)


@pytest.mark.parametrize("method", ["ash_b", "ash_s", "gsc_ash"])
@pytest.mark.parametrize("arch", ["resnet", "vit"])
def test_ash_shapes_bf16_features_in_float32(method, arch, images) -> None:
    """Under bf16 autocast the backbone's features are bf16; ASH's percentile cut, sums, ``exp(s1 / s2)``, the
    head and the energy then run in float32: the score equals the float32 computation on those same features."""
    from hf_gsc.detectors import get_detector
    from hf_gsc.detectors.ash import ash_shape
    from hf_gsc.utils.scores import energy_score

    detector = get_detector(method, _float_model(arch))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        score = detector.score(images)
        split = detector.split if method != "gsc_ash" else detector.backend.split_point
        features = split.features(images)
    assert score.dtype == torch.float32
    assert features.dtype == (torch.bfloat16 if arch == "resnet" else torch.float32)  # autocast runs LayerNorm in float32
    variant = detector.variant if method != "gsc_ash" else detector.hyperparameters["feature_shaping"][-1]
    percentile = detector.hyperparameters["percentile" if method != "gsc_ash" else "shaping_percentile"]
    shaped = ash_shape(features.flatten(1).float(), variant, percentile).view(features.shape)
    if method == "gsc_ash":
        expected = detector.backend.inner.linearize(images, features=shaped)
        from hf_gsc.gsc_math.step import gsc_step

        reference = gsc_step(expected.head, expected.read_part, detector.config).ood_score
    else:
        with torch.no_grad():
            reference = energy_score(split.head(shaped, images))
    torch.testing.assert_close(score, reference.to(score.dtype), atol=1e-4, rtol=1e-4)
