"""GSC's explanation against an autograd reference, on tiny models of the three head kinds: a pooled convolutional
map (ResNet), a mean over tokens (Swin) and a first token (ViT)."""

from __future__ import annotations

import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model

from hf_gsc import GSCForImageClassification
from hf_gsc.gsc_math.explanation import unravel


TOP_K = 7


def _reference(detector: GSCForImageClassification, pixel_values: torch.Tensor):
    """F and the mask from the detector's forward; g = d y_c / dF by autograd through the model's own modules, with
    the split module's output replaced by a leaf F (a forward hook written here); contributions of the ``zero``
    operation, F' = F off the mask and 0 on it."""
    output = detector(pixel_values, output_short_circuit=True)
    features = output.features.detach().clone().requires_grad_(True)

    def replace(module, inputs, result):
        return (features, *result[1:]) if isinstance(result, tuple) else features

    handle = detector.split_point.module.register_forward_hook(replace)
    try:
        with torch.enable_grad():
            logits = detector.model(pixel_values=pixel_values).logits
            predicted = logits.argmax(dim=-1)
            (gradient,) = torch.autograd.grad(logits[torch.arange(len(predicted)), predicted].sum(), features)
    finally:
        handle.remove()
    shorted = torch.where(output.mask, torch.zeros_like(features), features)
    return output, predicted, gradient * (shorted - features).detach()


@pytest.mark.filterwarnings("ignore:detector .gsc. has no threshold")
@pytest.mark.parametrize("arch", ["resnet", "swin", "vit"])
def test_explanation_matches_autograd(arch):
    detector = GSCForImageClassification(make_tiny_model(arch), mask_ratio=0.2)
    pixel_values = torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0),
                               dtype=torch.float64)
    explanation = detector.explain(pixel_values, top_k=TOP_K)
    output, predicted, contributions = _reference(detector, pixel_values)
    flat = contributions.flatten(1)
    assert torch.equal(explanation.predicted_class, predicted)
    torch.testing.assert_close(explanation.score_after, output.ood_score.double(), rtol=1e-6, atol=1e-6)
    energy_before = torch.logsumexp(output.logits.double(), dim=-1)
    torch.testing.assert_close(explanation.score_before, energy_before, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(explanation.total_contribution, flat.sum(dim=1), rtol=1e-9, atol=1e-12)
    # first_order: the predicted logit moves by exactly the sum of the contributions
    torch.testing.assert_close(explanation.logit_change, flat.sum(dim=1), rtol=1e-9, atol=1e-12)
    expected_top = flat.abs().topk(TOP_K, dim=1)
    torch.testing.assert_close(explanation.contributions.abs(), expected_top.values, rtol=1e-9, atol=1e-12)
    listed = explanation.coordinates >= 0  # -1 pads where fewer than TOP_K coordinates were short-circuited
    assert torch.equal(listed.sum(dim=1), output.mask.flatten(1).sum(dim=1).clamp(max=TOP_K))
    assert output.mask.flatten(1).gather(1, explanation.coordinates.clamp(min=0))[listed].all()
    torch.testing.assert_close(explanation.contributions,
                               torch.where(listed, flat.gather(1, explanation.coordinates.clamp(min=0)), 0.0),
                               rtol=1e-9, atol=1e-12)
    assert (explanation.contributions.abs()[:, :-1] >= explanation.contributions.abs()[:, 1:]).all()
    assert explanation.feature_shape == tuple(output.features.shape[1:])
    if arch == "resnet":  # (B, C, H, W): sum over channels
        assert explanation.head_reads == "mean_spatial"
        expected_map = contributions.sum(dim=1)
    elif arch == "swin":  # (B, N, D) tokens on an h x w grid, row by row
        assert explanation.head_reads == "mean_tokens"
        tokens = contributions.shape[1]
        side = int(tokens ** 0.5)
        expected_map = contributions.sum(dim=2).reshape(-1, side, side)
    else:
        assert explanation.head_reads == "first_token" and "no map" in explanation.description
        assert explanation.position_map is None and explanation.image_map is None
        assert (flat.view_as(contributions)[:, 1:] == 0).all()  # only the CLS token is short-circuited
        return
    torch.testing.assert_close(explanation.position_map, expected_map, rtol=1e-9, atol=1e-12)
    assert explanation.image_map.shape == (3, IMAGE_SIZE, IMAGE_SIZE)
    # A bilinear resize keeps the map's range.
    assert explanation.image_map.max() <= expected_map.max() + 1e-12
    assert explanation.image_map.min() >= expected_map.min() - 1e-12


def test_explain_refuses_a_bad_top_k():
    detector = GSCForImageClassification(make_tiny_model("resnet"))
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        detector.explain(torch.zeros(1, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.float64), top_k=0)


@pytest.mark.filterwarnings("ignore:calibrate. 8 ID validation samples")
def test_pipeline_explains_gsc_and_refuses_other_methods(tmp_path):
    import numpy as np
    import transformers
    from PIL import Image
    from transformers import ViTImageProcessor

    from hf_gsc import AutoOODDetector

    processor = ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    detector = GSCForImageClassification(make_tiny_model("resnet").float(), mask_ratio=0.2)
    detector.image_processor = processor
    images = [Image.fromarray(np.random.default_rng(i).integers(0, 256, (30 + i, 40, 3), dtype=np.uint8))
              for i in range(3)]
    ood = transformers.pipeline("ood-image-classification", model=detector)
    for batch_size in (1, 2):
        results = ood(images, explain=True, batch_size=batch_size)
        for image, result in zip(images, results):
            pixel_values = processor(images=image, return_tensors="pt")["pixel_values"]
            expected = detector.explain(pixel_values, top_k=10)
            explanation = result["explanation"]
            assert explanation["predicted_label"] == result["predictions"][0]["label"]
            assert explanation["score_after"] == pytest.approx(result["ood_score"], rel=1e-5)
            assert explanation["score_before"] == pytest.approx(float(expected.score_before[0]), rel=1e-5)
            # One form: the pipeline's dict is GSCExplanation.to_dict(), the attributes' names and forms.
            assert explanation["head_reads"] == expected.head_reads == "mean_spatial"
            assert explanation["description"] == expected.description and "mean over the positions" in expected.description
            assert explanation["image_map"].shape == (image.height, image.width)  # the image as given
            assert explanation["position_map"].shape == tuple(expected.position_map.shape[1:])
            assert explanation["feature_shape"] == list(expected.feature_shape)
            assert explanation["coordinates"] == [int(i) for i in expected.coordinates[0] if int(i) >= 0]
            assert explanation["contributions"] == pytest.approx(expected.contributions[0].tolist()[:len(
                explanation["coordinates"])], rel=1e-4, abs=1e-7)
            channel, row, column = unravel(explanation["coordinates"][0], explanation["feature_shape"])
            assert (channel * expected.feature_shape[1] + row) * expected.feature_shape[2] + column == int(
                expected.coordinates[0, 0])
            assert set(explanation) == {"predicted_class", "predicted_label", "score_before", "score_after",
                                        "logit_change", "total_contribution", "coordinates", "contributions",
                                        "feature_shape", "head_reads", "description", "position_map", "image_map"}
    assert "explanation" not in ood(images[0])
    # map_size: the same map at another size (a display of a large image needs no map at its full size)
    from hf_gsc.gsc_math.explanation import resized_map

    sized = ood(images[0], explain=True, map_size=(7, 5))["explanation"]["image_map"]
    positions = detector.explain(processor(images=images[0], return_tensors="pt")["pixel_values"]).position_map
    assert sized.shape == (7, 5)
    assert np.allclose(sized, resized_map(positions[:1], (7, 5))[0].float().numpy(), rtol=1e-5, atol=1e-7)
    for bad in ((0, 5), (7,), (7.0, 5), "7x5"):
        with pytest.raises(ValueError, match="map_size must be"):
            ood(images[0], explain=True, map_size=bad)
    with pytest.raises(ValueError, match="with explain=True"):
        ood(images[0], map_size=(7, 5))
    energy = AutoOODDetector.from_pretrained(make_tiny_model("resnet").float(), method="energy")
    energy.image_processor = processor
    with pytest.raises(ValueError, match="explain=True explains GSC"):
        transformers.pipeline("ood-image-classification", model=energy)(images[0], explain=True)
