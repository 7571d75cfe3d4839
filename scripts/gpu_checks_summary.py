#!/usr/bin/env python
"""summary.json and cost_tables.md of a ``scripts/gpu_checks.sh`` run: each step's command, exit status and seconds,
and what the issue asks of each check next to its target. Reads ``DIR/details`` (steps.tsv and the steps' outputs);
a step that wrote nothing is reported as missing, never guessed."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path


TARGETS = {
    "gsc_time_relative_to_msp_at_most": 1.05,
    "gsc_peak_memory_relative_to_msp_at_most": 1.10,
    "vit_end_to_end_relative_to_model_only_at_least": 0.8,
    # scripts/benchmark_compiled.py in bf16: GSC over MSP at batch 64 and at batch 1 (latency), eager or compiled.
    "gsc_bf16_batch64_relative_to_msp_at_most": 1.02,
    "gsc_bf16_batch1_latency_relative_to_msp_at_most": 1.10,
}
EVALUATIONS = ("eval_device_fp32", "eval_device_bf16", "eval_cpu_fp32")
#: The one-pass table against KNN alone: on the small random ViT, and on a random ViT-B/16.
SHARED_PASSES = ("shared_pass", "shared_pass_vit_b16")
#: The benchmark_efficiency.py steps whose tables go into cost_tables.md.
COST_STEPS = ("cost_fp32", "cost_bf16", "per_channel_fp32", "per_channel_bf16")


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def steps(details: Path) -> list[dict]:
    rows = []
    for line in (details / "steps.tsv").read_text().splitlines():
        name, status, seconds, limit, command = (line.split("\t", 4) + [""] * 5)[:5]
        rows.append({"name": name, "command": command, "exit_status": int(status) if status.isdigit() else status,
                     "seconds": int(seconds), "limit_seconds": int(limit), "timed_out": status in ("124", "137"),
                     "log": f"details/logs/{name}.log"})
    return rows


def evaluation(results: dict) -> dict:
    scored = results["seconds"]["splits_scored"]
    return {
        "device": results["device"], "mixed_precision": results["mixed_precision"],
        "num_workers": results["num_workers"], "image_backend": results["image_backend"],
        "id_accuracy": results["id_accuracy"], "seconds_total": results["seconds"]["total"],
        "images_per_second": {split: row["images_per_second"] for split, row in scored.items()},
        "average": {method: {"auroc": row["average"]["auroc"], "fpr95": row["average"]["fpr95"]}
                    for method, row in results["methods"].items()},
    }


def against_cpu(device_run: dict, cpu_run: dict) -> dict:
    """Per method: the device run's average AUROC and FPR95 minus the CPU run's, and the largest absolute gap."""
    gaps = {method: {metric: row[metric] - cpu_run["average"][method][metric] for metric in ("auroc", "fpr95")}
            for method, row in device_run["average"].items() if method in cpu_run["average"]}
    largest = {metric: max((abs(gap[metric]) for gap in gaps.values()), default=None) for metric in ("auroc", "fpr95")}
    return {"difference": gaps, "largest_absolute": largest}


def cost(results: dict) -> dict:
    """model -> batch -> GSC approximation -> time and peak memory relative to MSP, and whether each meets its target."""
    out: dict = {}
    for model, per_split in results["models"].items():
        for split_point, per_batch in per_split.items():
            for batch, row in per_batch.items():
                msp = row["msp"]
                cell = out.setdefault(model, {}).setdefault(f"{split_point}, batch {batch}", {
                    "msp": {"median_ms": round(1000 * msp["median_seconds"], 3),
                            "peak_memory_mib": round(msp["peak_memory_bytes"] / 2**20, 2)}})
                for method, measured in row.items():
                    if not method.startswith("gsc_"):
                        continue
                    time, memory = measured["relative_time"], measured["relative_memory"]
                    cell[method] = {
                        "relative_time": round(time, 4), "relative_time_paired": round(measured["relative_time_paired"], 4),
                        "relative_memory": None if memory is None else round(memory, 4),
                        "time_target_met": time <= TARGETS["gsc_time_relative_to_msp_at_most"],
                        "memory_target_met": None if memory is None
                        else memory <= TARGETS["gsc_peak_memory_relative_to_msp_at_most"],
                    }
    return out


def per_channel_step(*results: dict | None) -> dict:
    """model -> batch -> GSC approximation, for the heads whose step runs per channel (``--per-coordinate
    --step-alone`` runs): GSC's time relative to MSP per channel and on every coordinate, the step alone both ways
    (median ms) and whether the two give the same masks and how far apart their scores are."""
    out: dict = {}
    for result in results:
        for model, per_split in (result or {}).get("models", {}).items():
            for split_point, per_batch in per_split.items():
                for batch, row in per_batch.items():
                    for method, measured in row.items():
                        alone = measured.get("step_alone")
                        if alone is None:
                            continue
                        coordinate = row.get(f"{method}_per_coordinate", {})
                        out.setdefault(model, {}).setdefault(f"{split_point}, batch {batch}", {})[method] = {
                            "relative_time_paired": round(measured["relative_time_paired"], 4),
                            "relative_time_paired_per_coordinate": round(coordinate["relative_time_paired"], 4)
                            if coordinate else None,
                            "step_ms": round(1000 * alone["per_channel_median_seconds"], 3),
                            "step_ms_per_coordinate": round(1000 * alone["per_coordinate_median_seconds"], 3),
                            "masks_equal": alone["masks_equal"],
                            "max_abs_score_difference": alone["max_abs_score_difference"],
                        }
    return out


def compiled(results: dict | None) -> dict | None:
    """Per model and batch size of scripts/benchmark_compiled.py: GSC / MSP eager and compiled, the median ms of
    each, and whether the batch-64 or batch-1 target is met (by the better of eager and compiled)."""
    if results is None:
        return None
    limits = {"64": TARGETS["gsc_bf16_batch64_relative_to_msp_at_most"],
              "1": TARGETS["gsc_bf16_batch1_latency_relative_to_msp_at_most"]}
    out: dict = {}
    for model, batches in results.get("models", {}).items():
        if "error" in batches:
            out[model] = batches
            continue
        out[model] = {}
        for batch, row in batches.items():
            cell = {"gsc_over_msp": row["gsc_over_msp"], "median_ms": row["median_ms"],
                    "first_call_seconds": row["first_call_seconds"],
                    "max_abs_score_difference_compiled_vs_eager": row["max_abs_score_difference_compiled_vs_eager"]}
            if batch in limits:
                cell["met"] = min(row["gsc_over_msp"].values()) <= limits[batch]
            out[model][batch] = cell
    return out


def summarize(directory: Path, mode: str, seconds: int) -> dict:
    details = directory / "details"
    findings: dict = {}
    environment = details / "logs" / "environment.log"
    findings["environment"] = {
        "nvidia_smi": (details / "nvidia-smi.txt").read_text().strip() if (details / "nvidia-smi.txt").exists() else None,
        "pip_freeze": (details / "pip-freeze.txt").read_text().split() if (details / "pip-freeze.txt").exists() else [],
        "python": next((json.loads(line) for line in reversed(environment.read_text().splitlines())
                        if line.startswith("{")), None) if environment.exists() else None,
    }
    tests_log = details / "logs" / "device_tests.log"
    if tests_log.exists():
        lines = [line for line in tests_log.read_text().splitlines() if line.strip()]
        findings["device_tests"] = {"last_line": lines[-1] if lines else "", "skipped": [line for line in lines if "SKIP" in line]}
    runs = {name: evaluation(r) for name in EVALUATIONS if (r := _json(details / name / "results.json"))}
    missing = [name for name in EVALUATIONS if name not in runs]
    findings["evaluation"] = {"runs": runs, "missing": missing}
    if "eval_cpu_fp32" in runs:
        findings["evaluation"]["against_cpu_fp32"] = {
            name: against_cpu(runs[name], runs["eval_cpu_fp32"]) for name in runs if name != "eval_cpu_fp32"}
    findings["cost"] = {precision: cost(r) if (r := _json(details / f"cost_{precision}.json")) else None
                        for precision in ("fp32", "bf16")}
    findings["per_channel_step"] = {
        precision: per_channel_step(_json(details / f"cost_{precision}.json"),
                                    _json(details / f"per_channel_{precision}.json")) or None
        for precision in ("fp32", "bf16")}
    findings["compiled_bf16"] = compiled(_json(details / "compiled_bf16.json"))
    loading = _json(details / "data_loading.json")
    findings["data_loading"] = None if loading is None else {
        key: loading[key] for key in ("model", "device", "workers", "batch_size", "mixed_precision",
                                      "images_per_second", "target", "jpeg_draft")
        if key in loading}
    for name in SHARED_PASSES:
        shared = _json(details / f"{name}.json")
        findings[name] = None if shared is None else {
            key: shared[key] for key in ("median_seconds", "all_relative_to_knn", "all_relative_to_msp", "target",
                                         "knn_scores_equal_alone_and_together", "setup") if key in shared}
    return {
        "mode": mode, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "wall_seconds": seconds,
        "targets": TARGETS, "steps": steps(details), "findings": findings,
    }


def report(summary: dict) -> str:
    """A few lines for the console (the device tool shows the end of the output)."""
    lines = [f"summary ({summary['mode']}, {summary['wall_seconds']} s):"]
    lines += [f"  {s['name']}: exit {s['exit_status']} in {s['seconds']} s" for s in summary["steps"]]
    findings = summary["findings"]
    if "device_tests" in findings:
        lines.append(f"  device tests: {findings['device_tests']['last_line']}")
    for name, run in findings["evaluation"]["runs"].items():
        rates = run["images_per_second"].values()
        averages = ", ".join(f"{m} {r['auroc']:.4f}/{r['fpr95']:.3f}" for m, r in run["average"].items())
        lines.append(f"  {name}: {run['device']} {run['mixed_precision']}, {min(rates):.0f}-{max(rates):.0f} img/s; "
                     f"AUROC/FPR95 {averages}")
    for name, comparison in findings["evaluation"].get("against_cpu_fp32", {}).items():
        lines.append(f"  {name} vs cpu fp32: largest |AUROC gap| {comparison['largest_absolute']['auroc']:.2g}, "
                     f"|FPR95 gap| {comparison['largest_absolute']['fpr95']:.2g}")
    for precision, models in findings["cost"].items():
        for model, cells in (models or {}).items():
            for cell, row in cells.items():
                gsc = ", ".join(f"{m[4:]} {r['relative_time']:.2f}x/{r['relative_memory'] or 0:.2f}x mem"
                                for m, r in row.items() if m != "msp")
                lines.append(f"  cost {precision} {model} ({cell}, MSP {row['msp']['median_ms']:.1f} ms): {gsc}")
    for precision, models in findings["per_channel_step"].items():
        for model, cells in (models or {}).items():
            for cell, row in cells.items():
                steps = ", ".join(f"{m[4:]} {r['step_ms']:.2f} vs {r['step_ms_per_coordinate']:.2f} ms, masks "
                                  f"{'equal' if r['masks_equal'] else 'DIFFER'}" for m, r in row.items())
                lines.append(f"  per-channel step {precision} {model} ({cell}): {steps}")
    for model, batches in (findings.get("compiled_bf16") or {}).items():
        for batch, cell in batches.items():
            if isinstance(cell, dict) and "gsc_over_msp" in cell:
                lines.append(f"  compiled bf16 {model} batch {batch}: GSC/MSP eager {cell['gsc_over_msp']['eager']:.2f}x, "
                             f"compiled {cell['gsc_over_msp']['compiled']:.2f}x; met: {cell.get('met', '-')}")
    if findings["data_loading"] and "target" in findings["data_loading"]:
        lines.append(f"  data loading: {findings['data_loading']['target']}")
    for name in SHARED_PASSES:
        if findings.get(name):
            lines.append(f"  {name}: one-pass methods vs KNN alone: {findings[name].get('all_relative_to_knn')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path, help="the folder gpu_checks.sh wrote (holding details/)")
    parser.add_argument("--mode", default="gpu")
    parser.add_argument("--seconds", type=int, default=0, help="the whole run's wall time so far")
    args = parser.parse_args(argv)
    summary = summarize(args.directory, args.mode, args.seconds)
    (args.directory / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    tables = [(args.directory / "details" / f"{name}.md") for name in COST_STEPS]
    (args.directory / "cost_tables.md").write_text("\n".join(t.read_text() for t in tables if t.exists()))
    print(report(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
