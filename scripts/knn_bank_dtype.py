#!/usr/bin/env python
"""KNN's bank in float32 against float16 (``bank_dtype``) at ImageNet width: the bank's bytes, the fit's peak memory
above the stored features, the search time per 1,000 queries, and how far the float16 scores move.

The bank is built by ``KNNDetector._fit`` (normalised batch by batch into the one bank tensor) from a feature store of
synthetic ReLU features around ``K`` class means (``N`` rows, ``D`` wide, batches of 256), and searched by
:func:`hf_gsc.detectors.knn.knn_score` (what ``KNNDetector.score_batch`` calls; here without the bank's squared norms
precomputed, so each call takes them chunk by chunk: ``N D`` more work, 1/250 of the search) in batches of 250
queries, one thread; the two searches alternate, each repeated, and the median is kept (CPU seconds of the one
thread, and wall-clock seconds).

Example::

    python scripts/knn_bank_dtype.py --output docs/results/scale/knn_bank_dtype.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch


FIT_BATCH = 256
SCORE_BATCH = 250


def main(argv: list[str] | None = None) -> dict:
    from benchmark_scale import measured  # the scale benchmark's peak above the resident memory (this folder)
    from transformers import ViTConfig, ViTForImageClassification

    from hf_gsc import __version__
    from hf_gsc.detectors import get_detector
    from hf_gsc.detectors.knn import knn_score
    from hf_gsc.detectors.penultimate import FeatureStore

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=50_000, help="bank rows N")
    parser.add_argument("--dim", type=int, default=2048, help="feature width D")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--queries", type=int, default=1000)
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    means = torch.randn(args.classes, args.dim, generator=generator)

    def synthetic(count: int) -> torch.Tensor:
        labels = torch.randint(args.classes, (count,), generator=generator)
        return torch.relu(means[labels] + torch.randn(count, args.dim, generator=generator))

    store = FeatureStore()
    for start in range(0, args.size, FIT_BATCH):
        rows = min(FIT_BATCH, args.size - start)
        store.update(synthetic(rows), torch.zeros(rows, dtype=torch.long))
    queries = synthetic(args.queries)
    # The smallest model with a D-wide penultimate feature: only its feature width is read (the bank comes from the store).
    model = ViTForImageClassification(ViTConfig(image_size=4, patch_size=4, num_channels=1, hidden_size=args.dim,
                                                num_hidden_layers=0, num_attention_heads=1, intermediate_size=1,
                                                num_labels=args.classes)).eval()
    runs: dict = {}
    banks = {}
    for bank_dtype in ("float32", "float16"):
        detector = get_detector("knn", model, k=args.k, bank_dtype=bank_dtype)
        _, fit_seconds, fit_peak = measured(lambda: detector._fit(store))
        banks[bank_dtype] = detector.bank
        runs[bank_dtype] = {"bank_dtype": str(detector.bank.dtype), "bank_bytes": detector.bank.nbytes,
                            "fit_seconds": fit_seconds, "fit_peak_bytes_above_store": fit_peak}

    def search(bank: torch.Tensor) -> torch.Tensor:
        return torch.cat([knn_score(queries[i:i + SCORE_BATCH], bank, args.k)
                          for i in range(0, args.queries, SCORE_BATCH)])

    scores, wall, cpu = {}, {name: [] for name in banks}, {name: [] for name in banks}
    with torch.no_grad():
        for name, bank in banks.items():  # also the warm-up
            scores[name], _, runs[name]["search_peak_bytes"] = measured(lambda: search(bank))
        for _ in range(args.repeats):  # alternated, so that a load from other jobs falls on both alike
            for name, bank in banks.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                search(bank)
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    per_1000 = 1000 / args.queries
    for name in banks:
        # CPU seconds of the one thread: what the search costs, less sensitive than the wall clock to other jobs
        # on the shared machine (both are kept).
        runs[name]["search_cpu_seconds_per_1000"] = float(np.median(cpu[name])) * per_1000
        runs[name]["search_wall_seconds_per_1000"] = float(np.median(wall[name])) * per_1000
        runs[name]["search_cpu_seconds_per_1000_each_repeat"] = [t * per_1000 for t in cpu[name]]
        runs[name]["search_wall_seconds_per_1000_each_repeat"] = [t * per_1000 for t in wall[name]]
        print(name, json.dumps(runs[name]), file=sys.stderr, flush=True)
    moved = (scores["float16"] - scores["float32"]).abs()
    results = {
        "command": "python scripts/knn_bank_dtype.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {"size": args.size, "dim": args.dim, "classes": args.classes, "queries": args.queries, "k": args.k,
                     "fit_batch": FIT_BATCH, "score_batch": SCORE_BATCH, "repeats": args.repeats,
                     "threads": torch.get_num_threads()},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__, "hf_gsc": __version__,
                    "note": "measured with 1 thread on a 2-core machine shared with other jobs"},
        "runs": runs,
        "float16_over_float32": {
            "bank_bytes": runs["float16"]["bank_bytes"] / runs["float32"]["bank_bytes"],
            **{key: runs["float16"][key] / runs["float32"][key]
               for key in ("search_cpu_seconds_per_1000", "search_wall_seconds_per_1000")}},
        "score_difference": {"max_abs": moved.max().item(), "mean_abs": moved.mean().item(),
                             "bound_2_pow_minus_11": 2.0 ** -11,
                             "score_range": [scores["float32"].min().item(), scores["float32"].max().item()]},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
