"""``hf-gsc space`` as a user runs its folder: written for a local detector, installed from its own
``requirements.txt`` into a fresh virtual environment that cannot see this checkout (the package index only, torch
first from the same wheel ``make install`` uses), started with ``python app.py`` and asked by ``gradio_client``.

Marked ``space``: it installs Gradio, transformers and their dependencies from the package index (minutes), so
``make test`` leaves it to ``make test-space`` (called from ``.ci/run``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import venv
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model
from PIL import Image
from transformers import ViTImageProcessor

from hf_gsc import AutoOODDetector, GSCForImageClassification


REPO_ROOT = Path(__file__).resolve().parents[1]
#: The torch that make install puts first (the local CPU wheel), so that no dependency pulls in a CUDA build.
TORCH = "torch==2.13.0"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(args: list, cwd: Path, env: dict, timeout: int = 1200) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args}\nstdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    return result.stdout


def _detector(folder: Path) -> Path:
    detector = GSCForImageClassification(make_tiny_model("resnet").float(), mask_ratio=0.2)
    detector.image_processor = ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    detector.calibrate(torch.randn(200, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0)))
    detector.save_pretrained(folder, save_base_model=True)
    return folder


def test_a_local_detector_folder_is_copied_and_the_package_carried(tmp_path):
    """Fast: what the folder holds (no install). The package is this hf_gsc's, the requirements its dependencies
    with the demo extra, nothing names this checkout."""
    from hf_gsc import cli

    detector = _detector(tmp_path / "my-detector")
    space = tmp_path / "space"
    assert cli.main(["space", "--detector", str(detector), "--output", str(space)]) == 0
    assert (space / "detector" / "detector_config.json").is_file() and (space / "detector" / "model.safetensors").is_file()
    assert (space / "hf_gsc" / "app" / "demo.py").read_bytes() == (REPO_ROOT / "hf_gsc/app/demo.py").read_bytes()
    lines = (space / "requirements.txt").read_text().splitlines()
    names = {line.split(">")[0].split("=")[0] for line in lines}
    assert {"torch", "transformers", "gradio", "matplotlib"} <= names and "hf_gsc" not in names
    assert not any("extra" in line for line in lines), lines
    app = (space / "app.py").read_text()
    compile(app, "app.py", "exec")
    assert str(tmp_path) not in app + (space / "README.md").read_text()
    assert "models:" not in (space / "README.md").read_text().split("---")[1]
    # A later run replaces its own folders whole (a file gone from the detector is gone from the copy).
    (detector / "extra.txt").write_text("x")
    assert cli.main(["space", "--detector", str(detector), "--output", str(space), "--requirement", "hf_gsc[demo]"]) == 0
    assert (space / "detector" / "extra.txt").is_file()
    (detector / "extra.txt").unlink()
    assert cli.main(["space", "--detector", str(detector), "--output", str(space), "--requirement", "hf_gsc[demo]"]) == 0
    assert not (space / "detector" / "extra.txt").exists()
    assert (space / "requirements.txt").read_text() == "hf_gsc[demo]\n"
    assert not (space / "hf_gsc").exists()  # the earlier package copy would shadow what --requirement installs
    assert cli.main(["space", "--detector", "user/name", "--output", str(space), "--requirement", "hf_gsc[demo]"]) == 0
    assert not (space / "detector").exists() and 'build_app("user/name")' in (space / "app.py").read_text()


def test_a_missing_or_unusable_local_detector_is_refused(tmp_path, capsys):
    from hf_gsc import cli

    for missing in ("./typo", str(tmp_path / "nothing"), "a/b/c"):
        assert cli.main(["space", "--detector", missing, "--output", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert f"--detector {missing!r} reads as a local folder and does not exist" in err, err
    assert cli.main(["space", "--detector", str(tmp_path), "--output", str(tmp_path / "out")]) == 1
    assert "without detector_config.json" in capsys.readouterr().err
    detector = _detector(tmp_path / "d")
    assert cli.main(["space", "--detector", str(detector), "--output", str(detector / "space")]) == 1
    assert "lies inside --detector" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (detector / "space").exists()


@pytest.mark.space
def test_the_space_installs_from_its_requirements_and_answers(tmp_path):
    pytest.importorskip("gradio_client")
    from gradio_client import Client, handle_file

    from hf_gsc import cli

    detector = _detector(tmp_path / "my-detector")
    space = tmp_path / "space"
    assert cli.main(["space", "--detector", str(detector), "--output", str(space)]) == 0
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    started = time.monotonic()
    _run([python, "-m", "pip", "install", "-q", TORCH], tmp_path, clean)
    _run([python, "-m", "pip", "install", "-q", "-r", space / "requirements.txt"], tmp_path, clean)
    installed = time.monotonic() - started
    # The environment cannot import hf_gsc from anywhere but the Space's folder.
    probe = "import importlib.util as u; s = u.find_spec('hf_gsc'); print(s.origin if s else None)"
    assert _run([python, "-c", probe], tmp_path, clean).strip() == "None"
    assert _run([python, "-c", probe], space, clean).strip() == str(space / "hf_gsc" / "__init__.py")

    port = _free_port()
    env = {**clean, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port), "HF_HUB_OFFLINE": "1",
           "GRADIO_ANALYTICS_ENABLED": "False", "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / "app.log", "w")
    app = subprocess.Popen([str(python), "app.py"], cwd=space, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url, deadline = f"http://127.0.0.1:{port}/", time.monotonic() + 300
        while True:
            assert app.poll() is None, (tmp_path / "app.log").read_text()
            try:
                client = Client(url, verbose=False)
                break
            except Exception:
                assert time.monotonic() < deadline, (tmp_path / "app.log").read_text()
                time.sleep(2)
        image = tmp_path / "upload.png"
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(image)
        labels, verdict, _figure, summary, _shown, rows = client.predict(handle_file(str(image)), api_name="/predict")
    finally:
        app.terminate()
        app.wait(30)
        log.close()
    import transformers

    expected = transformers.pipeline("ood-image-classification", model=AutoOODDetector.from_pretrained(detector))(
        Image.open(image))
    assert summary["ood_score"] == pytest.approx(expected["ood_score"], rel=1e-5)
    assert labels["label"] == expected["predictions"][0]["label"]
    assert len(rows["data"]) == 10 and verdict
    print(f"space environment installed in {installed:.0f} s", file=sys.stderr)
