"""What ``hf-gsc evaluate`` prints and leaves behind says what happened, in the user's words: a saved detector's
threshold is described by its own calibration, a small calibration split warns as ``calibrate`` does, no internal
names, and a run that fails before writing anything leaves no empty folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hf_gsc.evaluation import cli

from test_evaluation import tiny  # noqa: F401  (the tiny model and data fixture)


def _argv(tiny, output_dir: Path, *extra: str) -> list[str]:  # noqa: F811
    return ["--id-dataset", tiny["id"], "--ood-dataset", f"noise={tiny['noise']}", "--output-dir", str(output_dir),
            "--batch-size", "8", "--no-plots", *extra]


def test_console_says_what_the_run_did_in_user_words(tiny, tmp_path, capsys):  # noqa: F811
    with pytest.warns(UserWarning, match=r"the thresholds are calibrated on 10 ID validation samples "
                                         r"\(--max-samples 10\), too few .* \(at least 100;"):
        assert cli.main(["--model", tiny["model"], *_argv(tiny, tmp_path / "fit", "--methods", "msp,knn",
                                                           "--hyperparameter", "knn.k=3", "--save-detectors",
                                                           "--max-samples", "10")]) == 0
    printed = capsys.readouterr().out
    assert "Thresholds calibrated on ID validation only." in printed
    # The selection's validation sets, without --tune: no internal split names, no claim about --tune.
    assert "OOD sets generated from a random half of the ID validation subset, against its other half" in printed
    assert not [word for word in ("tune_fit", "tune_select", "--tune") if word in printed]

    saved = tmp_path / "fit" / "detectors" / "knn"
    assert cli.main(["--detector", str(saved), *_argv(tiny, tmp_path / "as_saved")]) == 0
    printed = capsys.readouterr().out
    assert "None" not in printed
    assert ("The threshold is the saved detector's own, calibrated before this run on split 'validation' of dataset "
            f"root {os.path.abspath(tiny['id'])} (10 samples, target ID TPR 95%); not recalibrated.") in printed
    assert (tmp_path / "as_saved" / "results.md").read_text() in printed


def test_a_failed_run_leaves_no_empty_output_folder(tiny, tmp_path, capsys):  # noqa: F811
    missing_model = ["--model", str(tmp_path / "no_such_model"), "--methods", "msp"]
    new = tmp_path / "new" / "run"
    with pytest.raises(SystemExit) as stop:
        cli.main([*missing_model, *_argv(tiny, new)])
    assert stop.value.code == 2 and "no_such_model" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # neither the folder nor the parent this run made
    # A folder that existed before the run is never removed, empty or holding earlier results.
    empty, earlier = tmp_path / "empty", tmp_path / "earlier"
    empty.mkdir()
    (earlier / "scores").mkdir(parents=True)
    (earlier / "results.md").write_text("an earlier run")
    for folder in (empty, earlier):
        with pytest.raises(SystemExit):
            cli.main([*missing_model, *_argv(tiny, folder)])
    assert empty.is_dir() and (earlier / "results.md").read_text() == "an earlier run" and (earlier / "scores").is_dir()
