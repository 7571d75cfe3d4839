"""``accelerate launch --cpu --num_processes 2`` runs one process: the evaluation says so and names the recipe that
works, instead of running alone in silence."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from test_evaluation import tiny  # noqa: F401  (the tiny model and data fixture)

from hf_gsc.evaluation import run_info


SIMPLE_LAUNCH = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "ACCELERATE_USE_CPU": "True",
                 "ACCELERATE_MIXED_PRECISION": "no"}


def test_a_simple_launch_of_several_processes_warns():
    alone = SimpleNamespace(num_processes=1, device="cpu")
    with pytest.warns(UserWarning, match="ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N"):
        run_info.check_process_count(alone, SIMPLE_LAUNCH)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run_info.check_process_count(alone, {"ACCELERATE_MIXED_PRECISION": "no"})  # a launch of one process
        run_info.check_process_count(SimpleNamespace(num_processes=2, device="cpu"), {**SIMPLE_LAUNCH, "WORLD_SIZE": "2"})


def test_accelerate_launch_cpu_num_processes_2_warns_end_to_end(tiny, tmp_path):  # noqa: F811
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "-m", "hf_gsc",
               "evaluate", "--model", tiny["model"], "--id-dataset", tiny["id"], "--ood-dataset",
               f"noise={tiny['noise']}", "--methods", "msp", "--output-dir", str(tmp_path / "run"), "--no-plots",
               "--no-selection"]
    env = {key: value for key, value in os.environ.items() if key not in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "accelerate launch was asked for several processes, but one runs" in done.stderr
    assert (tmp_path / "run" / "results.json").exists()
