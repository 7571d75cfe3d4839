"""Beyond the paper (issue #8): GSC variants against default GSC and Energy, and a validation-only
protocol that decides whether a variant may become the default.

Variants (all built through the ``gsc`` detector, so fitting goes through ``Detector.fit`` exactly
as in ``scripts/evaluate_ood.py``):

* ``energy``: Energy score of the base model's logits (reference baseline).
* ``gsc``: default ``GSCConfig`` (fixed ``mask_ratio=0.05``, ``|g|`` selection, final encoder output).
* ``gsc_adaptive``: ``mask_size="adaptive"``; its gradient mass is calibrated on ID *validation*
  data (part ``fit`` below) so that the mean mask ratio there is ``mask_ratio``.
* ``gsc_fisher``: ``selection="fisher"``; the diagonal Fisher is fitted on ID *train* data.
* ``gsc_multilayer``: ``earlier_split_point`` = the block before the last one, shared budget.
  Unsupported architectures (Swin) are reported as ``n/a`` with the reason the core gives.

Selection protocol (:func:`run_protocol`), which never reads an ID test split or a test OOD split:

* ID validation is split once, at random (``seed``), into disjoint parts: ``fit`` (calibrates
  ``gsc_adaptive``), ``select`` (the ID side of the selection) and, for ``fmnist-ood``, ``jigsaw``
  (source images of a validation OOD set).
* Validation OOD (:func:`build_validation_ood`):
    - ``fmnist-ood``: ``val_noise`` = ``hf_gsc.data.noise.generate_noise`` with seed
      ``VALIDATION_SEED`` (test ``noise`` uses seed 0: same generator, different pixels) and
      ``val_jigsaw`` = ID validation images (part ``jigsaw``) whose 4x4 grid of patches is shuffled
      (:class:`hf_gsc.evaluation.validation_sets.GeneratedImages`, the evaluation's own jigsaw set).
    - ``fmnist-openset``: ``val_heldout_classes`` = the Fashion-MNIST *validation* rows (held out of
      training, never test images) of the four classes the benchmark keeps out of distribution.
* Rule: the evaluation's own (:func:`hf_gsc.evaluation.ranking.rank`): among the GSC configurations, the highest
  mean validation AUROC over the validation OOD sets, ties broken by the lower mean FPR95, then by the order of
  ``GSC_VARIANTS`` (default first). Energy is reported but is not a GSC default candidate.
* A variant is *recommended as the default* (:func:`verdict`) only if the protocol picks it over
  default GSC in a strict majority of the evaluated (model, benchmark) pairs.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..evaluation.accelerator import make_accelerator
from ..evaluation.fingerprints import file_sha256
from ..evaluation.json_files import jsonable, table_lines
from ..evaluation.loaders import device_batches, make_dataloader
from ..evaluation.loop import score_split
from ..evaluation.plan import subset
from ..evaluation.ranking import VALIDATION_METRICS, rank, validation_metrics
from ..evaluation.validation_sets import VALIDATION_SEED, GeneratedImages, heldout_classes_validation
from ..utils.confined_files import atomic_write_text


#: Every method compared, in report order.
VARIANT_NAMES: tuple[str, ...] = ("energy", "gsc", "gsc_adaptive", "gsc_fisher", "gsc_multilayer")
#: The GSC configurations the protocol chooses between; the default first (it wins ties).
GSC_VARIANTS: tuple[str, ...] = ("gsc", "gsc_adaptive", "gsc_fisher", "gsc_multilayer")
BENCHMARK_NAMES: tuple[str, ...] = ("fmnist-ood", "fmnist-openset")
ARCHS: tuple[str, ...] = ("resnet", "vit", "swin")


# ------------------------------------------------------------------------------------- variants
def earlier_block(model: torch.nn.Module) -> str:
    """The block before the last one of the model's registered encoder, e.g. ``"vit.layers.-2"``."""
    from ..classifier.architectures import ARCHITECTURES

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    spec = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if spec is None:
        raise ValueError(f"model type {model_type!r} has no registered encoder blocks")
    return f"{spec.blocks}.-2"


def variant_hyperparameters(model: torch.nn.Module) -> dict[str, tuple[str, dict[str, Any]]]:
    """Variant name -> (registered detector name, hyperparameters)."""
    try:
        earlier: str | None = earlier_block(model)
    except ValueError:
        earlier = None
    return {
        "energy": ("energy", {}),
        "gsc": ("gsc", {}),
        "gsc_adaptive": ("gsc", {"mask_size": "adaptive"}),
        "gsc_fisher": ("gsc", {"selection": "fisher"}),
        "gsc_multilayer": ("gsc", {"earlier_split_point": earlier or "unregistered"}),
    }


def build_variants(
    model: torch.nn.Module, names: Sequence[str] = VARIANT_NAMES
) -> tuple[dict[str, Any], dict[str, str]]:
    """``(detectors, unavailable)``: a detector per variant, or the reason it cannot run on ``model``."""
    from ..detectors import get_detector

    specs = variant_hyperparameters(model)
    detectors, unavailable = {}, {}
    for name in names:
        method, hyperparameters = specs[name]
        try:
            detectors[name] = get_detector(method, model, **hyperparameters)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            unavailable[name] = str(error)
    return detectors, unavailable


# ----------------------------------------------------------------------------------------- data
def split_validation(num_rows: int, parts: Mapping[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Disjoint random row sets of the ID validation split, sorted, of the requested sizes (shrunk
    proportionally when the split is too small)."""
    total = sum(parts.values())
    scale = min(1.0, num_rows / total) if total else 1.0
    order = np.random.default_rng([seed, zlib.crc32(b"validation-parts")]).permutation(num_rows)
    out, start = {}, 0
    for name, size in parts.items():
        size = int(size * scale)
        out[name] = np.sort(order[start : start + size])
        start += size
    return out


def build_validation_ood(
    benchmark: str, jigsaw_source: Any | None, num_samples: int, seed: int = VALIDATION_SEED
) -> dict[str, Any]:
    """The validation OOD sets of ``benchmark`` (see the module docstring); never a test OOD split."""
    from ..data.arrays import to_dataset

    if benchmark == "fmnist-ood":
        from ..data.noise import generate_noise

        noise, _ = generate_noise(num_samples, seed=seed)
        sets = {"val_noise": to_dataset(noise, [-1] * len(noise))}
        if jigsaw_source is not None and len(jigsaw_source):
            sets["val_jigsaw"] = GeneratedImages(jigsaw_source, "jigsaw", seed)
        return sets
    if benchmark == "fmnist-openset":
        return {"val_heldout_classes": heldout_classes_validation(num_samples, seed)}
    raise ValueError(f"no validation OOD sets defined for benchmark {benchmark!r}; known: {BENCHMARK_NAMES}")


# -------------------------------------------------------------------------------------- scoring
def fit_batches(dataset: Any, transform: Callable[[list], torch.Tensor], batch_size: int, device: Any) -> Any:
    """``(pixel_values, labels)`` batches of a benchmark-style dataset on ``device``, for ``Detector.fit``."""
    return device_batches(make_dataloader(dataset, transform, batch_size), device)


def score_dataset(
    detectors: Mapping[str, Any], dataset: Any, transform: Callable[[list], torch.Tensor], batch_size: int = 128
) -> dict[str, np.ndarray]:
    """Scores (higher = ID) of every detector on ``dataset`` through the evaluation's loop
    (:func:`hf_gsc.evaluation.loop.score_split`); images are preprocessed once per batch."""
    from ..detectors import DetectorBundle

    bundle = DetectorBundle(dict(detectors))  # one backbone pass per batch for every variant
    outputs = score_split(make_accelerator(), make_dataloader(dataset, transform, batch_size), {"variants": bundle.scores})
    return {name: outputs[("variants", name)].numpy() for name in detectors}


def metrics(id_scores: np.ndarray, ood_scores: Mapping[str, np.ndarray]) -> dict[str, dict[str, float]]:
    """The validation metrics of :func:`hf_gsc.evaluation.ranking.validation_metrics` (FPR95, AUROC, FPR95 (OOD+))
    per OOD set and their mean (``"average"``)."""
    result = validation_metrics(id_scores, ood_scores)
    if result is None:
        raise ValueError("scores that are not finite (NaN or infinite) cannot be compared")
    return {**result["ood"], "average": {metric: result[metric] for metric in VALIDATION_METRICS}}


def select_variant(validation: Mapping[str, Mapping[str, Mapping[str, float]]], candidates: Sequence[str] = GSC_VARIANTS) -> str:
    """The protocol's rule, the package's one (:func:`hf_gsc.evaluation.ranking.rank`): the highest mean AUROC, then
    the lowest mean FPR95, then the candidates' order (the default first)."""
    ranked = rank({name: validation[name]["average"] for name in candidates if name in validation})
    if not ranked:
        raise ValueError("no candidate variant has validation metrics")
    return ranked[0]


# ------------------------------------------------------------------------------------- protocol
def fit_variants(
    detectors: Mapping[str, Any],
    id_splits: Mapping[str, Any],
    fit_validation: Any,
    transform: Callable,
    max_fit_samples: int,
    seed: int = 0,
    batch_size: int = 128,
) -> dict[str, dict[str, Any]]:
    """Fit the detectors that need it: ``fit_split="train"`` on at most ``max_fit_samples`` ID train
    rows, ``"validation"`` on ``fit_validation`` (the ``fit`` part of ID validation). Returns what was fitted."""
    from ..detectors import fit_together

    info: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}  # fixed before fitting: a fit can change what a detector still needs
    for name, detector in detectors.items():
        if detector.needs_fit:
            groups.setdefault(detector.fit_split, {})[name] = detector
    for split, group in groups.items():
        data = subset(id_splits["train"], max_fit_samples, seed, "fit") if split == "train" else fit_validation
        start = time.perf_counter()
        # The evaluation's fit loop: one backbone pass per batch for every variant fitted on this split.
        fit_together(list(group.values()), fit_batches(data, transform, batch_size, next(iter(group.values())).device))
        seconds = time.perf_counter() - start
        for name, detector in group.items():
            entry: dict[str, Any] = {"split": split, "num_samples": len(data), "seconds": seconds}
            if getattr(detector.config, "gradient_mass", None) is not None:
                entry["gradient_mass"] = detector.config.gradient_mass
            info[name] = entry
    return info


def run_protocol(
    detectors: Mapping[str, Any],
    id_splits: Mapping[str, Any],
    benchmark: str,
    transform: Callable,
    max_samples: int = 1000,
    max_fit_samples: int = 5000,
    seed: int = 0,
    batch_size: int = 128,
    validation_ood_builder: Callable[..., dict[str, Any]] = build_validation_ood,
) -> dict[str, Any]:
    """Fit every variant and choose between them with validation data only.

    Reads ``id_splits["train"]`` (Fisher) and ``id_splits["validation"]`` (adaptive mass, ID side of
    the selection, jigsaw sources) and nothing else of the benchmark: no ID test split, no OOD split.
    """
    validation = id_splits["validation"]
    parts = {"fit": max_samples, "select": max_samples}
    if benchmark == "fmnist-ood":
        parts["jigsaw"] = max_samples
    rows = split_validation(len(validation), parts, seed)
    fit_info = fit_variants(detectors, id_splits, validation.select(rows["fit"].tolist()), transform,
                            max_fit_samples, seed, batch_size)
    jigsaw_source = validation.select(rows["jigsaw"].tolist()) if "jigsaw" in rows else None
    val_ood = validation_ood_builder(benchmark, jigsaw_source, max_samples, VALIDATION_SEED)
    id_scores = score_dataset(detectors, validation.select(rows["select"].tolist()), transform, batch_size)
    ood_scores = {split: score_dataset(detectors, ds, transform, batch_size) for split, ds in val_ood.items()}
    validation_metrics = {
        name: metrics(id_scores[name], {split: s[name] for split, s in ood_scores.items()}) for name in detectors
    }
    return {
        "fit": fit_info,
        "num_samples": {"id_validation_fit": len(rows["fit"]), "id_validation_select": len(rows["select"]),
                        **{split: len(ds) for split, ds in val_ood.items()}},
        "validation": validation_metrics,
        "choice": select_variant(validation_metrics),
    }


def evaluate_test(
    detectors: Mapping[str, Any],
    id_test: Any,
    ood_splits: Mapping[str, Any],
    transform: Callable[[list], torch.Tensor],
    max_samples: int | None,
    seed: int = 0,
    batch_size: int = 128,
) -> dict[str, Any]:
    """Test metrics of every (already fitted) detector: ID test vs each OOD split, ``max_samples`` each."""
    id_test = subset(id_test, max_samples, seed, "test")
    id_scores = score_dataset(detectors, id_test, transform, batch_size)
    ood_scores, counts = {}, {"id_test": len(id_test)}
    for split, dataset in ood_splits.items():
        dataset = subset(dataset, max_samples, seed, f"ood_{split}")
        counts[split] = len(dataset)
        ood_scores[split] = score_dataset(detectors, dataset, transform, batch_size)
    test_metrics = {name: metrics(id_scores[name], {s: v[name] for s, v in ood_scores.items()}) for name in detectors}
    return {"num_samples": counts, "test": test_metrics}


def compare(
    arch: str,
    benchmark: str,
    max_samples: int = 1000,
    max_fit_samples: int = 5000,
    seed: int = 0,
    batch_size: int = 128,
    model_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Everything for one (reference model, benchmark) pair: protocol, test metrics, the comparison."""
    from transformers import AutoModelForImageClassification

    from ..data import load_benchmark, load_image_processor
    from ..evaluation.models import image_transform
    from ..reference_models import reference_model_path

    start = time.perf_counter()
    path = Path(model_dir) if model_dir is not None else reference_model_path(arch, benchmark)
    sha256 = model_sha256(path)  # before loading, so that a checkpoint replaced during the run is noticed
    model = AutoModelForImageClassification.from_pretrained(path).eval().requires_grad_(False)
    model.to(make_accelerator().device)
    processor = load_image_processor(path)
    bench = load_benchmark(benchmark)
    if model.config.num_labels != bench.num_labels:
        raise ValueError(f"{path} has {model.config.num_labels} labels but {benchmark} has {bench.num_labels} ID classes")
    detectors, unavailable = build_variants(model)

    transform = image_transform(processor, model)

    protocol = run_protocol(detectors, bench.id_splits, benchmark, transform, max_samples,
                            max_fit_samples, seed, batch_size)
    test = evaluate_test(detectors, bench.id_splits["test"], bench.ood_splits, transform, max_samples, seed, batch_size)
    choice = protocol["choice"]
    test_avg = {name: test["test"][name]["average"] for name in detectors}
    test_best = select_variant(test["test"])
    return {
        "arch": arch,
        "benchmark": benchmark,
        "model": str(path),
        "model_sha256": sha256,
        "settings": {"max_samples": max_samples, "max_fit_samples": max_fit_samples, "seed": seed,
                     "validation_seed": VALIDATION_SEED},
        "hyperparameters": {name: variant_hyperparameters(model)[name][1] for name in detectors},
        "unavailable": unavailable,
        **protocol,
        **test,
        "test_best": test_best,
        "choice_wins_on_test": choice == test_best,
        "choice_beats_default_on_test": choice != "gsc" and test_avg[choice]["fpr95"] < test_avg["gsc"]["fpr95"],
        "seconds": time.perf_counter() - start,
    }


def model_sha256(path: str | Path) -> str:
    """SHA-256 of ``model.safetensors`` in ``path``: results are tied to the exact checkpoint."""
    return file_sha256(Path(path) / "model.safetensors")


# --------------------------------------------------------------------------------------- report
def verdict(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per variant: in how many evaluated pairs the protocol picked it; ``default`` is the variant to
    recommend as the new default (picked over ``gsc`` in a strict majority of pairs) or ``"gsc"``."""
    picks = {name: sum(r["choice"] == name for r in results) for name in GSC_VARIANTS}
    evaluated = {name: sum(name in r["validation"] for r in results) for name in GSC_VARIANTS}
    winners = [name for name in GSC_VARIANTS[1:] if results and picks[name] * 2 > len(results)]
    return {"pairs": len(results), "picks": picks, "evaluated": evaluated, "default": winners[0] if winners else "gsc"}


def _cell(entry: Mapping[str, float] | None) -> str:
    if entry is None:
        return "n/a"
    return f"{100 * entry['fpr95']:.1f} / {100 * entry['auroc']:.1f}"


def markdown_tables(results: Sequence[Mapping[str, Any]], missing: Mapping[str, str] | None = None) -> str:
    """Test tables per benchmark (FPR95 / AUROC in %, per OOD split and average), the validation
    table, and the protocol's choices."""
    lines: list[str] = []
    for benchmark in BENCHMARK_NAMES:
        rows = [r for r in results if r["benchmark"] == benchmark]
        if not rows:
            continue
        splits = list(rows[0]["test"][next(iter(rows[0]["test"]))])
        splits = [s for s in splits if s != "average"] + ["average"]
        lines += [f"### `{benchmark}`: test (FPR95 / AUROC, %)", ""]
        lines += table_lines(["model", "method", *splits], (
            [r["arch"], name + (" (picked)" if name == r["choice"] else ""),
             *(_cell(r["test"][name].get(s)) if name in r["test"] else "n/a" for s in splits)]
            for r in rows for name in VARIANT_NAMES))
        counts = ", ".join(f"{r['arch']}: " + ", ".join(f"{k} {v}" for k, v in r["num_samples"].items()) for r in rows)
        lines += ["", f"Samples: {counts}.", ""]
    lines += ["### Validation protocol (FPR95 / AUROC on validation OOD, %)", ""]
    lines += table_lines(
        ["model", "benchmark", "validation OOD sets", *VARIANT_NAMES, "picked", "test best GSC", "picked beats default on test"],
        ([r["arch"], r["benchmark"], ", ".join(s for s in r["validation"][next(iter(r["validation"]))] if s != "average"),
          *(_cell(r["validation"][n]["average"]) if n in r["validation"] else "n/a" for n in VARIANT_NAMES),
          r["choice"], r["test_best"], "yes" if r["choice_beats_default_on_test"] else "no"] for r in results))
    lines.append("")
    notes = sorted({(r["arch"], n, reason) for r in results for n, reason in r["unavailable"].items()})
    for arch, name, reason in notes:
        lines.append(f"- `{name}` on {arch}: n/a ({reason})")
    for key, reason in (missing or {}).items():
        lines.append(f"- {key}: not evaluated ({reason})")
    fitted = [f"{r['arch']}/{r['benchmark']}: gradient_mass {r['fit']['gsc_adaptive']['gradient_mass']:.4f}"
              for r in results if "gradient_mass" in r["fit"].get("gsc_adaptive", {})]
    if fitted:
        lines.append("- calibrated adaptive gradient mass: " + "; ".join(fitted))
    v = verdict(results)
    lines += ["", f"Protocol picks over {v['pairs']} pairs: " + ", ".join(f"{k} {n}" for k, n in v["picks"].items())
              + f". Recommended default: `{v['default']}`.", ""]
    return "\n".join(lines)


def run(
    archs: Sequence[str],
    benchmarks: Sequence[str],
    output_dir: str | Path,
    max_samples: int = 1000,
    max_fit_samples: int = 5000,
    seed: int = 0,
    batch_size: int = 128,
    log: Callable[[str], None] = print,
) -> str:
    """Run :func:`compare` for every pair (reusing ``{output_dir}/{benchmark}/{arch}.json`` from an earlier
    run with the same settings), then write ``{output_dir}/variants.md``; returns the markdown."""
    output_dir = Path(output_dir)
    results, missing = [], {}
    settings = {"max_samples": max_samples, "max_fit_samples": max_fit_samples, "seed": seed,
                "validation_seed": VALIDATION_SEED}
    from ..reference_models import reference_model_path

    for benchmark in benchmarks:
        for arch in archs:
            try:
                model_dir = reference_model_path(arch, benchmark)
            except FileNotFoundError as error:
                missing[f"{arch} on {benchmark}"] = f"no checkpoint: {error}"
                log(f"{benchmark}/{arch}: skipped, {error}")
                continue
            path = output_dir / benchmark / f"{arch}.json"
            if path.is_file():
                saved = json.loads(path.read_text())
                if saved.get("settings") == settings and saved.get("model_sha256") == model_sha256(model_dir):
                    log(f"{benchmark}/{arch}: reusing {path}")
                    results.append(saved)
                    continue
            log(f"{benchmark}/{arch}: running")
            result = jsonable(compare(arch, benchmark, max_samples, max_fit_samples, seed, batch_size))
            atomic_write_text(path, json.dumps(result, indent=2, sort_keys=True))
            log(f"{benchmark}/{arch}: picked {result['choice']}, test best {result['test_best']} ({result['seconds']:.0f} s)")
            results.append(result)
    text = markdown_tables(results, missing)
    atomic_write_text(output_dir / "variants.md", text)
    return text
