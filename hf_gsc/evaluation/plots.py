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
#: The colour of the ID scores in the density figure; no OOD split or method is drawn in it.
ID_COLOR = "tab:blue"
#: Colours of curves (methods, OOD splits): tab10 without the ID colour, then four named colours far from all of
#: them, cycled through :data:`LINESTYLES`, so that every one of 52 curves has its own (colour, line style) pair.
CURVE_COLORS = ("tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive",
                "tab:cyan", "black", "gold", "teal", "maroon")
LINESTYLES = ("-", "--", "-.", ":")
#: The density figure's x axis spans these quantiles of the scores (one heavy tail would squash the rest into a bin).
SCORE_QUANTILES = (0.01, 0.99)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _as_numpy(values: Any) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().cpu().double().numpy()
    return np.asarray(values, dtype=np.float64)


def curve_styles(count: int) -> list[tuple[str, str]]:
    """``count`` distinct (colour, line style) pairs, colours first (solid lines up to 9 curves); none in
    :data:`ID_COLOR`. Past ``len(CURVE_COLORS) * len(LINESTYLES)`` pairs repeat (no figure here has that many)."""
    pairs = [(color, style) for style in LINESTYLES for color in CURVE_COLORS]
    return [pairs[i % len(pairs)] for i in range(count)]


def score_range(arrays: Mapping[str, np.ndarray]) -> tuple[float, float, int]:
    """The x range of a density panel: from the lowest split's :data:`SCORE_QUANTILES` low quantile to the highest
    split's high one, and how many scores fall outside it (drawn nowhere; the axis label says so)."""
    finite = [a[np.isfinite(a)] for a in arrays.values() if np.isfinite(a).any()]
    if not finite:
        return 0.0, 1.0, 0
    low = min(float(np.quantile(a, SCORE_QUANTILES[0])) for a in finite)
    high = max(float(np.quantile(a, SCORE_QUANTILES[1])) for a in finite)
    if not high > low:
        high = low + 1.0
    outside = sum(int(((a < low) | (a > high)).sum()) for a in arrays.values())
    return low, high, outside


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
        scores: method -> {``id_name`` or OOD split name -> 1-D scores}; the ID entry is drawn filled in
            :data:`ID_COLOR`, each OOD split as a line of its own colour.
        path: the PNG to write.
        thresholds: method -> calibrated threshold (dashed vertical line).
    """
    plt = _pyplot()
    fig, axes = density_figure(scores, thresholds, id_name, bins)
    return _finish(plt, fig, axes, len(scores), Path(path))


def density_figure(scores: Mapping[str, Mapping[str, Any]], thresholds: Mapping[str, float] | None = None,
                   id_name: str = "ID test", bins: int = 60) -> tuple[Any, Any]:
    """The figure of :func:`plot_densities` (``(figure, axes)``), not saved. Each panel's x axis spans the scores'
    :data:`SCORE_QUANTILES` (:func:`score_range`); its label says so when scores fall outside."""
    plt = _pyplot()
    rows, cols = _panels(len(scores))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (method, by_split) in zip(axes.flat, scores.items()):
        arrays = {split: _as_numpy(values) for split, values in by_split.items()}
        low, high, outside = score_range(arrays)
        edges = np.linspace(low, high, bins + 1)
        styles = iter(curve_styles(len(arrays)))
        for split, values in arrays.items():
            if split == id_name:
                ax.hist(values, bins=edges, density=True, alpha=0.45, color=ID_COLOR, label=split)
            else:
                color, style = next(styles)
                ax.hist(values, bins=edges, density=True, histtype="step", linewidth=1.4, color=color,
                        linestyle=style, label=split)
        if thresholds and method in thresholds and low <= thresholds[method] <= high:
            ax.axvline(thresholds[method], color="black", linestyle="--", linewidth=1, label="threshold")
        ax.set_xlim(low, high)
        ax.set_title(method)
        clipped = (f"; axis: {100 * SCORE_QUANTILES[0]:g}-{100 * SCORE_QUANTILES[1]:g}% quantiles, {outside} "
                   "scores outside" if outside else "")
        ax.set_xlabel(f"ood_score (higher = ID{clipped})", fontsize=8 if outside else None)
        ax.set_ylabel("density")
        ax.legend(fontsize=7)
    return fig, axes


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
        styles = curve_styles(len(ood_scores[method]))
        for (split, ood), (color, style) in zip(ood_scores[method].items(), styles):
            ood = _as_numpy(ood)
            labels = np.concatenate([np.ones(ids.size), np.zeros(ood.size)])
            fpr, tpr, _ = roc_curve(labels, np.concatenate([ids, ood]))
            label = split
            if aurocs and split in aurocs.get(method, {}):
                label = f"{split} (AUROC {100 * aurocs[method][split]:.1f})"
            ax.plot(fpr, tpr, linewidth=1.3, color=color, linestyle=style, label=label)
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
    plt = _pyplot()
    fig, axes = risk_coverage_figure(id_scores, correct, thresholds)
    return _finish(plt, fig, axes, 1, Path(path))


def risk_coverage_figure(id_scores: Mapping[str, Any], correct: Any,
                         thresholds: Mapping[str, float] | None = None) -> tuple[Any, Any]:
    """The figure of :func:`plot_risk_coverage` (``(figure, axes)``), not saved: each method its own (colour, line
    style) pair, the legend (methods by AURC, best first) outside the axes, right of them, so that it covers no
    curve whatever the number of methods."""
    from .selective import aurc, risk_coverage_curve

    plt = _pyplot()
    correct = correct.detach().cpu().numpy() if hasattr(correct, "detach") else np.asarray(correct)
    curves = {method: _as_numpy(scores) for method, scores in id_scores.items()}
    areas = {method: aurc(scores, correct) for method, scores in curves.items()}
    order = sorted(curves, key=lambda method: areas[method])
    # Taller with many methods, so that the legend's rows fit beside the axes; wide enough for the axes (about 5
    # inches) and the legend beside them.
    fig, axes = plt.subplots(1, 1, figsize=(8.0, max(4.0, 0.17 * (len(order) + 2))), squeeze=False)
    ax = axes[0, 0]
    for method, (color, style) in zip(order, curve_styles(len(order))):
        coverage, risk, _ = risk_coverage_curve(curves[method], correct)
        ax.step(coverage, risk, where="post", linewidth=1.3, color=color, linestyle=style,
                label=f"{method} (AURC {100 * areas[method]:.2f})")
        if thresholds and method in thresholds:
            accepted = curves[method] >= thresholds[method]
            if accepted.any():
                ax.plot(accepted.mean(), 1.0 - correct[accepted].mean(), "o", color=color, markersize=5)
    ax.axhline(1.0 - correct.mean(), color="black", linestyle=":", linewidth=0.8, label="error rate, no abstention")
    ax.set_title("risk-coverage on ID test (dots: calibrated threshold)")
    ax.set_xlabel("coverage (fraction of ID test accepted)")
    ax.set_ylabel("risk (error rate of accepted)")
    ax.set_xlim(0, 1)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
              title="method (AURC %, best first)", title_fontsize=7)
    return fig, axes


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


__all__ = ["ID_COLOR", "PLOTS_DIR", "SCORE_QUANTILES", "curve_styles", "density_figure", "plot_densities",
           "plot_risk_coverage", "plot_roc", "risk_coverage_figure", "score_range", "write_plots"]
