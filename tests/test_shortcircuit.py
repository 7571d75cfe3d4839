"""The pure mask and update functions against direct references."""

from __future__ import annotations

import pytest
import torch

from hf_gsc.gsc_math.shortcircuit import num_masked, top_k_mask, top_k_mask_by_topk


#: Both ways: the stable sort of every column (GSC's, no host read) and the partial top-k (host reads).
MASKS = pytest.mark.parametrize("mask_of", [top_k_mask, top_k_mask_by_topk], ids=["sort", "topk"])


def _stable_argsort_mask(priority: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    rows = []
    for row, size in zip(priority.tolist(), k.tolist()):
        ranked = sorted(range(len(row)), key=lambda j: (-row[j], j))
        chosen = set(ranked[:size])
        rows.append([j in chosen for j in range(len(row))])
    return torch.tensor(rows, dtype=torch.bool)


@MASKS
def test_mask_keeps_top_k_with_ties_to_the_lower_index(mask_of):
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        width = int(torch.randint(1, 30, (1,), generator=generator))
        if trial % 2:
            priority = torch.randint(-2, 3, (4, width), generator=generator).double()  # many ties
            priority[priority == -2] = -float("inf")  # unread coordinates
        else:
            priority = torch.randn(4, width, generator=generator, dtype=torch.float64)
        k = torch.randint(0, width + 1, (4,), generator=generator)
        mask = mask_of(priority, k)
        assert torch.equal(mask, _stable_argsort_mask(priority, k)), (priority, k)
        assert mask.sum(dim=1).tolist() == k.tolist()


def test_num_masked_counts_nonzero_gradient_coordinates():
    gradient = torch.tensor([[0.0, 1.0, -2.0, 0.0] + [0.5] * 96, [0.0] * 100])
    # 98 read coordinates: ceil(0.05 * 98) = 5; nothing read: 0.
    assert num_masked(gradient, 0.05).tolist() == [5, 0]
    assert num_masked(torch.ones(1, 100), 0.05).tolist() == [5]  # no float round-up to 6


@MASKS
def test_mask_with_one_size_for_every_row_handles_ties(mask_of):
    # Every row the same size takes the no-gather path; rows with ties across the cut still need the fill.
    generator = torch.Generator().manual_seed(1)
    for trial in range(200):
        width = int(torch.randint(1, 30, (1,), generator=generator))
        if trial % 2:
            priority = torch.randint(-2, 3, (4, width), generator=generator).double()
            priority[priority == -2] = -float("inf")
        else:
            priority = torch.randn(4, width, generator=generator, dtype=torch.float64)
        k = torch.full((4,), int(torch.randint(0, width + 1, (1,), generator=generator)))
        expected = _stable_argsort_mask(priority, k)
        assert torch.equal(mask_of(priority, k), expected), (priority, k)


def test_both_ways_agree_on_a_pooled_heads_gradient():
    """A pooled head's gradient repeats over a channel's positions: ties straddle every cut (ResNet-50's 2048x7x7)."""
    gradient = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)).repeat_interleave(49, dim=1)
    k = num_masked(gradient, 0.05)
    by_sort = top_k_mask(gradient.abs(), k)
    assert torch.equal(by_sort, top_k_mask_by_topk(gradient.abs(), k))
    assert by_sort.sum(dim=1).tolist() == k.tolist()
