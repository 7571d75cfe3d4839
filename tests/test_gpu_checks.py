"""scripts/gpu_checks.sh (run on a lent GPU machine, rehearsed by hand with --cpu-rehearsal): its syntax, and the
summary of a run in which no step wrote anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]


def test_gpu_checks_script_parses():
    result = subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_checks.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_summary_reports_missing_outputs_without_guessing(tmp_path):
    (tmp_path / "details").mkdir()
    (tmp_path / "details" / "steps.tsv").write_text("cost_fp32\t124\t90\t90\tpython x.py\ndata_loading\tskipped\t0\t0\tpython y.py\n")
    command = [sys.executable, str(REPO / "scripts" / "gpu_checks_summary.py"), "--seconds", "95", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(s["name"], s["exit_status"], s["timed_out"]) for s in summary["steps"]] == [
        ("cost_fp32", 124, True), ("data_loading", "skipped", False)]
    findings = summary["findings"]
    assert findings["evaluation"]["missing"] == ["eval_device_fp32", "eval_device_bf16", "eval_cpu_fp32"]
    assert findings["cost"] == {"fp32": None, "bf16": None} and findings["data_loading"] is None
    assert findings["per_channel_step"] == {"fp32": None, "bf16": None}
    assert findings["shared_pass"] is None and findings["shared_pass_vit_b16"] is None
    assert summary["targets"]["gsc_time_relative_to_msp_at_most"] == 1.05
