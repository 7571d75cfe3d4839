"""The hf_gsc a Space carries: the running version's package files, copied into the Space folder, and the
``requirements.txt`` lines of its dependencies with the ``demo`` extra (resolved from the package index).

Why the package itself and not a wheel named in ``requirements.txt``: a Space (Gradio SDK) installs its
``requirements.txt`` before the repository's files are copied into the image (only that file is mounted for the
``pip install`` step), so a line ``./hf_gsc-X-py3-none-any.whl[demo]`` names a file that is not there at build time.
A package folder beside ``app.py`` is importable as soon as the app starts (``app.py``'s folder is first on
``sys.path``), on a Space and offline alike.

Where the files come from:

* running from a source tree (``pyproject.toml`` beside the package: a checkout, an editable install): the wheel
  is built from a copy of it (``pip wheel --no-deps --no-build-isolation``), and its ``hf_gsc/`` files and
  ``Requires-Dist`` are taken;
* running from an installed distribution: the files it installed under ``hf_gsc/`` (its ``RECORD``) and its
  metadata's ``Requires-Dist``.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path


PACKAGE = "hf_gsc"
#: The extra a Space installs with the package: the Gradio app and its figure.
EXTRA = "demo"
#: What a source tree holds that its wheel is built from (setup.py: the shim over pyproject.toml, when present).
SOURCE_PARTS = ("hf_gsc", "docs", "pyproject.toml", "README.md", "setup.py")


def package_root() -> Path:
    """The folder of the running hf_gsc package."""
    return Path(__file__).resolve().parents[1]


def source_tree() -> Path | None:
    """The source tree the running package belongs to (its ``pyproject.toml`` names hf_gsc), else None."""
    root = package_root().parent
    pyproject = root / "pyproject.toml"
    if pyproject.is_file() and f'name = "{PACKAGE}"' in pyproject.read_text(encoding="utf-8"):
        return root
    return None


def requirements(requires_dist: list[str], extra: str = EXTRA) -> list[str]:
    """The ``requirements.txt`` lines that install the dependencies of hf_gsc with ``extra``: the unconditional
    ``Requires-Dist`` entries and those of ``extra``, its marker dropped (other markers are kept, to be evaluated
    where the Space installs them)."""
    from packaging.requirements import Requirement

    lines = []
    for entry in requires_dist:
        requirement = Requirement(entry)
        marker = requirement.marker
        if marker is not None and "extra" in str(marker):
            if not marker.evaluate({"extra": extra}):
                continue
            requirement.marker = None
        if requirement.name.replace("-", "_") == PACKAGE:  # a self-referencing extra (all = hf_gsc[...])
            continue
        lines.append(str(requirement))
    return lines


def write_package(target: Path) -> list[str]:
    """Write the running hf_gsc's package files into ``target / "hf_gsc"`` (a folder that must not exist yet) and
    return the requirement lines of its dependencies with the ``demo`` extra.

    Raises:
        OSError: the wheel could not be built (the tool's output in the message) or the files could not be copied.
    """
    tree = source_tree()
    if tree is not None:
        return _from_source_tree(tree, target)
    return _from_installed(target)


def _from_source_tree(tree: Path, target: Path) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="hf_gsc-space-wheel-") as scratch:
        source, wheels = Path(scratch) / "source", Path(scratch) / "wheels"
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        for name in SOURCE_PARTS:
            if (tree / name).is_dir():
                shutil.copytree(tree / name, source / name, ignore=ignore)
            elif (tree / name).is_file():
                shutil.copy2(tree / name, source / name)
        # Without PYTHONPATH: pip would take an hf_gsc found on it for an installed one.
        env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
        built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                                "-w", str(wheels), str(source)], capture_output=True, text=True, env=env)
        found = sorted(wheels.glob(f"{PACKAGE}-*.whl"))
        if built.returncode != 0 or not found:
            raise OSError(f"could not build the wheel of hf_gsc from {tree} (pip wheel, exit {built.returncode}): "
                          f"{(built.stderr or built.stdout).strip()[-2000:]}")
        with zipfile.ZipFile(found[0]) as wheel:
            members = [name for name in wheel.namelist() if name.startswith(f"{PACKAGE}/")]
            wheel.extractall(target, members)
            meta = next(name for name in wheel.namelist() if name.endswith(".dist-info/METADATA"))
            parsed = email.parser.Parser().parsestr(wheel.read(meta).decode("utf-8"))
    return requirements(parsed.get_all("Requires-Dist") or [])


def _from_installed(target: Path) -> list[str]:
    distribution = metadata.distribution(PACKAGE)
    root = package_root()
    for record in distribution.files or []:
        if record.parts[0] != PACKAGE or "__pycache__" in record.parts:
            continue
        source = Path(record.locate())
        if source.resolve().is_relative_to(root) and source.is_file():
            destination = target / Path(*record.parts)
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)
    return requirements(distribution.requires or [])


__all__ = ["EXTRA", "package_root", "requirements", "source_tree", "write_package"]
