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

def _flat_png(path: Path, width: int, height: int, grey: int = 200) -> Path:
    """A PNG of one grey level (8-bit RGB), written row by row: a file of a few hundred KB that decodes to
    ``3 * width * height`` bytes, made without holding its pixels."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row, packer = b"\0" + bytes([grey]) * (3 * width), zlib.compressobj(1)
    with open(path, "wb") as handle:
        handle.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)))
        body = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
        handle.write(chunk(b"IDAT", body) + chunk(b"IEND", b""))
    return path


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

    assert cli.main(["space", "--detector", "user/gsc-fmnist-resnet", "--output", str(tmp_path / "space"),
                     "--requirement", "hf_gsc[demo]==0.4.0"]) == 0
    readme = (tmp_path / "space" / "README.md").read_text()
    front = readme.split("---")[1]
    assert "sdk: gradio" in front and "app_file: app.py" in front and "- user/gsc-fmnist-resnet" in front
    assert "hf upload SPACE_ID . . --repo-type space" in readme
    app = (tmp_path / "space" / "app.py").read_text()
    compile(app, "app.py", "exec")
    assert 'build_app("user/gsc-fmnist-resnet")' in app
    assert (tmp_path / "space" / "requirements.txt").read_text() == "hf_gsc[demo]==0.4.0\n"
    assert not (tmp_path / "space" / "hf_gsc").exists()  # --requirement installs hf_gsc: no package copied
    # A local folder that is no saved detector: refused, naming the argument (tests/test_space.py: a detector's).
    assert cli.main(["space", "--detector", str(tmp_path), "--output", str(tmp_path / "other")]) == 1
    assert not (tmp_path / "other").exists()
    capsys.readouterr()
    assert cli.main(["--help"]) == 0
    help_text = capsys.readouterr().out
    assert "\n  demo " in help_text and "\n  space " in help_text


def _kinds(folder: Path) -> dict[str, Path]:
    """Images whose pixels depend on the decoding rule: 16-bit, transparent, CMYK, EXIF-turned, animated."""
    rng = np.random.default_rng(7)
    made = {}
    sixteen = rng.integers(0, 65536, (40, 30), dtype=np.uint16)
    Image.fromarray(sixteen).save(made.setdefault("16-bit", folder / "sixteen.png"))  # I;16: Gradio's RGB clips it
    rgba = rng.integers(0, 256, (40, 30, 4), dtype=np.uint8)
    rgba[:, :15, 3] = 0  # half transparent over dark colours: composited on white, not dropped
    Image.fromarray(rgba, "RGBA").save(made.setdefault("RGBA", folder / "rgba.png"))
    cmyk = Image.fromarray(rng.integers(0, 256, (40, 30, 4), dtype=np.uint8), "CMYK")
    cmyk.save(made.setdefault("CMYK", folder / "cmyk.jpg"), quality=95)
    turned = Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8))
    exif = turned.getexif()
    exif[0x0112] = 6  # turned 90 degrees: shown upright
    turned.save(made.setdefault("EXIF", folder / "exif.jpg"), exif=exif, quality=95)
    frames = [Image.fromarray(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)).convert("P") for _ in range(3)]
    frames[0].save(made.setdefault("GIF", folder / "animated.gif"), save_all=True, append_images=frames[1:],
                   duration=100, loop=0)
    return made


@pytest.mark.parametrize("kind", ["16-bit", "RGBA", "CMYK", "EXIF", "GIF"])
def test_the_app_decodes_as_the_pipeline(served, kind):
    """The app's verdict, score and p-value on an uploaded file equal the pipeline's on the same file: Gradio hands
    the app a path and the library decodes it (load_image), as the pipeline does."""
    import transformers
    from gradio_client import Client, handle_file

    app, detector, folder = served
    path = _kinds(folder / "kinds" if (folder / "kinds").is_dir() else _mkdir(folder / "kinds"))[kind]
    expected = transformers.pipeline("ood-image-classification", model=detector)(str(path))
    _labels, verdict, _, summary, _shown, _rows = Client(app.local_url, verbose=False).predict(
        handle_file(str(path)), api_name="/predict")
    assert summary["ood_score"] == pytest.approx(expected["ood_score"], rel=1e-6, abs=1e-9)
    assert summary["p_value"] == pytest.approx(expected["p_value"], rel=1e-12)
    assert summary["is_ood"] == expected["is_ood"]
    assert verdict.startswith("Flagged" if expected["is_ood"] else "In-distribution")


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_what_the_browser_receives_names_no_local_path(served):
    """The page (title, config) names the detector folder by its name only; the app limits uploads and cleans its
    cache."""
    import json

    app, _detector, folder = served
    config = json.dumps(app.get_config_file())
    assert str(folder) not in config and str(folder.resolve()) not in config
    assert "(detector)" in app.title
    assert app.delete_cache is not None and min(app.delete_cache) > 0
    assert app.max_file_size == 20 * 1024 * 1024


def test_an_upload_over_the_limit_is_refused(served, tmp_path):
    import requests

    app, _detector, _folder = served
    big = tmp_path / "big.png"
    big.write_bytes(b"\x89PNG" + bytes(21 * 1024 * 1024))
    with open(big, "rb") as handle:
        response = requests.post(app.local_url + "gradio_api/upload", files={"files": handle}, timeout=60)
    assert response.status_code == 413, response.text


def test_an_image_over_the_pixel_limit_is_one_line_naming_it(served, monkeypatch):
    """Refused from the header (HF_GSC_MAX_IMAGE_PIXELS), the message names the upload by its name, not its path."""
    from hf_gsc.app.demo import DemoModel

    _app, detector, folder = served
    path = _image(folder / "holiday.png")
    monkeypatch.setenv("HF_GSC_MAX_IMAGE_PIXELS", "100")
    with pytest.raises(ValueError, match="exceeds the limit") as caught:
        DemoModel(detector)(str(path))
    assert "'holiday.png'" in str(caught.value) and str(folder) not in str(caught.value)


def test_the_histogram_is_drawn_from_a_bounded_sample_once(monkeypatch):
    """The kept scores are binned once at start, from at most HISTOGRAM_SAMPLE of them: a request draws the bins."""
    from matplotlib.axes import Axes

    from hf_gsc.app import demo

    detector = GSCForImageClassification(make_tiny_model("resnet").float(), mask_ratio=0.2)
    detector.image_processor = ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    detector.calibrate(torch.randn(200, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0)))
    monkeypatch.setattr(demo, "HISTOGRAM_SAMPLE", 50)
    binned = []
    original = np.histogram
    monkeypatch.setattr(np, "histogram", lambda values, *a, **k: binned.append(len(values)) or original(values, *a, **k))
    model = demo.DemoModel(detector)
    assert binned == [50] and model.histogram.n == 200
    assert model.histogram.counts.sum() == pytest.approx(200)

    def refuse(*_args, **_kwargs):
        raise AssertionError("a request binned the calibration scores again")

    monkeypatch.setattr(Axes, "hist", refuse)
    monkeypatch.setattr(np, "histogram", refuse)
    model(Image.new("RGB", (30, 40), (10, 200, 30)))


def test_the_overlay_is_computed_at_the_models_input_size(monkeypatch):
    """A large image's map is asked at the model's input size, and the overlay blended there."""
    from hf_gsc.app import demo

    detector = GSCForImageClassification(make_tiny_model("resnet").float(), mask_ratio=0.2)
    detector.image_processor = ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    with pytest.warns(UserWarning, match="no threshold"):
        _labels, _verdict, _figure, _summary, shown, _rows = demo.DemoModel(detector)(
            Image.new("RGB", (1600, 1200), (10, 200, 30)))
    # 16 x 12 (the model's 16-pixel side, the image's aspect), enlarged x16 (nearest) to 256 pixels
    assert shown.size == (16 * 16, 12 * 16)


MEMORY_SCRIPT = """
import json, resource, sys
from hf_gsc.app.demo import DemoModel
model = DemoModel(sys.argv[1])
model(sys.argv[2])  # a small image first: what serving costs before the large ones
for path in sys.argv[3:]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        model(path)
        outcome = "handled"
    except ValueError as error:
        outcome = str(error)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"image": path, "before_kib": before, "peak_kib": peak, "outcome": outcome}), flush=True)
"""


def test_the_server_serves_large_pngs_in_bounded_memory(served):
    """In a fresh process (the app's handler, peak RSS from ``getrusage``; printed with ``-s``):

    * a 12000 x 12000 PNG (144 megapixels, over the default pixel limit) is refused from its header, naming the
      upload: it costs nothing (decoded, it would take 432 MB);
    * a 9000 x 9000 PNG (81 megapixels, within the limit) costs its decode (243 MB of 8-bit RGB) and the image
      processor's 8-bit copies of it, never a float array at its size (one float64 copy alone is 1.9 GB): the request
      adds less than 5 bytes per decoded sample to the peak.
    """
    import json
    import subprocess
    import sys

    _app, _detector, folder = served
    huge, large = _flat_png(folder / "huge.png", 12000, 12000), _flat_png(folder / "large.png", 9000, 9000)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(folder / "detector"),
                           str(_image(folder / "small.png")), str(huge), str(large)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    refused, served_large = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert "exceeds the limit" in refused["outcome"] and "'huge.png'" in refused["outcome"]
    assert refused["peak_kib"] - refused["before_kib"] < 50 * 2**10
    assert served_large["outcome"] == "handled"
    added = (served_large["peak_kib"] - served_large["before_kib"]) * 1024
    print(f"81-megapixel PNG ({large.stat().st_size:,} bytes): peak RSS {served_large['peak_kib'] / 2**20:.2f} GiB, "
          f"{added / 2**30:.2f} GiB over the process after a small image ({served_large['before_kib'] / 2**20:.2f} "
          "GiB)")
    assert added < 5 * 9000 * 9000 * 3


def test_space_never_writes_over_the_users_files(tmp_path, capsys):
    """A non-empty --output that hf-gsc space did not write is refused (nothing replaced) unless --overwrite; a folder
    it wrote is rewritten; nothing else in the folder is ever touched."""
    from hf_gsc import cli

    mine = tmp_path / "mine"
    mine.mkdir()
    own = {"app.py": "print('my app')\n", "README.md": "# my space\n", "requirements.txt": "numpy\n",
           "notes.txt": "keep me\n"}
    for name, text in own.items():
        (mine / name).write_text(text)
    command = ["space", "--detector", "user/gsc-fmnist-resnet", "--output", str(mine), "--requirement", "hf_gsc"]
    assert cli.main(command) == 1
    err = capsys.readouterr().err
    assert "is not empty and was not written by hf-gsc space" in err and "--overwrite" in err
    assert {name: (mine / name).read_text() for name in own} == own
    (mine / "app.py").unlink()
    assert cli.main(command) == 1  # any other file makes it the user's folder
    assert cli.main([*command, "--overwrite"]) == 0
    assert 'build_app("user/gsc-fmnist-resnet")' in (mine / "app.py").read_text()
    assert (mine / "notes.txt").read_text() == "keep me\n"
    # A folder this command wrote is its own: written again without --overwrite, for another detector.
    assert cli.main(["space", "--detector", "user/other", "--output", str(mine), "--requirement", "hf_gsc"]) == 0
    assert 'build_app("user/other")' in (mine / "app.py").read_text() and (mine / "notes.txt").is_file()
    (tmp_path / "file").write_text("x")
    assert cli.main(["space", "--detector", "user/other", "--output", str(tmp_path / "file")]) == 1
    assert "is a file, not a folder" in capsys.readouterr().err


def test_an_unreadable_upload_is_one_line_naming_it_without_its_folder(served):
    from hf_gsc.app.demo import DemoModel

    _app, detector, folder = served
    path = folder / "notes.png"
    path.write_bytes(b"not an image")
    with pytest.raises(ValueError, match="cannot read the image 'notes.png': ") as caught:
        DemoModel(detector)(str(path))
    assert str(folder) not in str(caught.value)
