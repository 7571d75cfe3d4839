#!/usr/bin/env python
"""OOD evaluation of GSC and baselines: ``results.json``, ``results.md``, score cache, plots.

The same as ``hf-gsc evaluate``. Same results with ``python`` and with ``accelerate launch`` over several processes::

    python scripts/evaluate_ood.py --model hf_gsc/reference_models/resnet --benchmark fmnist-ood \\
        --methods gsc,msp,energy --output-dir runs/resnet --max-samples 1000
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 scripts/evaluate_ood.py ...

See ``python scripts/evaluate_ood.py --help``, ``hf_gsc.evaluation`` and docs/evaluation.md.
"""
import sys

from hf_gsc.evaluation import main


if __name__ == "__main__":
    sys.exit(main(prog="evaluate_ood.py"))
