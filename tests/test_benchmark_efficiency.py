"""scripts/benchmark_efficiency.py end to end on the ResNet reference model (tiny run: the numbers are not checked,
only that every method and split point is measured against MSP and written out)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
METHODS = {"msp", "energy", "odin", "gsc_exact", "gsc_first_order", "gsc_predicted_logit"}


def test_benchmark_writes_every_method_relative_to_msp(tmp_path):
    output = tmp_path / "efficiency.json"
    command = [
        sys.executable, str(REPO / "scripts" / "benchmark_efficiency.py"), "--models", "resnet", "--batch-sizes", "2",
        "--repeats", "3", "--warmup", "1", "--threads", "1", "--after-backbone",
        "--split-points", "final_encoder_output,resnet.encoder.stages.-3,vit.layers.-3", "--output", str(output),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "skipping split point 'vit.layers.-3' for resnet" in result.stderr

    results = json.loads(output.read_text())
    assert results["settings"]["threads"] == 1 and results["settings"]["repeats"] == 3
    cells = results["models"]["resnet"]
    assert set(cells) == {"final_encoder_output", "resnet.encoder.stages.-3"}
    for per_batch in cells.values():
        row = per_batch["2"]
        assert set(row) == METHODS
        assert row["msp"]["relative_time"] == 1.0 and row["msp"]["relative_time_paired"] == 1.0
        for method in METHODS:
            measured = row[method]
            assert measured["median_seconds"] > 0 and measured["peak_memory_bytes"] > 0
            assert measured["relative_time"] == measured["median_seconds"] / row["msp"]["median_seconds"]
            assert measured["relative_time_paired"] > 0
            assert len(measured["round_seconds"]) == 3 and sorted(measured["round_seconds"])[1] == measured["median_seconds"]
            if method.startswith("gsc_"):  # the work after the backbone alone is part of the whole call
                after = measured["after_backbone_median_seconds"]
                assert 0 < after and measured["after_backbone_relative_to_msp"] == after / row["msp"]["median_seconds"]
            else:
                assert "after_backbone_median_seconds" not in measured
    # ODIN backpropagates to the input: it must allocate more than MSP's forward.
    assert cells["final_encoder_output"]["2"]["odin"]["relative_memory"] > 1.0
    table = output.with_suffix(".md").read_text()
    assert "#### resnet, split point `resnet.encoder.stages.-3`" in table
    assert "| gsc_first_order |" in table and "batch 2 time, paired" in table


def _run_benchmark(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, str(REPO / "scripts" / "benchmark_efficiency.py"), "--models", "resnet", "--batch-sizes", "2",
        "--repeats", "1", "--warmup", "0", "--threads", "1", "--baselines", "msp", "--approximations", "first_order",
        "--output", str(tmp_path / "efficiency.json"), *extra,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_benchmark_under_bf16_autocast_records_the_precision(tmp_path):
    result = _run_benchmark(tmp_path, "--mixed-precision", "bf16", "--after-backbone")
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((tmp_path / "efficiency.json").read_text())
    assert results["mixed_precision"] == "bf16" and results["settings"]["mixed_precision"] == "bf16"
    row = results["models"]["resnet"]["final_encoder_output"]["2"]
    assert set(row) == {"msp", "gsc_first_order"}
    for measured in row.values():
        assert measured["median_seconds"] > 0 and measured["peak_memory_bytes"] > 0 and measured["relative_time"] > 0
    assert row["gsc_first_order"]["after_backbone_median_seconds"] > 0
    assert "#### resnet, split point `final_encoder_output`, bf16 autocast" in (tmp_path / "efficiency.md").read_text()


def test_benchmark_refuses_fp16_on_cpu(tmp_path):
    result = _run_benchmark(tmp_path, "--mixed-precision", "fp16")
    assert result.returncode == 2 and "fp16 autocast on CUDA only" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "efficiency.json").exists()


def test_benchmark_compares_the_per_channel_step_with_the_step_on_every_coordinate(tmp_path):
    """--per-coordinate adds each GSC approximation with its step on every coordinate of F (the ResNet's head pools,
    so its step runs per channel), --step-alone times the step alone both ways; the GPU checks' summary reads it."""
    result = _run_benchmark(tmp_path, "--per-coordinate", "--step-alone", "--approximations", "first_order,exact")
    assert result.returncode == 0, result.stderr[-2000:]
    results = json.loads((tmp_path / "efficiency.json").read_text())
    row = results["models"]["resnet"]["final_encoder_output"]["2"]
    assert set(row) == {"msp", "gsc_first_order", "gsc_exact", "gsc_first_order_per_coordinate",
                        "gsc_exact_per_coordinate"}
    for method in ("gsc_first_order", "gsc_exact"):
        alone = row[method]["step_alone"]
        assert alone["masks_equal"] and alone["max_abs_score_difference"] <= 1e-5
        assert alone["per_channel_median_seconds"] > 0 and alone["per_coordinate_median_seconds"] > 0
        assert "step_alone" not in row[f"{method}_per_coordinate"]
    assert "| 2 | gsc_exact |" in (tmp_path / "efficiency.md").read_text()

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from gpu_checks_summary import per_channel_step
    finally:
        sys.path.remove(str(REPO / "scripts"))
    cells = per_channel_step(results, None)["resnet"]["final_encoder_output, batch 2"]
    assert set(cells) == {"gsc_first_order", "gsc_exact"}
    assert cells["gsc_exact"]["masks_equal"] is True
    assert cells["gsc_exact"]["relative_time_paired_per_coordinate"] == round(
        row["gsc_exact_per_coordinate"]["relative_time_paired"], 4)


def test_per_coordinate_adds_nothing_where_the_head_does_not_pool(tmp_path):
    """The ViT reference model's head reads the first token: there is no per-channel step to compare."""
    command = [
        sys.executable, str(REPO / "scripts" / "benchmark_efficiency.py"), "--models", "vit", "--batch-sizes", "2",
        "--repeats", "1", "--warmup", "0", "--threads", "1", "--baselines", "msp", "--approximations", "exact",
        "--per-coordinate", "--step-alone", "--output", str(tmp_path / "efficiency.json"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    row = json.loads((tmp_path / "efficiency.json").read_text())["models"]["vit"]["final_encoder_output"]["2"]
    assert set(row) == {"msp", "gsc_exact"} and "step_alone" not in row["gsc_exact"]


def test_after_backbone_timing_runs_no_backbone(monkeypatch):
    """--after-backbone times GSC with its backbone pass looked up: the base model runs once per detector (the pass
    that is looked up), not in the timed calls."""
    import torch

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from benchmark_efficiency import _after_backbone_seconds, load_model

    from hf_gsc import GSCForImageClassification

    model = load_model("resnet")
    detectors = {a: GSCForImageClassification(model, approximation=a) for a in ("exact", "first_order")}
    calls = []
    model.resnet.embedder.register_forward_hook(lambda *_: calls.append(1))  # the backbone's first module
    x = torch.randn(2, model.config.num_channels, 28, 28)
    times = _after_backbone_seconds(detectors, x, repeats=3)
    assert {name: len(t) for name, t in times.items()} == {"exact": 3, "first_order": 3}
    assert len(calls) == len(detectors)
    detectors["exact"](x)  # the lookup is gone afterwards
    assert len(calls) == len(detectors) + 1
