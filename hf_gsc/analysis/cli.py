"""Command line of ``scripts/run_ablations.py``: load reference models and benchmarks, run the grid, write results.

For each (benchmark, model): ``{output_dir}/{benchmark}_{model}.json`` (every variant's metrics per OOD split,
approximation errors, TopKRatio curves), ``.md`` (the tables) and ``_concentration.png`` (TopKRatio curves).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from ..utils.confined_files import atomic_write_text
from .ablations import DEFAULT_SPLIT, collect, markdown_tables, model_split_points, summarise, variant_grid
from .gradient_concentration import plot_curves


BENCHMARKS = ("fmnist-ood", "fmnist-openset")
ID_SPLIT = "id_test"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run_ablations.py",
        description="GSC ablations (mask ratio, operation, selection, iterative, split point, GSC+ASH), "
        "approximation error and gradient concentration on the reference models.",
    )
    parser.add_argument("--models", default="resnet,vit,swin", help="comma list of reference archs or model paths")
    parser.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    parser.add_argument("--max-samples", type=int, default=2000,
                        help="at most this many samples per data split (ID test and each OOD split), drawn "
                        "at random with --seed (default 2000)")
    parser.add_argument("--batch-size", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared machine 2 threads were several times slower)")
    parser.add_argument("--tables", default=None, help="comma list of tables to run (default: all)")
    parser.add_argument("--output-dir", default="docs/results/ablations")
    parser.add_argument("--summary-only", action="store_true",
                        help="only rewrite {output_dir}/summary.md from the JSON files already there")
    return parser


def benchmark_data(
    benchmark: str, model: torch.nn.Module, processor: Any, max_samples: int | None, batch_size: int, seed: int
) -> dict[str, DataLoader]:
    """``{"id_test": loader, "<ood split>": loader}`` subsampled as ``scripts/evaluate_ood.py`` does."""
    from ..data import load_benchmark
    from ..evaluation.loaders import make_dataloader
    from ..evaluation.models import image_transform
    from ..evaluation.plan import subset

    bench = load_benchmark(benchmark)
    splits = {ID_SPLIT: ("test", bench.id_splits["test"])}
    splits.update({name: (name, dataset) for name, dataset in bench.ood_splits.items()})
    transform = image_transform(processor, model)
    return {
        name: make_dataloader(subset(dataset, max_samples, seed, key), transform, batch_size)
        for name, (key, dataset) in splits.items()
    }


def run_one(
    model: torch.nn.Module,
    data: Mapping[str, DataLoader],
    output_dir: str | Path,
    stem: str,
    title: str,
    tables: Sequence[str] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Collect, summarise and write ``{stem}.json``, ``{stem}.md``, ``{stem}_concentration.png``; returns the summary."""
    grid = variant_grid(model)
    if tables:
        unknown = set(tables) - set(grid)
        if unknown:
            raise ValueError(f"unknown tables {sorted(unknown)}; known: {sorted(grid)}")
        grid = {name: rows for name, rows in grid.items() if name in tables}
    points = model_split_points(model)
    started = time.perf_counter()
    collected = collect(
        model, data, grid,
        approximation_split_points=(DEFAULT_SPLIT, points["two_blocks_before"]),
        concentration_split_points=(DEFAULT_SPLIT, "penultimate"),
    )
    summary = summarise(collected, grid, ID_SPLIT)
    summary["named_split_points"] = points
    summary["provenance"] = {**(provenance or {}), "seconds": round(time.perf_counter() - started, 1)}
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output_dir / f"{stem}.json", json.dumps(summary, indent=1, default=float))
    atomic_write_text(output_dir / f"{stem}.md", markdown_tables(summary, title) + "\n")
    plot_summary(summary, output_dir / f"{stem}_concentration.png", title)
    return summary


def plot_summary(summary: Mapping[str, Any], path: str | Path, title: str) -> Path:
    """TopKRatio curves (and their difference to ID) of one summary, one panel per split point."""
    curves = {point: result["curves"] for point, result in summary["gradient_concentration"].items()}
    fractions = next(iter(summary["gradient_concentration"].values()))["fractions"]
    return plot_curves(curves, fractions, path, title=f"TopKRatio: {title}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForImageClassification

    from ..data import load_image_processor
    from ..reference_models import ARCHS, reference_model_path

    if args.summary_only:
        write_summary(args.output_dir)
        return 0
    missing = []
    for benchmark in args.benchmarks.split(","):
        for name in args.models.split(","):
            try:
                path = reference_model_path(name, benchmark) if name in ARCHS else Path(name)
            except FileNotFoundError as error:
                print(f"skipping {benchmark} / {name}: {error}", flush=True)
                missing.append({"benchmark": benchmark, "model": name, "reason": str(error)})
                continue
            print(f"{benchmark} / {name} ({path})", flush=True)
            model = AutoModelForImageClassification.from_pretrained(str(path))
            processor = load_image_processor(str(path))
            data = benchmark_data(benchmark, model, processor, args.max_samples, args.batch_size, args.seed)
            stem = f"{benchmark}_{Path(str(name)).name}"
            provenance = {"benchmark": benchmark, "model": str(name), "model_path": str(path),
                          "checkpoint": checkpoint_record(Path(path)),
                          "max_samples": args.max_samples, "seed": args.seed, "threads": args.threads,
                          "torch": torch.__version__}
            run_one(model, data, args.output_dir, stem, f"{benchmark} / {name}",
                    args.tables.split(",") if args.tables else None, provenance)
            print(f"  wrote {Path(args.output_dir) / stem}.{{json,md}}", flush=True)
    if missing:
        atomic_write_text(Path(args.output_dir) / "missing.json", json.dumps(missing, indent=1))
    write_summary(args.output_dir)
    return 0


def checkpoint_record(path: Path) -> dict[str, Any]:
    """sha256 (first 16 hex digits) of ``model.safetensors`` and the test accuracy in ``training_results.json``."""
    from ..evaluation.fingerprints import file_sha256

    record: dict[str, Any] = {}
    weights = path / "model.safetensors"
    if weights.is_file():
        record["model_safetensors_sha256"] = file_sha256(weights)[:16]
    results = path / "training_results.json"
    if results.is_file():
        record["test_accuracy"] = json.loads(results.read_text()).get("test_accuracy")
    return record


def write_summary(output_dir: str | Path) -> Path:
    """``{output_dir}/summary.md`` (cross-model tables) and each result's ``.md`` and plot, from the JSON files."""
    from .report import combined_markdown, load_summaries

    summaries = load_summaries(output_dir)
    for stem, summary in summaries.items():
        title = stem.replace("_", " / ", 1)
        atomic_write_text(Path(output_dir) / f"{stem}.md", markdown_tables(summary, title) + "\n")
        plot_summary(summary, Path(output_dir) / f"{stem}_concentration.png", stem.replace("_", " / ", 1))
    path = Path(output_dir) / "summary.md"
    atomic_write_text(path, combined_markdown(summaries))
    print(f"wrote {path}")
    return path
