"""The ablation grid of issue #7 and its runner: every variant scored on the same samples, head only where possible.

Tables (paper label in brackets), all at ``mask_ratio = 5%``, ``operation = zero``, ``selection = gradient``,
``approximation = first_order`` (the library defaults) unless the table varies that setting:

* ``mask_ratio`` [``tab:finer_ratios``, ``fig:shortcircuit_curve``]: 1, 2, 5, 10, 20 %.
* ``operation`` [``tab:shortcircuit_ablation``, ``tab:local_replacement``]: zero, perturb (``alpha=0.1``, "Small"),
  project ("Orth"), clip +-1, clip +-0.5, scale 0.5, at 5 % and 10 %.
* ``selection`` [``tab:random_reverse_table``]: largest ``|g|`` (GSC), random, reverse (smallest nonzero ``|g|``).
* ``iterative`` [``tab:iterative_shortcircuit``]: 1, 2, 3 steps under one 5 % budget
  (:mod:`hf_gsc.analysis.iterative`; exact logits, so 1 step = one-shot GSC with ``approximation="exact"``).
* ``split_point`` [``tab:layerwise_shortcircuit``]: two blocks before the end, one block before the end, the final
  encoder output (default), the penultimate feature, and two at once (two blocks before the end + final encoder
  output under one shared 5 % budget, ``GSCConfig.earlier_split_point``).
* ``gsc_ash`` [the paper's "GSC + ASH" rows]: ASH-S, GSC at the penultimate feature, GSC + ASH.

Every row reports test metrics (that is what an ablation is); nothing here picks a setting on test data.
Single-split variants share the backbone pass: ``F`` is computed once per (batch, split point) and every
variant runs the head only (:mod:`hf_gsc.analysis.context`). The multi-layer and ASH rows run their detectors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

import torch
from torch import nn
from transformers import PreTrainedModel

from ..classifier.architectures import registered_architecture
from ..classifier.split_points import resolve_split_point
from ..detectors.gsc import GSCConfig, GSCDetector
from ..evaluation.metrics import ood_metrics
from ..evaluation.report import average_over_splits, table_lines
from .approximation_error import approximation_outputs, summarise_errors
from .context import HeadContext, gsc_logits, head_context, scores_of
from .gradient_concentration import DEFAULT_FRACTIONS, TABLE_FRACTIONS, column_of, curve_summary, top_fraction_ratio


if TYPE_CHECKING:
    from ..evaluation.loop import Scorer

_GSC_DEFAULTS = GSCConfig()
DEFAULT_SPLIT = _GSC_DEFAULTS.split_point


def _variant_key(self) -> str:
    """A short stable name: the fields that differ from the defaults."""
    default = Variant()
    parts = [f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
             if getattr(self, f.name) != getattr(default, f.name)]
    return ",".join(parts) or "gsc(defaults)"


#: One scored configuration (a frozen dataclass): ``kind`` -- ``baseline`` (score of the unchanged logits), ``gsc``
#: (head only at ``split_point``), ``multi_layer`` (``earlier_split_point`` + ``split_point``), ``gsc_ash`` or
#: ``ash_s`` (detectors) --, then every ``GSCConfig`` setting with the library's own default (so ablations vary one
#: thing away from them), then ``steps`` (short-circuit steps sharing the budget). ``key()`` names it.
Variant: Any = dataclasses.make_dataclass(
    "Variant",
    [("kind", str, "gsc")]
    + [(name, Any, getattr(_GSC_DEFAULTS, name)) for name in GSCConfig.setting_names()]
    + [("steps", int, 1)],
    namespace={"key": _variant_key, "__module__": __name__},
    frozen=True,
)


class SplitPointNames(TypedDict):
    """:func:`model_split_points`: module paths of a model's named split points."""

    one_block_before: str
    two_blocks_before: str
    multi_layer_earlier: str | None


def model_split_points(model: nn.Module) -> SplitPointNames:
    """Named split points of ``model``: ``one_block_before`` / ``two_blocks_before`` the final encoder output
    (module paths whose remaining head runs 1 / 2 encoder blocks) and ``multi_layer_earlier`` (``None`` where the
    library has no multi-layer support for the architecture)."""
    spec = registered_architecture(model)
    if spec is None:
        raise ValueError(f"no encoder registry entry for model type {getattr(model.config, 'model_type', None)!r}")
    return {
        "one_block_before": spec.blocks_before_final(model, 1),
        "two_blocks_before": spec.blocks_before_final(model, 2),
        "multi_layer_earlier": f"{spec.blocks}.-3" if spec.blocks_take_hidden_only else None,
    }


def variant_grid(model: nn.Module) -> dict[str, list[tuple[str, Variant]]]:
    """Table name -> ``[(row label, variant)]``. Rows of different tables may share a variant (scored once)."""
    points = model_split_points(model)
    no_sc = ("No SC (energy)", Variant(kind="baseline"))
    gsc = Variant()
    tables: dict[str, list[tuple[str, Variant]]] = {
        "baseline": [("MSP", Variant(kind="baseline", score="msp")), no_sc, ("GSC (defaults)", gsc)],
        "mask_ratio": [no_sc] + [(f"{r:g}%", Variant(mask_ratio=r / 100)) for r in (1, 2, 5, 10, 20)],
        "operation": [],
        "selection": [
            ("GSC (largest |g|)", gsc),
            ("Random", Variant(selection="random")),
            ("Reverse (smallest |g|)", Variant(selection="reverse")),
        ],
        "iterative": [no_sc] + [
            (f"{t} step{'s' if t > 1 else ''} (5% total)", Variant(approximation="exact", steps=t)) for t in (1, 2, 3)
        ],
        "split_point": [no_sc],
        "gsc_ash": [
            no_sc,
            ("ASH-S", Variant(kind="ash_s", split_point="penultimate")),
            ("GSC at penultimate", Variant(split_point="penultimate")),
            ("GSC at final encoder output (default)", gsc),
            ("GSC + ASH", Variant(kind="gsc_ash", split_point="penultimate")),
        ],
    }
    operations: list[tuple[str, dict[str, Any]]] = [
        ("Zero", {"operation": "zero"}),
        ("Small (perturb, alpha=0.1)", {"operation": "perturb", "alpha": 0.1}),
        ("Orth (project)", {"operation": "project"}),
        ("Clip (+-1.0)", {"operation": "clip", "clip_bound": 1.0}),
        ("Clip (+-0.5)", {"operation": "clip", "clip_bound": 0.5}),
        ("Scale (0.5)", {"operation": "scale", "beta": 0.5}),
    ]
    for ratio in (5, 10):
        for label, settings in operations:
            tables["operation"].append((f"{label} @ {ratio}%", Variant(mask_ratio=ratio / 100, **settings)))
    tables["split_point"] += [
        (f"two blocks before the end ({points['two_blocks_before']})", Variant(split_point=points["two_blocks_before"])),
        (f"one block before the end ({points['one_block_before']})", Variant(split_point=points["one_block_before"])),
        ("final encoder output (default)", gsc),
        ("penultimate", Variant(split_point="penultimate")),
    ]
    if points["multi_layer_earlier"] is not None:
        tables["split_point"].append((
            f"two at once ({points['multi_layer_earlier']} + final, shared 5%)",
            Variant(kind="multi_layer", earlier_split_point=points["multi_layer_earlier"]),
        ))
    return tables


def unique_variants(tables: Mapping[str, Sequence[tuple[str, Variant]]]) -> list[Variant]:
    seen: dict[Variant, None] = {}
    for rows in tables.values():
        for _, variant in rows:
            seen.setdefault(variant)
    return list(seen)


class _Scorer:
    """Scores one variant on batches; keeps its own random generator across batches."""

    def __init__(self, model: nn.Module, variant: Variant, seed: int = 0) -> None:
        self.variant = variant
        self.generator = torch.Generator().manual_seed(seed)
        self.detector: Any = None
        if variant.kind == "multi_layer":
            self.detector = GSCDetector(
                model, GSCConfig(**{name: getattr(variant, name) for name in GSCConfig.setting_names()})
            )
        elif variant.kind in ("gsc_ash", "ash_s"):
            from ..detectors import get_detector

            settings = {} if variant.kind == "ash_s" else {
                "split_point": variant.split_point, "mask_ratio": variant.mask_ratio, "approximation": variant.approximation}
            self.detector = get_detector(variant.kind, model, **settings)

    def __call__(
        self, pixel_values: torch.Tensor, contexts: Callable[[str], HeadContext]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(scores (B,) float64, predictions (B,) or None)`` on the CPU."""
        v = self.variant
        if v.kind == "baseline":
            logits = contexts(DEFAULT_SPLIT).logits
        elif v.kind == "gsc":
            logits = gsc_logits(contexts(v.split_point), v.mask_ratio, v.selection, v.operation, v.approximation,
                                v.alpha, v.clip_bound, v.beta, v.steps, self.generator)
        elif v.kind in ("multi_layer", "gsc_ash"):  # both have GSC's step(backbone pass)
            logits = self.detector.step(self.detector.backbone_pass(pixel_values))[1].gsc_logits
        else:  # ash_s: a score without new logits
            return self.detector.score(pixel_values).double().cpu(), None
        return scores_of(logits, v.score), logits.argmax(dim=-1).cpu()


class _BatchWork:
    """Work shared by the scorers of one batch: the :class:`HeadContext` per split point and each variant's
    ``(scores, predictions)``, computed on first use and dropped when the next batch arrives.

    The scoring loop calls every scorer of a batch with the same ``pixel_values`` object, so its identity
    tells a new batch from the current one.
    """

    def __init__(self, model: nn.Module, scorers: Mapping[Variant, _Scorer]) -> None:
        self.model, self.scorers = model, scorers
        self.splits: dict = {}
        self.seconds = {variant: 0.0 for variant in scorers}
        self._batch: torch.Tensor | None = None
        self._done: dict = {}

    def _memo(self, pixel_values: torch.Tensor, key: Any, compute: Callable[[], Any]) -> Any:
        if pixel_values is not self._batch:
            self._batch, self._done = pixel_values, {}
        if key not in self._done:
            self._done[key] = compute()
        return self._done[key]

    def context(self, pixel_values: torch.Tensor, name: str) -> HeadContext:
        def compute() -> HeadContext:
            if name not in self.splits:
                self.splits[name] = resolve_split_point(self.model, name)
            return head_context(self.splits[name], pixel_values)

        return self._memo(pixel_values, ("context", name), compute)

    def variant(self, pixel_values: torch.Tensor, variant: Variant) -> tuple[torch.Tensor, torch.Tensor | None]:
        def compute() -> tuple[torch.Tensor, torch.Tensor | None]:
            tick = time.perf_counter()
            result = self.scorers[variant](pixel_values, lambda name: self.context(pixel_values, name))
            self.seconds[variant] += time.perf_counter() - tick
            return result

        return self._memo(pixel_values, ("variant", variant), compute)

    # The scorers of collect(), one per output:
    def score(self, pixel_values: torch.Tensor, variant: Variant) -> torch.Tensor:
        return self.variant(pixel_values, variant)[0]

    def prediction(self, pixel_values: torch.Tensor, variant: Variant) -> torch.Tensor:
        predictions = self.variant(pixel_values, variant)[1]
        assert predictions is not None, "only ASH-S makes no predictions, and it has no prediction scorer"
        return predictions

    def approximation(self, pixel_values: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
        return approximation_outputs(self.context(pixel_values, name))

    def concentration(self, pixel_values: torch.Tensor, name: str, fractions: Sequence[float]) -> torch.Tensor:
        return top_fraction_ratio(self.context(pixel_values, name).gradient, fractions)


def _prepare_model(model: nn.Module) -> None:
    """Eval mode, frozen, eager attention (torch has no forward-mode AD for fused SDPA; same function)."""
    model.eval().requires_grad_(False)
    # Only a transformers model has an attention implementation to set.
    if isinstance(model, PreTrainedModel) and getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation("eager")


def collect(
    model: nn.Module,
    data: Mapping[str, Any],
    tables: Mapping[str, Sequence[tuple[str, Variant]]],
    approximation_split_points: Sequence[str] = (DEFAULT_SPLIT,),
    concentration_split_points: Sequence[str] = (DEFAULT_SPLIT, "penultimate"),
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Score every variant, the approximation-error outputs and TopKRatio curves on every data split.

    Args:
        data: split name -> an unprepared ``DataLoader`` of ``{"pixel_values", "labels"}`` batches (labels
            ``-1`` for OOD), as :func:`hf_gsc.evaluation.loaders.make_dataloader` makes; each split goes through
            :func:`hf_gsc.evaluation.loop.score_split`, the evaluation's own loop.
    Returns:
        ``{"scores": {variant: {split: (N,)}}, "predictions": {...}, "labels": {split: (N,)},
        "approximation": {split_point: {split: {...}}}, "concentration": {split_point: {split: (N, F)}},
        "seconds": {variant: float}}``.
    """
    from ..evaluation.accelerator import make_accelerator
    from ..evaluation.loop import score_split

    _prepare_model(model)
    accelerator = make_accelerator()
    model.to(accelerator.device)
    variants = unique_variants(tables)
    work = _BatchWork(model, {v: _Scorer(model, v) for v in variants})
    scorers: dict[tuple[str, Any], Scorer] = {}
    for variant in variants:
        scorers[("score", variant)] = functools.partial(work.score, variant=variant)
        if variant.kind != "ash_s":  # ASH-S scores without new logits: no predictions
            scorers[("prediction", variant)] = functools.partial(work.prediction, variant=variant)
    for point in approximation_split_points:
        scorers[("approximation", point)] = functools.partial(work.approximation, name=point)
    for point in concentration_split_points:
        scorers[("concentration", point)] = functools.partial(work.concentration, name=point, fractions=fractions)
    scores: dict = {v: {} for v in variants}
    predictions: dict = {v: {} for v in variants}
    labels: dict[str, torch.Tensor] = {}
    approximation: dict = {p: {} for p in approximation_split_points}
    concentration: dict = {p: {} for p in concentration_split_points}
    for split_name, dataloader in data.items():
        started = time.perf_counter()
        out = score_split(accelerator, dataloader, scorers, description=split_name)
        labels[split_name] = out["labels"]
        for variant in variants:
            scores[variant][split_name] = out[("score", variant)]
            predictions[variant][split_name] = out.get(("prediction", variant))
        for point in approximation_split_points:
            approximation[point][split_name] = {
                key[1]: value for key, value in out.items() if isinstance(key, tuple) and key[0] == ("approximation", point)
            }
        for point in concentration_split_points:
            concentration[point][split_name] = out[("concentration", point)]
        log(f"  {split_name}: {labels[split_name].numel()} samples, {time.perf_counter() - started:.1f}s")
    return {"scores": scores, "predictions": predictions, "labels": labels, "approximation": approximation,
            "concentration": concentration, "seconds": work.seconds, "split_points": {
                name: split.module_path for name, split in work.splits.items()}}


def summarise(
    collected: Mapping[str, Any],
    tables: Mapping[str, Sequence[tuple[str, Variant]]],
    id_split: str,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
) -> dict[str, Any]:
    """Metrics per variant (each OOD split and their mean), ID accuracy, error tables and concentration curves."""
    labels = collected["labels"]
    ood_splits = [s for s in labels if s != id_split]
    id_labels = labels[id_split]
    keep = id_labels >= 0
    variants: dict[str, Any] = {}
    for variant, per_split in collected["scores"].items():
        per_ood = {s: ood_metrics(per_split[id_split], per_split[s]) for s in ood_splits}
        mean = average_over_splits(per_ood)
        prediction = collected["predictions"][variant][id_split]
        accuracy = None
        if prediction is not None and keep.any():
            accuracy = float((prediction[keep] == id_labels[keep]).double().mean())
        variants[variant.key()] = {
            "settings": dataclasses.asdict(variant), "mean": mean, "per_ood_split": per_ood,
            "id_accuracy": accuracy, "seconds": collected["seconds"][variant],
        }
    base = collected["predictions"][Variant(kind="baseline")][id_split] if Variant(kind="baseline") in collected["predictions"] else None
    result_tables = {
        table: [{"row": label, "variant": variant.key()} for label, variant in rows] for table, rows in tables.items()
    }
    approximation = {
        point: summarise_errors(outputs, id_split, ood_splits, id_labels if keep.any() else None)
        for point, outputs in collected["approximation"].items()
    }
    concentration: dict[str, Any] = {}
    for point, per_split in collected["concentration"].items():
        curves = {f"ID ({id_split})": curve_summary(per_split[id_split])}
        curves["OOD (all)"] = curve_summary(torch.cat([per_split[s] for s in ood_splits]))
        for s in ood_splits:
            curves[f"OOD {s}"] = curve_summary(per_split[s])
        concentration[point] = {"fractions": list(fractions), "curves": curves}
    return {
        "id_split": id_split,
        "ood_splits": ood_splits,
        "num_samples": {s: int(v.numel()) for s, v in labels.items()},
        "id_accuracy_base": None if base is None or not keep.any() else float((base[keep] == id_labels[keep]).double().mean()),
        "split_point_modules": collected.get("split_points", {}),
        "variants": variants,
        "tables": result_tables,
        "approximation_error": approximation,
        "gradient_concentration": concentration,
    }


# ------------------------------------------------------------------------------------------ markdown
def _pct(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{100 * value:.2f}"


def _row_cells(label: str, r: Mapping[str, Any], ood: Sequence[str]) -> list[str]:
    """One ablation row: mean FPR95, AUROC, ID accuracy, and per OOD split when there are several."""
    escaped = label.replace("|", "\\|")  # a literal | would end the markdown cell
    cells = [escaped, _pct(r["mean"]["fpr95"]), _pct(r["mean"]["auroc"]), _pct(r["id_accuracy"])]
    if len(ood) > 1:
        cells += [f"{_pct(r['per_ood_split'][s]['fpr95'])} / {_pct(r['per_ood_split'][s]['auroc'])}" for s in ood]
    return cells


def markdown_tables(summary: Mapping[str, Any], title: str = "") -> str:
    """The ablation tables, approximation error and concentration tables of one (benchmark, model) summary."""
    lines = [f"## {title}", ""] if title else []
    n = summary["num_samples"]
    lines.append(
        f"Samples: ID {summary['id_split']} {n[summary['id_split']]}, OOD "
        + ", ".join(f"{s} {n[s]}" for s in summary["ood_splits"])
        + f". Base ID accuracy {_pct(summary['id_accuracy_base'])}%. FPR95 / AUROC averaged over the OOD splits (%)."
    )
    lines.append("")
    ood = summary["ood_splits"]
    for table, rows in summary["tables"].items():
        lines += [f"### {table}", ""]
        header = ["variant", "FPR95", "AUROC", "ID acc"] + ([f"{s} FPR95/AUROC" for s in ood] if len(ood) > 1 else [])
        lines += table_lines(header, (_row_cells(row["row"], summary["variants"][row["variant"]], ood) for row in rows))
        lines.append("")
    for point, result in summary["approximation_error"].items():
        lines += [f"### approximation error at {point} (5% zero-out): |score(approx) - score(exact)|", ""]
        lines += table_lines(
            ["approximation", "score", "ID mean +- std", "ID max", "OOD mean +- std", "OOD max"],
            ([approximation, score, *(cell for group in ("ID", "OOD") for cell in (
                f"{groups[group]['mean']:.3g} +- {groups[group]['std']:.3g}", f"{groups[group]['max']:.3g}"))]
             for approximation, per_score in result["errors"].items() for score, groups in per_score.items()))
        if result["id_accuracy"]:
            acc = result["id_accuracy"]
            lines += ["", "ID accuracy: " + ", ".join(f"{k} {_pct(v)}%" for k, v in acc.items())]
        lines.append("")
    for point, result in summary["gradient_concentration"].items():
        fractions = result["fractions"]
        cols = [column_of(f, fractions) for f in TABLE_FRACTIONS]
        lines += [f"### gradient concentration at {point}: mean TopKRatio(k = f n) +- std", ""]
        lines += table_lines(["data", *(f"f={100 * f:g}%" for f in TABLE_FRACTIONS)], (
            [split, *(f"{curve['mean'][c]:.3f} +- {curve['std'][c]:.3f}" for c in cols)]
            for split, curve in result["curves"].items()))
        lines.append("")
    return "\n".join(lines)
