"""Figures (PNG, matplotlib ``Agg``): ID vs OOD ``ood_score`` densities, ROC curves and risk-coverage curves.

The density figure is the paper's: one panel per method, the ID test scores against each OOD
split, with the calibrated threshold as a vertical line. ROC curves use ID as the positive class
(``sklearn.metrics.roc_curve(is_id, score)``), one curve per OOD split. The risk-coverage figure has one curve
per method: the base model's error rate on the ID test samples accepted when only the highest-``ood_score``
fraction (the coverage) is kept (:mod:`hf_gsc.evaluation.selective`), with each method's calibrated operating point.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..utils.confined_files import atomic_open, make_dirs

PLOTS_DIR = "plots"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _as_numpy(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64)


def _panels(count: int) -> tuple[int, int]:
    cols = min(count, 3)
    return math.ceil(count / cols), cols


def _finish(plt: Any, fig: Any, axes: Any, used: int, path: Path) -> Path:
    """Hide unused panels, save atomically and never through a link (:mod:`hf_gsc.utils.confined_files`), close."""
    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    fig.tight_layout()
    with atomic_open(path) as handle:
        fig.savefig(handle, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_densities(
    scores: Mapping[str, Mapping[str, Any]],
    path: str | os.PathLike,
    thresholds: Mapping[str, float] | None = None,
    id_name: str = "ID test",
    bins: int = 60,
) -> Path:
    """One panel per method: histogram densities of ``scores[method][split]``.

    Args:
        scores: method -> {``id_name`` or OOD split name -> 1-D scores}; the ID entry is drawn filled.
        path: the PNG to write.
        thresholds: method -> calibrated threshold (dashed vertical line).
    """
    plt = _pyplot()
    rows, cols = _panels(len(scores))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (method, by_split) in zip(axes.flat, scores.items()):
        arrays = {split: _as_numpy(values) for split, values in by_split.items()}
        low = min(a.min() for a in arrays.values())
        high = max(a.max() for a in arrays.values())
        edges = np.linspace(low, high if high > low else low + 1.0, bins + 1)
        for split, values in arrays.items():
            if split == id_name:
                ax.hist(values, bins=edges, density=True, alpha=0.45, color="tab:blue", label=split)
            else:
                ax.hist(values, bins=edges, density=True, histtype="step", linewidth=1.4, label=split)
        if thresholds and method in thresholds:
            ax.axvline(thresholds[method], color="black", linestyle="--", linewidth=1, label="threshold")
        ax.set_title(method)
        ax.set_xlabel("ood_score (higher = ID)")
        ax.set_ylabel("density")
        ax.legend(fontsize=7)
    return _finish(plt, fig, axes, len(scores), Path(path))


def plot_roc(
    id_scores: Mapping[str, Any],
    ood_scores: Mapping[str, Mapping[str, Any]],
    path: str | os.PathLike,
    aurocs: Mapping[str, Mapping[str, float]] | None = None,
) -> Path:
    """One panel per method: ROC curves (ID positive) of the ID test scores against each OOD split.

    Args:
        id_scores: method -> ID test scores.
        ood_scores: method -> {OOD split -> scores}.
        path: the PNG to write.
        aurocs: method -> {split -> AUROC}, shown in the legend when given.
    """
    from sklearn.metrics import roc_curve

    plt = _pyplot()
    rows, cols = _panels(len(id_scores))
    fig, axes = plt.subplots(rows, cols, figsize=(4.0 * cols, 3.6 * rows), squeeze=False)
    for ax, (method, ids) in zip(axes.flat, id_scores.items()):
        ids = _as_numpy(ids)
        for split, ood in ood_scores[method].items():
            ood = _as_numpy(ood)
            labels = np.concatenate([np.ones(ids.size), np.zeros(ood.size)])
            fpr, tpr, _ = roc_curve(labels, np.concatenate([ids, ood]))
            label = split
            if aurocs and split in aurocs.get(method, {}):
                label = f"{split} (AUROC {100 * aurocs[method][split]:.1f})"
            ax.plot(fpr, tpr, linewidth=1.3, label=label)
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=0.8)
        ax.axhline(0.95, color="black", linestyle="--", linewidth=0.6)
        ax.set_title(method)
        ax.set_xlabel("FPR (OOD accepted)")
        ax.set_ylabel("TPR (ID accepted)")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.01)
        ax.legend(fontsize=7, loc="lower right")
    return _finish(plt, fig, axes, len(id_scores), Path(path))


def plot_risk_coverage(
    id_scores: Mapping[str, Any],
    correct: Any,
    path: str | os.PathLike,
    thresholds: Mapping[str, float] | None = None,
) -> Path:
    """One axis, one risk-coverage curve per method (ID test samples ranked by that method's ``ood_score``).

    Args:
        id_scores: method -> ID test scores.
        correct: per ID test sample, whether the base model's prediction is right (same order as the scores).
        path: the PNG to write.
        thresholds: method -> calibrated threshold, drawn as a marker at its (coverage, risk).
    """
    from .selective import aurc, risk_coverage_curve

    plt = _pyplot()
    fig, axes = plt.subplots(1, 1, figsize=(5.2, 4.0), squeeze=False)
    ax = axes[0, 0]
    correct = correct.detach().cpu().numpy() if hasattr(correct, "detach") else np.asarray(correct)
    for method, scores in id_scores.items():
        coverage, risk, _ = risk_coverage_curve(_as_numpy(scores), correct)
        (line,) = ax.step(coverage, risk, where="post", linewidth=1.3,
                          label=f"{method} (AURC {100 * aurc(_as_numpy(scores), correct):.2f})")
        if thresholds and method in thresholds:
            accepted = _as_numpy(scores) >= thresholds[method]
            if accepted.any():
                ax.plot(accepted.mean(), 1.0 - correct[accepted].mean(), "o", color=line.get_color(), markersize=5)
    ax.axhline(1.0 - correct.mean(), color="grey", linestyle=":", linewidth=0.8, label="error rate, no abstention")
    ax.set_title("risk-coverage on ID test (dots: calibrated threshold)")
    ax.set_xlabel("coverage (fraction of ID test accepted)")
    ax.set_ylabel("risk (error rate of accepted)")
    ax.set_xlim(0, 1)
    ax.legend(fontsize=7)
    return _finish(plt, fig, axes, 1, Path(path))


def write_plots(
    output_dir: str | os.PathLike,
    id_scores: Mapping[str, Any],
    ood_scores: Mapping[str, Mapping[str, Any]],
    results: Mapping[str, Any],
    id_test_correct: Any | None = None,
) -> list[Path]:
    """``plots/densities.png`` and ``plots/roc.png`` (one panel per method) and, given ``id_test_correct``,
    ``plots/risk_coverage.png``."""
    folder = make_dirs(output_dir, PLOTS_DIR)  # refuses a plots/ link leading out of output_dir
    methods = results["methods"]
    thresholds = {m: methods[m]["threshold"] for m in id_scores}
    aurocs = {m: {s: v["auroc"] for s, v in methods[m]["ood"].items()} for m in id_scores}
    density_input = {m: {"ID test": id_scores[m], **ood_scores[m]} for m in id_scores}
    paths = [
        plot_densities(density_input, folder / "densities.png", thresholds),
        plot_roc(id_scores, ood_scores, folder / "roc.png", aurocs),
    ]
    if id_test_correct is not None:
        paths.append(plot_risk_coverage(id_scores, id_test_correct, folder / "risk_coverage.png", thresholds))
    return paths


__all__ = ["PLOTS_DIR", "plot_densities", "plot_risk_coverage", "plot_roc", "write_plots"]
