"""The method table (``hf-gsc evaluate --list-methods``) is written from what each class declares."""

from __future__ import annotations

from hf_gsc.detectors import DETECTORS
from hf_gsc.method_table import method_table


def _row(table: str, method: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(f"| `{method}` |"))
    return [cell.strip() for cell in line.strip("|").split(" | ")]


def test_every_method_has_a_row_saying_what_it_reads_fits_and_keeps():
    table = method_table()
    assert {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")} == set(DETECTORS)
    assert _row(table, "knn")[2:5] == ["penultimate feature z", "ID train", "`bank` (N, D)"]
    assert _row(table, "mahalanobis")[3:5] == ["ID train (labels)", "`class_means` (K, D), `precision` (D, D)"]
    assert _row(table, "energy")[2:5] == ["logits", "nothing", "none"]
    assert _row(table, "odin")[2].startswith("the input")  # its own passes, outside the shared one
    assert _row(table, "gsc")[2] == "F at `final_encoder_output` + the head"
    assert "OpenOOD react.yml" in _row(table, "react")[5]
