"""The evaluation's fit on 2 processes (``accelerate launch``) equals the one-process fit, and each process reads its
own share of the fit data.

One 2-process launch of ``tests/fit_on_processes.py`` (KNN's bank, Mahalanobis' float64 class sums, ReAct's
percentile, AdaSCALE's per-sample statistics and seeded subsample, GSC's reduced Fisher sum; uneven shares and one
unreadable image, left out, then raising), against the same script run in this process on one process. Tolerance: the model is float64 and
both runs pass the same batches through the backbone, so the features agree to the last bit wherever the kernels do;
the one sum taken in another order is GSC's Fisher (a float64 sum per process, then added: about 1e-16 relative).
``rtol=1e-9`` leaves room for kernels that depend on the thread count (this process runs with the default threads,
the launched ones with one each) and is still far below any difference a wrong row, order or count would make.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import fit_on_processes as script
import pytest
import torch
from safetensors.torch import load_file


REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 300
TOLERANCE = {"rtol": 1e-9, "atol": 1e-12}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distributed_fit")
    one, two = root / "one", root / "two"
    one.mkdir()
    two.mkdir()
    script.main(one)
    with socket.socket() as probe:  # a free port: other runs may hold accelerate's default 29500
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(Path(sys.executable).with_name("accelerate")), "launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
               "--dynamo_backend", "no", script.__file__, str(two)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=root)
    assert result.returncode == 0, result.stderr[-4000:]
    return {"one": one, "two": two}


def _expected_shares(num_processes: int) -> list[int]:
    """Readable images per process when process ``r`` reads batches ``r, r + P, ...`` of the data."""
    batches = [range(start, min(start + script.BATCH_SIZE, script.NUM_IMAGES))
               for start in range(0, script.NUM_IMAGES, script.BATCH_SIZE)]
    return [sum(len(rows) - (script.BROKEN_ROW in rows) for rows in batches[rank::num_processes])
            for rank in range(num_processes)]


def test_a_fit_on_two_processes_equals_the_one_process_fit_on_each_process(runs):
    one = load_file(str(runs["one"] / "state-0.safetensors"))
    first, second = (load_file(str(runs["two"] / f"state-{rank}.safetensors")) for rank in (0, 1))
    assert set(one) == set(first) == set(second) == {
        "knn.bank", "mahalanobis.class_means", "mahalanobis.precision", "react.threshold",
        "adascale_a.reference_statistic", "gsc.fisher_diagonal", "nac.counts", "nac.widths", "nac.fitted_bins",
        "nac.fitted_alpha"}
    for name in one:
        torch.testing.assert_close(first[name], one[name], **TOLERANCE, msg=name)
        assert torch.equal(first[name], second[name]), f"{name} differs between the processes"
    # Both processes passed fit images through the backbone; the bank holds every readable image once.
    assert all(json.loads((runs["two"] / "outcome.json").read_text())["images_per_process"])
    assert one["knn.bank"].shape[0] == script.NUM_IMAGES - 1
    # The saved fits are the fitted states.
    saved = load_file(str(runs["two"] / "run" / "detectors" / "knn" / "detector_state.safetensors"))
    assert torch.equal(saved["bank"], first["knn.bank"])


def test_each_process_reads_its_own_share_of_the_fit_data(runs):
    outcome = json.loads((runs["two"] / "outcome.json").read_text())
    shares = _expected_shares(2)
    assert outcome["failed"] == {}
    assert outcome["images_per_process"] == shares and all(shares)
    assert sum(shares) == script.NUM_IMAGES - 1  # every readable image once
    (only_pass,) = outcome["passes"]
    assert only_pass["images_per_process"] == shares and only_pass["num_skipped"] == 1
    for method in script.METHODS:
        info = json.loads((runs["two"] / "run" / "detectors" / method / "fit.json").read_text())
        assert info["images_per_process"] == shares and info["num_samples"] == sum(shares)
        # Each process's peak resident memory (bytes, by rank), gathered: one reading per process.
        peaks = info["peak_memory_bytes_per_process"]
        assert len(peaks) == 2 and all(peak > 2**20 for peak in peaks)
    single = json.loads((runs["one"] / "outcome.json").read_text())
    assert single["images_per_process"] == _expected_shares(1) == [sum(shares)]


def test_an_unreadable_image_raises_on_every_process(runs):
    """The unreadable image lies in the first process's share; the second raises too instead of waiting for it."""
    for run, ranks in (("one", [0]), ("two", [0, 1])):
        for rank in ranks:
            message = (runs[run] / f"raised-{rank}.txt").read_text()
            assert f"row {script.BROKEN_ROW}" in message and "fit_on_processes" in message, (run, rank, message)


def test_a_tuning_grid_fits_without_saving_and_keeps_each_grid_point_apart(tmp_path, monkeypatch):
    """``context.output_dir=None``: nothing written; failures are keyed by grid point, not by method."""
    from conftest import make_tiny_model

    from hf_gsc.detectors import get_detector
    from hf_gsc.evaluation.accelerator import make_accelerator
    from hf_gsc.evaluation.context import RunContext
    from hf_gsc.evaluation.fitting import fit_detectors

    monkeypatch.chdir(tmp_path)
    model = make_tiny_model("vit")
    grid = {"knn[0]": get_detector("knn", model, k=2), "knn[1]": get_detector("knn", model, k=1000)}
    data = script.fit_data()
    context = RunContext(make_accelerator("no"), script.to_pixels, script.BATCH_SIZE, on_error="skip", seed=0)
    outcome = fit_detectors(context, grid, list(grid), {key: data for key in grid}, {})
    assert set(outcome.failed) == {"knn[1]"} and "1000" in outcome.failed["knn[1]"]
    assert grid["knn[0]"].fitted and grid["knn[0]"].bank.shape[0] == script.NUM_IMAGES - 1
    assert outcome.images_per_process == [script.NUM_IMAGES - 1] and not any(tmp_path.iterdir())
    assert math.isfinite(outcome.seconds)
