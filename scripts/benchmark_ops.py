#!/usr/bin/env python
"""ATen ops and host reads per forward: the base model's forward against every one-pass method's, as JSON.

A GPU runs each ATen op as at least one kernel launch, and each host read of a tensor's value (``Tensor.item``,
``bool(t)``, ``torch.equal``, ``nonzero``: the ops ``_local_scalar_dense``, ``equal``, ``is_nonzero``, ``nonzero``)
makes the host wait for the device. What a detector adds to a plain forward in both is its cost where arithmetic
is cheap (bf16 on a GPU, batch 1). Both are counted here on the CPU, with a ``TorchDispatchMode`` that sees every
op dispatched in one eager call (``model(pixel_values=x)`` under ``no_grad`` for the base model, ``detector(x)``
for each method); they do not depend on the number of pixels, so small inputs give the counts of 224 px ones
(ViT-B/16 at 32 px: 4 patches; ResNet-50 at 64 px; Swin-T at 224 px, where its windows are those of serving).

Models: random-weight ResNet-50, ViT-B/16 and Swin-T (transformers' default configs, 1000 classes). Fitted
methods get random fitted state of the shapes they expect (counts do not depend on the values; no path in a
forward branches on them). Single-threaded; nothing is timed.

    python scripts/benchmark_ops.py --output docs/results/ops/ops_per_forward.json
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_gsc import AutoOODDetector, __version__
from hf_gsc.detectors import DETECTORS


HOST_READS = ("_local_scalar_dense", "equal", "is_nonzero", "nonzero")
#: name -> (config class, model class, input side in pixels, config overrides)
MODELS = {
    "resnet-50": ("ResNetConfig", "ResNetForImageClassification", 64, {}),
    "vit-b16": ("ViTConfig", "ViTForImageClassification", 32, {"image_size": 32}),
    "swin-t": ("SwinConfig", "SwinForImageClassification", 224, {}),
}
GSC_VARIANTS = {"gsc": {}, "gsc_exact": {"approximation": "exact"}, "gsc_predicted_logit": {"approximation": "predicted_logit"}}


class OpCounter(TorchDispatchMode):
    """Counts every ATen op dispatched (by name) and the host reads among them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def host_reads(self) -> dict[str, int]:
        return {name: self.ops[name] for name in HOST_READS if self.ops[name]}


def build_model(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers

    config_name, model_name, side, overrides = MODELS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(num_labels=1000, **overrides)).eval()
    model.config.image_size = side  # ResNet's config has no image size
    x = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(1))
    return model, x


def random_state(detector) -> dict[str, torch.Tensor]:
    """Fitted tensors of the shapes ``detector`` expects (an unknown dimension, a bank's rows: 64), positive values."""
    generator = torch.Generator().manual_seed(2)
    state = {name: torch.rand(*[64 if size is None else size for size in shape], generator=generator,
                              dtype=torch.float64) + 0.5
             for name, shape in detector.expected_state().items()}
    # States that record the percentiles they were fitted at (VRA's, BFAct's) are checked against the settings at
    # load: they hold those settings.
    for name, keys in {"percentiles": ("percentile_low", "percentile_high"), "percentile": ("percentile",)}.items():
        if name in state and all(key in detector.hyperparameters for key in keys):
            state[name] = torch.tensor([float(detector.hyperparameters[key]) for key in keys], dtype=torch.float64)
    return state


def counted(call) -> OpCounter:
    with torch.no_grad(), OpCounter() as counter:
        call()
    return counter


def measure(name: str) -> dict:
    model, x = build_model(name)
    call = lambda: model(pixel_values=x)  # noqa: E731
    call()  # warm-up: lazy initialisation is no part of a forward
    base = counted(call)
    rows = {"base_model": {"ops": base.total, "host_reads": base.host_reads}}
    methods = {m: {} for m in sorted(DETECTORS) if DETECTORS[m].one_pass and m != "gsc"} | GSC_VARIANTS
    for method, settings in sorted(methods.items()):
        try:  # a method that does not apply to this model (BATS without a BatchNorm) is refused when built: recorded
            detector = AutoOODDetector.from_pretrained(model, method=method.split("_")[0] if method.startswith("gsc_")
                                                       and method != "gsc_ash" else method, **settings)
        except ValueError as refusal:
            rows[method] = {"refused": str(refusal)}
            continue
        try:
            if detector.needs_fit:
                detector.load_fitted_state(random_state(detector), "random state")
            detector.config.threshold = 0.0
            detector(x)  # warm-up (caches of the head's folded form, of the mask sizes)
            counter = counted(lambda: detector(x))
        except Exception as error:  # noqa: BLE001 - recorded, the other methods go on
            rows[method] = {"error": f"{type(error).__name__}: {error}"}
            continue
        added = counter.ops - base.ops
        rows[method] = {"ops": counter.total, "added_ops": counter.total - base.total,
                        "host_reads": counter.host_reads,
                        "most_added": dict(added.most_common(8))}
        print(f"{name:10s} {method:22s} ops {counter.total:5d} ({counter.total - base.total:+5d}) "
              f"host reads {sum(counter.host_reads.values())}", flush=True)
    return {"input_shape": list(x.shape), "methods": rows}


def table(results: dict) -> str:
    models = list(results["models"])
    lines = ["| method | " + " | ".join(f"{m}: ops (added)" for m in models) + " | host reads |",
             "|---|" + "---|" * (len(models) + 1)]
    methods = list(results["models"][models[0]]["methods"])
    for method in methods:
        cells, reads = [], set()
        for model in models:
            row = results["models"][model]["methods"].get(method, {})
            if "error" in row or "refused" in row:
                cells.append("error" if "error" in row else "refused: does not apply")
                continue
            cells.append(str(row["ops"]) if method == "base_model" else f"{row['ops']} (+{row['added_ops']})")
            reads.add(sum(row["host_reads"].values()))
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {', '.join(map(str, sorted(reads)))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {sorted(MODELS)}")
    parser.add_argument("--output", type=Path, required=True, help="JSON file (a .md table is written beside it)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    models = args.models.split(",")
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    results = {
        "command": "python scripts/benchmark_ops.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "counted": "ATen ops dispatched in one eager forward (TorchDispatchMode), batch 2, float32, CPU, 1 thread; "
                   f"host reads: {list(HOST_READS)}",
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "hf_gsc": __version__,
                    "threads": 1},
        "models": {name: measure(name) for name in models},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    args.output.with_suffix(".md").write_text(f"`{results['command']}`\n\n{table(results)}\n")
    print(table(results))
    failed = [(m, k) for m, r in results["models"].items() for k, v in r["methods"].items() if "error" in v]
    for model, method in failed:
        print(f"{model} {method}: {results['models'][model]['methods'][method]['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
