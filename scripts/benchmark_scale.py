#!/usr/bin/env python
"""Every fitted one-pass method at the shape of the ImageNet-1K protocol: fit time and peak fit memory at several
numbers of fitting samples ``N``, scoring time per 1,000 inputs, the growth of each with ``N``, and the projection to
1.28M fitting images and 0.35M scored ones on 1 and 8 processes.

The detectors are fed features directly, so that their own cost shows: synthetic class-conditional features (``K``
classes, width ``D``; non-negative like a ResNet's pooled ReLU output at ``D = 2048``, signed like a ViT's LayerNorm
output at ``D = 768``) and a random-weight model whose last ``nn.Linear`` is set to the normalised class means (so that
most fitting samples are classified correctly, as SHE needs). Each fit is the library's own: ``fit_begin``,
``fit_update`` per batch of a :class:`~hf_gsc.detectors.backbone_pass.BackbonePass` holding the batch's features,
``fit_end``. The backbone's cost is measured apart, from one forward of a real random-weight ResNet-50 and ViT-B/16
(``transformers`` defaults, 1,000 classes) at 224 px, and the same ViT-B/16's pass checks that a fitted KNN keeps no
token tensor alive (the bytes its fit holds against ``N D`` float32).

Peak memory is the process's peak resident memory during the fit above what it held before (Linux ``VmHWM``, reset
through ``/proc/self/clear_refs``), so it includes the allocator's slack; the fitting features themselves are
generated before and not counted. Everything runs on one thread (``torch.set_num_threads(1)``). Reference products
over the same scored batches: one ``(B, D) @ (D, D)`` product in float32 and float64 (the Gaussian family's target is
within ~5x of it) and the head ``(B, D) @ (D, K)``. KNN is compared with faiss ``IndexFlatL2`` (exact search, the
authors' index) on the same bank where ``faiss-cpu`` is installed (``pip install hf_gsc[scale]``).

Growth model per method: least squares ``a + b N`` for fit seconds, peak bytes and scoring seconds per 1,000
(KNN's and NNGuide's scoring grow with their bank; where the fitted growth is not positive, the median is taken). Projection: fit at ``N = 1,281,167`` and scoring of 350,000
inputs; on 8 processes each process accumulates ``N / 8`` (the ``b N`` part divided, the ``a`` part not) and scores
``1/8`` of the inputs, and holds what its method keeps after the reduction (statistics: the same as one process;
feature-reading methods: every process's features, gathered); the gathering's own time is not modelled.

Examples::

    python scripts/benchmark_scale.py --output docs/results/scale/cpu1.json            # full: K=1000, D=2048 and 768
    python scripts/benchmark_scale.py --small --output /tmp/scale_small.json           # a minute: what CI runs
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hf_gsc import __version__
from hf_gsc.detectors import DETECTORS, get_detector
from hf_gsc.detectors.backbone_pass import BackbonePass, fit_from_passes
from hf_gsc.detectors.common import FittedDetector


#: Gram reads the feature maps of many layers, not the penultimate feature this benchmark feeds: left out.
LAYER_METHODS = ("gram",)
#: The fitted methods that score from the shared pass (``one_pass``): fitted together in one pass by the evaluation.
METHODS = tuple(sorted(name for name, cls in DETECTORS.items()
                       if cls.one_pass and issubclass(cls, FittedDetector) and name not in LAYER_METHODS))
#: The methods whose scoring grows with N (a bank searched whole); the others' scoring is modelled as constant in N.
BANK_METHODS = ("knn", "nnguide")
GAUSSIAN_METHODS = ("mahalanobis", "mahalanobis_pp", "rmds", "rmds_pp", "gem")
IMAGENET_FIT = 1_281_167
IMAGENET_SCORED = 350_000
FIT_BATCH = 256

FULL = {"classes": 1000, "dims": (2048, 768), "sizes": (5000, 20000, 50000), "scored": 1000, "score_batch": 250,
        "backbone_batch": 4, "end_to_end": {"size": 4000, "batch": 32, "image_size": 224, "resnet": {}}}
SMALL = {"classes": 50, "dims": (64, 32), "sizes": (200, 400), "scored": 100, "score_batch": 100,
         "backbone_batch": 1,
         "end_to_end": {"size": 200, "batch": 50, "image_size": 32,
                        "resnet": {"embedding_size": 8, "hidden_sizes": [8, 16, 32, 64], "depths": [1, 1, 1, 1]}}}


# ----------------------------------------------------------------------------------------------------- measuring
_LIBC = ctypes.CDLL("libc.so.6")


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def measured(work: Callable[[], Any]) -> tuple[Any, float, int]:
    """``(result, seconds, peak bytes above the resident memory before)`` of ``work()``."""
    gc.collect()
    _LIBC.malloc_trim(0)  # freed memory back to the system, so that the peak counts this work's allocations
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident memory
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    result = work()
    seconds = time.perf_counter() - start
    return result, seconds, max(0, _status_kib("VmHWM") - before) * 1024


def timed(work: Callable[[], Any], repeats: int = 3) -> float:
    """Median seconds of ``repeats`` runs after one warm-up."""
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


# --------------------------------------------------------------------------------------------------- the setting
def synthetic(count: int, class_means: torch.Tensor, seed: int, relu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` features ``mu_y + eps`` (``eps ~ N(0, I)``; ReLU'd for a ResNet-like width) and their labels (classes
    equally represented, shuffled)."""
    generator = torch.Generator().manual_seed(seed)
    labels = (torch.arange(count) % class_means.shape[0])[torch.randperm(count, generator=generator)]  # every class
    features = torch.empty(count, class_means.shape[1])
    for start in range(0, count, 4096):
        rows = slice(start, start + 4096)
        features[rows] = class_means[labels[rows]] + torch.randn(features[rows].shape, generator=generator)
    return (features.relu_() if relu else features), labels


def feature_model(dim: int, classes: int, class_means: torch.Tensor) -> torch.nn.Module:
    """A one-layer random-weight ViT whose classifier ``(K, D)`` is the normalised class means (the detectors read
    only its last ``nn.Linear`` and the split point before it)."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(image_size=16, patch_size=16, hidden_size=dim, num_hidden_layers=1,
                                                num_attention_heads=8, intermediate_size=32,
                                                num_labels=classes)).eval()
    with torch.no_grad():
        model.classifier.weight.copy_(class_means / class_means.norm(dim=1, keepdim=True))
        model.classifier.bias.zero_()
    return model


def passes(detector: FittedDetector, features: torch.Tensor, labels: torch.Tensor, batch: int):
    """``(BackbonePass holding the features of each batch, labels)``, as the evaluation's pass gives them."""
    target = (detector.split.module, detector.split.capture_input)
    for start in range(0, features.shape[0], batch):
        rows = features[start:start + batch]
        # No images: an empty (B, 0) stand-in for pixel_values (every row finite), the features given directly.
        yield (BackbonePass(torch.empty(rows.shape[0], 0), None, {target: rows}),
               labels[start:start + batch])


def fit(detectors: list[FittedDetector], features: torch.Tensor, labels: torch.Tensor) -> None:
    """What :func:`~hf_gsc.detectors.backbone_pass.fit_from_passes` does per batch, fed the features directly."""
    for detector in detectors:
        detector.fit_begin()
    for batch, batch_labels in passes(detectors[0], features, labels, FIT_BATCH):
        for detector in detectors:
            detector.fit_update(batch, batch_labels)
    for detector in detectors:
        detector.fit_end()


def score(detector: FittedDetector, queries: torch.Tensor, batch: int) -> None:
    for pass_, _ in passes(detector, queries, torch.zeros(queries.shape[0], dtype=torch.long), batch):
        detector.score_batch(pass_)


# ------------------------------------------------------------------------------------------------------ per shape
def linear_model(sizes: list[int], values: list[float]) -> dict[str, float]:
    """Least squares ``a + b N``."""
    slope, intercept = np.polyfit(np.asarray(sizes, dtype=float), np.asarray(values, dtype=float), 1)
    return {"a": float(intercept), "b": float(slope)}


def faiss_search(bank: torch.Tensor, queries: torch.Tensor, k: int) -> float | None:
    try:
        import faiss
    except ImportError:
        return None
    faiss.omp_set_num_threads(1)
    index = faiss.IndexFlatL2(bank.shape[1])
    index.add(bank.float().numpy())
    normalised = (queries / (queries.norm(dim=-1, keepdim=True) + 1e-10)).numpy()
    return timed(lambda: index.search(normalised, k), repeats=1)


def paired_ratio(work: Callable[[], Any], reference: Callable[[], Any], rounds: int = 3) -> float:
    """Median over ``rounds`` of ``time(work) / time(reference)``, each pair timed back to back (robust to the drift of
    a shared machine's speed)."""
    ratios = []
    for _ in range(rounds):
        reference_seconds = timed(reference, repeats=1)
        ratios.append(timed(work, repeats=1) / reference_seconds)
    return float(np.median(ratios))


def run_shape(dim: int, setting: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    classes, sizes, scored, score_batch = (setting[key] for key in ("classes", "sizes", "scored", "score_batch"))
    methods = setting["methods"]
    relu = dim >= 2048
    class_means = 2.0 * torch.randn(classes, dim, generator=torch.Generator().manual_seed(dim))
    model = feature_model(dim, classes, class_means)
    queries, _ = synthetic(scored, class_means, seed=1, relu=relu)
    per_method: dict[str, dict[str, Any]] = {name: {"fit_seconds": {}, "peak_fit_bytes": {}, "score_seconds_per_1000": {}}
                                             for name in methods}
    together: dict[str, Any] = {"fit_seconds": {}, "peak_fit_bytes": {}}
    knn_faiss: dict[str, Any] = {}
    for size in sizes:
        features, labels = synthetic(size, class_means, seed=2, relu=relu)
        product = torch.eye(dim)

        def reference() -> None:  # one (B, D) @ (D, D) float32 product per scored batch
            for start in range(0, scored, score_batch):
                queries[start:start + score_batch] @ product

        for name in methods:
            detector = get_detector(name, model)
            _, seconds, peak = measured(lambda: fit([detector], features, labels))
            score_seconds = timed(lambda: score(detector, queries, score_batch), repeats=1)
            row = per_method[name]
            row["fit_seconds"][size], row["peak_fit_bytes"][size] = seconds, peak
            row["score_seconds_per_1000"][size] = score_seconds * 1000 / scored
            if name in GAUSSIAN_METHODS and size == sizes[-1]:
                row["score_over_dd_matmul_float32_paired"] = paired_ratio(lambda: score(detector, queries, score_batch),
                                                                          reference)
            log(f"D={dim} N={size} {name}: fit {seconds:.2f} s, peak {peak / 2**20:.0f} MiB, "
                f"score {row['score_seconds_per_1000'][size]:.2f} s / 1000")
            if name == "knn":
                library = timed(lambda: score(detector, queries, scored), repeats=1)
                faiss_seconds = faiss_search(detector.bank, queries, detector.hyperparameters["k"])
                knn_faiss[size] = {"hf_gsc_seconds_per_1000": library * 1000 / scored,
                                   "faiss_index_flat_l2_seconds_per_1000":
                                       None if faiss_seconds is None else faiss_seconds * 1000 / scored}
        detectors = [get_detector(name, model) for name in methods]
        _, seconds, peak = measured(lambda: fit(detectors, features, labels))
        together["fit_seconds"][size], together["peak_fit_bytes"][size] = seconds, peak
        log(f"D={dim} N={size} all {len(methods)} together: fit {seconds:.2f} s, peak {peak / 2**20:.0f} MiB")
        detectors = features = labels = None  # freed before the next N
        gc.collect()

    batch = queries[:score_batch]
    precision64 = torch.eye(dim, dtype=torch.float64)
    references = {
        "dd_matmul_float32_seconds_per_1000": timed(lambda: batch @ precision64.float()) * 1000 / score_batch,
        "dd_matmul_float64_seconds_per_1000": timed(lambda: batch.double() @ precision64) * 1000 / score_batch,
        "head_seconds_per_1000": timed(lambda: model.classifier(batch)) * 1000 / score_batch,
    }
    for name, row in per_method.items():
        row["fit_seconds_model"] = linear_model(sizes, list(row["fit_seconds"].values()))
        row["peak_fit_bytes_model"] = linear_model(sizes, list(row["peak_fit_bytes"].values()))
        row["score_seconds_per_1000_model"] = linear_model(sizes, list(row["score_seconds_per_1000"].values()))
    largest = sizes[-1]
    summary: dict[str, Any] = {
        "gaussian_score_over_dd_matmul_float32": {
            name: per_method[name]["score_seconds_per_1000"][largest] / references["dd_matmul_float32_seconds_per_1000"]
            for name in GAUSSIAN_METHODS if name in per_method},
        "gaussian_score_over_dd_matmul_float32_paired": {
            name: per_method[name]["score_over_dd_matmul_float32_paired"] for name in GAUSSIAN_METHODS
            if name in per_method},
    }
    if "knn" in per_method:
        summary["together_fit_over_knn_fit_at_largest_n"] = (together["fit_seconds"][largest]
                                                             / per_method["knn"]["fit_seconds"][largest])
        summary["together_score_over_knn_score_at_largest_n"] = (
            sum(row["score_seconds_per_1000"][largest] for row in per_method.values())
            / per_method["knn"]["score_seconds_per_1000"][largest])
    return {"classes": classes, "dim": dim, "sizes": list(sizes), "methods": per_method, "together": together,
            "references": references, "knn_against_faiss": knn_faiss, "summary": summary}


def project(shape: dict[str, Any], backbone_seconds_per_1000: float | None) -> dict[str, Any]:
    """Each method at the ImageNet-1K protocol on 1 and 8 processes (see the module docstring)."""
    rows = {}
    statistic = {"dice", "nci", "fdbd", "she", "mahalanobis", "mahalanobis_pp", "rmds", "rmds_pp", "gem"}
    for name, row in shape["methods"].items():
        fit_model, memory_model, score_model = (row[key] for key in ("fit_seconds_model", "peak_fit_bytes_model",
                                                                     "score_seconds_per_1000_model"))
        fit_one = fit_model["a"] + fit_model["b"] * IMAGENET_FIT
        # A bank's search grows with N; where the measured growth is not positive (NNGuide's bank is 1% of N, its
        # search a small part of its scoring at these sizes), the scoring is taken as constant, as for the others.
        per_1000 = (score_model["a"] + score_model["b"] * IMAGENET_FIT if name in BANK_METHODS and score_model["b"] > 0
                    else float(np.median(list(row["score_seconds_per_1000"].values()))))
        score_one = per_1000 * IMAGENET_SCORED / 1000
        memory_one = memory_model["a"] + memory_model["b"] * IMAGENET_FIT
        rows[name] = {
            "holds": "statistics (flat in N)" if name in statistic else "every feature once, float32",
            "one_process": {"fit_seconds": fit_one, "score_seconds": score_one, "peak_fit_bytes": memory_one},
            "eight_processes": {
                "fit_seconds": fit_model["a"] + fit_model["b"] * IMAGENET_FIT / 8,
                "score_seconds": score_one / 8,
                "peak_fit_bytes_per_process": memory_one if name not in statistic
                else memory_model["a"] + memory_model["b"] * IMAGENET_FIT / 8,
            },
        }
    backbone = None if backbone_seconds_per_1000 is None else {
        "fit_pass_seconds_one_process": backbone_seconds_per_1000 * IMAGENET_FIT / 1000,
        "scoring_pass_seconds_one_process": backbone_seconds_per_1000 * IMAGENET_SCORED / 1000}
    return {"fit_samples": IMAGENET_FIT, "scored": IMAGENET_SCORED, "methods": rows, "backbone": backbone}


#: The backbone whose forward goes with each feature width: ResNet-50 at 2048, ViT-B/16 at 768.
BACKBONE_OF_WIDTH = {"2048": "resnet50", "768": "vit_b16"}


def _forward_seconds_per_1000(results: dict[str, Any], dim: str) -> float | None:
    backbone = results.get("backbones") or {}
    name = BACKBONE_OF_WIDTH.get(dim)
    return backbone[name]["forward_seconds_per_1000"] if name in backbone else None


def projections(results: dict[str, Any]) -> dict[str, Any]:
    """:func:`project` for every width, with the backbone of that width (:data:`BACKBONE_OF_WIDTH`)."""
    return {dim: project(shape, _forward_seconds_per_1000(results, dim)) for dim, shape in results["shapes"].items()}


def compositions(results: dict[str, Any]) -> dict[str, Any]:
    """:func:`composed_with_backbone` for every width whose backbone was measured and whose methods include KNN."""
    return {dim: composed_with_backbone(shape, forward) for dim, shape in results["shapes"].items()
            if (forward := _forward_seconds_per_1000(results, dim)) is not None and "knn" in shape["methods"]}


def derive(results: dict[str, Any]) -> None:
    """Set what is derived from the measured rows, :func:`projections` and :func:`compositions`, on ``results``
    (read as saved: the widths are string keys), after a run and again by ``--table-only``."""
    saved = json.loads(json.dumps(results))
    results["projection"], results["with_backbone"] = projections(saved), compositions(saved)


# ----------------------------------------------------------------------------------------------------- backbones
def backbones(batch: int, log: Callable[[str], None]) -> dict[str, Any]:
    """One real random-weight ResNet-50 and ViT-B/16 forward at 224 px (per 1,000 images), and the bytes a KNN fit on
    the ViT's pass holds against its features' own size."""
    from transformers import ResNetConfig, ResNetForImageClassification, ViTConfig, ViTForImageClassification

    out: dict[str, Any] = {}
    pixel_values = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    for name, make in (("resnet50", lambda: ResNetForImageClassification(ResNetConfig(num_labels=1000))),
                       ("vit_b16", lambda: ViTForImageClassification(ViTConfig(num_labels=1000)))):
        torch.manual_seed(0)
        model = make().eval()
        with torch.no_grad():
            seconds = timed(lambda: model(pixel_values=pixel_values), repeats=2)
        out[name] = {"batch": batch, "forward_seconds_per_1000": seconds * 1000 / batch}
        log(f"{name} forward at 224 px: {out[name]['forward_seconds_per_1000']:.1f} s / 1000 images")
        if name == "vit_b16":
            detector = get_detector("knn", model, k=1)
            fit_from_passes([detector], [(pixel_values, torch.zeros(batch, dtype=torch.long))] * 2, "vit")
            stored = 2 * batch * detector.feature_dim * 4
            out[name]["knn_fit_held_bytes_over_features"] = detector.bank.untyped_storage().nbytes() / stored
        model = None
        gc.collect()
    return out


def end_to_end(setting: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """The fit as a user pays for it, backbone included: a random-weight ResNet-50 (``transformers`` defaults, ``K``
    classes) runs on every fitting image through the library's own pass (:func:`fit_from_passes`, the pass the
    evaluation runs), once for KNN alone and once for every fitted one-pass method together, on the same batches.

    The trunk's work is done in full at the image size given; its pooled output, the penultimate feature, is then
    replaced batch by batch (a forward hook) by the synthetic class-conditional features of :func:`run_shape`, so that
    the detectors fit ImageNet-shaped statistics (a random-weight trunk's own features carry no classes, and SHE needs
    correctly classified samples of every class). The same fits are timed on the features alone, so that the
    difference of the two passes can be checked against the methods' own work."""
    from transformers import ResNetConfig, ResNetForImageClassification

    options = setting["end_to_end"]
    size, batch, image_size, classes = options["size"], options["batch"], options["image_size"], setting["classes"]
    config = ResNetConfig(num_labels=classes, **options["resnet"])
    dim = config.hidden_sizes[-1]
    class_means = 2.0 * torch.randn(classes, dim, generator=torch.Generator().manual_seed(dim))
    features, labels = synthetic(size, class_means, seed=2, relu=True)
    torch.manual_seed(0)
    model = ResNetForImageClassification(config).eval()
    with torch.no_grad():  # the head classifies the synthetic features mostly correctly (feature_model's head)
        model.classifier[-1].weight.copy_(class_means / class_means.norm(dim=1, keepdim=True))
        model.classifier[-1].bias.zero_()
    cursor = [0]

    def substitute(module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        rows = features[cursor[0]:cursor[0] + output.shape[0]]
        cursor[0] += output.shape[0]
        return rows.reshape(output.shape).to(output.dtype)

    model.resnet.pooler.register_forward_hook(substitute)
    pixels = torch.randn(batch, 3, image_size, image_size, generator=torch.Generator().manual_seed(0))

    def batches():  # the same pixels each batch: decoding images is not what is measured here
        for start in range(0, size, batch):
            yield pixels[:min(batch, size - start)], labels[start:start + batch]

    out: dict[str, Any] = {"model": f"ResNetForImageClassification, random weights, {classes} classes, "
                                    f"{image_size} px" + (f", config {options['resnet']}" if options["resnet"] else ""),
                           "dim": dim, "classes": classes, "size": size, "batch": batch, "methods": list(setting["methods"])}
    for key, names in (("knn_alone", ["knn"]), ("together", list(setting["methods"]))):
        detectors = [get_detector(name, model) for name in names]
        cursor[0] = 0
        start = time.perf_counter()
        fit_from_passes(detectors, batches(), "benchmark fitting images")
        out[f"{key}_seconds"] = time.perf_counter() - start
        if cursor[0] != size:
            raise RuntimeError(f"end_to_end: the pass read {cursor[0]} features, expected {size}")
        detectors = [get_detector(name, model) for name in names]
        out[f"{key}_features_alone_seconds"] = timed(lambda: fit(detectors, features, labels), repeats=1)
        log(f"end to end, N={size}, {key}: {out[f'{key}_seconds']:.1f} s with the backbone, "
            f"{out[f'{key}_features_alone_seconds']:.2f} s on the features alone")
        detectors = None
        gc.collect()
    out["together_over_knn_alone"] = out["together_seconds"] / out["knn_alone_seconds"]
    out["together_over_knn_alone_features_alone"] = (out["together_features_alone_seconds"]
                                                     / out["knn_alone_features_alone_seconds"])
    return out


def composed_with_backbone(shape: dict[str, Any], forward_seconds_per_1000: float) -> dict[str, Any]:
    """The methods fitted together against KNN alone at the largest ``N`` measured on the features, with the
    backbone's measured forward over those ``N`` images added to both (the composition :func:`end_to_end` checks)."""
    largest = str(shape["sizes"][-1])
    forward = forward_seconds_per_1000 * int(largest) / 1000
    together, knn = shape["together"]["fit_seconds"][largest], shape["methods"]["knn"]["fit_seconds"][largest]
    return {"size": int(largest), "forward_seconds": forward, "together_seconds": forward + together,
            "knn_alone_seconds": forward + knn, "together_over_knn_alone": (forward + together) / (forward + knn)}


def _duration(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def markdown(results: dict[str, Any]) -> str:
    """The tables of docs/efficiency.md from the JSON."""
    lines = []
    backbone = results.get("backbones") or {}
    for dim, shape in results["shapes"].items():
        sizes = [str(size) for size in shape["sizes"]]
        largest = sizes[-1]
        projection = results["projection"][dim]["methods"]
        references = shape["references"]
        lines += [f"#### K = {shape['classes']}, D = {dim}", "",
                  "| method | fit at N = " + " / ".join(sizes) + " | peak fit memory (MiB) | growth per 10k samples "
                  f"| scoring per 1,000 at N = {largest} | projected fit, 1.28M (1 / 8 processes) "
                  "| projected scoring, 0.35M (1 / 8) |",
                  "|---|---|---|---|---|---|---|"]
        for name, row in shape["methods"].items():
            fit_times = " / ".join(f"{row['fit_seconds'][size]:.2f}" for size in sizes)
            peaks = " / ".join(f"{row['peak_fit_bytes'][size] / 2**20:.0f}" for size in sizes)
            growth = row["peak_fit_bytes_model"]["b"] * 10_000 / 2**20
            one, eight = projection[name]["one_process"], projection[name]["eight_processes"]
            lines.append(f"| `{name}` | {fit_times} s | {peaks} | {growth:+.0f} MiB | "
                         f"{row['score_seconds_per_1000'][largest]:.2f} s | {_duration(one['fit_seconds'])} / "
                         f"{_duration(eight['fit_seconds'])} | {_duration(one['score_seconds'])} / "
                         f"{_duration(eight['score_seconds'])} |")
        together = shape["together"]
        lines.append(f"| the {len(shape['methods'])} in one pass | "
                     + " / ".join(f"{together['fit_seconds'][size]:.2f}" for size in sizes) + " s | "
                     + " / ".join(f"{together['peak_fit_bytes'][size] / 2**20:.0f}" for size in sizes) + " | | | | |")
        summary = shape["summary"]
        paired = summary.get("gaussian_score_over_dd_matmul_float32_paired", {})
        lines += ["", f"One `(B, D) @ (D, D)` product per 1,000 inputs: {references['dd_matmul_float32_seconds_per_1000']:.3f} s "
                  f"float32, {references['dd_matmul_float64_seconds_per_1000']:.3f} s float64; the head "
                  f"{references['head_seconds_per_1000']:.3f} s. Gaussian family's scoring over the float32 product at "
                  f"N = {largest}: " + ", ".join(f"`{name}` {ratio:.1f}x" for name, ratio in
                                                 summary["gaussian_score_over_dd_matmul_float32"].items())
                  + ("; timed back to back with the product (median of 3 pairs): "
                     + ", ".join(f"`{name}` {ratio:.1f}x" for name, ratio in paired.items()) if paired else "")
                  + (f". The methods measured, fitted in one pass, against KNN alone at N = {largest}: fit "
                     f"{summary['together_fit_over_knn_fit_at_largest_n']:.0f}x, scoring (the sum of the methods') "
                     f"{summary['together_score_over_knn_score_at_largest_n']:.1f}x."
                     if "together_fit_over_knn_fit_at_largest_n" in summary else "."), ""]
        knn = shape["knn_against_faiss"].get(largest)
        if knn:
            faiss_seconds = knn["faiss_index_flat_l2_seconds_per_1000"]
            lines += [f"KNN's exact search at N = {largest}, per 1,000 queries in one batch: hf_gsc "
                      f"{knn['hf_gsc_seconds_per_1000']:.2f} s, faiss `IndexFlatL2` "
                      + ("not installed" if faiss_seconds is None else f"{faiss_seconds:.2f} s") + ".", ""]
    end = results.get("end_to_end")
    if end:
        lines += [f"**The fit with its backbone** ({end['model']}, N = {end['size']}, batch {end['batch']}, one pass "
                  f"through `fit_from_passes`): KNN alone {_duration(end['knn_alone_seconds'])}, the "
                  f"{len(end['methods'])} methods together {_duration(end['together_seconds'])}: "
                  f"**{end['together_over_knn_alone']:.3f}x**. The same fits on the features alone: "
                  f"{end['knn_alone_features_alone_seconds']:.2f} s and {end['together_features_alone_seconds']:.2f} s "
                  f"({end['together_over_knn_alone_features_alone']:.0f}x).", ""]
    for dim, composed in (results.get("with_backbone") or {}).items():
        lines += [f"At D = {dim}, N = {composed['size']}, the fits above with the {BACKBONE_OF_WIDTH[dim]} forward over "
                  f"those N images added ({_duration(composed['forward_seconds'])}): KNN alone "
                  f"{_duration(composed['knn_alone_seconds'])}, the methods together "
                  f"{_duration(composed['together_seconds'])}: {composed['together_over_knn_alone']:.3f}x.", ""]
    for name, measured_row in backbone.items():
        lines.append(f"* {name} forward at 224 px, batch {measured_row['batch']}: "
                     f"{measured_row['forward_seconds_per_1000']:.0f} s per 1,000 images"
                     + (f"; a KNN fit on its pass holds {measured_row['knn_fit_held_bytes_over_features']:.2f}x the "
                        "bytes of its CLS features" if "knn_fit_held_bytes_over_features" in measured_row else ""))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="the small configuration (K=50, D=64 and 32, "
                        "N=200 and 400): seconds of work, what CI runs")
    parser.add_argument("--sizes", help="comma-separated N values (default: the configuration's)")
    parser.add_argument("--methods", help=f"comma-separated subset of {', '.join(METHODS)} (default: all)")
    parser.add_argument("--dims", help="comma-separated feature widths (default: the configuration's)")
    parser.add_argument("--no-backbones", action="store_true", help="skip the ResNet-50 / ViT-B/16 forwards")
    parser.add_argument("--output", required=True, type=Path, help="the JSON; its tables go beside it (.md)")
    parser.add_argument("--end-to-end", type=int, metavar="N", help="fitting images of the end-to-end fit, backbone "
                        "included (default: the configuration's, 4000 full, 200 small; 0: skip it)")
    parser.add_argument("--end-to-end-only", action="store_true", help="only the end-to-end fit (no shapes, no "
                        "backbone forwards): to run it beside the rest on another core")
    parser.add_argument("--table-only", action="store_true", help="write the tables from an existing --output JSON")
    args = parser.parse_args(argv)
    if args.table_only:  # the projection is derived from the measured rows: recomputed, then the tables
        results = json.loads(args.output.read_text())
        derive(results)
        args.output.write_text(json.dumps(results, indent=1))
        args.output.with_suffix(".md").write_text(markdown(results))
        return results
    torch.set_num_threads(1)
    setting = dict(SMALL if args.small else FULL)
    if args.sizes:
        setting["sizes"] = tuple(int(size) for size in args.sizes.split(","))
    if args.dims:
        setting["dims"] = tuple(int(dim) for dim in args.dims.split(","))
    setting["methods"] = tuple(args.methods.split(",")) if args.methods else METHODS
    if args.end_to_end is not None:
        setting["end_to_end"] = {**setting["end_to_end"], "size": args.end_to_end}
    unknown = sorted(set(setting["methods"]) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; the fitted one-pass methods are {list(METHODS)}")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    load_before = os.getloadavg()
    if args.end_to_end_only and not setting["end_to_end"]["size"]:
        parser.error("--end-to-end-only with --end-to-end 0 measures nothing")
    backbone = None if args.no_backbones or args.end_to_end_only else backbones(setting["backbone_batch"], log)
    shapes = {} if args.end_to_end_only else {str(dim): run_shape(dim, setting, log) for dim in setting["dims"]}
    together = end_to_end(setting, log) if setting["end_to_end"]["size"] else None
    results = {
        "settings": {**{key: list(value) if isinstance(value, tuple) else value for key, value in setting.items()},
                     "configuration": "small" if args.small else "full", "threads": torch.get_num_threads(),
                     "fit_batch": FIT_BATCH},
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpu_count": os.cpu_count(), "torch": torch.__version__, "hf_gsc": __version__,
                    "note": "measured with 1 thread on a 2-core machine shared with other jobs",
                    "load_average_1min_before_and_after": [load_before[0], os.getloadavg()[0]]},
        "backbones": backbone,
        "shapes": shapes,
        "end_to_end": together,
    }
    derive(results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))
    args.output.with_suffix(".md").write_text(markdown(json.loads(args.output.read_text())))  # the keys as saved
    return results


if __name__ == "__main__":
    main()
