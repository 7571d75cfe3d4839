"""RankFeat against OpenOOD v1.5's ``rankfeat_postprocessor.py`` (ResNet) and the authors' ``test_ood_vit.py``
(``iterate_data_rankfeat``, ViT), written again on the tiny models' public modules and outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model

from hf_gsc.detectors import DETECTORS, get_detector


#: float64 models; the SVDs and the head run in float64 on both sides (measured: equal to the last bit here).
RTOL = 1e-12


def svd_remove(feat):
    """Both codes' rank-1 removal (``accelerate: False``): ``u, s, v = torch.linalg.svd(feat)`` on ``(B, C, H W)``."""
    u, s, v = torch.linalg.svd(feat, full_matrices=False)
    return feat - s[:, 0:1].unsqueeze(2) * u[:, :, 0:1].bmm(v[:, 0:1, :])


def openood_rankfeat_resnet(model, inputs, temperature):
    """``postprocess``: block 4's map rank-1 removed, pooled, ``fc``; block 3's map rank-1 removed, ``layer4``,
    pooled, ``fc``; the logits averaged, then ``T logsumexp(logits / T)``."""
    with torch.no_grad():
        hidden = model.resnet(inputs, output_hidden_states=True).hidden_states
        feat1 = hidden[-1]
        B, C, H, W = feat1.size()
        feat1 = svd_remove(feat1.view(B, C, H * W)).view(B, C, H, W)
        logits1 = model.classifier(model.resnet.pooler(feat1))
        feat2 = hidden[-2]
        B, C, H, W = feat2.size()
        feat2 = svd_remove(feat2.view(B, C, H * W)).view(B, C, H, W)
        feat2 = model.resnet.encoder.stages[-1](feat2)
        logits2 = model.classifier(model.resnet.pooler(feat2))
        logits = (logits1 + logits2) / 2
        return temperature * torch.logsumexp(logits / temperature, dim=1)


def authors_rankfeat_vit(model, inputs, temperature):
    """``iterate_data_rankfeat``: the blocks up to ``svd_block_index`` (all but the last), the rank-1 removal of the
    ``(tokens, width)`` matrix, the last block, the final LayerNorm, the CLS token, the head, the energy."""
    with torch.no_grad():
        x = model.vit.embeddings(inputs)
        layers = model.vit.layers
        svd_block_index = len(layers) - 1
        for i in range(svd_block_index):
            x = layers[i](x)
        feat = svd_remove(x)
        for i in range(svd_block_index, len(layers)):
            feat = layers[i](feat)
        feat = model.vit.layernorm(feat)[:, 0]
        logits = model.classifier(feat)
        return temperature * torch.logsumexp(logits / temperature, dim=1)


REFERENCES = {"resnet": openood_rankfeat_resnet, "vit": authors_rankfeat_vit}


@pytest.mark.parametrize("arch", sorted(REFERENCES))
@pytest.mark.parametrize("temperature", [1.0, 3.0])
def test_rankfeat_matches_the_authors_code(arch, temperature):
    model = make_tiny_model(arch)
    inputs = torch.randn(6, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    expected = REFERENCES[arch](model, inputs, temperature).numpy()
    detector = get_detector("rankfeat", model, temperature=temperature)
    np.testing.assert_allclose(detector.score(inputs).double().numpy(), expected, rtol=RTOL)
    with torch.no_grad():
        energy = torch.logsumexp(model(pixel_values=inputs).logits / temperature, dim=1).numpy() * temperature
    assert np.abs(expected - energy).max() > 1e-3  # the removal changes the score


def test_the_default_split_points_follow_the_authors_per_architecture():
    assert DETECTORS["rankfeat"].defaults == {"temperature": 1.0, "split_points": None}
    expected = {"resnet": ("final_encoder_output", "resnet.encoder.stages.-2"),
                "convnext": ("final_encoder_output", "convnext.encoder.stages.-2"),
                "vit": ("vit.layers.-2",), "swin": ("swin.encoder.layers.-2",)}
    for arch, points in expected.items():
        assert get_detector("rankfeat", make_tiny_model(arch)).hyperparameters["split_points"] == points
    one_block = make_tiny_model("vit")
    del one_block.vit.layers[1:]  # an encoder of one block: its final output is the one split point
    assert get_detector("rankfeat", one_block).hyperparameters["split_points"] == ("final_encoder_output",)


def test_one_split_point_scores_its_own_removal():
    """Block 4 alone of OpenOOD's fusion: the energy of the head at the rank-1-removed final feature map."""
    model = make_tiny_model("resnet")
    inputs = torch.randn(4, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    with torch.no_grad():
        feat = model.resnet(inputs, output_hidden_states=True).hidden_states[-1]
        B, C, H, W = feat.shape
        removed = svd_remove(feat.view(B, C, H * W)).view(B, C, H, W)
        expected = torch.logsumexp(model.classifier(model.resnet.pooler(removed)), dim=1).numpy()
    detector = get_detector("rankfeat", model, split_points=["final_encoder_output"])
    assert detector.hyperparameters["split_points"] == ("final_encoder_output",)
    np.testing.assert_allclose(detector.score(inputs).numpy(), expected, rtol=RTOL)


def test_bad_split_points_are_refused_by_name():
    model = make_tiny_model("resnet")
    with pytest.raises(ValueError, match=r"split_points: 'penultimate' is a vector per sample"):
        get_detector("rankfeat", model, split_points=["penultimate"])
    with pytest.raises(ValueError, match=r"split_points must be None or a non-empty list"):
        get_detector("rankfeat", model, split_points="final_encoder_output")
    with pytest.raises(ValueError, match=r"split_points: split_point must be one of"):
        get_detector("rankfeat", model, split_points=["no such/path"])
