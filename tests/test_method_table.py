"""The method table (``hf-gsc evaluate --list-methods``) is written from what each class declares."""

from __future__ import annotations

from hf_gsc.detectors import DETECTORS
from hf_gsc.evaluation.arguments import parse_arguments
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
    assert _row(table, "nac")[2].startswith("its own forward and backward")  # no step on the input
    assert _row(table, "gsc")[2] == "F at `final_encoder_output` + the head"
    assert _row(table, "rankfeat")[2] == "F at `final_encoder_output` + the head"  # a split point, not z
    assert _row(table, "gram")[2].startswith("logits, the output of every `nn.Conv2d` and `nn.ReLU` module")
    assert "OpenOOD react.yml" in _row(table, "react")[5]


def test_the_default_table_comes_from_the_classes_and_gscs_flags_are_its_settings(monkeypatch, tmp_path):
    """``--methods``' default is read from the classes (``in_default_table``), never inherited, so that a new
    method's file is the only place that sets it; a method's settings are ``--hyperparameter METHOD.NAME=VALUE``, and
    GSC's also have flags (``GSCArguments``), which ``--hyperparameter`` overrides."""
    import pytest

    from hf_gsc.evaluation.errors import InputError
    from hf_gsc.evaluation.options import parse_methods
    from hf_gsc.settings.registry import default_methods

    assert default_methods() == ["gsc", "ash_b", "energy", "max_logit", "msp", "odin", "react"]
    assert parse_methods(None) == default_methods()
    assert "gsc_ash" not in default_methods()  # a GSC subclass: not in the table unless it says so

    class TabledKNN(DETECTORS["knn"]):
        method = "tabled_knn"
        in_default_table = True

    class Untabled(TabledKNN):  # does not inherit it
        method = "untabled_knn"

    monkeypatch.setitem(DETECTORS, "tabled_knn", TabledKNN)
    monkeypatch.setitem(DETECTORS, "untabled_knn", Untabled)
    assert parse_methods(None) == ["gsc", "ash_b", "energy", "max_logit", "msp", "odin", "react", "tabled_knn"]
    argv = ["--model", "some/model", "--benchmark", "fmnist-ood", "--output-dir", str(tmp_path), "--no-plots"]
    parsed = parse_arguments([*argv, "--methods", "tabled_knn,untabled_knn", "--hyperparameter", "tabled_knn.k=7"])
    assert parsed.method_hyperparameters == {"tabled_knn": {"k": 7}, "untabled_knn": {}}
    parsed = parse_arguments([*argv, "--methods", "gsc", "--mask-ratio", "0.1", "--gsc-seed", "3"])
    assert parsed.method_hyperparameters == {"gsc": {"mask_ratio": 0.1, "seed": 3}}
    # The more specific --hyperparameter wins over the flag.
    parsed = parse_arguments([*argv, "--methods", "gsc", "--mask-ratio", "0.1", "--hyperparameter", "gsc.mask_ratio=0.2"])
    assert parsed.method_hyperparameters == {"gsc": {"mask_ratio": 0.2}}
    with pytest.raises(InputError, match="gsc options \\(mask_ratio\\) given but 'gsc' is not in --methods"):
        parse_arguments([*argv, "--methods", "knn", "--mask-ratio", "0.1"])
