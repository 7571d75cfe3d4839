"""Cross-model summary of the ablation results: one compact table per paper table, one column group per model."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..evaluation.json_files import table_lines
from .gradient_concentration import TABLE_FRACTIONS, column_of


PAPER_TABLES = {
    "baseline": "baselines",
    "mask_ratio": "mask ratio (paper tab:finer_ratios / tab:shortcircuit_ablation)",
    "operation": "operation (paper tab:shortcircuit_ablation, tab:local_replacement)",
    "selection": "selection (paper tab:random_reverse_table)",
    "iterative": "iterative, one 5% budget (paper tab:iterative_shortcircuit)",
    "split_point": "split point (paper tab:layerwise_shortcircuit)",
    "gsc_ash": "GSC + ASH",
}


def load_summaries(directory: str | Path) -> dict[str, dict[str, Any]]:
    """``{stem: summary}`` of every ``{benchmark}_{model}.json`` in ``directory``, sorted."""
    return {
        path.stem: json.loads(path.read_text())
        for path in sorted(Path(directory).glob("*.json"))
        if path.stem != "missing"
    }


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}"


def _generic_row(label: str) -> str:
    """Row labels without model-specific module paths (``two blocks before the end (vit.layers.-3)`` -> ``... end``)."""
    return label.split(" (")[0] if "before the end" in label or label.startswith("two at once") else label


def combined_markdown(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """Tables ``row x model`` with ``FPR95 / AUROC / ID acc`` (mean over OOD splits, %)."""
    stems = list(summaries)
    lines = ["Cells: FPR95 / AUROC / ID accuracy (%), FPR95 and AUROC averaged over the benchmark's OOD splits.", ""]
    for table, title in PAPER_TABLES.items():
        rows: dict[str, dict[str, str]] = {}
        for stem in stems:
            summary = summaries[stem]
            for row in summary["tables"].get(table, []):
                r = summary["variants"][row["variant"]]
                rows.setdefault(_generic_row(row["row"]), {})[stem] = (
                    f"{_cell(r['mean']['fpr95'])} / {_cell(r['mean']['auroc'])} / {_cell(r['id_accuracy'])}"
                )
        if not rows:
            continue
        lines += [f"### {title}", ""]
        lines += table_lines(["row", *stems], ([label.replace("|", "\\|"), *(cells.get(s, "-") for s in stems)]
                                               for label, cells in rows.items()))
        lines.append("")

    lines += ["### approximation error |score(approx) - score(exact)| (5% zero-out), mean +- std (max)", ""]
    error_rows = []
    for stem in stems:
        for point, result in summaries[stem]["approximation_error"].items():
            acc = result.get("id_accuracy") or {}
            accuracy = " / ".join(_cell(acc.get(k)) for k in ("exact", "first_order", "predicted_logit"))
            for approximation, per_score in result["errors"].items():
                for score, groups in per_score.items():
                    errors = [f"{g['mean']:.3g} +- {g['std']:.2g} ({g['max']:.3g})" for g in (groups["ID"], groups["OOD"])]
                    error_rows.append([stem, point, approximation, score, *errors, accuracy])
    lines += table_lines(["model", "split point", "approximation", "score", "ID", "OOD",
                          "ID acc exact / first_order / predicted_logit"], error_rows)
    lines.append("")
    lines += ["### gradient concentration: mean TopKRatio(k = f n), ID vs all OOD", ""]
    concentration_rows = []
    for stem in stems:
        for point, result in summaries[stem]["gradient_concentration"].items():
            curves = result["curves"]
            id_curve = next(c for name, c in curves.items() if name.startswith("ID"))
            ood_curve = curves["OOD (all)"]
            cols = [column_of(f, result["fractions"]) for f in TABLE_FRACTIONS]
            concentration_rows.append([stem, point, *(f"{id_curve['mean'][c]:.3f} / {ood_curve['mean'][c]:.3f}"
                                                      for c in cols)])
    lines += table_lines(["model", "split point", *(f"f={100 * f:g}% ID / OOD" for f in TABLE_FRACTIONS)],
                         concentration_rows)
    lines.append("")
    return "\n".join(lines)
