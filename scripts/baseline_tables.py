#!/usr/bin/env python
"""Every registered method on the six reference model/benchmark pairs, and ``docs/baselines.md`` written from them.

Each pair is one ``hf-gsc evaluate --methods all`` run (``hf_gsc.OODEvaluator``) into
``docs/results/baselines/BENCHMARK/MODEL`` (``results.json``, ``results.md``; score caches are left out of git by
``.gitignore``). The page's summary (which method wins where, where GSC stands) is computed here from those
``results.json`` files, never typed in. Test metrics only describe; nothing here chooses by them.

Example (about 10 minutes on 2 CPU cores)::

    python scripts/baseline_tables.py            # runs what is missing, then writes docs/baselines.md
    python scripts/baseline_tables.py --rerun    # runs every pair again
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "baselines"
PAGE = ROOT / "docs" / "baselines.md"
PAIRS = [("fmnist-ood", "resnet"), ("fmnist-ood", "vit"), ("fmnist-ood", "swin"),
         ("fmnist-openset", "resnet-openset"), ("fmnist-openset", "vit-openset"), ("fmnist-openset", "swin-openset")]
SETTINGS = ["--max-samples", "500", "--max-fit-samples", "2000", "--seed", "0", "--no-plots"]
#: OpenOOD v1.5's ImageNet-1K leaderboard rows as published (``results/imagenet1k_ood.csv``; each row's repository and
#: commit in its ``Source`` column): cited, never measured here.
LEADERBOARD = ROOT / "docs" / "results" / "openood_leaderboard" / "imagenet1k_ood.csv"
#: The method of this library that reruns each leaderboard postprocessor, with a note; ``None``: not here, and why.
LEADERBOARD_METHODS: dict[str, tuple[str | None, str]] = {
    "OpenMax": ("openmax", ""), "MSP": ("msp", ""), "TempScale": ("temp_scaling", ""), "ODIN": ("odin", ""),
    "MDS": ("mahalanobis", ""), "MDSEns": ("mds_ensemble", ""), "RMDS": ("rmds", ""),
    "Gram": ("gram", "the row was published (June 2023) before OpenOOD's Gram code was rewritten by the paper's first "
                     "author (February 2024); `gram` follows the rewrite, not the code that gave this row"),
    "EBO": ("energy", ""), "GradNorm": ("gradnorm", ""), "ReAct": ("react", ""), "MLS": ("max_logit", ""),
    "KLM": ("klm", ""), "VIM": ("vim", ""), "KNN": ("knn", ""), "DICE": ("dice", ""), "RankFeat": ("rankfeat", ""),
    "ASH": ("ash_b", "OpenOOD's `ASHNet` applies ASH-B"), "SHE": ("she", ""), "GEN": ("gen", ""),
    "NNGuide": ("nnguide", ""), "SCALE": ("scale", ""),
    "NAC": ("nac", "the authors' per-layer settings as published (the ID-only mode)"),
    "fDBD": ("fdbd", ""), "CombOOD": (None, "not here: not implemented, its code not read"),
    "WeiPer+KLD": ("weiper_kldiv", ""), "i-ODIN": ("iodin", ""), "AdaSCALE-A": ("adascale_a", ""),
    "AdaSCALE-L": ("adascale_l", ""), "NCI": ("nci", ""), "MDS++": ("mahalanobis_pp", ""), "RMDS++": ("rmds_pp", ""),
}


def evaluate(benchmark: str, model: str) -> None:
    from hf_gsc import OODEvaluator
    from hf_gsc.evaluation.arguments import parse_arguments

    # Paths relative to the repository root, the working directory: results.json records the arguments.
    os.chdir(ROOT)
    OODEvaluator(args=parse_arguments([
        "--model", f"hf_gsc/reference_models/{model}", "--benchmark", benchmark, "--methods", "all", *SETTINGS,
        "--output-dir", str((RESULTS / benchmark / model).relative_to(ROOT)), "--overwrite"])).evaluate()


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


def summary(results: dict[tuple[str, str], dict]) -> list[str]:
    """One line per pair: the best method by mean AUROC and by mean FPR95, GSC's rank and GSC vs Energy."""
    lines = ["| Benchmark / model | selected on validation: test AUROC / FPR95 (its test rank) | best test mean AUROC | "
             "best test mean FPR95 | GSC: test rank by AUROC, AUROC / FPR95 | Energy (the score GSC modifies): AUROC / "
             "FPR95 | skipped |", "|---|---|---|---|---|---|---|"]
    for (benchmark, model), result in results.items():
        methods = result["methods"]
        by_auroc = sorted(methods, key=lambda m: (-methods[m]["average"]["auroc"], methods[m]["average"]["fpr95"], m))
        best_fpr = min(methods, key=lambda m: (methods[m]["average"]["fpr95"], -methods[m]["average"]["auroc"], m))
        gsc, energy = methods.get("gsc"), methods.get("energy")
        gsc_cell = (f"{by_auroc.index('gsc') + 1} of {len(methods)}, {_pct(gsc['average']['auroc'])} / "
                    f"{_pct(gsc['average']['fpr95'])}" if gsc else "not scored")
        energy_cell = f"{_pct(energy['average']['auroc'])} / {_pct(energy['average']['fpr95'])}" if energy else "-"
        skipped = ", ".join(sorted(result.get("skipped", {}))) or "none"
        chosen = (result.get("selection") or {}).get("method")
        chosen_cell = (f"{chosen}: {_pct(methods[chosen]['average']['auroc'])} / {_pct(methods[chosen]['average']['fpr95'])}"
                       f" ({by_auroc.index(chosen) + 1} of {len(methods)})" if chosen in methods else "none")
        lines.append(f"| {benchmark} / {model} | {chosen_cell} | "
                     f"{by_auroc[0]} ({_pct(methods[by_auroc[0]]['average']['auroc'])}) | "
                     f"{best_fpr} ({_pct(methods[best_fpr]['average']['fpr95'])}) | {gsc_cell} | {energy_cell} | "
                     f"{skipped} |")
    return lines


def leaderboard_method(training: str, postprocessor: str) -> str:
    """The table's last cell: the method name that reruns the row, or "not here" and why."""
    if training == postprocessor:  # ConfBranch, RotPred, G-ODIN, ARPL, MOS, T2FNorm
        return "not here: a training-time method (its own training objective or head)"
    method, note = LEADERBOARD_METHODS.get(postprocessor, (None, "not here: not implemented"))
    if method is None:
        return note
    cell = f"`{method}`" + (f" ({note})" if note else "")
    if training != "CrossEntropy":
        cell += f", on a checkpoint trained with {training} (the training is not here)"
    return cell


def leaderboard_section() -> list[str]:
    """The section placing this library's methods beside OpenOOD v1.5's ImageNet-1K leaderboard rows."""
    with LEADERBOARD.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    sources = sorted({row["Source"] for row in rows})
    lines = [
        "## Beside OpenOOD v1.5's ImageNet-1K leaderboard",
        "",
        "Each row of OpenOOD v1.5's ImageNet-1K OOD leaderboard (its `results/imagenet1k_ood.csv`, read at the "
        "commits below) with its published",
        "near-OOD and far-OOD AUROC, and the method of this library that reruns its postprocessor. The numbers are "
        "OpenOOD's, copied",
        "as published: **none was measured by this library**; the page's tables above are this library's runs. The "
        "`CrossEntropy` rows",
        "are torchvision's ImageNet checkpoints; to rerun one here, load those weights as a Hugging Face or timm "
        "model (timm's",
        "`timm/resnet50.tv_in1k` holds torchvision's ResNet-50 weights) and evaluate on `imagenet-ood`, whose near "
        "and far groups are",
        "OpenOOD v1.5's ([data.md](data.md)): `hf-gsc evaluate --model MODEL --benchmark imagenet-ood --methods "
        "NAME`. OpenOOD",
        "chooses some methods' settings on its OOD validation set (`APS_mode`); this library's defaults and `--tune` "
        "use ID data only.",
        "",
        "Sources (repository, commit): " + "; ".join(f"`{source}`" for source in sources) + " (the rows after NCI are "
        "in the second, the fork where OpenOOD's maintainers now take leaderboard entries). The rows, with their "
        "source: [results/openood_leaderboard/imagenet1k_ood.csv](results/openood_leaderboard/imagenet1k_ood.csv).",
        "",
        "| Arch | Training | Postprocessor | near-OOD AUROC | far-OOD AUROC | ID accuracy | checkpoint | hf_gsc method |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['Arch']} | {row['Training']} | {row['Postprocessor']} | {row['Near-OOD_AUROC']} | "
                     f"{row['Far-OOD_AUROC']} | {row['ID_Accuracy']} | {row['Additional_Description']} | "
                     f"{leaderboard_method(row['Training'], row['Postprocessor'])} |")
    return lines


def write_page(results: dict[tuple[str, str], dict]) -> None:
    methods = sorted({m for r in results.values() for m in r["methods"]})
    parts = [
        "# Baselines: every registered method on the reference models",
        "",
        "Every registered method (`hf-gsc evaluate --list-methods`; one file each under `hf_gsc/detectors/`, defaults",
        "and citations in each docstring) run through the main evaluation on both benchmarks and the three shipped",
        "reference models of each. Fitted methods are fitted on their `fit_split` (train; ReAct on",
        "ID validation), thresholds come from ID validation, metrics from the ID test split and the OOD splits. **500",
        "samples per split** (random, seed 0) and at most 2,000 fitting samples, to fit the 2-core CPU budget: one FPR95",
        "value is good to about ±2–3 points at this size. ODIN and AdaSCALE take the image processor's normalisation",
        "std. Default hyperparameters throughout (no `--tune`): these tables describe the methods, they do not choose",
        "one; choose on validation data (`hf-gsc evaluate` writes a `selection` record).",
        "",
        "Regenerate every run and this page (the summary below is computed from the `results.json` files):",
        "",
        "```bash",
        "python scripts/baseline_tables.py --rerun",
        "```",
        "",
        f"Methods ({len(methods)}): {', '.join(f'`{m}`' for m in methods)}.",
        "",
        "## Summary",
        "",
        *summary(results),
        "",
        "Means are over each pair's OOD splits; ID = positive class. The selection ranks the methods on validation data",
        "only (ID validation against OOD sets generated from it, `results.json` `selection`); the test columns describe,",
        "they do not choose.",
        "",
        *leaderboard_section(),
        "",
    ]
    for benchmark, model in results:
        parts.append((RESULTS / benchmark / model / "results.md").read_text().strip())
        parts.append("")
    PAGE.write_text("\n".join(parts))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rerun", action="store_true", help="run every pair again, not only the missing ones")
    parser.add_argument("--pairs", default=None, help="comma list of BENCHMARK/MODEL to run (default: all six)")
    args = parser.parse_args()
    pairs = PAIRS if args.pairs is None else [tuple(p.split("/")) for p in args.pairs.split(",")]
    for benchmark, model in pairs:
        if args.rerun or not (RESULTS / benchmark / model / "results.json").exists():
            print(f"evaluating {model} on {benchmark}", file=sys.stderr, flush=True)
            evaluate(benchmark, model)
    results = {pair: json.loads((RESULTS / pair[0] / pair[1] / "results.json").read_text()) for pair in PAIRS
               if (RESULTS / pair[0] / pair[1] / "results.json").exists()}
    write_page(results)
    print("\n".join(summary(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
