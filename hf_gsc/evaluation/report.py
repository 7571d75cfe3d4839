"""Metrics per method and OOD split, ``results.json`` and the ``results.md`` table.

``results.json`` holds fractions in ``[0, 1]``; ``results.md`` shows percentages, in the shape of
the paper's tables (one row per method, FPR95 and AUROC per OOD split, then their average).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..safe_files import atomic_write_text
from .calibration import calibrate_threshold, calibration_record, true_positive_rate
from .labels import label_warning
from .metrics import METRIC_NAMES, check_finite_scores, ood_metrics

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
#: Metrics where lower is better (the rest: higher is better).
LOWER_IS_BETTER = frozenset({"fpr95"})


def method_results(
    id_test_scores: Any,
    id_validation_scores: Any,
    ood_scores: Mapping[str, Any],
    tpr: float = 0.95,
    validation_split: str = "validation",
    method: str = "scores",
) -> dict[str, Any]:
    """Calibrate on ID validation, then evaluate on ID test vs each OOD split.

    Non-finite scores are refused (:class:`~hf_gsc.evaluation.metrics.NonFiniteScoreError` naming ``method`` and
    the split), never counted on either side of the threshold.

    Returns the ``results.json`` entry of one method: ``threshold`` (from ``id_validation_scores``
    only), ``calibration`` (split, num_samples, tpr), ``id_tpr_at_threshold`` (reached on ID test),
    ``ood`` (split -> the four metrics) and ``average`` (their mean over the OOD splits).
    """
    for split, scores in [("id_test", id_test_scores), ("id_validation", id_validation_scores),
                          *((f"ood_{name}", values) for name, values in ood_scores.items())]:
        check_finite_scores(scores, method, split)
    threshold = calibrate_threshold(id_validation_scores, tpr)
    ood = {name: ood_metrics(id_test_scores, scores) for name, scores in ood_scores.items()}
    average = average_over_splits(ood)
    return {
        "threshold": threshold,
        "calibration": calibration_record(validation_split, len(id_validation_scores), tpr),
        "id_tpr_at_threshold": true_positive_rate(id_test_scores, threshold),
        "ood": ood,
        "average": average,
    }


def average_over_splits(
    per_split: Mapping[str, Mapping[str, float]], metrics: Sequence[str] = METRIC_NAMES
) -> dict[str, float]:
    """The mean of each metric over the OOD splits (``{split: {metric: value}}``); NaN when there is no split."""
    return {
        metric: float(np.mean([values[metric] for values in per_split.values()])) if per_split else math.nan
        for metric in metrics
    }


def jsonable(value: Any) -> Any:
    """``value`` with only JSON types: numpy scalars as Python numbers, tuples as lists, non-finite floats as
    strings (``"nan"``, strict JSON has no NaN), anything else unknown as its ``str``."""
    if isinstance(value, Mapping):
        return {k if isinstance(k, str) else str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else str(float(value))
    if value is None or isinstance(value, str):
        return value
    return str(value)


def table_lines(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A markdown table: the header row, the ``|---|`` rule, one line per row of cells."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(cells) + " |" for cells in rows
    ]


def write_json(path: str | os.PathLike, data: Any, root: str | os.PathLike | None = None) -> Path:
    """Write JSON atomically (temporary file, then ``os.replace``) and never through a link out of ``root``
    (default: ``path``'s folder), see :mod:`hf_gsc.safe_files`."""
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n", root)


def _best(values: Sequence[float], metric: str) -> float:
    return min(values) if metric in LOWER_IS_BETTER else max(values)


def markdown_table(results: Mapping[str, Any], metrics: Sequence[str] = ("fpr95", "auroc")) -> str:
    """The paper-style table: methods x (OOD splits + Average), each cell ``FPR95 / AUROC`` in %.

    The best value of each column and metric is in bold. A second table lists, per method, the
    calibrated ``threshold`` and the ID TPR it reaches on the ID test split.
    """
    methods: Mapping[str, Any] = results["methods"]
    if not methods:
        return "(no methods)\n"
    splits = list(next(iter(methods.values()))["ood"])
    columns = [*splits, "average"]
    arrows = {m: ("↓" if m in LOWER_IS_BETTER else "↑") for m in metrics}
    metric_label = " / ".join(f"{m.upper()}{arrows[m]}" for m in metrics)

    def cell(method: str, column: str, metric: str) -> float:
        entry = methods[method]
        return entry["average"][metric] if column == "average" else entry["ood"][column][metric]

    best = {(c, m): _best([cell(name, c, m) for name in methods], m) for c in columns for m in metrics}

    def cells(name: str) -> list[str]:
        row = [name]
        for column in columns:
            parts = []
            for metric in metrics:
                value = cell(name, column, metric)
                text = f"{100 * value:.2f}"
                parts.append(f"**{text}**" if np.isclose(value, best[(column, metric)], rtol=0, atol=1e-12) else text)
            row.append(" / ".join(parts))
        return row

    data = results.get("benchmark") or (f"ID {results['id_dataset']}" if results.get("id_dataset") else None)
    lines = [
        f"## OOD detection: {results.get('model')} on {data}",
        "",
        f"ID test accuracy: {100 * results['id_accuracy']:.2f}%. "
        f"Cells: {metric_label} in %, ID = positive class; thresholds calibrated on ID "
        f"{results.get('calibration_split', 'validation')} only.",
        "",
        *table_lines(["Method", *("Average" if c == "average" else c for c in columns)], map(cells, methods)),
        "",
        *table_lines(
            ["Method", "threshold", f"ID TPR at threshold (test, target {100 * _target_tpr(methods):.0f}%)"],
            ([name, f"{entry['threshold']:.6g}", f"{100 * entry['id_tpr_at_threshold']:.2f}"]
             for name, entry in methods.items()),
        ),
    ]
    sizes = results.get("split_sizes")
    if sizes:
        ood_sizes = ", ".join(f"{k} {v}" for k, v in sizes.get("ood", {}).items())
        lines += [
            "",
            f"Samples: ID test {sizes.get('id_test')}, ID validation {sizes.get('id_validation')}; OOD: {ood_sizes}.",
        ]
    mismatch = label_warning(results.get("label_check") or {"status": None})
    if mismatch:
        lines += ["", f"**Warning:** {mismatch}."]
    skipped = skipped_images_line(results.get("num_skipped") or {})
    if skipped:
        lines += ["", skipped]
    return "\n".join(lines) + "\n"


def skipped_images_line(num_skipped: Mapping[str, Any]) -> str:
    """The sentence of ``results.md`` naming the splits that lost unreadable images (``""`` when none did)."""
    counts = [("ID test", num_skipped.get("id_test", 0)), ("ID validation", num_skipped.get("id_validation", 0)),
              *((f"OOD {name}", n) for name, n in num_skipped.get("ood", {}).items()),
              *((f"fit of {name}", n) for name, n in num_skipped.get("fit", {}).items())]
    parts = [f"{label} {n}" for label, n in counts if n]
    return f"Unreadable images left out (--skip-unreadable-images): {', '.join(parts)}." if parts else ""


def _target_tpr(methods: Mapping[str, Any]) -> float:
    entry = next(iter(methods.values()))
    return float(entry.get("calibration", {}).get("tpr", 0.95))


def write_report(output_dir: str | os.PathLike, results: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``results.json`` and ``results.md`` into ``output_dir``; returns both paths."""
    output_dir = Path(output_dir)
    json_path = write_json(output_dir / RESULTS_JSON, results, output_dir)
    md_path = atomic_write_text(output_dir / RESULTS_MD, markdown_table(results), output_dir)
    return json_path, md_path


__all__ = [
    "RESULTS_JSON",
    "RESULTS_MD",
    "average_over_splits",
    "jsonable",
    "markdown_table",
    "method_results",
    "table_lines",
    "write_json",
    "write_report",
]
