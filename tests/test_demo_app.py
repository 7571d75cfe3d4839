"""The demo app as a person and a program use it: one app per module (Gradio's import and start are slow), driven by
``gradio_client`` and, where Debian's Chromium is installed (CI installs it: .ci/run), in a headless browser."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model
from PIL import Image
from transformers import ViTImageProcessor

from hf_gsc import AutoOODDetector, GSCForImageClassification

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
gradio = pytest.importorskip("gradio", reason="the demo app needs the 'demo' extra (pip install 'hf_gsc[demo]')")

def _image(path: Path, seed: int = 0) -> Path:
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 30, 3), dtype=np.uint8)).save(path)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A calibrated GSC detector on a tiny ResNet, saved with its base and processor, and its app, started."""
    from hf_gsc.app.demo import build_app, launch

    folder = tmp_path_factory.mktemp("demo")
    detector = GSCForImageClassification(make_tiny_model("resnet").float(), mask_ratio=0.2)
    detector.image_processor = ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    detector.calibrate(torch.randn(200, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0)))
    detector.save_pretrained(folder / "detector", save_base_model=True)
    app = build_app(str(folder / "detector"))
    launch(app, prevent_thread_lock=True, server_name="127.0.0.1", quiet=True)
    try:
        yield app, AutoOODDetector.from_pretrained(folder / "detector"), folder
    finally:
        app.close()


def _expected(detector, path: Path) -> dict:
    import transformers

    result = transformers.pipeline("ood-image-classification", model=detector)(Image.open(path))
    verdict = "Flagged as out-of-distribution" if result["is_ood"] else "In-distribution"
    return {**result, "verdict": verdict}


def test_the_api_answers_with_the_detectors_decision(served):
    from gradio_client import Client, handle_file

    app, detector, folder = served
    client = Client(app.local_url, verbose=False)
    for seed in range(2):
        path = _image(folder / f"api{seed}.png", seed)
        labels, verdict, _, summary, shown, rows = client.predict(handle_file(str(path)), api_name="/predict")
        expected = _expected(detector, path)
        assert verdict.startswith(expected["verdict"]) and f"p-value {expected['p_value']:.3g}" in verdict
        assert summary["ood_score"] == pytest.approx(expected["ood_score"], rel=1e-6)
        assert summary["p_value"] == pytest.approx(expected["p_value"], rel=1e-12)
        assert summary["p_value_cut"] == pytest.approx(detector.p_value_cut, rel=1e-12)
        assert labels["label"] == expected["predictions"][0]["label"]
        assert Path(shown).is_file()  # the explanation's map over the image (GSC)
        assert len(rows["data"]) == 10 and summary["score_after_short_circuit"] == pytest.approx(expected["ood_score"])


def test_a_person_drops_an_image_and_reads_the_verdict(served, tmp_path):
    """Headless Chromium: load the page, upload an image, wait for the verdict, read it, save a screenshot
    (``HF_GSC_SCREENSHOT=PATH`` keeps it there too)."""
    from hf_gsc.app.browser import (
        chromium_missing,
        start_chromium,
        upload_and_read_verdict,
    )

    if chromium_missing():
        pytest.skip(f"{chromium_missing()}; .ci/run installs them")
    app, detector, folder = served
    browser = start_chromium(tmp_path / "profile")
    try:
        path = _image(folder / "browser.png", seed=5)
        verdict = upload_and_read_verdict(browser, app.local_url, path)
        expected = _expected(detector, path)
        assert verdict.startswith(expected["verdict"]), verdict
        assert f"p-value {expected['p_value']:.3g}" in verdict
        screenshot = tmp_path / "demo.png"
        browser.save_screenshot(str(screenshot))
        assert min(Image.open(screenshot).size) > 100  # a real page, not an empty frame
        if os.environ.get("HF_GSC_SCREENSHOT"):
            shutil.copyfile(screenshot, os.environ["HF_GSC_SCREENSHOT"])
    finally:
        browser.quit()


def test_other_methods_have_no_map():
    from hf_gsc.app.demo import DemoModel

    detector = AutoOODDetector.from_pretrained(make_tiny_model("resnet").float(), method="energy")
    detector.image_processor = ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    image = Image.new("RGB", (30, 40), (10, 200, 30))
    with pytest.warns(UserWarning, match="no threshold"):
        _labels, verdict, _figure, summary, shown, rows = DemoModel(detector)(image)
    assert verdict.startswith("No decision") and shown is None and rows == []
    assert summary["p_value"] is None and "not calibrated" in summary["p_value_unavailable"]


def test_space_folder_and_the_command(tmp_path, capsys):
    from hf_gsc import cli

    assert cli.main(["space", "--detector", "user/gsc-fmnist-resnet", "--output", str(tmp_path / "space")]) == 0
    readme = (tmp_path / "space" / "README.md").read_text()
    front = readme.split("---")[1]
    assert "sdk: gradio" in front and "app_file: app.py" in front and "- user/gsc-fmnist-resnet" in front
    assert "hf upload SPACE_ID . . --repo-type space" in readme
    app = (tmp_path / "space" / "app.py").read_text()
    compile(app, "app.py", "exec")
    assert 'build_app("user/gsc-fmnist-resnet")' in app
    assert (tmp_path / "space" / "requirements.txt").read_text().startswith("hf_gsc[demo]==")
    # A local folder cannot be read by a Space: refused, naming the argument.
    assert cli.main(["space", "--detector", str(tmp_path), "--output", str(tmp_path / "other")]) == 1
    assert not (tmp_path / "other").exists()
    capsys.readouterr()
    assert cli.main(["--help"]) == 0
    help_text = capsys.readouterr().out
    assert "\n  demo " in help_text and "\n  space " in help_text
