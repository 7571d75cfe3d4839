"""Scoring times that outlive the run: ``scores/timings.json``, next to the score files they belong to.

A rerun reads cached score files instead of scoring again, so its own clock says nothing about scoring. Each
pass over a split is recorded under the fingerprint of every score file it wrote (the same fingerprint the
:class:`~hf_gsc.evaluation.score_cache.ScoreCache` checks), so ``results.json`` reports, for every split, the timing of
the pass that computed the scores it uses, marked ``cached`` when that pass ran in an earlier run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .json_files import write_json


#: The timing records' file, inside the score cache folder (``scores/``).
TIMINGS_FILE = "timings.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):  # missing, or cut short by a crash: timings are a record, not a result
        return {}
    return records if isinstance(records, dict) else {}


def update_timings(
    scores_dir: str | Path,
    fingerprints: Mapping[tuple[str, str], str],
    scored: Mapping[str, Sequence[str]],
    passes: Mapping[str, Mapping[str, Any]],
    method_seconds: Mapping[str, Mapping[str, float]],
) -> dict[str, Any]:
    """Record this run's passes and return every record (main process).

    Args:
        scores_dir: the score cache folder.
        fingerprints: ``(method, split)`` -> fingerprint of its score file in this run's plan.
        scored: split -> the methods scored in this run.
        passes: split -> ``{"seconds", "num_samples", "images_per_second", "backbone_seconds"}`` of this run's pass
            over it.
        method_seconds: method -> split -> that method's scoring seconds on the main process.
    """
    path = Path(scores_dir) / TIMINGS_FILE
    records = _read(path)
    current = set(fingerprints.values())
    # A record whose (method, split) now holds another fingerprint describes an overwritten file.
    planned = {(r.get("method"), r.get("split")) for r in records.values()} & set(fingerprints)
    records = {fp: r for fp, r in records.items() if (r.get("method"), r.get("split")) not in planned or fp in current}
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for split, methods in scored.items():
        if not methods or split not in passes:
            continue
        for method in methods:
            seconds = method_seconds.get(method, {}).get(split)
            records[fingerprints[(method, split)]] = {
                "method": method, "split": split, "methods": list(methods), "created": created,
                **dict(passes[split]), "method_seconds": None if seconds is None else round(seconds, 3),
            }
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, records)
    return records


def split_timings(
    records: Mapping[str, Mapping[str, Any]],
    fingerprints: Mapping[tuple[str, str], str],
    passes_now: Mapping[str, Mapping[str, Any]],
    scored_now: Mapping[str, Sequence[str]],
    created_now: str,
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, float]]]:
    """``(split -> timing of the pass that computed its scores, method -> split -> scoring seconds)``.

    A split scored in this run reports this run's pass (``cached: False``, ``methods``: those it scored); any
    other the recorded pass that wrote most of its score files (``cached: True``, ``created``: when it ran). A
    split with no record (score files written before timings were recorded) is left out.
    """
    splits: dict[str, dict[str, Any]] = {}
    seconds: dict[str, dict[str, float]] = {}
    by_split: dict[str, list[Mapping[str, Any]]] = {}
    for (method, split), fp in fingerprints.items():
        by_split.setdefault(split, [])
        record = records.get(fp)
        if record is None:
            continue
        by_split[split].append(record)
        if record.get("method_seconds") is not None:
            seconds.setdefault(method, {})[split] = record["method_seconds"]
    for split, found in by_split.items():
        if scored_now.get(split) and split in passes_now:
            splits[split] = {**dict(passes_now[split]), "methods": list(scored_now[split]), "cached": False,
                             "created": created_now}
            continue
        if not found:
            continue
        passes: dict[tuple[str, tuple[str, ...]], list[Mapping[str, Any]]] = {}
        for record in found:  # one pass over a split = one (created, methods) group
            passes.setdefault((record["created"], tuple(record["methods"])), []).append(record)
        best = max(passes.values(), key=len)[0]
        splits[split] = {"seconds": best["seconds"], "num_samples": best["num_samples"],
                         "images_per_second": best["images_per_second"],
                         # a record written before the backbone's seconds were kept has none
                         **({"backbone_seconds": best["backbone_seconds"]} if "backbone_seconds" in best else {}),
                         "methods": list(best["methods"]), "cached": True, "created": best["created"]}
    return splits, seconds


__all__ = ["TIMINGS_FILE", "split_timings", "update_timings"]
