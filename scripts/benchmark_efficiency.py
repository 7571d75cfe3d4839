#!/usr/bin/env python
"""Relative wall time and peak memory of GSC and baselines versus MSP (issue: efficiency study).

Methods are interleaved (every repeat runs each method once, in a rotating order), timed after a
warm-up with a fixed number of threads, and summarised by the median. Peak memory is the high-water
mark of tensor memory allocated during one call, read from the torch profiler's memory events on CPU
(``torch.cuda.max_memory_allocated`` on GPU). Results go to a JSON file; nothing here asserts a speed.

With ``--mixed-precision bf16`` (or ``fp16``, CUDA only) every timed and memory-measured call runs under
``torch.autocast`` on the device's type, as the evaluation runs its methods under ``accelerator.autocast()``: the
backbone in the lower precision, GSC's step, ODIN and ASH in float32 (:mod:`hf_gsc.utils.precision`).

With ``--after-backbone`` each GSC method is also timed with its backbone pass replaced by a lookup: what is
left is GSC's whole work after the backbone (what a faster backend could save), reported relative to MSP's whole
forward (``after_backbone_relative_to_msp``).

With ``--per-coordinate`` each GSC approximation whose head reads ``F`` through a mean over positions (ResNet,
ConvNeXt, ...) also runs as ``gsc_<approximation>_per_coordinate``: the same detector with the step on every
coordinate of ``F`` instead of per channel (:func:`hf_gsc.gsc_math.step.gsc_step` on the head without its
``pooled_read``), timed in the same rounds. ``--step-alone`` times :func:`hf_gsc.gsc_math.step.gsc_step` by itself (ranking,
mask, short-circuit, logit update, score; ``F`` and the linearised head made once) both ways, and records whether the
two give the same masks and how far apart their scores are (``step_alone`` in the JSON).

Example (random-weight ResNet-50, ViT-B/16 and Swin-T at 224 px)::

    python scripts/benchmark_efficiency.py --models resnet-50-random,vit-b16-random,swin-t-random \\
        --baselines msp --batch-sizes 8 --after-backbone --output docs/results/efficiency/cpu_batch8.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForImageClassification

from hf_gsc import GSCForImageClassification, __version__
from hf_gsc.detectors import get_detector
from hf_gsc.gsc_math.step import gsc_step
from hf_gsc.reference_models import reference_model_path


GSC_APPROXIMATIONS = ("exact", "first_order", "predicted_logit")


BASELINES = ("msp", "energy", "odin")
# Random-weight full-size models at 224 px, 1000 classes (transformers' default configs are these architectures).
RANDOM_MODELS = {
    "resnet-50-random": ("ResNetConfig", "ResNetForImageClassification"),
    "vit-b16-random": ("ViTConfig", "ViTForImageClassification"),
    "swin-t-random": ("SwinConfig", "SwinForImageClassification"),
}


#: ``--mixed-precision`` -> the autocast dtype (accelerate's ``get_mixed_precision_context_manager``).
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: str, mixed_precision: str) -> contextlib.AbstractContextManager:
    """What the evaluation's ``accelerator.autocast()`` enters for ``mixed_precision`` on ``device``: ``torch.autocast``
    on the device's type with the precision's dtype, or nothing for ``no``. A new context manager per call."""
    if mixed_precision == "no":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=AUTOCAST_DTYPES[mixed_precision])


def precision_error(device: str, mixed_precision: str) -> str | None:
    """Why ``mixed_precision`` cannot run on ``device`` as the evaluation runs it, or ``None`` when it can."""
    device_type = torch.device(device).type
    if mixed_precision == "fp16" and device_type == "cpu":
        return "--mixed-precision fp16: the evaluation runs fp16 autocast on CUDA only; use bf16 or no on a CPU"
    if mixed_precision == "bf16" and device_type == "cuda" and torch.cuda.is_available() \
            and not torch.cuda.is_bf16_supported():
        return f"--mixed-precision bf16: {torch.cuda.get_device_name(device)} has no bf16; use fp16 or no"
    return None


def _under_autocast(
    function: Callable[[torch.Tensor], torch.Tensor], device: str, mixed_precision: str
) -> Callable[[torch.Tensor], torch.Tensor]:
    if mixed_precision == "no":
        return function

    def run(x: torch.Tensor) -> torch.Tensor:
        with autocast(device, mixed_precision):
            return function(x)

    return run


def load_model(name: str) -> torch.nn.Module:
    """A reference model (resnet, vit, swin), a random-weight full-size model (:data:`RANDOM_MODELS`) or a path."""
    if name in RANDOM_MODELS:
        import transformers

        config_class, model_class = (getattr(transformers, n) for n in RANDOM_MODELS[name])
        torch.manual_seed(0)
        model = model_class(config_class(num_labels=1000)).eval()
        model.config.image_size = getattr(model.config, "image_size", 224)  # ResNet's config has no image size
        return model
    path = reference_model_path(name) if name in ("resnet", "vit", "swin") else name
    return AutoModelForImageClassification.from_pretrained(path).eval()


def _methods(
    model: torch.nn.Module,
    split_point: str,
    baselines: tuple[str, ...] = BASELINES,
    approximations: tuple[str, ...] = GSC_APPROXIMATIONS,
    detectors: dict[str, GSCForImageClassification] | None = None,
    per_coordinate_too: bool = False,
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every method as ``pixel_values -> scores``; ``detectors`` is filled with each GSC method's detector.
    ``per_coordinate_too``: also each GSC approximation with its step on every coordinate (where that differs)."""
    methods: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for name in baselines:
        methods[name] = get_detector(name, model).score
    for approximation in approximations:
        for per_coordinate in (False, True) if per_coordinate_too else (False,):
            gsc = GSCForImageClassification(model, split_point=split_point, approximation=approximation)
            name = f"gsc_{approximation}"
            if per_coordinate:
                if not step_per_coordinate(gsc):
                    continue
                name += "_per_coordinate"
            methods[name] = lambda x, gsc=gsc: gsc(x).ood_score
            if detectors is not None:
                detectors[name] = gsc
    return methods


def _without_pooled_read(linearization):
    """A linearisation whose head has no pooled form: the GSC step on it runs on every coordinate of ``F``."""
    return dataclasses.replace(linearization, head=dataclasses.replace(linearization.head, pooled_read=None))


def step_per_coordinate(detector: GSCForImageClassification) -> bool:
    """Make ``detector`` run its step on every coordinate of ``F`` (its linearisations lose their pooled form);
    ``False``, and nothing changed, where its head has no pooled form to lose."""
    backend = detector.backend
    linearize = backend.linearize
    probe = torch.zeros(2, *_input_shape(detector.model), device=detector.device, dtype=detector.dtype)
    if linearize(probe).head.pooled_read is None:
        return False
    backend.linearize = lambda *args, **kwargs: _without_pooled_read(linearize(*args, **kwargs))
    return True


def _input_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    config = model.config
    size = getattr(config, "image_size", 28)
    size = size if isinstance(size, int) else size[0]
    return config.num_channels, size, size


def _peak_memory_bytes(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> int:
    """Peak of (allocated - freed) tensor bytes during one call.

    On CPU each profiler event's *self* memory is used: ``cpu_memory_usage`` of an op includes that of the ops it
    calls (``aten::linear`` -> ``aten::addmm``), so summing it would count one allocation several times.
    """
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
        (event for event in profiler.events() if getattr(event, "self_cpu_memory_usage", 0)),
        key=lambda event: event.time_range.start,
    )
    current = peak = 0
    for event in events:
        current += event.self_cpu_memory_usage
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


def _iqr(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    quartiles = statistics.quantiles(values, n=4)
    return quartiles[2] - quartiles[0]


def benchmark_model(
    model: torch.nn.Module,
    batch_size: int,
    repeats: int,
    warmup: int,
    split_point: str,
    device: str,
    baselines: tuple[str, ...] = BASELINES,
    approximations: tuple[str, ...] = GSC_APPROXIMATIONS,
    after_backbone_rounds: bool = False,
    unhooked_twin: torch.nn.Module | None = None,
    mixed_precision: str = "no",
    per_coordinate: bool = False,
    step_alone: bool = False,
) -> dict:
    """Every method's times and peak memory on one random batch, each call under ``mixed_precision``'s autocast."""
    x = torch.randn(batch_size, *_input_shape(model), generator=torch.Generator().manual_seed(0)).to(device)
    detectors: dict[str, GSCForImageClassification] = {}
    methods = _methods(model, split_point, baselines, approximations, detectors, per_coordinate)
    if unhooked_twin is not None:  # the same weights, never wrapped by GSC: no split hooks on any module
        methods["msp_without_split_hooks"] = get_detector("msp", unhooked_twin).score
    methods = {name: _under_autocast(function, device, mixed_precision) for name, function in methods.items()}
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
    after_backbone = (
        _after_backbone_seconds(detectors, x, repeats, device, mixed_precision) if after_backbone_rounds else {}
    )
    alone = _step_alone(detectors, x, repeats, device, mixed_precision) if step_alone else {}
    # Paired: each repeat's time over MSP's in the same repeat (adjacent calls), so that load changes slower
    # than one round cancel; reported next to the ratio of medians, which is the headline number.
    paired = {name: [t / m for t, m in zip(times[name], times["msp"])] for name in names}
    return {
        name: {
            "median_seconds": statistics.median(times[name]),
            "iqr_seconds": _iqr(times[name]),
            "relative_time": statistics.median(times[name]) / msp_time,
            "relative_time_paired": statistics.median(paired[name]),
            "relative_time_paired_iqr": _iqr(paired[name]),
            # Every round's time, in round order, for paired comparisons between any two methods.
            "round_seconds": times[name],
            "peak_memory_bytes": memory[name],
            "relative_memory": memory[name] / msp_memory if msp_memory else None,
            **({
                # GSC's work after the backbone alone (F looked up instead of computed), over MSP's whole forward.
                "after_backbone_median_seconds": statistics.median(after_backbone[name]),
                "after_backbone_iqr_seconds": _iqr(after_backbone[name]),
                "after_backbone_relative_to_msp": statistics.median(after_backbone[name]) / msp_time,
            } if name in after_backbone else {}),
            **({"step_alone": alone[name]} if name in alone else {}),
        }
        for name in names
    }


def _step_alone(
    detectors: dict[str, GSCForImageClassification], x: torch.Tensor, repeats: int, device: str = "cpu",
    mixed_precision: str = "no",
) -> dict[str, dict]:
    """Per GSC detector whose head has a pooled form: :func:`hf_gsc.gsc_math.step.gsc_step` alone, per channel and on every
    coordinate, on one linearisation of ``x`` (interleaved over ``repeats`` rounds after one warm-up call each), and
    how the two results compare."""
    out: dict[str, dict] = {}
    for name, detector in detectors.items():
        if name.endswith("_per_coordinate"):
            continue
        with torch.no_grad(), autocast(device, mixed_precision):
            linearization = detector._linearize(detector.backbone_pass(x))
        head, features = linearization.head, linearization.read_part
        if head.pooled_read is None:
            continue
        heads = {"per_channel": head, "per_coordinate": dataclasses.replace(head, pooled_read=None)}
        steps = {way: _under_autocast(lambda _x, h=h: gsc_step(h, features, detector.config).ood_score, device,
                                      mixed_precision) for way, h in heads.items()}
        for step in steps.values():
            _time_once(step, x)
        times: dict[str, list[float]] = {way: [] for way in heads}
        for _ in range(repeats):
            for way, step in steps.items():
                times[way].append(_time_once(step, x))
        with torch.no_grad():
            results = {way: gsc_step(h, features, detector.config) for way, h in heads.items()}
        channel, coordinate = results["per_channel"], results["per_coordinate"]
        out[name] = {
            **{f"{way}_median_seconds": statistics.median(t) for way, t in times.items()},
            **{f"{way}_iqr_seconds": _iqr(t) for way, t in times.items()},
            **{f"{way}_round_seconds": t for way, t in times.items()},
            "per_coordinate_over_per_channel": statistics.median(times["per_coordinate"])
            / statistics.median(times["per_channel"]),
            "coordinates_per_sample": int(features[0].numel()),
            "masks_equal": bool(torch.equal(channel.mask, coordinate.mask)),
            "max_abs_score_difference": float((channel.ood_score - coordinate.ood_score).abs().max()),
            "max_abs_gsc_logit_difference": float((channel.gsc_logits - coordinate.gsc_logits).abs().max()),
        }
    return out


def _after_backbone_seconds(
    detectors: dict[str, GSCForImageClassification], x: torch.Tensor, repeats: int, device: str = "cpu",
    mixed_precision: str = "no",
) -> dict[str, list[float]]:
    """Each GSC detector's time per call with the backbone replaced by a lookup of its ``F`` (the detector's
    ``backbone_pass`` patched on the instance to return a pass computed once, under the same autocast, with a fresh
    memo each call), interleaved over ``repeats`` rounds after one warm-up call."""
    from hf_gsc.detectors.backbone_pass import BackbonePass

    calls = {name: _under_autocast(detector, device, mixed_precision) for name, detector in detectors.items()}
    for name, detector in detectors.items():
        with torch.no_grad():
            done = _under_autocast(detector.backbone_pass, device, mixed_precision)(x)
        detector.backbone_pass = lambda pixel_values, logits=False, done=done: BackbonePass(
            done.pixel_values, done.logits, dict(done.captured))
        _time_once(calls[name], x)
    times: dict[str, list[float]] = {name: [] for name in detectors}
    try:
        for _ in range(repeats):
            for name in detectors:
                times[name].append(_time_once(calls[name], x))
    finally:
        for detector in detectors.values():
            del detector.backbone_pass
    return times


def profile_methods(
    model: torch.nn.Module, batch_size: int, split_point: str, device: str, label: str, mixed_precision: str = "no"
) -> None:
    """Print the 12 operators with the most self time for msp, gsc_exact and gsc_first_order (5 calls each)."""
    x = torch.randn(batch_size, *_input_shape(model)).to(device)
    methods = {name: _under_autocast(function, device, mixed_precision)
               for name, function in _methods(model, split_point).items()}
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sort = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    for name in ("msp", "gsc_exact", "gsc_first_order"):
        for _ in range(2):
            _time_once(methods[name], x)
        with torch.profiler.profile(activities=activities) as profiler:
            for _ in range(5):
                _time_once(methods[name], x)
        print(f"--- profile {label} {split_point} batch {batch_size} {name}")
        print(profiler.key_averages().table(sort_by=sort, row_limit=12, max_name_column_width=40))


def markdown(results: dict) -> str:
    """One table per (model, split point) and batch size: relative time (ratio of medians, +- half the IQR), the
    median of per-repeat ratios to MSP (paired), relative peak memory and, where measured, the time after the
    backbone (median ms, and as a percentage of MSP's whole forward). The heading names the precision (fp32, or
    the autocast dtype of ``--mixed-precision``; results written before that option existed are fp32)."""
    mixed_precision = results.get("mixed_precision", "no")
    precision = "fp32" if mixed_precision == "no" else f"{mixed_precision} autocast"
    lines = []
    for model, per_split in results["models"].items():
        for split_point, per_batch in per_split.items():
            batches = list(per_batch)
            after = any("after_backbone_median_seconds" in r for b in batches for r in per_batch[b].values())
            columns = ["time", "time, paired", "mem"] + (["after backbone"] if after else [])
            lines += [f"#### {model}, split point `{split_point}`, {precision}", ""]
            lines.append("| method | " + " | ".join(f"batch {b} {c}" for b in batches for c in columns) + " |")
            lines.append("|---|" + "---|" * len(columns) * len(batches))
            for method in per_batch[batches[0]]:
                cells = []
                for b in batches:
                    r = per_batch[b][method]
                    spread = r.get("iqr_seconds", 0.0) / r["median_seconds"] * r["relative_time"]
                    memory = "n/a" if r["relative_memory"] is None else f"{r['relative_memory']:.2f}x"
                    paired = f"{r['relative_time_paired']:.2f}x (+-{r['relative_time_paired_iqr'] / 2:.2f})"
                    cells += [f"{r['relative_time']:.2f}x (+-{spread / 2:.2f})", paired, memory]
                    if after:
                        cells.append(
                            f"{1000 * r['after_backbone_median_seconds']:.2f} ms "
                            f"({100 * r['after_backbone_relative_to_msp']:.2f}% of MSP)"
                            if "after_backbone_median_seconds" in r else ""
                        )
                lines.append(f"| {method} | " + " | ".join(cells) + " |")
            alone = [(b, m, r["step_alone"]) for b in batches for m, r in per_batch[b].items() if "step_alone" in r]
            if alone:
                lines += ["", "GSC's step alone (ranking, mask, short-circuit, logit update, score), median ms:", "",
                          "| batch | method | per channel | on every coordinate | ratio | same masks | largest score "
                          "difference |", "|---|---|---|---|---|---|---|"]
                lines += [f"| {b} | {m} | {1000 * a['per_channel_median_seconds']:.2f} | "
                          f"{1000 * a['per_coordinate_median_seconds']:.2f} | "
                          f"{a['per_coordinate_over_per_channel']:.1f}x | {'yes' if a['masks_equal'] else 'NO'} | "
                          f"{a['max_abs_score_difference']:.2g} |" for b, m, a in alone]
            msp = {b: per_batch[b]["msp"] for b in batches}
            lines += ["", "MSP: " + ", ".join(
                f"batch {b} {1000 * msp[b]['median_seconds']:.1f} ms, {msp[b]['peak_memory_bytes'] / 2**20:.2f} MiB"
                for b in batches), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet,vit,swin",
                        help="comma list of reference model names (resnet, vit, swin), random-weight full-size "
                        f"models ({', '.join(RANDOM_MODELS)}) or model paths")
    parser.add_argument("--baselines", default=",".join(BASELINES), help="comma list of baselines; msp is required")
    parser.add_argument("--approximations", default=",".join(GSC_APPROXIMATIONS),
                        help="comma list of GSC approximations to run")
    parser.add_argument("--hook-overhead", action="store_true",
                        help="also run MSP on an untouched copy of the model (msp_without_split_hooks): the cost of "
                        "the persistent split hooks GSC leaves on the model")
    parser.add_argument("--after-backbone", action="store_true",
                        help="also time each GSC method with its backbone replaced by a lookup of F (what a backend "
                        "can change), relative to MSP's whole forward")
    parser.add_argument("--per-coordinate", action="store_true",
                        help="also run each GSC approximation with its step on every coordinate of F instead of per "
                        "channel (gsc_<approximation>_per_coordinate), where its head reads F through a mean")
    parser.add_argument("--step-alone", action="store_true",
                        help="also time GSC's step alone (after F and the linearised head), per channel and on every "
                        "coordinate, and compare their masks and scores (step_alone in the JSON)")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--split-points", default="final_encoder_output",
                        help="comma list of split points to benchmark GSC at (e.g. final_encoder_output,vit.layers.-3)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default="no",
                        help="run every measured call under torch.autocast with this dtype, as the evaluation's "
                        "--mixed-precision does (fp16: CUDA only)")
    parser.add_argument("--profile", action="store_true",
                        help="also print the top operators by self CPU time of msp / gsc_exact / gsc_first_order at "
                        "the largest batch size and first split point (where the overhead goes)")
    parser.add_argument("--output", required=True, help="JSON file to write (and the same name with .md: tables)")
    parser.add_argument("--render-only", action="store_true",
                        help="measure nothing: rewrite the .md tables of an existing --output JSON")
    args = parser.parse_args(argv)
    if args.render_only:
        output = Path(args.output)
        output.with_suffix(".md").write_text(markdown(json.loads(output.read_text())) + "\n")
        return 0
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    error = precision_error(args.device, args.mixed_precision)
    if error:
        parser.error(error)
    baselines = tuple(args.baselines.split(","))
    approximations = tuple(args.approximations.split(","))
    if "msp" not in baselines or not set(baselines) <= set(BASELINES):
        parser.error(f"--baselines must include msp and name only {BASELINES}, got {args.baselines!r}")
    if not set(approximations) <= set(GSC_APPROXIMATIONS):
        parser.error(f"--approximations must name only {GSC_APPROXIMATIONS}, got {args.approximations!r}")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)

    results: dict = {
        "versions": {"hf_gsc": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "machine": {"processor": platform.processor() or platform.machine(), "threads": args.threads,
                    "device": args.device, "cpu_count": os.cpu_count(),
                    "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None},
        "mixed_precision": args.mixed_precision,
        "settings": vars(args),
        "models": {},
    }
    for name in args.models.split(","):
        model = load_model(name).to(args.device)
        twin = copy.deepcopy(model) if args.hook_overhead else None
        results["models"][name] = {}
        for split_point in args.split_points.split(","):
            try:
                GSCForImageClassification(model, split_point=split_point)
            except ValueError as error:
                print(f"skipping split point {split_point!r} for {name}: {error}", file=sys.stderr)
                continue
            for batch_size in (int(b) for b in args.batch_sizes.split(",")):
                row = benchmark_model(
                    model, batch_size, args.repeats, args.warmup, split_point, args.device, baselines, approximations,
                    args.after_backbone, twin, args.mixed_precision, args.per_coordinate, args.step_alone,
                )
                results["models"][name].setdefault(split_point, {})[str(batch_size)] = row
                summary = ", ".join(
                    f"{m} {r['relative_time']:.2f}x/{r['relative_memory'] or 0:.2f}x mem" for m, r in row.items()
                )
                print(f"{name} {split_point} batch {batch_size}: {summary}", flush=True)
                # Written after every cell so an interrupted run keeps what it measured.
                output.write_text(json.dumps(results, indent=2))
    if args.profile:
        for name in args.models.split(","):
            model = load_model(name).to(args.device)
            profile_methods(model, max(int(b) for b in args.batch_sizes.split(",")),
                            args.split_points.split(",")[0], args.device, f"{name}", args.mixed_precision)
    if hasattr(os, "getloadavg"):
        results["machine"]["load_average_at_end"] = list(os.getloadavg())
        output.write_text(json.dumps(results, indent=2))
    output.with_suffix(".md").write_text(markdown(results) + "\n")
    print(f"wrote {output} and {output.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
