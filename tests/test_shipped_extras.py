"""Small things a user meets: the model card of a folder run names its data (not "Benchmark `None`"), and
``python -m hf_gsc.method_table --help`` answers with a usage line instead of printing the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hf_gsc.model_card import render_model_card

REPO = Path(__file__).resolve().parents[1]


def _card(results: dict) -> str:
    values = {"method": "energy", "hyperparameters": {"temperature": 1.0}, "threshold": 1.5,
              "base_model_name_or_path": "user/vit", "hf_gsc_version": "0.4.0"}
    return str(render_model_card(values, "user/vit-energy", results, "| method | far |\n|---|---|\n| energy | 0.9 |\n"))


def test_the_card_of_a_folder_run_names_its_data():
    metrics = {"fpr95": 0.25, "auroc": 0.9, "aupr_in": 0.8, "aupr_out": 0.85}
    methods = {"energy": {"ood": {"sketches": metrics}}}
    folder_run = _card({"benchmark": None, "id_dataset": "local:photos", "ood_datasets": {"sketches": "local:sketches"},
                        "id_accuracy": 0.9, "methods": methods})
    assert "None" not in folder_run
    assert "Evaluated on ID data `local:photos`; OOD data `sketches` (local:sketches)" in folder_run
    benchmark_run = _card({"benchmark": "fmnist-ood", "id_accuracy": 0.9, "methods": methods})
    assert "Evaluated on benchmark `fmnist-ood`" in benchmark_run


def test_method_table_help():
    result = subprocess.run([sys.executable, "-m", "hf_gsc.method_table", "--help"], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m hf_gsc.method_table") and "| Method |" not in result.stdout
