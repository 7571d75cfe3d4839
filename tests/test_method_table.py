"""The method table (``hf-gsc evaluate --list-methods``) is written from what each class declares."""

from __future__ import annotations

from hf_gsc.detectors import DETECTORS
from hf_gsc.method_table import method_table
from hf_gsc.evaluation.arguments import parse_arguments


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


def test_the_default_table_and_a_methods_own_flags_come_from_its_class(monkeypatch, tmp_path):
    """``--methods``' default and a method's own flags are read from the classes (``in_default_table``,
    ``command_line_flags``), never inherited, so that a new method's file is the only place that sets them."""
    from hf_gsc.evaluation.options import parse_methods
    from hf_gsc.settings.registry import default_methods

    assert default_methods() == ["gsc", "ash_b", "energy", "max_logit", "msp", "odin", "react"]
    assert parse_methods(None) == default_methods()
    assert "gsc_ash" not in default_methods()  # a GSC subclass: not in the table unless it says so

    class FlaggedKNN(DETECTORS["knn"]):
        method = "flagged_knn"
        in_default_table = True
        command_line_flags = {"flagged_k": "k"}

    class Unflagged(FlaggedKNN):  # inherits neither
        method = "unflagged_knn"

    monkeypatch.setitem(DETECTORS, "flagged_knn", FlaggedKNN)
    monkeypatch.setitem(DETECTORS, "unflagged_knn", Unflagged)
    assert parse_methods(None) == ["gsc", "ash_b", "energy", "max_logit", "msp", "odin", "react", "flagged_knn"]
    argv = ["--model", "some/model", "--benchmark", "fmnist-ood", "--output-dir", str(tmp_path), "--no-plots",
            "--flagged-k", "7"]
    parsed = parse_arguments([*argv, "--methods", "flagged_knn,unflagged_knn"])
    assert parsed.method_hyperparameters == {"flagged_knn": {"k": 7}, "unflagged_knn": {}}
    # The more specific --hyperparameter wins over the flag.
    parsed = parse_arguments([*argv, "--methods", "flagged_knn", "--hyperparameter", "flagged_knn.k=3"])
    assert parsed.method_hyperparameters == {"flagged_knn": {"k": 3}}
    import pytest

    from hf_gsc.evaluation.errors import InputError

    with pytest.raises(InputError, match="flagged_knn options \\(k\\) given but 'flagged_knn' is not in --methods"):
        parse_arguments([*argv, "--methods", "knn"])
