#!/usr/bin/env python
"""``make demo``: the embedded default evaluation, printed as the paper-style table.

Runs ``scripts/evaluate_ood.py``'s evaluation on the shipped reference classifier
(``hf_gsc/reference_models/resnet``) and the ``fmnist-ood`` benchmark (OOD: mnist, notmnist,
textures, noise) with GSC and the main baselines that need no long fit (those registered of
msp, energy, max_logit, odin, react, ash_b), on 1000 random samples of every split (ID test, ID
validation, each OOD split) so that it finishes well under 10 minutes on 2 CPU cores (about 220 s of
CPU time at 2000 samples per split; 10 minutes of wall time at 2000 when the 2 cores were shared
with other jobs, hence 1000). Results, score cache and plots go to ``outputs/demo-resnet`` (a rerun
reuses the cached scores). Any other ``evaluate_ood.py`` argument may be added, e.g.::

    python scripts/demo.py --arch vit --max-samples 2000
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 scripts/demo.py
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from hf_gsc.evaluation import main
from hf_gsc.reference_models import reference_model_path


#: Samples per split: ID test, ID validation (calibration) and each of the 4 OOD splits.
DEMO_MAX_SAMPLES = 1000
#: Samples to fit ReAct's activation percentile (on ID validation).
DEMO_MAX_FIT_SAMPLES = 1000


def demo_argv(argv: list[str] | None = None) -> list[str]:
    """The ``evaluate_ood.py`` arguments of the demo; ``argv`` may add or override any of them."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--arch", default="resnet", choices=("resnet", "vit", "swin"))
    known, rest = parser.parse_known_args(argv)
    defaults = {
        "--model": str(reference_model_path(known.arch)),
        "--benchmark": "fmnist-ood",
        "--output-dir": f"outputs/demo-{known.arch}",
        "--max-samples": str(DEMO_MAX_SAMPLES),
        "--max-fit-samples": str(DEMO_MAX_FIT_SAMPLES),
        "--batch-size": "250",
    }
    given = {arg.split("=", 1)[0] for arg in rest if arg.startswith("--")}
    result = [item for flag, value in defaults.items() if flag not in given for item in (flag, value)]
    return result + rest


if __name__ == "__main__":
    start = time.perf_counter()
    status = main(demo_argv(sys.argv[1:]), prog="demo.py")
    if os.environ.get("RANK", "0") == "0":  # the main process under accelerate launch
        print(f"demo finished in {time.perf_counter() - start:.0f}s")
    sys.exit(status)
