"""The run folder as one artifact: whose folder it is (a run's, or the user's: never written over without
``--overwrite``), what the results and saved detectors of an earlier run leave that this run must remove or replace
(so that the folder never holds results that disagree with its fits and score files), the folders a failed run made
and leaves empty, and what a run stopped by a full disk leaves."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import suppress
from pathlib import Path

from ..utils.confined_files import atomic_write_text
from ..utils.version import __version__
from .errors import InputError
from .fitting import DETECTORS_DIR, FIT_INFO, fit_dir, read_fit_info
from .report import RESULTS_JSON, RESULTS_MD
from .score_cache import SCORES_DIR


#: The folder (under ``OUTPUT/detectors/``) of the detector the selection chose.
SELECTED = "selected"


#: The file a run writes first into ``--output-dir``: the folder is a run's, whose files later runs replace.
RUN_MARKER = ".hf_gsc_run.json"
#: The keys every ``results.json`` of a run holds (a folder written before :data:`RUN_MARKER` existed is known by it).
RESULTS_KEYS = ("methods", "skipped", "seconds")


def is_run_folder(output_dir: Path) -> bool:
    """Whether ``output_dir`` holds a run of ``hf-gsc evaluate``: its :data:`RUN_MARKER`, or a ``results.json`` with
    the keys of one (:data:`RESULTS_KEYS`)."""
    if (output_dir / RUN_MARKER).is_file():
        return True
    try:
        results = json.loads((output_dir / RESULTS_JSON).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(results, dict) and all(key in results for key in RESULTS_KEYS)


def claim_output_dir(output_dir: Path, overwrite: bool) -> bool:
    """Before anything is written: ``True`` when ``output_dir`` is missing, empty or a run's (this run may replace
    and remove what earlier runs wrote there), ``False`` for a folder that is not a run, accepted with ``overwrite``
    only (this run then replaces the files of its own names and deletes nothing).

    Raises:
        InputError: a non-empty folder that is not a run, without ``overwrite``; or a path that is not a folder.
    """
    if not output_dir.exists():
        return True
    if not output_dir.is_dir():
        raise InputError(f"--output-dir {str(output_dir)!r} is a file, not a folder")
    # Another process of the same launch may be proving the folder writable (check_output_dir) at this moment.
    entries = [path.name for path in output_dir.iterdir() if not path.name.startswith(".write_test.")]
    if not entries or is_run_folder(output_dir):
        return True
    if overwrite:
        return False
    shown = ", ".join(sorted(entries)[:5]) + (", ..." if len(entries) > 5 else "")
    raise InputError(f"--output-dir {str(output_dir)!r} is not empty ({shown}) and holds no run of hf-gsc evaluate "
                     f"(no {RUN_MARKER} or results.json of one): a run would replace files there; choose a new or "
                     "empty folder, or pass --overwrite to write there anyway (files of the run's names are replaced, "
                     "nothing else is deleted)")


def mark_run_folder(output_dir: Path) -> None:
    """Write :data:`RUN_MARKER` (main process, before the run writes anything else)."""
    atomic_write_text(output_dir / RUN_MARKER, json.dumps({"written_by": "hf-gsc evaluate", "hf_gsc": __version__})
                      + "\n", output_dir)


def unmark_if_alone(output_dir: Path) -> None:
    """Remove :data:`RUN_MARKER` when it is all the folder holds (a run that failed before writing anything)."""
    with suppress(OSError):
        if [path.name for path in output_dir.iterdir()] == [RUN_MARKER]:
            (output_dir / RUN_MARKER).unlink()


def kept_files(output_dir: Path) -> str:
    """What the run folder holds, in words, for a run stopped before its end: score files, fits, results."""
    scores = sum(1 for _ in (output_dir / SCORES_DIR).glob("*/*.safetensors"))
    fits = sorted(path.parent.name for path in (output_dir / DETECTORS_DIR).glob(f"*/{FIT_INFO}"))
    parts = [f"{scores} score file(s) under {SCORES_DIR}/"]
    if fits:
        parts.append(f"the fits of {', '.join(fits)} under {DETECTORS_DIR}/")
    if (output_dir / RESULTS_JSON).is_file():
        parts.append(f"{RESULTS_JSON}")
    return " and ".join(parts)


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


__all__ = ["RESULTS_KEYS", "RUN_MARKER", "SELECTED", "claim_output_dir", "clear_stale_results", "copy_results_json",
           "first_missing", "is_run_folder", "kept_files", "mark_run_folder", "remove_empty_folders",
           "remove_saved_detector", "saved_fingerprint", "unmark_if_alone"]
