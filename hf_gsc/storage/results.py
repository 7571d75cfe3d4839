"""The evaluation results a detector folder carries (``results.json``, ``results.md``, plots of an ``hf-gsc evaluate``
output): read, checked to belong to the detector, made public (no local path) and copied in."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..settings.config import parse_json_object
from ..utils import confined_files
from .repo_ids import is_hub_id
from .saved_format import read_config


if TYPE_CHECKING:
    from .savable import SavableDetector

#: The results files of an evaluation output that a detector folder carries (its plots besides).
RESULT_FILES = ("results.json", "results.md")


def read_results(results_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], str | None, list[Path]]:
    """``results.json`` (parsed), ``results.md`` (text or ``None``) and the plots (paths relative to the folder)
    of an evaluation output folder. A link leading out of the folder is refused (:class:`~hf_gsc.utils.confined_files.LinkError`)."""
    source = Path(results_dir)
    if not confined_files.is_file(source, "results.json"):
        raise FileNotFoundError(f"results_dir {source} has no results.json; run `hf-gsc evaluate` first")
    results = parse_json_object(confined_files.read_bytes(source, "results.json"), source / "results.json",
                                "evaluation results")
    table = confined_files.read_text(source, "results.md") if confined_files.is_file(source, "results.md") else None
    # Saved detectors and score files beside the results are not results (a saved detector carries a copy).
    plots = [p for p in confined_files.find_files(source, "*.png") if p.parts[0] not in ("detectors", "scores")]
    return results, table, plots


def copy_results(results_dir: str | os.PathLike[str], directory: Path, plots: list[Path], public: bool = False) -> None:
    """Copy the results files and ``plots`` into ``directory``, neither reading out of ``results_dir`` nor
    writing out of ``directory`` through a link. ``public`` (a push): the local paths that ``results.json`` names
    are replaced in ``results.json`` and ``results.md`` by :func:`public_results`."""
    source = Path(results_dir)
    names = [name for name in RESULT_FILES if confined_files.is_file(source, name)]
    if public and names:
        results, table, _ = read_results(source)
        results, table = public_results(results, table)
        confined_files.atomic_write_text(Path(directory) / RESULT_FILES[0], json.dumps(results, indent=2) + "\n")
        if table is not None:
            confined_files.atomic_write_text(Path(directory) / RESULT_FILES[1], table)
        names = []
    relatives: list[str | Path] = [*names, *plots]
    for relative in relatives:
        confined_files.copy_file(source, relative, directory)


def _local_paths(value: Any) -> set[str]:
    """Every string in a results record that names a path on this machine (absolute, or an existing file or folder)."""
    if isinstance(value, Mapping):
        return set().union(*(_local_paths(item) for item in value.values())) if value else set()
    if isinstance(value, (list, tuple)):
        return set().union(*(_local_paths(item) for item in value)) if value else set()
    if isinstance(value, str) and value and not is_hub_id(value):
        if os.path.isabs(value) or (os.sep in value and os.path.exists(value)):
            return {value}
    return set()


def public_results(results: Mapping[str, Any], table: str | None) -> tuple[dict[str, Any], str | None]:
    """``results.json`` and ``results.md`` as they may leave this machine: each local path they name (the model
    folder, an image folder, the output dir) becomes ``local:NAME`` (its last component), so that nothing pushed
    reveals where files lie on the publisher's machine."""
    paths = sorted(_local_paths(results), key=len, reverse=True)

    def public(text: str) -> str:
        for path in paths:
            text = text.replace(path, f"local:{Path(path.rstrip(os.sep)).name}")
        return text

    return json.loads(public(json.dumps(results))), None if table is None else public(table)


def check_results_match(results: Mapping[str, Any], detector: SavableDetector, results_dir: str | os.PathLike[str]) -> None:
    """Refuse results that another model or other settings produced: the card would claim them.

    The fingerprint compared is the evaluated model and every hyperparameter that changes ``ood_score``, as recorded
    under ``methods.{method}.hyperparameters`` in ``results.json``.
    """
    method = detector.method
    entry = (results.get("methods") or {}).get(method)
    if not entry or "hyperparameters" not in entry:
        raise ValueError(f"results_dir {results_dir}: results.json holds no {method} results with their hyperparameters")
    config = detector.config
    evaluated = str(results.get("model"))
    if not _same_model(evaluated, config.base_model_name_or_path):
        raise ValueError(
            f"results_dir {results_dir} evaluated the model {evaluated!r}, but this detector's base model is "
            f"{config.base_model_name_or_path!r}; attach results of this detector's own evaluation"
        )
    saved = entry["hyperparameters"]
    mine = detector.config.score_hyperparameters()
    differing = [name for name in mine if name in saved and _jsonable(saved[name]) != _jsonable(mine[name])]
    if differing:
        details = ", ".join(f"{name}: results {saved[name]!r} vs detector {mine[name]!r}" for name in differing)
        raise ValueError(f"results_dir {results_dir} was evaluated with other {method} settings ({details})")


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _same_model(evaluated: str, base: str | None) -> bool:
    if base is None:
        return False
    if os.path.isdir(evaluated):
        saved = read_config(evaluated)
        if saved is not None:  # the evaluation ran on a saved detector: compare its base model
            evaluated = saved.base_model_name_or_path or evaluated
    if os.path.isdir(evaluated) and os.path.isdir(base):
        return os.path.realpath(evaluated) == os.path.realpath(base)
    return evaluated == base
