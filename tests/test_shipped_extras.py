"""Small things a user meets: the model card of a folder run names its data (not "Benchmark `None`"), and
``python -m hf_gsc.method_table --help`` answers with a usage line instead of printing the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hf_gsc.storage.model_card import render_model_card


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


def test_a_detector_names_its_classes_for_the_pipeline(tmp_path):
    import transformers
    from test_first_hour import CLASSES, save_tiny_vit

    from hf_gsc import AutoOODDetector

    save_tiny_vit(tmp_path / "model", num_channels=3)
    detector = AutoOODDetector.from_pretrained(str(tmp_path / "model"), method="energy")
    assert detector.id2label == dict(enumerate(CLASSES))
    assert detector.label2id == {name: index for index, name in enumerate(CLASSES)}
    assert detector.num_channels == 3
    ood = transformers.pipeline("ood-image-classification", model=detector)
    from PIL import Image

    labels = [prediction["label"] for prediction in ood(Image.new("RGB", (20, 20)))["predictions"]]
    assert sorted(labels) == sorted(CLASSES)
