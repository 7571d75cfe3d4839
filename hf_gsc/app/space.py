"""``hf-gsc space --detector REPO_OR_FOLDER --output DIR``: a folder that runs the demo app (:mod:`hf_gsc.app.demo`)
as a Hugging Face Space: ``app.py``, ``requirements.txt``, ``README.md`` with the Space's metadata (it says how to
push the folder), the running hf_gsc's package (``hf_gsc/``, :mod:`hf_gsc.app.space_package`; its dependencies with
the ``demo`` extra are ``requirements.txt``'s lines, from the package index) and, for a local ``--detector`` folder,
a copy of it (``detector/``), so that the folder runs offline (``pip install -r requirements.txt && python app.py``)
and a private detector needs no Hub repo. ``--requirement LINE`` writes that line instead and no ``hf_gsc/``.

``DIR`` must be new, empty, or a folder this command wrote (its ``app.py`` says so on its first line); another folder
is refused without ``--overwrite``, so the user's own files are never replaced unasked. Only the names in
:data:`WRITTEN` are written (a ``hf_gsc/`` or ``detector/`` folder this command wrote is replaced whole, or removed
when this run writes none: ``--requirement``, a Hub id); nothing else in ``DIR`` is touched.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..storage.repo_ids import is_hub_id, looks_local
from ..utils.confined_files import atomic_write_text
from ..utils.version import __version__
from .space_package import write_package


PROG = "hf-gsc space"
#: The Gradio SDK version the Space metadata names when gradio is not installed here (the ``demo`` extra's oldest).
GRADIO_SDK_VERSION = "5.0.0"

#: The first line of every ``app.py`` this command writes, up to the repo id: how it knows a folder it wrote.
APP_MARK = '"""The hf_gsc demo app for '
#: The files this command writes (and, without ``--overwrite``, replaces only in a folder it wrote).
#: The folders among them: the hf_gsc package (unless ``--requirement``) and a local detector's copy.
PACKAGE_DIR, DETECTOR_DIR = "hf_gsc", "detector"
WRITTEN = ("app.py", "requirements.txt", "README.md", PACKAGE_DIR, DETECTOR_DIR)

APP = APP_MARK + '''{repo_id} (written by hf-gsc space, hf_gsc {version})."""

from hf_gsc.app.demo import build_app, launch

launch(build_app({detector}))
'''
#: What app.py loads for a local detector: its copy beside app.py, wherever the Space's folder is.
LOCAL_DETECTOR = f'str(__import__("pathlib").Path(__file__).resolve().parent / "{DETECTOR_DIR}")'

README = """---
title: {title}
emoji: 🔎
colorFrom: gray
colorTo: red
sdk: gradio
sdk_version: {sdk_version}
app_file: app.py
pinned: false
{models}tags:
- out-of-distribution-detection
- hf_gsc
---

# {title}

Drop or paste an image to see what the OOD detector {shown} makes of it: the
base model's top labels, the verdict, the score against the threshold and the ID calibration scores, the p-value
(the chance that an in-distribution image scores this low) and, for GSC, the map of what the short-circuit took from
the predicted logit. The app is `hf_gsc.app.demo` (hf_gsc {version}); {installed}

Run this folder locally (offline for a detector in `{detector_dir}/`):

```bash
pip install -r requirements.txt
python app.py
```

## Push this folder as a Space

```bash
hf repos create SPACE_ID --repo-type space --space-sdk gradio
hf upload SPACE_ID . . --repo-type space
```

(`SPACE_ID` is `user/name`; `huggingface_hub`'s Python API does the same:
`HfApi().create_repo(SPACE_ID, repo_type="space", space_sdk="gradio")`, then
`HfApi().upload_folder(repo_id=SPACE_ID, folder_path=".", repo_type="space")`.)
"""


def written_here(output: Path) -> bool:
    """Whether ``output`` is a folder this command wrote: its ``app.py`` begins with :data:`APP_MARK` and names this
    command."""
    try:
        with open(output / "app.py", "rb") as handle:
            first = handle.read(512).decode("utf-8", errors="replace").splitlines()[:1]
    except OSError:
        return False
    return bool(first) and first[0].startswith(APP_MARK) and "(written by hf-gsc space" in first[0]


def check_output(output: Path, overwrite: bool = False) -> None:
    """Refuse an ``output`` that is a file, or a non-empty folder this command did not write (unless ``overwrite``).

    Raises:
        ValueError: naming ``--output`` and ``--overwrite``.
    """
    if output.exists() and not output.is_dir():
        raise ValueError(f"{PROG}: --output {str(output)!r} is a file, not a folder")
    if overwrite or not output.exists() or not any(output.iterdir()) or written_here(output):
        return
    present = [name for name in WRITTEN if (output / name).exists()]
    replaced = f"; it would replace its {', '.join(present)}" if present else ""
    raise ValueError(f"{PROG}: --output {str(output)!r} is not empty and was not written by hf-gsc space{replaced}; "
                     f"choose a new or empty folder, or pass --overwrite to write {', '.join(WRITTEN)} there anyway "
                     "(nothing else in it is touched)")


def write_space(detector: str | os.PathLike, output: str | Path, requirement: str | None = None,
                overwrite: bool = False) -> Path:
    """Write the Space folder for ``detector`` into ``output`` and return ``output``.

    Args:
        detector: a Hub repo id (the Space downloads it) or a local detector folder (copied into ``output/detector``;
            it must hold its base weights or name its base model by a Hub id, since the Space has no other folder).
        output: new, empty or written by this command, unless ``overwrite`` (:func:`check_output`).
        requirement: the one ``requirements.txt`` line that installs hf_gsc there; default: the running hf_gsc's
            package copied into ``output/hf_gsc`` and its dependencies with the ``demo`` extra as the lines.
        overwrite: write into a non-empty folder this command did not write.

    Raises:
        FileNotFoundError: ``detector`` reads as a local path that does not exist.
        ValueError: ``detector`` is neither a detector folder nor a Hub id; ``output`` is refused.
        OSError: the package could not be built or written.
    """
    local = os.path.isdir(detector)
    name = str(detector)
    if local:
        _check_local_detector(Path(detector))
    elif looks_local(name):
        raise FileNotFoundError(f"{PROG}: --detector {name!r} reads as a local folder and does not exist (working "
                                f"directory {os.getcwd()}); give a detector folder or a Hub repo id (user/name)")
    elif not is_hub_id(name):
        raise ValueError(f"{PROG}: --detector must be a detector folder or a Hub repo id (user/name), got {name!r}")
    output = Path(output)
    if local and Path(output).resolve().is_relative_to(Path(detector).resolve()):
        raise ValueError(f"{PROG}: --output {str(output)!r} lies inside --detector {name!r}, which is copied into it; "
                         "choose a folder outside it")
    check_output(output, overwrite)
    ours = written_here(output)
    output.mkdir(parents=True, exist_ok=True)
    # A folder of ours from an earlier run drops what this run does not write: a package copy app.py would import
    # instead of what --requirement installs, a detector copy it no longer loads.
    for folder, kept in ((PACKAGE_DIR, requirement is None), (DETECTOR_DIR, local)):
        if ours and not kept and (output / folder).is_dir() and not (output / folder).is_symlink():
            shutil.rmtree(output / folder)
    if local:
        _replace_folder(output, DETECTOR_DIR, lambda staged: shutil.copytree(
            detector, staged, ignore=shutil.ignore_patterns(".cache", ".git")))
    if requirement is None:
        lines: list[str] = []
        _replace_folder(output, PACKAGE_DIR, lambda staged: lines.extend(write_package(staged.parent)))
        installs = (f"`{PACKAGE_DIR}/` is hf_gsc {__version__} itself and `requirements.txt` its dependencies with "
                    "the `demo` extra (from the package index).")
    else:
        lines = [requirement]
        installs = f"`requirements.txt` installs hf_gsc: `{requirement}`."
    shown_id = f"in `{DETECTOR_DIR}/`" if local else f"[{name}](https://huggingface.co/{name})"
    title = f"{(Path(detector).resolve().name if local else name.split('/')[-1])} OOD detector"
    atomic_write_text(output / "app.py", APP.format(
        repo_id=f"./{DETECTOR_DIR}" if local else name, version=__version__,
        detector=LOCAL_DETECTOR if local else json.dumps(name)))
    atomic_write_text(output / "requirements.txt", "".join(f"{line}\n" for line in lines))
    atomic_write_text(output / "README.md", README.format(
        title=title, version=__version__, sdk_version=_gradio_version(), shown=shown_id, installed=installs,
        models="" if local else f"models:\n- {name}\n", detector_dir=DETECTOR_DIR))
    return output


def _check_local_detector(folder: Path) -> None:
    """A local ``--detector`` must be a saved detector that a Space can load from its copy alone."""
    from ..settings.config import CONFIG_NAME  # here: hf-gsc space --help imports no torch
    from ..storage.loading import has_base_weights

    config = folder / CONFIG_NAME
    if not config.is_file():
        raise ValueError(f"{PROG}: --detector {str(folder)!r} is a folder without {CONFIG_NAME}: not a saved detector "
                         "(save_pretrained, or hf-gsc evaluate --save-detectors)")
    base = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
    if not has_base_weights(folder) and not is_hub_id(base):
        raise ValueError(f"{PROG}: --detector {str(folder)!r} holds no base weights and names its base model "
                         f"{base!r}, which a Space cannot read; save it with save_pretrained(..., "
                         "save_base_model=True) (hf-gsc publish --save-base-model)")


def _replace_folder(output: Path, name: str, write) -> None:
    """``write(staged)`` into a new folder beside ``output / name``, then swap it in (the old one removed)."""
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=output))
    try:
        staged = scratch / name
        write(staged)
        if (output / name).is_symlink() or (output / name).is_file():
            (output / name).unlink()
        elif (output / name).exists():
            shutil.rmtree(output / name)
        os.replace(staged, output / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _gradio_version() -> str:
    """The installed gradio's version (what the app was run with here), else :data:`GRADIO_SDK_VERSION`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gradio")
    except PackageNotFoundError:
        return GRADIO_SDK_VERSION


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--detector", required=True,
                        help="the detector: a Hub repo id (user/name) or a local detector folder (copied into the "
                        "Space as detector/)")
    parser.add_argument("--output", required=True,
                        help="folder to write (app.py, requirements.txt, README.md, hf_gsc/, detector/)")
    parser.add_argument("--requirement", default=None,
                        help="the one requirements.txt line that installs hf_gsc (e.g. a package index's "
                        "'hf_gsc[demo]==X'); default: this hf_gsc's package copied into the Space as hf_gsc/ and its "
                        "dependencies with the demo extra as requirements.txt")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --output that this command did not write (its app.py, "
                        "requirements.txt, README.md, hf_gsc/ and detector/ are replaced; nothing else is touched)")
    args = parser.parse_args(argv)
    try:
        folder = write_space(args.detector, args.output, args.requirement, args.overwrite)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote the Space for {args.detector} to {folder}; run it with `pip install -r requirements.txt && python "
          "app.py` there, or push it as its README.md says")
    return 0


__all__ = ["APP_MARK", "WRITTEN", "check_output", "main", "write_space", "written_here"]
