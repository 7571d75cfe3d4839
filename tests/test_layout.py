"""The repository's layout as the design names it: ``setup.py`` (a shim over ``pyproject.toml``) for tools that call
it, and the top-level ``model_cards/`` holding the cards of the reference detectors, regenerated without a diff."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[1]


def _clean_env() -> dict[str, str]:
    # Without PYTHONPATH: pip would take an hf_gsc found on it for an installed one.
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_setup_py_reports_the_version(tmp_path):
    from hf_gsc.utils.version import __version__

    result = subprocess.run([sys.executable, "setup.py", "--version"], cwd=REPO_ROOT, capture_output=True, text=True,
                            env=_clean_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == __version__


def test_pip_builds_the_package_through_setup_py(tmp_path):
    """``pip install .``'s build step (a wheel from a copy of the tree, no isolation: the installed setuptools)."""
    source = tmp_path / "source"
    for name in ("hf_gsc", "docs"):
        shutil.copytree(REPO_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "setup.py"):
        shutil.copy2(REPO_ROOT / name, source / name)
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                             str(tmp_path / "wheels"), str(source)], capture_output=True, text=True, env=_clean_env(),
                            timeout=300)
    assert result.returncode == 0, result.stderr
    wheel = next((tmp_path / "wheels").glob("hf_gsc-*.whl"))
    assert "hf_gsc/model_cards/ood_detector.md" in zipfile.ZipFile(wheel).namelist()


def test_model_cards_are_regenerated_without_a_diff(tmp_path):
    spec = importlib.util.spec_from_file_location("model_cards_script", REPO_ROOT / "scripts" / "model_cards.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--check"]) == 0, "model_cards/ is stale: python scripts/model_cards.py"
    shipped = {path.name for path in (REPO_ROOT / "model_cards").glob("*.md")}
    assert {"gsc-fmnist-ood-resnet.md", "gsc-fmnist-ood-vit.md", "gsc-fmnist-ood-swin.md"} <= shipped
    # The check sees a change: a card edited by hand, or one missing.
    shutil.copytree(REPO_ROOT / "model_cards", tmp_path / "cards")
    card = tmp_path / "cards" / "gsc-fmnist-ood-vit.md"
    card.write_text(card.read_text().replace("mask_ratio", "mask_fraction"))
    assert script.main(["--check", "--output", str(tmp_path / "cards")]) == 1
    assert "mask_fraction" not in (REPO_ROOT / "model_cards" / "gsc-fmnist-ood-vit.md").read_text()
