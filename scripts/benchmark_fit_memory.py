#!/usr/bin/env python
"""Peak resident memory of a fit at two numbers of fitting inputs, each measured in a fresh process, as JSON.

What a user's machine feels is the fit's peak resident memory, allocator slack included: each measurement runs in a
new Python process (``python scripts/benchmark_fit_memory.py --measure CASE METHOD N``) that builds the model, fits
one detector on ``N`` inputs and reports ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` (the process's peak RSS);
the growth between the two sizes is what the fit adds per input, the rest (Python, torch, the model) being the same.

Cases:

* ``vit``: a one-layer ViT-B/16-wide random-weight model (``hidden_size=768``, 12 heads, ``intermediate_size=3072``,
  1,000 classes) at 224 px, fitted through ``detector.fit(batches)`` on batches of 50 random images: the backbone
  pass, its transient token tensors (about 30 MB a batch) and the fit's own copies, as in a user's fit. ``forward``
  is the same loop of forwards with no fit, the reference.
* ``resnet``: ResNet-50-shaped penultimate features (2,048-d, 1,000 classes; synthetic class-conditional features,
  ReLU'd, made batch by batch) fed through the fit path (``fit_begin``, ``fit_update`` per
  :class:`~hf_gsc.detectors.backbone_pass.BackbonePass` of 50, ``fit_end``) of a model whose classifier is the
  normalised class means. One float32 copy of 20,000 such features is 156 MiB.

Single-threaded (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``).

    OMP_NUM_THREADS=1 python scripts/benchmark_fit_memory.py --output docs/results/fit_memory/fit_memory.json
    OMP_NUM_THREADS=1 python scripts/benchmark_fit_memory.py --small --output /tmp/fit_memory.json   # a minute
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path


BATCH = 50
#: case -> (methods, (small N, large N), growth limit in MiB)
CASES = {
    "vit": (("knn", "forward"), (1000, 3000), 64),
    "resnet": (("mahalanobis", "react", "vim", "conjnorm", "knn"), (4000, 24000),
               {"mahalanobis": 48, "react": 200, "vim": 200, "conjnorm": 200}),
}
SMALL = {"vit": (200, 600), "resnet": (4000, 8000)}
#: ViT cases: attention heads, MLP width, classes (hidden size 768, one layer, patch 16, 224 px). ``vit-light`` has the
#: token tensors of ``vit`` (the transient sizes that matter to the allocator) at a fraction of its arithmetic: the
#: tests' case.
VITS = {"vit": (12, 3072, 1000), "vit-light": (1, 64, 10)}
#: Feature cases: width D and classes K. ``resnet-light``: the tests' case.
FEATURES = {"resnet": (2048, 1000), "resnet-light": (1024, 100)}


def vit_model(case: str):
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    heads, width, classes = VITS[case]
    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=1,
                                               num_attention_heads=heads, intermediate_size=width,
                                               num_labels=classes)).eval()


def vit_batches(count: int, classes: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    for start in range(0, count, BATCH):
        rows = min(BATCH, count - start)
        yield torch.randn(rows, 3, 224, 224, generator=generator), torch.arange(start, start + rows) % classes


def fit_features(method: str, count: int, dim: int, classes: int) -> None:
    import torch
    from benchmark_scale import feature_model  # scripts/, on the path of a script run from it

    from hf_gsc.detectors import get_detector
    from hf_gsc.detectors.backbone_pass import BackbonePass

    class_means = 2.0 * torch.randn(classes, dim, generator=torch.Generator().manual_seed(dim))
    detector = get_detector(method, feature_model(dim, classes, class_means))
    target = (detector.split.module, detector.split.capture_input)
    generator = torch.Generator().manual_seed(1)
    detector.fit_begin()
    for start in range(0, count, BATCH):
        labels = torch.arange(start, min(start + BATCH, count)) % classes
        features = (class_means[labels] + torch.randn(labels.shape[0], dim, generator=generator)).relu_()
        # No images: an empty (B, 0) stand-in for pixel_values, the features given directly.
        detector.fit_update(BackbonePass(torch.empty(labels.shape[0], 0), None, {target: features}), labels)
    detector.fit_end()


def measure(case: str, method: str, count: int) -> dict:
    """One measurement, in this (fresh) process."""
    import torch

    torch.set_num_threads(1)
    start = time.perf_counter()
    if case in VITS:
        model, classes = vit_model(case), VITS[case][2]
        if method == "forward":
            with torch.no_grad():
                for pixel_values, _ in vit_batches(count, classes):
                    model(pixel_values=pixel_values)
        else:
            from hf_gsc import AutoOODDetector

            AutoOODDetector.from_pretrained(model, method=method).fit(vit_batches(count, classes))
    elif case in FEATURES:
        fit_features(method, count, *FEATURES[case])
    else:
        raise ValueError(f"case must be one of {sorted(VITS) + sorted(FEATURES)}, got {case!r}")
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"case": case, "method": method, "inputs": count, "peak_rss_mib": peak_kib / 1024,
            "seconds": time.perf_counter() - start}


def in_fresh_process(case: str, method: str, count: int) -> dict:
    """:func:`measure` in a new Python process (the package found as this one found it)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--measure", case, method, str(count)]
    package_root = str(Path(__import__("hf_gsc").__file__).resolve().parents[1])
    path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, help="JSON file (a .md table is written beside it)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma list of {sorted(CASES)}")
    parser.add_argument("--small", action="store_true", help=f"smaller sizes, a quick check: {SMALL}")
    parser.add_argument("--methods", help="comma list: only these methods of each case (default: every one)")
    parser.add_argument("--measure", nargs=3, metavar=("CASE", "METHOD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        case, method, count = args.measure
        print(json.dumps(measure(case, method, int(count))))
        return 0
    if args.output is None:
        parser.error("--output is required")
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {sorted(CASES)}")
    rows: list[dict] = []
    failed = []
    command = "OMP_NUM_THREADS=1 python scripts/benchmark_fit_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)
    for case in cases:
        methods, sizes, limits = CASES[case]
        sizes = SMALL[case] if args.small else sizes
        for method in methods:
            if args.methods and method not in args.methods.split(","):
                continue
            small, large = (in_fresh_process(case, method, count) for count in sizes)
            growth = large["peak_rss_mib"] - small["peak_rss_mib"]
            limit = limits if isinstance(limits, int) else limits.get(method)
            limit = None if method == "forward" else limit
            row = {"case": case, "method": method, "inputs": list(sizes),
                   "peak_rss_mib": [small["peak_rss_mib"], large["peak_rss_mib"]], "growth_mib": growth,
                   "limit_mib": None if args.small else limit,
                   "seconds": [small["seconds"], large["seconds"]]}
            rows.append(row)
            if row["limit_mib"] is not None and growth > row["limit_mib"]:
                failed.append(row)
            print(f"{case:7s} {method:12s} N={sizes[0]:6d}: {small['peak_rss_mib']:8.1f} MiB  N={sizes[1]:6d}: "
                  f"{large['peak_rss_mib']:8.1f} MiB  growth {growth:+8.1f} MiB (limit {row['limit_mib']})",
                  flush=True)
            write(args.output, command, rows)  # after every row: a long run interrupted keeps what it measured
    return 1 if failed else 0


def write(output: Path, command: str, rows: list[dict]) -> None:
    """The JSON and, beside it, its table (.md)."""
    import torch

    from hf_gsc import __version__

    results = {
        "command": command,
        "measured": "peak RSS (ru_maxrss) of a fresh process that builds the model and fits one detector on N inputs "
                    f"in batches of {BATCH}; growth = the larger N's peak minus the smaller N's",
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "hf_gsc": __version__,
                    "threads": 1},
        "rows": rows,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=1) + "\n")
    lines = [f"`{results['command']}`", "", "| case | method | inputs | peak RSS (MiB) | growth (MiB) | limit (MiB) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['case']} | {row['method']} | {row['inputs'][0]:,} → {row['inputs'][1]:,} | "
                     f"{row['peak_rss_mib'][0]:.0f} → {row['peak_rss_mib'][1]:.0f} | {row['growth_mib']:+.0f} | "
                     f"{'' if row['limit_mib'] is None else row['limit_mib']} |")
    output.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
