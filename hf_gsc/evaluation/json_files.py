"""The run folder's JSON and table helpers, on the lowest floor of :mod:`hf_gsc.evaluation` (they import nothing of
it): :func:`jsonable` (JSON types only), :func:`write_json` (atomic, never through a link out of the folder) and
:func:`table_lines` (a markdown table).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..utils.confined_files import atomic_write_text


def jsonable(value: Any) -> Any:
    """``value`` with only JSON types: numpy scalars as Python numbers, tuples as lists, non-finite floats as
    strings (``"nan"``, strict JSON has no NaN), anything else unknown as its ``str``."""
    if isinstance(value, Mapping):
        return {k if isinstance(k, str) else str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else str(float(value))
    if value is None or isinstance(value, str):
        return value
    return str(value)


def table_lines(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A markdown table: the header row, the ``|---|`` rule, one line per row of cells."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(cells) + " |" for cells in rows
    ]


def write_json(path: str | os.PathLike, data: Any, root: str | os.PathLike | None = None) -> Path:
    """Write JSON atomically (temporary file, then ``os.replace``) and never through a link out of ``root``
    (default: ``path``'s folder), see :mod:`hf_gsc.utils.confined_files`."""
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n", root)


__all__ = ["jsonable", "table_lines", "write_json"]
