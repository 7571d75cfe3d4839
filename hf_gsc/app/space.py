"""``hf-gsc space --detector REPO --output DIR``: a folder that runs the demo app (:mod:`hf_gsc.app.demo`) as a
Hugging Face Space: ``app.py``, ``requirements.txt`` and ``README.md`` with the Space's metadata; the README says how
to push it.

``DIR`` must be new, empty, or a folder this command wrote (its ``app.py`` says so on its first line); another folder
is refused without ``--overwrite``, so the user's own ``app.py``, ``README.md`` or ``requirements.txt`` are never
replaced unasked. Nothing else in ``DIR`` is touched.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..storage.repo_ids import is_hub_id
from ..utils.confined_files import atomic_write_text
from ..utils.version import __version__

PROG = "hf-gsc space"
#: The Gradio SDK version the Space metadata names when gradio is not installed here (the ``demo`` extra's oldest).
GRADIO_SDK_VERSION = "5.0.0"

#: The first line of every ``app.py`` this command writes, up to the repo id: how it knows a folder it wrote.
APP_MARK = '"""The hf_gsc demo app for '
#: The files this command writes (and, without ``--overwrite``, replaces only in a folder it wrote).
WRITTEN = ("app.py", "requirements.txt", "README.md")

APP = APP_MARK + '''{repo_id} (written by hf-gsc space, hf_gsc {version})."""

from hf_gsc.app.demo import build_app, launch

launch(build_app("{repo_id}"))
'''

README = """---
title: {title}
emoji: 🔎
colorFrom: gray
colorTo: red
sdk: gradio
sdk_version: {sdk_version}
app_file: app.py
pinned: false
models:
- {repo_id}
tags:
- out-of-distribution-detection
- hf_gsc
---

# {title}

Drop or paste an image to see what the OOD detector [{repo_id}](https://huggingface.co/{repo_id}) makes of it: the
base model's top labels, the verdict, the score against the threshold and the ID calibration scores, the p-value
(the chance that an in-distribution image scores this low) and, for GSC, the map of what the short-circuit took from
the predicted logit. The app is `hf_gsc.app.demo` (hf_gsc {version}); run it locally with
`hf-gsc demo --detector {repo_id}`.

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
                     "choose a new or empty folder, or pass --overwrite to write app.py, requirements.txt and "
                     "README.md there anyway (nothing else in it is touched)")


def write_space(repo_id: str, output: str | Path, requirement: str | None = None, overwrite: bool = False) -> Path:
    """Write the Space folder for the detector ``repo_id`` (a Hub id: a Space cannot read a local folder) into
    ``output``; ``requirement`` is the line that installs hf_gsc there (default: this version with the ``demo``
    extra). ``output`` must be new, empty or written by this command, unless ``overwrite`` (:func:`check_output`).
    Returns ``output``."""
    if not is_hub_id(repo_id):
        raise ValueError(f"{PROG}: --detector must be a Hub repo id (user/name) that the Space can download, got "
                         f"{repo_id!r}; push a local detector first (hf-gsc publish --detector-dir ...)")
    output = Path(output)
    check_output(output, overwrite)
    output.mkdir(parents=True, exist_ok=True)
    title = f"{repo_id.split('/')[-1]} OOD detector"
    requirement = requirement or f"hf_gsc[demo]=={__version__}"
    atomic_write_text(output / "app.py", APP.format(repo_id=repo_id, version=__version__))
    atomic_write_text(output / "requirements.txt", f"{requirement}\n")
    atomic_write_text(output / "README.md", README.format(repo_id=repo_id, title=title, version=__version__,
                                                          sdk_version=_gradio_version()))
    return output


def _gradio_version() -> str:
    """The installed gradio's version (what the app was run with here), else :data:`GRADIO_SDK_VERSION`."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gradio")
    except PackageNotFoundError:
        return GRADIO_SDK_VERSION


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--detector", required=True, help="the detector's Hub repo id (user/name)")
    parser.add_argument("--output", required=True, help="folder to write (app.py, requirements.txt, README.md)")
    parser.add_argument("--requirement", default=None,
                        help=f"the requirements.txt line that installs hf_gsc (default: hf_gsc[demo]=={__version__})")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --output that this command did not write (its app.py, "
                        "requirements.txt and README.md are replaced; nothing else is touched)")
    args = parser.parse_args(argv)
    try:
        folder = write_space(args.detector, args.output, args.requirement, args.overwrite)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote the Space for {args.detector} to {folder}; push it as its README.md says")
    return 0


__all__ = ["APP_MARK", "WRITTEN", "check_output", "main", "write_space", "written_here"]
