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
    assert script["main"](["--num-images", "8", "--batch-size", "4", "--repeats", "2", "--worker-counts", "1",
                           "--photo-size", "640x480", "--output", str(output)]) == 0
    result = json.loads(output.read_text())
    rates = result["images_per_second"]
    assert set(rates) == {"floor_single_core", "processor_single_core", "processor_single_core_without_normalization",
                          "worker_single_core", "worker_single_core_jpeg_draft", "model_only", "workers_0",
                          "workers_2", "workers_2_normalization_in_workers", "sweep_workers_1"}
    # 640x480 photos for a 224 px input: the alternative, draft decoding at half scale, would move the pixels a
    # little; hf_gsc decodes at full size.
    draft = result["jpeg_draft"]
    assert draft["min_side"] == 224 and draft["applies"] and 0 < draft["mean_abs_difference_uint8"] < 2
    assert draft["used_by_hf_gsc"] is False
    assert result["images"]["size"] == [640, 480]
    assert all(value > 0 for value in rates.values())
    assert all(len(values) == 2 for values in result["images_per_second_per_round"].values())
    # The target is judged against the PIL + numpy floor, on the median of the ratios within each round.
    target, ratios = result["target"], result["ratios"]
    assert target["ratio"] == "workers_2 / floor_single_core" and target["at_least"] == 1.5
    per_round = [a / b for a, b in zip(result["images_per_second_per_round"]["workers_2"],
                                       result["images_per_second_per_round"]["floor_single_core"])]
    assert ratios["workers_2 / floor_single_core"]["per_round"] == [round(value, 2) for value in per_round]
    assert target["median"] == ratios["workers_2 / floor_single_core"]["median"] == round(sum(per_round) / 2, 2)
    assert target["met"] == (target["median"] >= 1.5)
    assert target["rounds_at_least"] == sum(value >= 1.5 for value in ratios["workers_2 / floor_single_core"]["per_round"])
    assert set(ratios) == {"workers_2 / floor_single_core", "workers_2 / processor_single_core",
                           "workers_2 / model_only"}
    assert result["image_backend"] in ("pil", "torchvision")
    assert result["workers_2_first_batch_seconds"] > 0
    assert len(result["machine"]["load_average_per_round"]) == 2
    # The scored loop (uint8 batches normalized in the main process) feeds the model the processor's pixel values,
    # and the floor does the same job up to float rounding.
    assert result["pixel_values_equal_to_baseline"] is True
    assert 0 <= result["floor_max_abs_difference_from_processor"] < 1e-5


def test_measure_subset_and_bad_arguments(tmp_path: Path, capsys) -> None:
    import pytest
    import torch

    script = runpy.run_path(str(REPO / "scripts" / "benchmark_data_loading.py"))
    output = tmp_path / "bench.json"
    argv = ["--num-images", "4", "--batch-size", "4", "--repeats", "1", "--workers", "1", "--output", str(output)]
    assert script["main"]([*argv, "--measure", "workers_N,floor_single_core"]) == 0
    result = json.loads(output.read_text())
    assert set(result["images_per_second"]) == {"floor_single_core", "workers_1"}
    assert set(result["ratios"]) == {"workers_1 / floor_single_core"}
    for bad, message in ((["--measure", "model_only,warp"], "unknown ['warp']"),
                         (["--measure", "model_only,processor_single_core"], "must include workers_N and floor_single_core"),
                         (["--workers", "0"], "--workers must be >= 1"),
                         *([(["--device", "cuda"], "CUDA is not available")] if not torch.cuda.is_available() else [])):
        with pytest.raises(SystemExit):
            script["main"]([*argv, *bad])
        assert message in capsys.readouterr().err
