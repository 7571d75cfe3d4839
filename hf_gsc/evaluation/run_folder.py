"""The run folder as one artifact: what the results and saved detectors of an earlier run leave that this run must
remove or replace (so that the folder never holds results that disagree with its fits and score files), and the
folders a failed run made and leaves empty."""

from __future__ import annotations

import os
import shutil
from contextlib import suppress
from pathlib import Path

from .fitting import FIT_INFO, fit_dir, read_fit_info
from .report import RESULTS_JSON, RESULTS_MD

#: The folder (under ``OUTPUT/detectors/``) of the detector the selection chose.
SELECTED = "selected"


def clear_stale_results(output_dir: Path, fit_fingerprints: dict[str, str], *, shipped: bool, overwrite: bool) -> None:
    """Before a run writes anything (main process): remove the earlier run's ``results.json``, ``results.md`` and
    ``detectors/selected``, and the saved-detector files of a method whose fit is about to change (its fit folder
    keeps only the fit)."""
    for name in (RESULTS_JSON, RESULTS_MD):
        (output_dir / name).unlink(missing_ok=True)
    selected = fit_dir(output_dir, SELECTED)
    if selected.is_dir() and not selected.is_symlink():
        shutil.rmtree(selected)
    for name, expected in fit_fingerprints.items():
        if not shipped and (overwrite or saved_fingerprint(output_dir, name) != expected):
            remove_saved_detector(output_dir, name)


def copy_results_json(output_dir: Path, folders: list[Path]) -> None:
    """The final ``results.json`` (with the save phase's time) into each saved detector folder, over the copy its
    ``save_pretrained`` made a moment before."""
    from ..utils.confined_files import copy_file

    for folder in folders:
        copy_file(output_dir, RESULTS_JSON, folder)


def saved_fingerprint(output_dir: Path, method: str) -> str | None:
    return read_fit_info(fit_dir(output_dir, method)).get("fingerprint")


def remove_saved_detector(output_dir: Path, method: str) -> None:
    """Remove what ``--save-detectors`` wrote for ``method`` (its config, card, processor files) beside a fit that
    this run replaces; the fit's own files stay for the fit to overwrite."""
    from ..settings.config import STATE_FILE

    folder = fit_dir(output_dir, method)
    if not folder.is_dir() or folder.is_symlink() or not (folder / "config.json").exists():
        return
    for path in folder.iterdir():
        if path.name in (STATE_FILE, FIT_INFO):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def first_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` (``path`` itself or an ancestor) that does not exist yet: what this run
    creates; ``None`` when ``path`` exists."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists() or folder.is_symlink():
            break
        missing = folder
    return missing


def remove_empty_folders(path: Path, created: Path) -> None:
    """Remove ``path`` and its ancestors up to ``created`` (the folders this run made), each only if it holds nothing
    (empty sub-folders this run made inside ``path``, e.g. the score cache's, go first)."""
    if path.is_dir() and not path.is_symlink():
        for root, folders, _ in os.walk(path, topdown=False):
            for name in folders:
                with suppress(OSError):  # not empty, or not ours to remove: kept
                    (Path(root) / name).rmdir()
    for folder in (path, *path.parents):
        try:
            folder.rmdir()
        except OSError:
            return
        if folder == created:
            return


__all__ = ["SELECTED", "clear_stale_results", "copy_results_json", "first_missing", "remove_empty_folders",
           "remove_saved_detector", "saved_fingerprint"]
