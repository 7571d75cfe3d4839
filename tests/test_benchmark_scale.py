"""scripts/benchmark_scale.py's small configuration end to end (the numbers are not checked, only that every fitted
one-pass method is measured at every N, modelled and projected; the backbones' forwards are left to the full run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import benchmark_scale  # noqa: E402

from hf_gsc.detectors import DETECTORS  # noqa: E402


def test_small_configuration_measures_models_and_projects_every_method(tmp_path):
    output = tmp_path / "scale.json"
    command = [sys.executable, str(REPO / "scripts" / "benchmark_scale.py"), "--small", "--no-backbones", "--output", str(output)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(output.read_text())
    assert results["settings"]["threads"] == 1 and results["settings"]["configuration"] == "small"
    # Every fitted one-pass method but those that read many layers' feature maps (not the penultimate feature fed here).
    fitted = {name for name, cls in DETECTORS.items() if cls.one_pass and cls.needs_fit} - set(benchmark_scale.LAYER_METHODS)
    assert set(benchmark_scale.METHODS) == fitted and set(results["settings"]["methods"]) == fitted
    for dim, shape in results["shapes"].items():
        assert shape["sizes"] == [200, 400] and shape["classes"] == 50
        for name in benchmark_scale.METHODS:
            row = shape["methods"][name]
            assert set(row["fit_seconds"]) == {"200", "400"} and all(value > 0 for value in row["fit_seconds"].values())
            assert all(value >= 0 for value in row["peak_fit_bytes"].values())
            assert set(row["fit_seconds_model"]) == {"a", "b"}
            projected = results["projection"][dim]["methods"][name]
            assert projected["one_process"]["fit_seconds"] == row["fit_seconds_model"]["a"] + \
                row["fit_seconds_model"]["b"] * benchmark_scale.IMAGENET_FIT
        assert set(shape["together"]["fit_seconds"]) == {"200", "400"}
        assert set(shape["summary"]["gaussian_score_over_dd_matmul_float32"]) == {
            "mahalanobis", "mahalanobis_pp", "rmds", "rmds_pp", "gem"}
    end = results["end_to_end"]  # the fit through the library's own pass, a (tiny) ResNet's trunk included
    assert end["size"] == 200 and end["dim"] == 64 and set(end["methods"]) == set(benchmark_scale.METHODS)
    assert all(end[key] > 0 for key in ("knn_alone_seconds", "together_seconds", "knn_alone_features_alone_seconds",
                                        "together_features_alone_seconds"))
    assert end["together_over_knn_alone"] == end["together_seconds"] / end["knn_alone_seconds"]
    assert results["with_backbone"] == {}  # no backbone forward measured (--no-backbones): nothing composed
    table = output.with_suffix(".md").read_text()
    assert "**The fit with its backbone**" in table
    assert "#### K = 50, D = 64" in table and "| `knn` |" in table and f"the {len(fitted)} in one pass" in table
