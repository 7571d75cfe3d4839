#!/usr/bin/env python
"""GSC against MSP, eager and compiled, in bf16 autocast at several batch sizes (batch 1: the serving latency), as JSON.

For each model (random-weight ResNet-50, ViT-B/16, Swin-T at 224 px, 1000 classes) and batch size, four callables
are timed in interleaved rounds (each round calls each once, in a rotated order, after warm-up rounds): MSP and GSC
(``first_order``, the default) eager, and both compiled whole by :meth:`hf_gsc.OODDetector.compiled`
(``torch.compile(fullgraph=True)``; ``--compile-mode``, default ``reduce-overhead``: CUDA graphs on a GPU). Each
call runs under ``torch.autocast`` (``--mixed-precision``, default bf16) and, on CUDA, is timed with a
synchronisation after it. Reported per model and batch size: the median ms of each, GSC / MSP (median over rounds of
the ratio of the same round's calls) for eager and compiled, the compiled call's first-call seconds (its compile
time; batches above 1 share one compile, their batch dimension marked dynamic, and batch 1 compiles once more) and
the largest difference between the compiled and eager scores. The JSON is written after each batch size, so a run
cut short keeps what it measured. Nothing here asserts a speed.

    python scripts/benchmark_compiled.py --device cuda --batch-sizes 1,64,256 --output compiled_bf16.json
    python scripts/benchmark_compiled.py --device cpu --models resnet-50 --batch-sizes 1 --image-size 64 \\
        --repeats 2 --warmup 1 --mixed-precision no --output /tmp/compiled_cpu.json   # a CPU rehearsal
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from hf_gsc import AutoOODDetector, __version__


MODELS = {
    "resnet-50": ("ResNetConfig", "ResNetForImageClassification"),
    "vit-b16": ("ViTConfig", "ViTForImageClassification"),
    "swin-t": ("SwinConfig", "SwinForImageClassification"),
}
PRECISIONS = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def build(name: str, image_size: int, device: torch.device) -> torch.nn.Module:
    import transformers

    config_name, model_name = MODELS[name]
    extra = {} if name == "resnet-50" else {"image_size": image_size}
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(num_labels=1000, **extra))
    model.config.image_size = image_size
    return model.eval().to(device)


def timer(device: torch.device, precision: str):
    dtype = PRECISIONS[precision]

    def call(function, x):
        autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        begin = time.perf_counter()
        with torch.no_grad(), autocast:
            output = function(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - begin, output.ood_score.float()

    return call


def measure(name: str, args: argparse.Namespace, device: torch.device, save) -> dict:
    model = build(name, args.image_size, device)
    call = timer(device, args.mixed_precision)
    detectors = {method: AutoOODDetector.from_pretrained(model, method=method) for method in ("msp", "gsc")}
    for detector in detectors.values():
        detector.config.threshold = 0.0
    out: dict = {}
    torch._dynamo.reset()
    compiled = {method: detector.compiled(mode=args.compile_mode, backend=args.backend)
                for method, detector in detectors.items()}
    # Batches above 1 first, with the batch dimension marked dynamic: one compile serves them all (CUDA graphs are
    # still recorded per shape); batch 1 is specialised by the compiler and compiles once more.
    for batch_size in sorted(args.batch_sizes, key=lambda b: (b == 1, b)):
        x = torch.randn(batch_size, 3, args.image_size, args.image_size, device=device,
                        generator=torch.Generator(device=device).manual_seed(batch_size))
        if batch_size > 1:
            torch._dynamo.mark_dynamic(x, 0)
        functions = {f"{method}_eager": detector for method, detector in detectors.items()}
        first_call, differences = {}, {}
        for method, detector in detectors.items():
            seconds, score = call(compiled[method], x)  # the first call at a new shape compiles
            first_call[method] = round(seconds, 2)
            differences[method] = float((score - call(detector, x)[1]).abs().max())
            functions[f"{method}_compiled"] = compiled[method]
        names = list(functions)
        times: dict[str, list[float]] = {n: [] for n in names}
        for round_index in range(args.warmup + args.repeats):
            shift = round_index % len(names)
            for n in names[shift:] + names[:shift]:
                seconds, _ = call(functions[n], x)
                if round_index >= args.warmup:
                    times[n].append(seconds)

        def paired(numerator: str, denominator: str) -> float:
            return round(statistics.median(a / b for a, b in zip(times[numerator], times[denominator])), 3)

        out[str(batch_size)] = {
            "median_ms": {n: round(1e3 * statistics.median(v), 3) for n, v in times.items()},
            "gsc_over_msp": {"eager": paired("gsc_eager", "msp_eager"), "compiled": paired("gsc_compiled", "msp_compiled")},
            "compiled_over_eager": {m: paired(f"{m}_compiled", f"{m}_eager") for m in detectors},
            "first_call_seconds": first_call,
            "max_abs_score_difference_compiled_vs_eager": differences,
        }
        print(f"{name} batch {batch_size}: " + json.dumps(out[str(batch_size)]), flush=True)
        save(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {list(MODELS)}")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--mixed-precision", choices=sorted(PRECISIONS), default="bf16")
    parser.add_argument("--compile-mode", default="reduce-overhead")
    parser.add_argument("--backend", default="inductor",
                        help="torch.compile backend (inductor; aot_eager for a quick rehearsal of the plumbing)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    models = args.models.split(",")
    if unknown := sorted(set(models) - set(MODELS)):
        parser.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        parser.error("--batch-sizes is a comma list of ints")
    if min(args.batch_sizes) < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--batch-sizes >= 1, --repeats >= 1, --warmup >= 0")
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    result = {
        "command": "python scripts/benchmark_compiled.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({args.threads} threads)",
        "mixed_precision": args.mixed_precision, "compile_mode": args.compile_mode, "backend": args.backend, "image_size": args.image_size,
        "repeats": args.repeats, "warmup": args.warmup,
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "hf_gsc": __version__},
        "models": {},
    }
    failed = False
    for name in models:
        def save(partial: dict, name: str = name) -> None:  # after each batch size: a timeout keeps what is done
            result["models"][name] = partial
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(result, indent=1) + "\n")

        try:
            measure(name, args, device, save)
        except Exception as error:  # noqa: BLE001 - recorded; the other models go on
            result["models"][name] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{name}: {type(error).__name__}: {error}", file=sys.stderr)
            failed = True
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
