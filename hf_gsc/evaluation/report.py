"""Metrics per method and OOD split, ``results.json`` and the ``results.md`` table.

``results.json`` holds fractions in ``[0, 1]``; ``results.md`` shows percentages, in the shape of
the paper's tables (one row per method; per OOD split FPR@95 under both conventions and AUROC; then the near-OOD,
far-OOD and overall averages), then per method the calibrated threshold, the ID TPR it reaches on ID test, and the
selective-classification numbers (base-model accuracy on the accepted ID test samples, AURC).

Two FPR@95 conventions are reported, each under its own key:

* ``fpr95``: the paper's, ID = positive class: the fraction of OOD samples accepted when 95% of ID test samples
  are (:func:`~hf_gsc.evaluation.metrics.fpr_at_tpr`);
* ``fpr95_ood_positive``: OpenOOD v1.5's, OOD = positive class: the fraction of ID test samples rejected when 95%
  of OOD samples are (:func:`~hf_gsc.evaluation.metrics.fpr_at_tpr_ood_positive`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..utils.calibration import Calibration
from ..utils.confined_files import atomic_write_text
from .calibration import true_positive_rate
from .json_files import jsonable, table_lines, write_json
from .labels import label_warning, labels_note, mapping_line
from .metrics import METRIC_NAMES, check_finite_scores, fpr_at_tpr_ood_positive, ood_metrics
from .selective import aurc, selective_accuracy


RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
#: Keys of each OOD split's entry in ``results.json``: the four metrics of ``ood_metrics`` and OpenOOD's FPR@95.
REPORTED_METRICS: tuple[str, ...] = (*METRIC_NAMES, "fpr95_ood_positive")
#: Metrics where lower is better (the rest: higher is better).
LOWER_IS_BETTER = frozenset({"fpr95", "fpr95_ood_positive", "aurc"})
#: How ``results.md`` names each metric: the FPR@95 conventions say which class is positive.
METRIC_LABELS = {"fpr95": "FPR95 (ID+)", "fpr95_ood_positive": "FPR95 (OOD+)", "auroc": "AUROC",
                 "aupr_in": "AUPR-In", "aupr_out": "AUPR-Out"}
#: The OOD groups of OpenOOD v1.5, in the order they are reported.
GROUPS: tuple[str, ...] = ("near", "far")


def split_metrics(id_test_scores: Any, ood_scores: Any) -> dict[str, float]:
    """The ``results.json`` metrics of ID test vs one OOD split: :func:`ood_metrics` plus ``fpr95_ood_positive``."""
    return {**ood_metrics(id_test_scores, ood_scores),
            "fpr95_ood_positive": fpr_at_tpr_ood_positive(id_test_scores, ood_scores, 0.95)}


def method_results(
    id_test_scores: Any,
    id_validation_scores: Any,
    ood_scores: Mapping[str, Any],
    tpr: float = 0.95,
    validation_split: str = "validation",
    method: str = "scores",
    id_test_correct: Any | None = None,
    delta: float | None = None,
    groups: Mapping[str, Sequence[str]] | None = None,
    threshold: float | None = None,
) -> dict[str, Any]:
    """Calibrate on ID validation, then evaluate on ID test vs each OOD split.

    Args:
        id_test_scores, id_validation_scores: ``ood_score`` of the ID test / validation samples.
        ood_scores: OOD split name -> its scores.
        tpr: target TPR of the threshold.
        validation_split: the name recorded as the calibration split.
        method: named when non-finite scores are refused (:class:`~hf_gsc.evaluation.metrics.NonFiniteScoreError`,
            naming the method and the split; they are never counted on either side of the threshold).
        id_test_correct: per ID test sample, whether the base model's prediction is right (same order as
            ``id_test_scores``); gives the ``selective`` entry.
        delta: ``None`` for the plain ``tpr`` quantile threshold, else the split-conformal threshold that keeps
            TPR >= ``tpr`` on new ID data with probability >= ``1 - delta``.
        groups: group name (``near``, ``far``) -> its OOD splits; gives ``average_by_group``.
        threshold: a threshold set beforehand (a saved detector's), with ``id_validation_scores`` ``None``: nothing
            is calibrated (``calibration`` is ``None``).

    Returns:
        The ``results.json`` entry of one method: ``threshold`` (from ``id_validation_scores`` only),
        ``calibration`` (split, num_samples, tpr, method, delta), ``id_tpr_at_threshold`` (reached on ID test:
        also the coverage of the selective classifier), ``ood`` (split -> the metrics of :func:`split_metrics`),
        ``average`` (their mean over all OOD splits), ``average_by_group`` (the mean over each non-empty group)
        and ``selective`` (``accuracy``: base-model accuracy on the ID test samples accepted at the threshold;
        ``aurc``: area under the risk-coverage curve).
    """
    if (threshold is None) == (id_validation_scores is None):
        raise ValueError("give exactly one of id_validation_scores (to calibrate the threshold) and threshold")
    for split, scores in [("id_test", id_test_scores), ("id_validation", id_validation_scores),
                          *((f"ood_{name}", values) for name, values in ood_scores.items())]:
        if scores is not None:
            check_finite_scores(scores, method, split)
    calibration = None
    if threshold is None:
        made = Calibration.from_scores(id_validation_scores, tpr, delta, split=validation_split)
        threshold, calibration = made.threshold, made.record
    threshold = float(threshold)
    ood = {name: split_metrics(id_test_scores, scores) for name, scores in ood_scores.items()}
    entry = {
        "threshold": threshold,
        "calibration": calibration,
        "id_tpr_at_threshold": true_positive_rate(id_test_scores, threshold),
        "ood": ood,
        "average": average_over_splits(ood),
    }
    if groups:
        entry["average_by_group"] = {
            group: average_over_splits({name: ood[name] for name in splits if name in ood})
            for group, splits in groups.items() if any(name in ood for name in splits)
        }
    if id_test_correct is not None:
        entry["selective"] = {
            "accuracy": selective_accuracy(id_test_scores, id_test_correct, threshold)["accuracy"],
            "aurc": aurc(id_test_scores, id_test_correct),
        }
    return entry


def average_over_splits(
    per_split: Mapping[str, Mapping[str, float]], metrics: Sequence[str] | None = None
) -> dict[str, float]:
    """The mean of each metric over the OOD splits (``{split: {metric: value}}``); NaN when there is no split.

    ``metrics`` defaults to the metrics every split has (in the order of the first split).
    """
    if metrics is None:
        first = next(iter(per_split.values()), {name: None for name in METRIC_NAMES})
        metrics = [name for name in first if all(name in values for values in per_split.values())]
    return {
        metric: float(np.mean([values[metric] for values in per_split.values()])) if per_split else math.nan
        for metric in metrics
    }


def _best(values: Sequence[float], metric: str) -> float:
    return min(values) if metric in LOWER_IS_BETTER else max(values)


def markdown_table(
    results: Mapping[str, Any], metrics: Sequence[str] = ("fpr95", "fpr95_ood_positive", "auroc")
) -> str:
    """The paper-style table: methods x (OOD splits, near / far averages, overall average), each cell the
    ``metrics`` in % (by default ``FPR95 (ID+) / FPR95 (OOD+) / AUROC``).

    Near-OOD splits come first, then far-OOD ones, then any other split. The best value of each column and
    metric is in bold. A second table lists, per method, the calibrated ``threshold``, the ID TPR it reaches
    on the ID test split and, when recorded, the selective-classification numbers.
    """
    methods: Mapping[str, Any] = results["methods"]
    if not methods:
        return "(no methods)\n"
    first = next(iter(methods.values()))
    groups = {g: [s for s in results.get("ood_groups", {}).get(g, ()) if s in first["ood"]] for g in GROUPS}
    grouped = [s for g in GROUPS for s in groups[g]]
    splits = grouped + [s for s in first["ood"] if s not in grouped]
    columns = [*splits, *(f"average_{g}" for g in GROUPS if groups[g]), "average"]
    titles = {"average": "Average", **{f"average_{g}": f"{g.capitalize()}-OOD avg." for g in GROUPS}}
    group_of = {s: g for g in GROUPS for s in groups[g]}
    arrows = {m: ("↓" if m in LOWER_IS_BETTER else "↑") for m in metrics}
    metric_label = " / ".join(f"{METRIC_LABELS.get(m, m)}{arrows[m]}" for m in metrics)

    def cell(method: str, column: str, metric: str) -> float:
        entry = methods[method]
        if column == "average":
            return entry["average"].get(metric, math.nan)
        if column.startswith("average_"):
            return entry.get("average_by_group", {}).get(column[len("average_"):], {}).get(metric, math.nan)
        return entry["ood"][column].get(metric, math.nan)

    def best(column: str, metric: str) -> float:
        values = [v for v in (cell(name, column, metric) for name in methods) if math.isfinite(v)]
        return _best(values, metric) if values else math.nan

    best_values = {(c, m): best(c, m) for c in columns for m in metrics}

    def cells(name: str) -> list[str]:
        row = [name]
        for column in columns:
            parts = []
            for metric in metrics:
                value = cell(name, column, metric)
                text = f"{100 * value:.2f}" if math.isfinite(value) else "–"
                is_best = math.isfinite(value) and np.isclose(value, best_values[(column, metric)], rtol=0, atol=1e-12)
                parts.append(f"**{text}**" if is_best else text)
            row.append(" / ".join(parts))
        return row

    data = results.get("benchmark") or (f"ID {results['id_dataset']}" if results.get("id_dataset") else None)
    def title(column: str) -> str:
        if column in titles:
            return titles[column]
        return f"{column} ({group_of[column]})" if column in group_of else column

    calibration = first.get("calibration", {})
    if calibration.get("method") == "conformal":
        rule = (f"split-conformal thresholds (TPR >= {100 * _target_tpr(methods):.0f}% on new ID data with probability "
                f">= 1 - {calibration.get('delta')})")
    else:
        rule = "thresholds"
    lines = [
        f"## OOD detection: {results.get('model')} on {data}",
        "",
        f"ID test accuracy: {100 * results['id_accuracy']:.2f}%. "
        f"Cells: {metric_label} in %. FPR95 (ID+): OOD accepted at 95% ID kept (ID = positive class, the paper's); "
        "FPR95 (OOD+): ID rejected at 95% OOD caught (OOD = positive class, OpenOOD's). "
        + _calibration_sentence(results, rule),
        "",
        *table_lines(["Method", *map(title, columns)], map(cells, methods)),
        "",
    ]
    if results.get("detector"):  # --detector: the decision as shipped
        shipped = results["detector"]
        accepted = ", ".join(f"{name} {100 * value:.2f}%" for name, value in shipped["fpr_at_threshold"].items())
        lines[4:4] = [f"Evaluated as saved: `{shipped['method']}` from {shipped['source']} at its shipped threshold "
                      f"{shipped['threshold']:.6g} (no refit, no recalibration): ID test accepted "
                      f"{100 * shipped['id_tpr_at_threshold']:.2f}%; OOD accepted (FPR at the threshold): {accepted}.", ""]
    if results.get("selection"):
        from .selection import sentence

        lines[4:4] = [sentence(results["selection"]), ""]  # above the test table: the decision first
    label_check = results.get("label_check") or {}
    unchecked = labels_note(label_check)
    if unchecked:  # above every table: the figures below rest on it
        lines[2:2] = [f"**Labels unchecked:** {unchecked}.", ""]
    elif label_check.get("status") and label_warning(label_check):  # names that do not match: the console's warning
        lines[2:2] = [f"**Labels do not match:** {label_warning(label_check)}.", ""]
    selective = all("selective" in entry for entry in methods.values())
    header = ["Method", "threshold", f"ID TPR at threshold (test, target {100 * _target_tpr(methods):.0f}%)"]
    if selective:
        header += ["accuracy on accepted ID test↑", "AURC↓"]

    def threshold_row(name: str, entry: Mapping[str, Any]) -> list[str]:
        row = [name, f"{entry['threshold']:.6g}", f"{100 * entry['id_tpr_at_threshold']:.2f}"]
        if selective:
            row += [f"{100 * entry['selective']['accuracy']:.2f}", f"{100 * entry['selective']['aurc']:.2f}"]
        return row

    lines += table_lines(header, (threshold_row(name, entry) for name, entry in methods.items()))
    if selective:
        lines += ["", "Selective classification: the base model answers only on the ID test samples the threshold "
                      "accepts (coverage = the ID TPR column); AURC = area under its risk-coverage curve (risk = "
                      "error rate of the accepted samples, ranked by ood_score), in %."]
    sizes = results.get("split_sizes")
    if sizes:
        ood_sizes = ", ".join(f"{k} {v}" for k, v in sizes.get("ood", {}).items())
        validation = f", ID validation {sizes['id_validation']}" if "id_validation" in sizes else ""
        lines += ["", f"Samples: ID test {sizes.get('id_test')}{validation}; OOD: {ood_sizes}."]
    if results.get("tuning"):
        from .tuning import markdown_lines

        lines += markdown_lines(results["tuning"])
    if results.get("selection"):
        from .selection import markdown_lines as selection_lines

        lines += selection_lines(results["selection"])
    if results.get("skipped"):
        lines += ["", "Skipped (could not be fitted or scored on this model and data; every other method is reported):"]
        lines += [f"* `{name}`: {reason}" for name, reason in results["skipped"].items()]
    if results.get("ood_same_as_id_test"):
        from .plan import same_as_test_warning

        lines += ["", f"**Warning:** {same_as_test_warning(results['ood_same_as_id_test'])}."]
    mapped = mapping_line(results.get("label_check") or {})
    if mapped:
        lines += ["", f"{mapped}."]
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


def _calibration_sentence(results: Mapping[str, Any], rule: str) -> str:
    """Where the thresholds come from: calibrated in this run on the ID split it read, or (``--detector``) the saved
    detector's own, described by its calibration record (never a split this run did not read)."""
    if results.get("detector"):
        record = results["detector"].get("calibration")
        if not record:
            return "The threshold is the saved detector's own, set by hand (no calibration record); not recalibrated."
        read = record.get("source") or (f"ID {record['split']} data" if record.get("split") else "data it does not name")
        details = ", ".join(part for part in (
            f"{record['num_samples']} samples" if record.get("num_samples") is not None else "",
            f"target ID TPR {100 * record['tpr']:.0f}%" if record.get("tpr") is not None else "") if part)
        return (f"The threshold is the saved detector's own, calibrated before this run on {read}"
                f"{f' ({details})' if details else ''}; not recalibrated.")
    first: Mapping[str, Any] = next(iter(results.get("methods", {}).values()), {})
    split = results.get("calibration_split") or (first.get("calibration") or {}).get("split")
    if split is None:  # results written without the record: say so rather than name a split
        return f"{rule[:1].upper() + rule[1:]}: the results do not record the data they were calibrated on."
    return f"{rule[:1].upper() + rule[1:]} calibrated on ID {split} only."


def _target_tpr(methods: Mapping[str, Any]) -> float:
    entry = next(iter(methods.values()))
    return float((entry.get("calibration") or {}).get("tpr", 0.95))


def write_report(output_dir: str | os.PathLike, results: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``results.md`` then ``results.json`` (last: its presence says the run finished) into ``output_dir``, each
    atomically; returns both paths."""
    output_dir = Path(output_dir)
    md_path = atomic_write_text(output_dir / RESULTS_MD, markdown_table(results), output_dir)
    json_path = write_json(output_dir / RESULTS_JSON, results, output_dir)
    return json_path, md_path


__all__ = [
    "GROUPS",
    "METRIC_LABELS",
    "REPORTED_METRICS",
    "RESULTS_JSON",
    "RESULTS_MD",
    "average_over_splits",
    "jsonable",
    "markdown_table",
    "method_results",
    "split_metrics",
    "table_lines",
    "write_json",
    "write_report",
]
