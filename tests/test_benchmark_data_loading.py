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
    assert result["speedup_over_single_core_decode"] == round(rates["workers_2"] / rates["decode_preprocess_single_core"], 2)
    assert result["images"]["size"] == [500, 375] and result["image_backend"] in ("pil", "torchvision")
