"""The evaluation on a benchmark read from the Hub (``cifar10-ood``, loopback stand-ins), downloaded and streamed.

The stand-in repos are those of ``tests/test_benchmarks_by_name.py`` (same ids, configs, columns). The runs are
subprocesses because ``datasets`` and ``huggingface_hub`` read ``HF_ENDPOINT`` at import.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hub_server import LoopbackHub
from test_benchmarks_by_name import hub  # noqa: F401  (the fixture: loopback Hub with the stand-in repos)


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cifar_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random 10-class ViT on 8x8 RGB images, with its image processor."""
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    folder = tmp_path_factory.mktemp("cifar_model")
    torch.manual_seed(0)
    ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, intermediate_size=32, num_labels=10)).save_pretrained(folder)
    ViTImageProcessorPil(size={"height": 8, "width": 8}).save_pretrained(folder)
    return str(folder)


def _evaluate(hub: LoopbackHub, tmp_path: Path, model: str, *extra: str) -> dict:
    output_dir = tmp_path / ("streamed" if "--streaming" in extra else "downloaded")
    command = [sys.executable, str(REPO / "scripts" / "evaluate_ood.py"), "--model", model, "--benchmark", "cifar10-ood",
               "--ood-splits", "svhn,textures", "--methods", "msp,energy,gsc", "--batch-size", "3", "--no-plots",
               # a random-weight model with generic labels on named classes: their order taken as the model's, said
               "--labels-by-order", "--output-dir", str(output_dir), *extra]
    env = {**hub.client_env(hf_home=tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + ":" + str(REPO / "tests")}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((output_dir / "results.json").read_text())


def test_hub_benchmark_streamed_matches_downloaded(hub: LoopbackHub, cifar_model: str, tmp_path: Path) -> None:
    downloaded = _evaluate(hub, tmp_path, cifar_model)
    streamed = _evaluate(hub, tmp_path, cifar_model, "--streaming")
    assert streamed["config"]["streaming"] and not downloaded["config"]["streaming"]
    assert streamed["split_sizes"] == downloaded["split_sizes"]
    assert streamed["split_sizes"]["ood"] == {"svhn": 4, "textures": 5}
    assert streamed["id_accuracy"] == downloaded["id_accuracy"]
    for name, entry in downloaded["methods"].items():
        assert streamed["methods"][name]["threshold"] == pytest.approx(entry["threshold"], rel=1e-9)
        for split, metrics in {**entry["ood"], "average": entry["average"]}.items():
            got = streamed["methods"][name]["average" if split == "average" else "ood"]
            got = got if split == "average" else got[split]
            assert got == pytest.approx(metrics, rel=1e-9, abs=1e-12), (name, split)
    assert not hub.unhandled_requests()


def test_hf_gsc_evaluate_resolves_every_set_and_reports_near_and_far(
    hub: LoopbackHub, cifar_model: str, tmp_path: Path
) -> None:
    """``hf-gsc evaluate --benchmark cifar10-ood`` with every OOD split of the benchmark (no ``--ood-splits``):
    each resolves on the loopback Hub and results.json / results.md report OpenOOD's near- and far-OOD averages,
    both FPR@95 conventions, selective classification and the split-conformal calibration."""
    output_dir = tmp_path / "all_sets"
    command = [sys.executable, "-m", "hf_gsc", "evaluate", "--model", cifar_model, "--benchmark", "cifar10-ood",
               "--methods", "msp,energy", "--batch-size", "4", "--conformal-delta", "0.5", "--tpr", "0.5",
               "--labels-by-order", "--output-dir", str(output_dir)]
    env = {**hub.client_env(hf_home=tmp_path / "hf"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + ":" + str(REPO / "tests")}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads((output_dir / "results.json").read_text())
    assert results["split_sizes"]["ood"] == {"cifar100": 6, "tin": 3, "mnist": 5, "svhn": 4, "textures": 5,
                                             "places365": 2, "lsun_crop": 4, "lsun_resize": 3, "isun": 2}
    assert results["ood_groups"] == {"near": ["cifar100", "tin"], "far": ["mnist", "svhn", "textures", "places365"]}
    for entry in results["methods"].values():
        for group, splits in results["ood_groups"].items():
            for metric in ("fpr95", "fpr95_ood_positive", "auroc"):
                expected = sum(entry["ood"][s][metric] for s in splits) / len(splits)
                assert entry["average_by_group"][group][metric] == pytest.approx(expected)
        assert entry["calibration"]["method"] == "conformal" and entry["calibration"]["delta"] == 0.5
        assert set(entry["selective"]) == {"accuracy", "aurc"}
    table = (output_dir / "results.md").read_text()
    assert "| cifar100 (near) | tin (near) | mnist (far) |" in table
    assert "Near-OOD avg. | Far-OOD avg. | Average |" in table
    assert (output_dir / "plots" / "risk_coverage.png").stat().st_size > 1000
