"""The peak resident memory of a fit grows with the fitting inputs only by what the method keeps.

Each figure is a fresh process's peak RSS (``ru_maxrss``) after building the model and fitting one detector
(``scripts/benchmark_fit_memory.py --measure``, the script that measures the ImageNet-shaped targets in
docs/efficiency.md), at two numbers of fitting inputs; the growth between them is compared with a bound scaled down
from those targets. KNN through ``detector.fit`` on a one-layer ViT of ViT-B/16's width at 224 px (token tensors of 30 MB a batch, the
transient memory a real forward makes): the features it keeps are 0.9 MiB more for 300 more inputs; the bound,
48 MiB, leaves room for the allocator's noise between two processes (about 30 MiB). A copy per batch landing
between the forward's transient tensors made it grow by about 0.45 MiB per input (+144 MiB here). The feature-space methods' own peaks at
ImageNet shape (Mahalanobis, ReAct, ViM, ConjNorm from 4,000 to 24,000 inputs) take minutes a measurement: the script
measures them (docs/efficiency.md).

One method of each fitting family (statistics, a percentile, a subspace, prototypes, a feature bank) is measured the
same way on 1,024-d features of 100 classes from 2,000 to 20,000 inputs, where one float32 copy of the added features
is 70 MiB: a method keeping one copy or less passes (KNN: two, its bank beside the stored features), one keeping three (what ReAct did before its percentile was
taken by selection on one buffer) fails. These ten processes take a minute or more, so they are marked ``memory``
and run by ``make test-memory`` (and CI), not ``make test``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[1]


def peak_rss_mib(case: str, method: str, count: int) -> float:
    command = [sys.executable, str(REPO / "scripts" / "benchmark_fit_memory.py"), "--measure", case, method, str(count)]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=environment, check=False, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_mib"]


def test_knn_fit_on_a_vit_at_224_px_grows_by_its_bank_only():
    # The least of two processes per size: a process's heap layout varies from run to run, and now and then one ends
    # 100-200 MiB higher (a copy per batch raised every run).
    small, large = (min(peak_rss_mib("vit-light", "knn", count) for _ in range(2)) for count in (100, 400))
    assert large - small <= 48, (small, large)


#: 1,024-d float32 features: 18,000 more of them are one copy of 70.3 MiB.
ONE_COPY_MIB = 18_000 * 1024 * 4 / 2**20
#: family -> (its method, the growth allowed in copies of the added features).
FAMILIES = {
    "class statistics": ("mahalanobis", 0.5),  # sums of fixed size: flat in N (half a copy: the allocator's noise)
    "a percentile": ("react", 2.0),
    "a subspace": ("vim", 2.0),
    "prototypes": ("conjnorm", 2.0),
    # The bank is a copy by design, filled at fit_end from the stored features, which are another until the fit
    # returns (a store the methods fitted together share): two copies at the peak, measured 2.1.
    "a feature bank": ("knn", 2.5),
}


@pytest.mark.memory
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_fitting_familys_peak_grows_by_at_most_what_it_keeps(family):
    method, copies = FAMILIES[family]
    small, large = (peak_rss_mib("resnet-light", method, count) for count in (2_000, 20_000))
    assert large - small <= copies * ONE_COPY_MIB, (method, small, large, f"one copy is {ONE_COPY_MIB:.1f} MiB")
