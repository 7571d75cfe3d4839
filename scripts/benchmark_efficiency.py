#!/usr/bin/env python
"""Relative wall time and peak memory of GSC and baselines versus MSP (issue: efficiency study).

Methods are interleaved (every repeat runs each method once, in a rotating order), timed after a
warm-up with a fixed number of threads, and summarised by the median. Peak memory is the high-water
mark of tensor memory allocated during one call, read from the torch profiler's memory events on CPU
(``torch.cuda.max_memory_allocated`` on GPU). Results go to a JSON file; nothing here asserts a speed.

Example::

    python scripts/benchmark_efficiency.py --models resnet,vit,swin --batch-sizes 1,16,64 \\
        --output docs/results/efficiency.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from hf_gsc import GSCForImageClassification, __version__
from hf_gsc.detectors import get_detector
from hf_gsc.reference_models import reference_model_path
from transformers import AutoModelForImageClassification

GSC_APPROXIMATIONS = ("exact", "first_order", "predicted_logit")


def _methods(model: torch.nn.Module, split_point: str) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    methods: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for name in ("msp", "energy", "odin"):
        detector = get_detector(name, model)
        methods[name] = detector.score
    for approximation in GSC_APPROXIMATIONS:
        gsc = GSCForImageClassification(model, split_point=split_point, approximation=approximation)
        methods[f"gsc_{approximation}"] = lambda x, gsc=gsc: gsc(x).ood_score
    return methods


def _peak_memory_bytes(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int:
    """Peak of (allocated - freed) tensor bytes during one call."""
    if x.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        function(x)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        function(x)
    events = sorted(
        (event for event in profiler.events() if getattr(event, "cpu_memory_usage", 0)),
        key=lambda event: event.time_range.start,
    )
    current = peak = 0
    for event in events:
        current += event.cpu_memory_usage
        peak = max(peak, current)
    return peak


def _time_once(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> float:
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        function(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def benchmark_model(
    model: torch.nn.Module, batch_size: int, repeats: int, warmup: int, split_point: str, device: str
) -> dict:
    config = model.config
    channels = config.num_channels
    size = getattr(config, "image_size", 28)
    size = size if isinstance(size, int) else size[0]
    x = torch.randn(batch_size, channels, size, size, generator=torch.Generator().manual_seed(0)).to(device)
    methods = _methods(model, split_point)
    names = list(methods)
    for _ in range(warmup):
        for name in names:
            _time_once(methods[name], x)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(repeats):
        # Rotate the order so that no method always runs first (cache and frequency effects).
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            times[name].append(_time_once(methods[name], x))
    memory = {name: _peak_memory_bytes(methods[name], x) for name in names}
    msp_time, msp_memory = statistics.median(times["msp"]), memory["msp"]
    return {
        name: {
            "median_seconds": statistics.median(times[name]),
            "relative_time": statistics.median(times[name]) / msp_time,
            "peak_memory_bytes": memory[name],
            "relative_memory": memory[name] / msp_memory if msp_memory else None,
        }
        for name in names
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet,vit,swin",
                        help="comma list of reference model names (resnet, vit, swin) or model paths")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--split-points", default="final_encoder_output",
                        help="comma list of split points to benchmark GSC at (e.g. final_encoder_output,vit.layers.-3)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)

    results: dict = {
        "versions": {"hf_gsc": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": {"processor": platform.processor() or platform.machine(), "threads": args.threads,
                    "device": args.device},
        "settings": vars(args),
        "models": {},
    }
    for name in args.models.split(","):
        path = reference_model_path(name) if name in ("resnet", "vit", "swin") else name
        model = AutoModelForImageClassification.from_pretrained(path).to(args.device).eval()
        results["models"][name] = {}
        for split_point in args.split_points.split(","):
            try:
                GSCForImageClassification(model, split_point=split_point)
            except ValueError as error:
                print(f"skipping split point {split_point!r} for {name}: {error}", file=sys.stderr)
                continue
            for batch_size in (int(b) for b in args.batch_sizes.split(",")):
                row = benchmark_model(model, batch_size, args.repeats, args.warmup, split_point, args.device)
                results["models"][name].setdefault(split_point, {})[str(batch_size)] = row
                summary = ", ".join(f"{m} {r['relative_time']:.2f}x" for m, r in row.items())
                print(f"{name} {split_point} batch {batch_size}: {summary}", flush=True)
                # Written after every cell so an interrupted run keeps what it measured.
                output.write_text(json.dumps(results, indent=2))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
