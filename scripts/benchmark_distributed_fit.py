#!/usr/bin/env python
"""A fit-heavy evaluation on the CPU on 1 process against 2 processes, one thread each: the fit phase and the whole
run, and whether both runs fitted and scored the same.

Each configuration is a whole ``hf-gsc evaluate`` run in a subprocess with ``OMP_NUM_THREADS=1`` into a fresh output
folder: ``python -m hf_gsc evaluate ...`` for 1 process, ``accelerate launch --multi_gpu --num_processes 2`` with
``ACCELERATE_USE_CPU=1`` for 2. The data is the offline Fashion-MNIST benchmark (``fmnist-ood``, ``make install-data``)
and the model a shipped reference classifier (``hf_gsc/reference_models/``); the default methods fit on 12,000 ID
train images (KNN, Mahalanobis and ViM in one pass) and Energy needs no fit; one OOD split (``mnist``) by default,
since every process generates the benchmark's splits, one after the other (the main process first). The runs are interleaved in rounds (each
round runs both, in a rotating order) because a shared machine's speed drifts; the JSON holds every round and the
medians. Figures:

* ``fit``: the wall time of the fit passes (``fit.json``'s ``seconds``, one per pass, on the main process:
  loading, the backbone on the process's share, gathering and every method's ``fit_end``);
* ``total``: ``results.json``'s ``seconds.total`` (the whole evaluation, in the process); ``wall``: the subprocess,
  interpreter and ``accelerate launch`` included;
* ``peak_memory_mib_per_process``: each process's peak resident memory once its fit passes were over, by rank
  (``fit.json``'s ``peak_memory_bytes_per_process``, the largest over the passes: model, data loader and the fit);
* equality: the largest absolute difference between the two runs' saved fitted tensors
  (``detectors/*/detector_state.safetensors``) and between their score files (``scores/*/*.safetensors``).

Targets (checked, recorded, never asserted): fit on 2 processes at most 0.65x the 1-process fit, and the whole run
faster.

Example::

    python scripts/benchmark_distributed_fit.py --output docs/results/distributed_fit/cpu2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf_gsc import __version__
from hf_gsc.reference_models import reference_model_path


REPO = Path(__file__).resolve().parents[1]
#: Targets of the 2-process run against the 1-process one.
MAX_FIT_RATIO = 0.65
MAX_TOTAL_RATIO = 1.0


def evaluate_argv(args: argparse.Namespace, output_dir: Path) -> list[str]:
    return ["evaluate", "--model", str(reference_model_path(args.arch)), "--benchmark", "fmnist-ood",
            "--ood-splits", args.ood_splits, "--methods", args.methods, "--max-fit-samples", str(args.max_fit_samples),
            "--max-samples", str(args.max_samples), "--batch-size", str(args.batch_size), "--num-workers", "0",
            "--no-plots", "--output-dir", str(output_dir)]


def free_port() -> int:
    with socket.socket() as probe:  # accelerate's default port may be held by another run
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(num_processes: int, args: argparse.Namespace, output_dir: Path) -> dict:
    """One evaluation on ``num_processes`` CPU processes of one thread each; its timings."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if num_processes == 1:
        command = [sys.executable, "-m", "hf_gsc", *evaluate_argv(args, output_dir)]
    else:
        env["ACCELERATE_USE_CPU"] = "1"
        command = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes",
                   str(num_processes), "--num_machines", "1", "--main_process_port", str(free_port()),
                   "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "hf_gsc",
                   *evaluate_argv(args, output_dir)]
    begin = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    wall = time.perf_counter() - begin
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    results = json.loads((output_dir / "results.json").read_text())
    passes = {}
    for path in sorted((output_dir / "detectors").glob("*/fit.json")):
        info = json.loads(path.read_text())
        passes[tuple(info["fitted_together"])] = info
    return {"num_processes": results["num_processes"], "wall": round(wall, 3), "total": results["seconds"]["total"],
            "fit": round(sum(info["seconds"] for info in passes.values()), 3),
            "fit_images_per_process": [sum(info["images_per_process"][rank] for info in passes.values())
                                       for rank in range(num_processes)],
            # Each process's peak resident memory once its fit passes were over (model, data loader and the fit).
            "peak_memory_mib_per_process": [round(max(info["peak_memory_bytes_per_process"][rank]
                                                      for info in passes.values()) / 2**20, 1)
                                            for rank in range(num_processes)]}


def max_difference(one: Path, two: Path, pattern: str) -> tuple[float, int]:
    """``(largest absolute difference, number of files)`` over the floating tensors of the files matching
    ``pattern`` in the two output folders (every file must be in both, with the same tensors and shapes)."""
    from safetensors.torch import load_file

    largest, files = 0.0, sorted(one.glob(pattern))
    if not files:
        raise RuntimeError(f"no {pattern} in {one}")
    for path in files:
        a, b = load_file(str(path)), load_file(str(two / path.relative_to(one)))
        if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
            raise RuntimeError(f"{path.relative_to(one)}: different tensors or shapes in the two runs")
        for key in a:
            if a[key].is_floating_point():
                largest = max(largest, float((a[key].double() - b[key].double()).abs().max()) if a[key].numel() else 0.0)
            elif not torch.equal(a[key], b[key]):
                raise RuntimeError(f"{path.relative_to(one)}: {key} differs between the runs")
    return largest, len(files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arch", default="resnet", choices=("resnet", "vit", "swin"))
    parser.add_argument("--methods", default="knn,mahalanobis,vim,energy")
    parser.add_argument("--max-fit-samples", type=int, default=12000, help="ID train images of the fit")
    parser.add_argument("--max-samples", type=int, default=500, help="rows of each scored split")
    parser.add_argument("--ood-splits", default="mnist",
                        help="OOD splits of fmnist-ood (one by default: each is generated on every process)")
    parser.add_argument("--batch-size", type=int, default=250)
    parser.add_argument("--output", required=True, help="JSON file to write")
    args = parser.parse_args()

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.rounds):
            order = (1, 2) if index % 2 == 0 else (2, 1)
            measured = {}
            for num_processes in order:
                measured[num_processes] = run(num_processes, args, Path(tmp) / f"round{index}" / f"p{num_processes}")
                print(f"round {index}: {num_processes} process(es): {measured[num_processes]}", file=sys.stderr)
            one, two = (Path(tmp) / f"round{index}" / f"p{n}" for n in (1, 2))
            fit_difference, fit_files = max_difference(one, two, "detectors/*/detector_state.safetensors")
            score_difference, score_files = max_difference(one, two, "scores/*/*.safetensors")
            rounds.append({"one_process": measured[1], "two_processes": measured[2],
                           "fit_ratio": round(measured[2]["fit"] / measured[1]["fit"], 3),
                           "total_ratio": round(measured[2]["total"] / measured[1]["total"], 3),
                           "max_abs_difference": {"fitted_state": fit_difference, "fitted_state_files": fit_files,
                                                  "scores": score_difference, "score_files": score_files}})

    def median(configuration: str, figure: str) -> float:
        return statistics.median(r[configuration][figure] for r in rounds)

    fit_ratio = statistics.median(r["fit_ratio"] for r in rounds)
    total_ratio = statistics.median(r["total_ratio"] for r in rounds)
    summary = {
        "median_seconds": {configuration: {figure: median(configuration, figure) for figure in ("fit", "total", "wall")}
                           for configuration in ("one_process", "two_processes")},
        "median_peak_memory_mib_per_process": {
            configuration: [statistics.median(r[configuration]["peak_memory_mib_per_process"][rank] for r in rounds)
                            for rank in range(len(rounds[0][configuration]["peak_memory_mib_per_process"]))]
            for configuration in ("one_process", "two_processes")},
        "median_fit_ratio": fit_ratio,
        "median_total_ratio": total_ratio,
        "max_abs_difference": {key: max(r["max_abs_difference"][key] for r in rounds)
                               for key in ("fitted_state", "scores")},
        "targets": {"fit_ratio_at_most": MAX_FIT_RATIO, "fit_met": fit_ratio <= MAX_FIT_RATIO,
                    "total_ratio_below": MAX_TOTAL_RATIO, "total_met": total_ratio < MAX_TOTAL_RATIO},
        "rounds": rounds,
        "setup": {"benchmark": "fmnist-ood", "model": f"hf_gsc/reference_models/{args.arch}", "threads_per_process": 1,
                  **{k: v for k, v in vars(args).items() if k != "output"}},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "load_average_after": os.getloadavg()},
        "versions": {"hf_gsc": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "command": " ".join(["python", "scripts/benchmark_distributed_fit.py", *sys.argv[1:]]),
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: summary[k] for k in ("median_seconds", "median_peak_memory_mib_per_process", "median_fit_ratio",
                                              "median_total_ratio",
                                              "max_abs_difference", "targets")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
