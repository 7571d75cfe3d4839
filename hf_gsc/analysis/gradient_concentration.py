"""Gradient concentration (paper Sec. ``sec:app:gradient_concentration``): how much of ``|g|`` sits in the top coordinates.

``TopKRatio(k) = sum_{i<=k} |g|_(i) / sum_i |g|_(i)`` with ``|g|_(1) >= |g|_(2) >= ...``, per sample. The paper
claims OOD samples have a *more concentrated* gradient (higher ``TopKRatio`` at small ``k``) than ID samples.

Pure functions on ``(B, d)`` gradients (``d`` = flattened feature size); plotting is kept separate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ..utils.confined_files import atomic_open


def top_k_ratio(gradient: torch.Tensor, ks: Sequence[int]) -> torch.Tensor:
    """``TopKRatio(k)`` of each row for each ``k`` in ``ks``.

    Args:
        gradient: ``(B, d)`` (or ``(B, *shape)``, flattened); coordinates the head does not read
            (``g = 0``) add nothing to either sum.
        ks: nonnegative integers; ``k >= d`` gives 1. ``k = 0`` gives 0.
    Returns:
        ``(B, len(ks))`` float64. A row whose gradient is all zero gives NaN (the ratio is undefined).
    """
    if any(int(k) != k or k < 0 for k in ks):
        raise ValueError(f"ks must be nonnegative integers, got {list(ks)}")
    magnitude = gradient.detach().flatten(1).abs().double()
    ordered = magnitude.sort(dim=1, descending=True).values
    cumulative = torch.cat([torch.zeros_like(ordered[:, :1]), ordered.cumsum(dim=1)], dim=1)
    total = cumulative[:, -1:]
    index = torch.as_tensor([min(int(k), ordered.shape[1]) for k in ks], dtype=torch.long)
    tops = cumulative[:, index]
    return torch.where(total > 0, tops / total.clamp_min(torch.finfo(torch.float64).tiny), torch.nan)


def top_fraction_ratio(gradient: torch.Tensor, fractions: Sequence[float]) -> torch.Tensor:
    """``TopKRatio(k)`` with ``k = ceil(fraction * n)``, ``n`` = the row's number of read (nonzero) coordinates.

    Comparable across architectures whose feature sizes differ. Returns ``(B, len(fractions))`` float64.
    """
    flat = gradient.detach().flatten(1)
    read = (flat != 0).sum(dim=1)
    magnitude = flat.abs().double().sort(dim=1, descending=True).values
    cumulative = torch.cat([torch.zeros_like(magnitude[:, :1]), magnitude.cumsum(dim=1)], dim=1)
    total = cumulative[:, -1:]
    k = torch.stack([torch.ceil(read.double() * f - 1e-9).long() for f in fractions], dim=1)
    tops = cumulative.gather(1, k.clamp(max=magnitude.shape[1]))
    return torch.where(total > 0, tops / total.clamp_min(torch.finfo(torch.float64).tiny), torch.nan)


def curve_summary(ratios: torch.Tensor) -> dict[str, list[float]]:
    """Mean and std over samples (NaN rows ignored) of a ``(B, K)`` ratio matrix."""
    values = ratios.double().numpy()
    return {
        "mean": np.nanmean(values, axis=0).tolist(),
        "std": np.nanstd(values, axis=0).tolist(),
        "num_samples": int(np.isfinite(values).all(axis=1).sum()),
    }


def plot_curves(
    curves: Mapping[str, Mapping[str, Mapping[str, list[float]]]],
    fractions: Sequence[float],
    path: str | Path,
    title: str = "",
) -> Path:
    """One panel per split point: mean ``TopKRatio`` (with a +-std band) against ``k / n``, one line per data split.

    Args:
        curves: ``{panel: {data_split: {"mean": [...], "std": [...]}}}``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(curves)
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 6.2), squeeze=False)
    x = np.asarray(fractions) * 100
    for column, panel in enumerate(panels):
        top, bottom = axes[0][column], axes[1][column]
        reference = next((np.asarray(c["mean"]) for name, c in curves[panel].items() if name.startswith("ID")), None)
        for split, summary in curves[panel].items():
            mean, std = np.asarray(summary["mean"]), np.asarray(summary["std"])
            style = "-" if split.startswith("ID") else "--"
            (line,) = top.plot(x, mean, style, label=split, linewidth=1.5)
            top.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.12)
            if reference is not None:
                bottom.plot(x, mean - reference, style, color=line.get_color(), label=split, linewidth=1.5)
        top.set_title(panel, fontsize=9)
        top.set_ylabel("TopKRatio (mean +- std)")
        bottom.set_ylabel("mean TopKRatio - ID mean")
        bottom.axhline(0.0, color="black", linewidth=0.8)
        for ax in (top, bottom):
            ax.set_xscale("log")
            ax.set_xlabel("k / n (%)")
            ax.grid(alpha=0.3)
        top.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    with atomic_open(path) as handle:
        fig.savefig(handle, format="png", dpi=90)
    plt.close(fig)
    return path


#: Fractions of the read coordinates at which curves are evaluated (log-spaced, 0.5% .. 100%).
DEFAULT_FRACTIONS: tuple[float, ...] = tuple(
    sorted({round(v, 4) for v in np.geomspace(0.005, 1.0, 24).tolist()} | {0.01, 0.02, 0.05, 0.1, 0.2})
)
#: Fractions shown in the tables.
TABLE_FRACTIONS: tuple[float, ...] = (0.01, 0.05, 0.1, 0.2)


def _is_close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def column_of(fraction: float, fractions: Sequence[float] = DEFAULT_FRACTIONS) -> int:
    """Index of ``fraction`` in ``fractions``."""
    for i, f in enumerate(fractions):
        if _is_close(f, fraction):
            return i
    raise KeyError(fraction)
