"""timm models (transformers' ``TimmWrapperForImageClassification``) at GSC's default split point, and every method.

The reference is the paper's Algorithm 1 written again here on timm's public API, not on hf_gsc's hooks or closed
forms: ``F = timm_model.forward_features(x)``, the head is ``timm_model.forward_head``, ``g = d y_c / dF`` through that
head by autograd (``torch.autograd.functional.jacobian``, one sample at a time), the top-k% ``|g|`` coordinates are
short-circuited, and the logits are updated to first order (``y + J (F' - F)``) or exactly (``head(F')``) before the
energy score. Skipped without timm (the ``[timm]`` extra; ``make test-timm`` runs it with ``HF_GSC_REQUIRE_TIMM=1``).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_modeling import SETTINGS, reference_score, reference_short_circuit
from timm_families import FAMILIES, image_size, import_timm, make_timm_model

from hf_gsc import GSCConfig, GSCForImageClassification
from hf_gsc.classifier.architectures import architecture_for
from hf_gsc.classifier.heads import HeadSpec
from hf_gsc.classifier.split_points import resolve_split_point
from hf_gsc.classifier.timm_models import describe_timm_split
from hf_gsc.detectors import DETECTORS, get_detector
from hf_gsc.detectors.backbone_pass import fit_together


import_timm()

NUM_LABELS = 5
OPERATIONS = ["zero", "perturb", "project", "clip", "scale"]


def images(family: str, count: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    size = image_size(family)
    generator = torch.Generator().manual_seed(seed)
    return scale * torch.randn(count, 3, size, size, generator=generator, dtype=torch.float64)


def reference(model, x: torch.Tensor, ratio: float, operation: str) -> list[dict]:
    """Algorithm 1 per sample on timm's forward_features / forward_head."""
    timm_model = model.timm_model
    rows = []
    with torch.no_grad():
        features = timm_model.forward_features(x)
    for i in range(x.shape[0]):
        fi = features[i : i + 1]
        head = timm_model.forward_head
        y = head(fi)[0].detach()
        jacobian = torch.autograd.functional.jacobian(lambda f: head(f)[0], fi).reshape(y.numel(), -1)
        c = int(y.argmax())
        g = jacobian[c].numpy()
        flat = fi.flatten().numpy()
        shorted, mask = reference_short_circuit(flat, g, ratio, operation)
        delta = torch.from_numpy(shorted - flat)
        with torch.no_grad():
            exact = head(torch.from_numpy(shorted).reshape(fi.shape))[0]
        rows.append({"y": y, "c": c, "g": g, "mask": mask, "features": flat, "first_order": y + jacobian @ delta, "exact": exact})
    return rows


def balanced(family: str, model):
    """``model`` with its classifier rescaled so that random images are predicted as every class (SHE needs a
    correctly classified sample of each)."""
    x = images(family, 64, seed=0)
    classifier = model.timm_model.get_classifier()
    with torch.no_grad():
        logits = model.timm_model.forward_head(model.timm_model.forward_features(x), pre_logits=True) @ classifier.weight.T
        scale = 3.0 / logits.std(dim=0)
        classifier.weight.mul_(scale[:, None])
        classifier.bias.copy_(-logits.mean(dim=0) * scale)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request):
    return request.param, balanced(request.param, make_timm_model(request.param, NUM_LABELS))


def test_final_encoder_output_is_forward_features_and_the_head_timms(family_model):
    """F is forward_features' output; the head is in closed form (pool, LayerNorm or none, timm's classifier) and
    reproduces the model's logits; the penultimate split is timm's classifier."""
    family, model = family_model
    split = resolve_split_point(model, "final_encoder_output")
    x = images(family, 2, seed=3)
    with torch.no_grad():
        expected = model.timm_model.forward_features(x)
    torch.testing.assert_close(split.features(x), expected, atol=0, rtol=0)
    # a closed form wherever timm builds pool -> LayerNorm or nothing -> Linear
    assert isinstance(split.head_spec, HeadSpec) == (family != "vit_avg_pool"), split.head_spec
    torch.testing.assert_close(split.head(expected), model(pixel_values=x).logits, atol=1e-10, rtol=0)
    classifier = model.timm_model.get_classifier()
    assert resolve_split_point(model, "penultimate").module is classifier
    # ConvNeXt's head normalises after pooling, the averaging ViT's too: g depends on the input
    assert split.head_is_linear == (family not in ("convnext", "vit_avg_pool"))


def test_the_documented_timm_table_is_what_is_resolved(family_model):
    """docs/architectures.md's timm table lists, per family, what the split resolves to."""
    family, model = family_model
    page = (Path(__file__).resolve().parents[1] / "docs" / "architectures.md").read_text()
    row = f"| {family} | `{FAMILIES[family][0]}` " + describe_timm_split(model, architecture_for(model))
    assert row in page, f"docs/architectures.md lacks (or has another) row: {row}"


@pytest.mark.parametrize("operation", OPERATIONS)
def test_gsc_matches_algorithm_1_at_forward_features(family_model, operation):
    family, model = family_model
    x = images(family, 3, seed=1)
    ratio = 0.1
    expected = reference(model, x, ratio, operation)
    for approximation in ("first_order", "exact"):
        config = GSCConfig(mask_ratio=ratio, operation=operation, approximation=approximation, score="energy",
                           **SETTINGS)
        out = GSCForImageClassification(model, config)(x, output_short_circuit=True)
        for i, row in enumerate(expected):
            assert int(out.predicted_class[i]) == row["c"]
            np.testing.assert_allclose(out.features[i].flatten().numpy(), row["features"], atol=0, rtol=0)
            # float64 throughout; relative tolerances because a balanced classifier's logits can be large
            torch.testing.assert_close(out.logits[i], row["y"], atol=1e-8, rtol=1e-10)
            np.testing.assert_allclose(out.gradient[i].flatten().numpy(), row["g"], atol=1e-8, rtol=1e-10)
            np.testing.assert_array_equal(out.mask[i].flatten().numpy(), row["mask"])
            torch.testing.assert_close(out.gsc_logits[i], row[approximation], atol=1e-8, rtol=1e-10)
            assert out.ood_score[i].item() == pytest.approx(reference_score(row[approximation], "energy", 1.0),
                                                            abs=1e-8, rel=1e-10)


def test_mask_counts_every_coordinate_the_head_reads(family_model):
    """k = ceil(ratio * coordinates read): all of F for a pooled head, the CLS token for ViT's token pool, the patch
    tokens for its average."""
    family, model = family_model
    x = images(family, 2, seed=2)
    out = GSCForImageClassification(model, mask_ratio=0.05)(x, output_short_circuit=True)
    tokens, width = out.features.shape[1:] if family.startswith("vit") else (1, out.features[0].numel())
    read = {"vit": width, "vit_avg_pool": (tokens - 1) * width}.get(family, width)
    assert out.mask.flatten(1).sum(dim=1).eq(math.ceil(0.05 * read)).all()


#: Methods that read a part of the model that a timm model lacks here, and the words of their refusal.
LACKING = {"bats": "has no affine BatchNorm layer", "rankfeat": "exposes no list of them",
           "mds_ensemble": "exposes no list of them", "nac": "exposes no list of them"}


def test_every_method_runs(family_model):
    """Every registered method builds, fits (one shared pass) and scores finite numbers on the timm model."""
    family, model = family_model
    # The Gaussian methods need more samples than the penultimate feature's width plus the classes; ActSub 100.
    count = 32 * math.ceil(max(model.timm_model.get_classifier().in_features + NUM_LABELS + 1, 100) / 32)
    fit_images = images(family, count, seed=4)
    with torch.no_grad():
        labels = model(pixel_values=fit_images).logits.argmax(-1)
    labels[::2] = torch.arange(count // 2) % NUM_LABELS  # every class present
    detectors = []
    for name in sorted(DETECTORS):
        try:
            detectors.append(get_detector(name, model))
        except ValueError as error:  # only a method reading a part timm models lack here, refused naming it
            assert name in LACKING and LACKING[name] in str(error), (name, error)
    errors: dict[str, str] = {}
    fit_together(detectors, [(fit_images[i : i + 32], labels[i : i + 32]) for i in range(0, count, 32)],
                 errors=errors)
    assert errors == {}
    test_images = images(family, 4, seed=5, scale=1.5)
    for detector in detectors:
        scores = detector.score(test_images)
        assert scores.shape == (4,) and torch.isfinite(scores).all(), detector.method
