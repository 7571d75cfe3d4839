"""What the library writes says what happened: a saved detector's base model reference loads from any working
directory (and a missing base fails at once, naming the ways out), the labels of a run are checked or the run says
they could not be, the command line answers at once, the figures and cards are readable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter in ``cwd``, with this checkout's ``hf_gsc`` (as a user's script would)."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------------- base model path
def test_a_relative_base_path_loads_from_any_directory_and_a_missing_one_fails_at_once(tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    make_tiny_model("vit").save_pretrained(project / "models" / "vit3")
    saved = _python("""
        from hf_gsc import AutoOODDetector
        AutoOODDetector.from_pretrained("models/vit3", method="msp").save_pretrained("saved")
    """, cwd=project)
    assert saved.returncode == 0, saved.stderr
    load = f"""
        import torch
        from hf_gsc import AutoOODDetector
        try:
            detector = AutoOODDetector.from_pretrained({str(project / "saved")!r})
        except FileNotFoundError as error:
            print("ERROR", error)
        else:
            print("OK", detector.config.base_model_name_or_path, detector(torch.rand(2, 3, 16, 16)).ood_score.shape)
    """
    loaded = _python(load, cwd=elsewhere)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.startswith(f"OK {project / 'models' / 'vit3'} torch.Size([2])"), loaded.stdout
    # The base moved away: the load fails before any Hub call, naming the folder and both ways out.
    (project / "models" / "vit3").rename(project / "models" / "moved")
    missing = _python(load, cwd=elsewhere, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    assert missing.returncode == 0, missing.stderr
    assert missing.stdout.startswith("ERROR"), missing.stdout
    for named in (str(project / "models" / "vit3"), "model=", "save_base_model=True"):
        assert named in missing.stdout
    assert "connection" not in (missing.stdout + missing.stderr).lower()
