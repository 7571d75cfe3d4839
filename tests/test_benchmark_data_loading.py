"""scripts/benchmark_data_loading.py runs end to end on a few images and writes the JSON it documents.

No speed is asserted here (the machine is shared); the numbers come from the script's own JSON.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_benchmark_writes_its_json(tmp_path: Path) -> None:
    script = runpy.run_path(str(REPO / "scripts" / "benchmark_data_loading.py"))
    output = tmp_path / "bench.json"
    assert script["main"](["--num-images", "8", "--batch-size", "4", "--repeats", "1", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    rates = result["images_per_second"]
    assert set(rates) == {"decode_preprocess_single_core", "model_only", "workers_0", "workers_2"}
    assert all(value > 0 for value in rates.values())
    assert result["target"]["value"] == round(rates["workers_2"] / rates["decode_preprocess_single_core"], 2)
    assert result["target"]["ratio"] == "workers_2 / decode_preprocess_single_core" and len(result["target"]["per_round"]) == 1
    assert result["images"]["size"] == [500, 375] and result["image_backend"] in ("pil", "torchvision")
    assert result["workers_2_normalization_in_workers"] > 0
    assert result["decode_preprocess_single_core_without_normalization"] > 0
    assert result["workers_2_first_batch_seconds"] > 0
    # The scored loop (uint8 batches normalized in the main process) feeds the model the baseline's pixel values.
    assert result["pixel_values_equal_to_baseline"] is True


def test_measure_subset_and_bad_arguments(tmp_path: Path, capsys) -> None:
    import pytest
    import torch

    script = runpy.run_path(str(REPO / "scripts" / "benchmark_data_loading.py"))
    output = tmp_path / "bench.json"
    argv = ["--num-images", "4", "--batch-size", "4", "--repeats", "1", "--workers", "1", "--output", str(output)]
    assert script["main"]([*argv, "--measure", "decode_preprocess_single_core,workers_N"]) == 0
    result = json.loads(output.read_text())
    assert set(result["images_per_second"]) == {"decode_preprocess_single_core", "workers_1"}
    for bad, message in ((["--measure", "model_only,warp"], "unknown ['warp']"),
                         (["--measure", "model_only"], "must include workers_N and decode_preprocess_single_core"),
                         (["--workers", "0"], "--workers must be >= 1"),
                         *([(["--device", "cuda"], "CUDA is not available")] if not torch.cuda.is_available() else [])):
        with pytest.raises(SystemExit):
            script["main"]([*argv, *bad])
        assert message in capsys.readouterr().err
