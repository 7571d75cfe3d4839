"""hf_gsc as a user installs it: the core install serves detectors without the evaluation extras, and a wheel
installed outside the checkout saves, loads, serves, pushes (loopback Hub) and runs its commands."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest
from hub_server import LoopbackHub


REPO_ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# The extras a serving install does not have; a module set to None in sys.modules cannot be imported.
EXTRAS = ("datasets", "accelerate", "sklearn", "evaluate", "matplotlib", "skimage")

# Runs in a fresh interpreter: save, load, calibrate and serve a tiny detector through the pipeline.
SERVE_SCRIPT = """
    import json, sys, tempfile
    import numpy as np, torch
    from PIL import Image
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor, pipeline
    import hf_gsc
    from hf_gsc import GSCForImageClassification

    root = tempfile.mkdtemp()
    torch.manual_seed(0)
    base = ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=32, num_labels=3))
    base.save_pretrained(root + "/base")
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(root + "/base")
    detector = GSCForImageClassification.from_pretrained(root + "/base", mask_ratio=0.1)
    detector.calibrate(torch.randn(4, 3, 16, 16))
    detector.save_pretrained(root + "/detector")
    loaded = GSCForImageClassification.from_pretrained(root + "/detector")
    x = torch.randn(2, 3, 16, 16)
    assert torch.equal(loaded(x).ood_score, detector(x).ood_score)
    served = pipeline("ood-image-classification", model=root + "/detector")(
        [Image.fromarray(np.zeros((20, 20, 3), dtype=np.uint8))])
    if len(sys.argv) > 1:  # a repo id: push (base saved) and load back from the Hub
        detector.push_to_hub(sys.argv[1], save_base_model=True)
        pulled = GSCForImageClassification.from_pretrained(sys.argv[1])
        assert torch.equal(pulled(x).ood_score, detector(x).ood_score)
    print(json.dumps({"file": hf_gsc.__file__, "served": served}))
"""


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> str:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def test_serving_needs_no_evaluation_extras(tmp_path):
    blocker = "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n" for name in EXTRAS)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    output = _run([sys.executable, "-c", blocker + textwrap.dedent(SERVE_SCRIPT)], tmp_path, env)
    assert '"ood_score"' in output.splitlines()[-1]
    # The evaluation says which extra it needs instead of a traceback.
    evaluate = ("from hf_gsc.cli import main\nraise SystemExit(main(['evaluate', '--model', "
                f"{str(REPO_ROOT / 'hf_gsc/reference_models/resnet')!r}, '--benchmark', 'fmnist-ood', '--output-dir', "
                f"{str(tmp_path / 'run')!r}, '--methods', 'msp']))")
    result = subprocess.run([sys.executable, "-c", blocker + evaluate], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "hf-gsc evaluate needs the 'evaluation' extra: pip install 'hf_gsc[evaluation]'" in result.stderr


def install_wheel(root: Path) -> tuple[Path, Path]:
    """Build the wheel from a copy of the package and install it (no deps) into a fresh venv whose other packages
    are the test interpreter's, after the venv's own: a plain path entry, so an editable hf_gsc of the checkout
    installed there is not activated. Built from a copy of what the package is made of (building writes build/
    and *.egg-info next to pyproject.toml), without PYTHONPATH (pip would take an hf_gsc found on it for an installed
    one). Returns ``(venv folder, wheel)``."""
    source = root / "source"
    for name in ("hf_gsc", "docs"):
        shutil.copytree(REPO_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, source / name)
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    wheels = root / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
          str(source)], root, clean)
    wheel = next(wheels.glob("hf_gsc-*.whl"))
    env_dir = root / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], root, clean)
    site = _run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root).strip()
    venv_site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root).strip()
    (Path(venv_site) / "test_deps.pth").write_text(site + "\n")
    return env_dir, wheel



@pytest.mark.slow
def test_wheel_installed_outside_the_checkout(tmp_path):
    """Build the wheel, install it (no deps: the test environment's are reused) into a fresh venv outside the
    checkout, and from another folder save, load, serve, push to the loopback Hub, evaluate and publish."""
    env_dir, wheel = install_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "hf_gsc/model_cards/ood_detector.md" in names
    assert {"hf_gsc/docs/index.md", "hf_gsc/docs/evaluation.md", "hf_gsc/docs/api/pipeline.md"} <= set(names)
    # pyproject.toml's metadata: the version read from hf_gsc.utils.version, and the self-referencing extra.
    from hf_gsc.utils.version import __version__

    metadata = zipfile.ZipFile(wheel).read(next(name for name in names if name.endswith("METADATA"))).decode()
    assert f"\nVersion: {__version__}\n" in metadata
    all_extra = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:") and "extra == \"all\"" in line]
    assert len(all_extra) == 1 and "[benchmarks,demo,evaluation,metric,plots]" in all_extra[0], all_extra
    # Every package of hf_gsc is listed in pyproject.toml (the list is explicit because of hf_gsc.docs).
    packages = {str(init.parent.relative_to(REPO_ROOT)).replace("/", ".") for init in (REPO_ROOT / "hf_gsc").rglob("__init__.py")}
    assert {name.rsplit("/", 1)[0].replace("/", ".") for name in names if name.endswith("/__init__.py")} == packages
    assert any(name.endswith("entry_points.txt") for name in names)
    python = env_dir / "bin" / "python"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    command = env_dir / "bin" / "hf-gsc"
    with LoopbackHub() as hub:
        env = {**hub.client_env(hf_home=tmp_path / "hf_home", token=hub.token), "OMP_NUM_THREADS": "1"}
        env.pop("PYTHONPATH", None)
        output = _run([str(python), "-c", textwrap.dedent(SERVE_SCRIPT), "user/gsc-from-wheel"], elsewhere, env)
        installed = json.loads(output.splitlines()[-1])["file"]
        assert installed.startswith(str(env_dir)), installed
        assert "model.safetensors" in hub.get_repo("user/gsc-from-wheel").commits[
            hub._resolve_revision(hub.get_repo("user/gsc-from-wheel"), "main")].files

        reference = Path(installed).parent / "reference_models" / "resnet"
        _run([str(command), "evaluate", "--model", str(reference), "--benchmark", "fmnist-ood", "--ood-splits", "mnist",
              "--methods", "msp,gsc", "--max-samples", "16", "--max-fit-samples", "16", "--batch-size", "16",
              "--no-plots", "--output-dir", "run"], elsewhere, env)
        assert json.loads((elsewhere / "run" / "results.json").read_text())["methods"]["gsc"]["ood"]["mnist"]["auroc"] >= 0
        _run([str(command), "publish", "--results-dir", "run", "--repo-id", "user/results"], elsewhere, env)
        # Published as it may leave the machine: the local paths it names become local:NAME.
        published = json.loads(hub.read_file("user/results", "results.json"))
        local = json.loads((elsewhere / "run" / "results.json").read_text())
        assert published["methods"] == local["methods"] and str(elsewhere) not in json.dumps(published)

    # hf-gsc space from an installed hf_gsc carries the files the wheel installed (no source tree to build from).
    _run([str(command), "space", "--detector", "user/gsc-from-wheel", "--output", "space"], elsewhere, env)
    carried = {str(path.relative_to(elsewhere / "space")) for path in (elsewhere / "space" / "hf_gsc").rglob("*")
               if path.is_file()}
    assert carried == {name for name in names if name.startswith("hf_gsc/")}, carried ^ {
        name for name in names if name.startswith("hf_gsc/")}
    assert "gradio>=5.0" in (elsewhere / "space" / "requirements.txt").read_text().splitlines()
    assert "usage: hf-gsc evaluate" in _run([str(command), "evaluate", "--help"], elsewhere, env)
    assert "usage: hf-gsc {evaluate,publish,docs,demo,space}" in _run([str(python), "-m", "hf_gsc", "--help"], elsewhere, env)
    # The documentation a pip user has: the pages inside the installed package, named by `hf-gsc docs`.
    listing = _run([str(command), "docs"], elsewhere, env)
    assert f"{Path(installed).parent / 'docs'}\n" in listing, listing
    assert "# Evaluation" in _run([str(command), "docs", "evaluation"], elsewhere, env)
    assert "usage: python -m hf_gsc.method_table" in _run([str(python), "-m", "hf_gsc.method_table", "--help"],
                                                          elsewhere, env)
    # The evaluate metric loads from the installed package, by its documented path constant and function.
    metric_script = ("import json; from hf_gsc.evaluation.metrics import OOD_METRIC_PATH, load_ood_metric; "
                     "print(json.dumps([str(OOD_METRIC_PATH), load_ood_metric().compute(predictions=[0.9, 0.4, 0.5, "
                     "0.1], references=[1, 1, 0, 0])]))")
    path, computed = json.loads(_run([str(python), "-c", metric_script], elsewhere, env).splitlines()[-1])
    assert path.startswith(str(env_dir)) and computed["fpr95_ood_positive"] == 0.5, (path, computed)
