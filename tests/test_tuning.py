"""Hyperparameter selection on validation only (``--tune``, :mod:`hf_gsc.evaluation.tuning`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hf_gsc.evaluation import runner, tuning
from test_evaluation import _argv, tiny  # noqa: F401  (the tiny model and data fixture)


def test_smoke(tiny, tmp_path):
    import time
    t = time.time()
    results = runner.run_evaluation(_argv(tiny, tmp_path, "--tune"))
    print(time.time() - t)
    print(json.dumps(results["tuning"], indent=1)[:3000])
    print((tmp_path / "results.md").read_text())
