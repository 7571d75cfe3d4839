#!/usr/bin/env python
"""KNN with a bank like the authors' on ImageNet (1% of the training set, ``k = 10``: 12.8 rows per class) against
the whole fitting set (``k = 50``, the default, and ``k = 10``), and the whole set held in float16
(``bank_dtype=float16``), on the reference models: the evaluation's AUROC and FPR95 per OOD split. Each row is one
``hf-gsc evaluate --methods knn`` run with the baseline tables' settings (``--max-samples 500 --max-fit-samples 2000
--seed 0``).

Example::

    python scripts/knn_bank_fraction.py --output docs/results/scale/knn_bank_fraction.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ["--max-samples", "500", "--max-fit-samples", "2000", "--seed", "0", "--no-plots"]
#: ``bank_fraction=0.064`` keeps 12.8 bank rows per class of the 2,000 fitting images of 10 classes, the rows per class
#: of the authors' ImageNet bank (1% of 1,281,167 images, 1,000 classes); 0.01 keeps 2 per class, fewer than k.
VARIANTS = {"k=50, whole set": ["knn.k=50"], "k=10, whole set": ["knn.k=10"],
            "k=10, bank_fraction=0.064": ["knn.k=10", "knn.bank_fraction=0.064"],
            "k=10, bank_fraction=0.01": ["knn.k=10", "knn.bank_fraction=0.01"],
            "k=50, whole set, bank_dtype=float16": ["knn.k=50", "knn.bank_dtype=float16"],
            "k=10, whole set, bank_dtype=float16": ["knn.k=10", "knn.bank_dtype=float16"]}


def main(argv: list[str] | None = None) -> dict:
    from hf_gsc import OODEvaluator
    from hf_gsc.evaluation.arguments import parse_arguments

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet,vit")
    parser.add_argument("--benchmark", default="fmnist-ood")
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args(argv)
    results: dict = {"benchmark": args.benchmark, "settings": SETTINGS, "runs": {}}
    for model in args.models.split(","):
        for variant, settings in VARIANTS.items():
            with tempfile.TemporaryDirectory() as output_dir:
                argv_run = ["--model", str(ROOT / "hf_gsc" / "reference_models" / model), "--benchmark", args.benchmark,
                            "--methods", "knn", *SETTINGS, "--output-dir", output_dir,
                            *[item for setting in settings for item in ("--hyperparameter", setting)]]
                OODEvaluator(args=parse_arguments(argv_run)).evaluate()
                record = json.loads((Path(output_dir) / "results.json").read_text())
                bank = json.loads((Path(output_dir) / "detectors" / "knn" / "fit.json").read_text()) \
                    if (Path(output_dir) / "detectors" / "knn" / "fit.json").exists() else None
            results["runs"].setdefault(model, {})[variant] = {"methods": record["methods"].get("knn"),
                                                              "fit": bank}
            print(model, variant, json.dumps(record["methods"].get("knn"))[:300], flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
