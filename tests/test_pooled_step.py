"""The per-channel GSC step of a head that reads ``F`` through a mean over positions (hf_gsc.gsc_math.step,
hf_gsc.gsc_math.shortcircuit.repeated_top_k_counts): the same masks, coordinate for coordinate and in the same tie order, and
the same logits and scores as the step on every coordinate, which the head without its ``pooled_read`` runs.

Tolerance of the updated logits and scores: 1e-5 absolute and relative. Both steps sum the same float32 terms
(``F' - F`` over a channel's positions, then over channels) in a different order, which moves a float32 result by a
few units in the last place of the sum's largest term; the logits here are of order 1.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from test_architectures import TINY, tiny_model, tiny_pixel_values

from hf_gsc import GSCConfig, GSCForImageClassification
from hf_gsc.classifier.head_jacobians import PoolNormLinearHead
from hf_gsc.gsc_math.shortcircuit import num_masked_adaptive, prefix_mask, repeated_top_k_counts, top_k_mask
from hf_gsc.gsc_math.step import gsc_step


TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
#: The registered architectures whose final_encoder_output head is a mean over positions, then (LayerNorm and) a
#: linear layer.
POOLED_CASES = ("convnext", "convnextv2", "donut-swin", "hgnet_v2", "hiera", "mobilenet_v1", "mobilenet_v2",
                "mobilevit", "mobilevitv2", "regnet", "resnet", "textnet")
#: Every setting of the step that reduces to per-channel quantities, one at a time around the defaults.
VARIANTS = (
    [{"operation": o} for o in ("zero", "perturb", "project", "clip", "scale")]
    + [{"approximation": a} for a in ("predicted_logit", "exact")]
    + [{"selection": "reverse"}, {"mask_size": "adaptive", "gradient_mass": 0.3}, {"mask_ratio": 0.5},
       {"mask_ratio": 1.0, "approximation": "exact"}]
)


def _expanded(priority: torch.Tensor, repeats: int, position_major: bool) -> torch.Tensor:
    """A per-channel ``(B, C)`` value at each of ``repeats`` positions, flattened as ``F`` is."""
    return priority.repeat(1, repeats) if position_major else priority.repeat_interleave(repeats, dim=1)


def _per_coordinate(head):
    """The same linearised head without its pooled form: the step then runs on every coordinate."""
    return dataclasses.replace(head, pooled_read=None)


@pytest.mark.parametrize("position_major", [False, True], ids=["channel-major", "position-major"])
def test_per_channel_counts_are_the_top_k_mask_of_the_expanded_priority(position_major):
    generator = torch.Generator().manual_seed(0)
    channels, repeats = 7, 4
    # Few distinct values, so that several channels tie at the cut in most rows.
    priority = torch.randint(0, 3, (200, channels), generator=generator).float()
    k = torch.randint(0, channels * repeats + 1, (200,), generator=generator)
    counts = repeated_top_k_counts(priority, k, repeats, position_major)
    mask = prefix_mask(counts, repeats)
    flat = (mask.transpose(1, 2) if position_major else mask).reshape(200, -1)
    assert torch.equal(flat, top_k_mask(_expanded(priority, repeats, position_major), k))


def test_adaptive_size_per_channel_is_the_size_of_the_expanded_gradient():
    generator = torch.Generator().manual_seed(1)
    gradient = torch.randn(50, 9, generator=generator)
    gradient[:, 3] = 0.0  # a channel the head does not read
    gradient[:10, 5] = gradient[:10, 6]  # ties
    for mass in (0.0, 0.1, 0.37, 0.5, 0.9, 1.0):
        expected = num_masked_adaptive(gradient.repeat_interleave(6, dim=1), mass)
        assert torch.equal(num_masked_adaptive(gradient, mass, repeats=6), expected), mass


@pytest.mark.parametrize("pool, norm", list(itertools.product(["mean_spatial", "mean_tokens"], [False, True])))
def test_tied_channels_at_the_cut_are_masked_in_index_order(pool, norm):
    """Channels 0, 1 and 2 have the same |g| (equal classifier columns, LayerNorm weights and features) and straddle
    the cut: the per-channel step takes their positions in the order of the flattened coordinates (channel by channel
    for a (B, C, H, W) map, position by position for (B, N, D) tokens), as the top-k on every coordinate does."""
    generator = torch.Generator().manual_seed(2)
    channels, classes = 6, 4
    weight = torch.randn(classes, channels, generator=generator)
    weight[:, 1], weight[:, 2] = weight[:, 0], weight[:, 0]
    extra = ()
    if norm:
        norm_weight = torch.randn(channels, generator=generator)
        norm_weight[1:3] = norm_weight[0]
        extra = (1e-5, norm_weight, torch.randn(channels, generator=generator))
    else:
        weight[:, 3] = -weight[:, 0]
    head = PoolNormLinearHead.fold(pool, weight, torch.randn(classes, generator=generator), *extra)
    if pool == "mean_spatial":
        features = torch.randn(5, channels, 3, 3, generator=generator)
        features[:, 1:3] = features[:, :1]
    else:
        features = torch.randn(5, 7, channels, generator=generator)
        features[:, :, 1:3] = features[:, :, :1]
    linearized = head.linearize(features)
    assert linearized.pooled_read is not None
    gradient = gsc_step(linearized, features, GSCConfig()).gradient.abs()
    per_channel = gradient.view(5, channels, -1)[:, :, 0] if pool == "mean_spatial" else gradient.view(5, 7, -1)[:, 0]
    assert torch.equal(per_channel[:, 1], per_channel[:, 0]) and torch.equal(per_channel[:, 2], per_channel[:, 0])
    for ratio in (0.1, 0.2, 0.3, 0.45, 0.5, 0.77):
        config = GSCConfig(mask_ratio=ratio, approximation="exact")
        pooled, reference = gsc_step(linearized, features, config), gsc_step(_per_coordinate(linearized), features, config)
        assert torch.equal(pooled.mask, reference.mask), ratio
        torch.testing.assert_close(pooled.ood_score, reference.ood_score, **TOLERANCE)


def test_the_pooled_architectures_are_those_with_a_mean_pooled_head():
    pooled = []
    for case in sorted(TINY):
        model = tiny_model(case)
        detector = GSCForImageClassification(model)
        linearization = detector._linearize(detector.backbone_pass(tiny_pixel_values(case)))
        if linearization.head.pooled_read is not None:
            pooled.append(case)
    assert tuple(pooled) == POOLED_CASES


@pytest.mark.parametrize("case", POOLED_CASES)
def test_per_channel_step_matches_the_step_on_every_coordinate(case):
    model = tiny_model(case)
    detector = GSCForImageClassification(model)
    linearization = detector._linearize(detector.backbone_pass(tiny_pixel_values(case, batch=4)))
    head, features = linearization.head, linearization.read_part
    for variant in VARIANTS:
        config = GSCConfig(**{"mask_ratio": 0.2, **variant})
        pooled = gsc_step(head, features, config)
        reference = gsc_step(_per_coordinate(head), features, config)
        assert torch.equal(pooled.logits, reference.logits) and torch.equal(pooled.gradient, reference.gradient)
        assert torch.equal(pooled.mask, reference.mask), variant
        assert int(pooled.mask.sum()) > 0
        torch.testing.assert_close(pooled.gsc_logits, reference.gsc_logits, **TOLERANCE, msg=str(variant))
        torch.testing.assert_close(pooled.ood_score, reference.ood_score, **TOLERANCE, msg=str(variant))


def test_fisher_selection_is_per_channel_only_where_the_diagonal_is():
    """A fitted diagonal Fisher of a pooled head is the same at every position of a channel; one that is not (loaded
    from elsewhere) keeps the step on every coordinate. Both give the reference's mask."""
    model = tiny_model("resnet")
    detector = GSCForImageClassification(model, selection="fisher", mask_ratio=0.3)
    pixel_values = tiny_pixel_values("resnet", batch=6)
    detector.fit_fisher([(pixel_values, torch.arange(6) % 5)])
    linearization = detector._linearize(detector.backbone_pass(pixel_values))
    head, features = linearization.head, linearization.read_part
    fitted = detector.fisher_diagonal
    varying = fitted * torch.linspace(0.5, 2.0, fitted.numel(), dtype=fitted.dtype)
    assert head.pooled_read.channel_values(fitted) is not None and head.pooled_read.channel_values(varying) is None
    for diagonal in (fitted, varying):
        pooled = gsc_step(head, features, detector.config, fisher_diagonal=diagonal)
        reference = gsc_step(_per_coordinate(head), features, detector.config, fisher_diagonal=diagonal)
        assert torch.equal(pooled.mask, reference.mask)
        torch.testing.assert_close(pooled.ood_score, reference.ood_score, **TOLERANCE)
    # The two diagonals rank differently: the varying one really took the other path's ranking.
    assert not torch.equal(gsc_step(head, features, detector.config, fisher_diagonal=fitted).mask,
                           gsc_step(head, features, detector.config, fisher_diagonal=varying).mask)


def test_detector_output_is_the_per_coordinate_step():
    """``GSCForImageClassification`` on a ResNet takes the per-channel step; its outputs (mask and gradient spread
    over ``F``, scores) are those of the step on every coordinate."""
    model = tiny_model("resnet")
    detector = GSCForImageClassification(model, mask_ratio=0.1)
    pixel_values = tiny_pixel_values("resnet", batch=4)
    out = detector(pixel_values, output_short_circuit=True)
    linearization = detector._linearize(detector.backbone_pass(pixel_values))
    reference = gsc_step(_per_coordinate(linearization.head), linearization.read_part, detector.config)
    assert torch.equal(out.mask, linearization.spread(reference.mask))
    assert torch.equal(out.gradient, linearization.spread(reference.gradient))
    torch.testing.assert_close(out.ood_score, reference.ood_score, **TOLERANCE)


def test_a_one_by_one_map_takes_the_step_on_every_coordinate():
    """A CNN's final map of 1 x 1 (a small input) has one position per channel: the step runs on the coordinates
    (the mask then has F's flattened shape), and scores as the step without the pooled form."""
    model = tiny_model("resnet")
    detector = GSCForImageClassification(model)
    pixel_values = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    linearization = detector._linearize(detector.backbone_pass(pixel_values))
    head, features = linearization.head, linearization.read_part
    assert features.shape[-2:] == (1, 1) and head.pooled_read is not None and head.pooled_read.positions == 1
    for variant in VARIANTS:
        config = GSCConfig(**{"mask_ratio": 0.2, **variant})
        step = gsc_step(head, features, config)
        reference = gsc_step(_per_coordinate(head), features, config)
        assert torch.equal(step.mask, reference.mask), variant
        torch.testing.assert_close(step.ood_score, reference.ood_score, **TOLERANCE, msg=str(variant))
    assert torch.isfinite(detector(pixel_values).ood_score).all()


def test_an_adaptive_mask_without_its_mass_and_a_folded_norm_without_its_epsilon_are_refused_by_name():
    """The step's adaptive size needs ``gradient_mass`` (a ValueError naming it, not a TypeError from the product
    with None); a head has its centred classifier exactly when it has a LayerNorm (refused when built by hand)."""
    generator = torch.Generator().manual_seed(0)
    head = PoolNormLinearHead.fold("mean_spatial", torch.randn(3, 4, generator=generator), None)
    features = torch.randn(2, 4, 2, 2, generator=generator)
    with pytest.raises(ValueError, match="mask_size='adaptive' needs gradient_mass"):
        gsc_step(head.linearize(features), features, GSCConfig(mask_size="adaptive"))
    with pytest.raises(ValueError, match="centered_weight exactly when it has norm_eps"):
        PoolNormLinearHead("identity", head.weight, None, norm_eps=1e-5)
