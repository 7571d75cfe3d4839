#!/usr/bin/env python
"""GSC ablations, approximation error and gradient concentration on the reference models (issue #7).

Writes ``{output_dir}/{benchmark}_{model}.{json,md}`` and ``_concentration.png``; see docs/ablations.md.

Example::

    nice -n 10 python scripts/run_ablations.py --models resnet,vit,swin \\
        --benchmarks fmnist-ood,fmnist-openset --max-samples 2000 --output-dir docs/results/ablations
"""

import sys

from hf_gsc.analysis.cli import main


if __name__ == "__main__":
    sys.exit(main())
