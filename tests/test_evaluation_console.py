"""What ``hf-gsc evaluate`` prints and leaves behind says what happened, in the user's words: a saved detector's
threshold is described by its own calibration, a small calibration split warns as ``calibrate`` does, no internal
names, and a run that fails before writing anything leaves no empty folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_evaluation import tiny  # noqa: F401  (the tiny model and data fixture)

from hf_gsc.evaluation import cli


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


def _users_folder(folder: Path) -> dict[Path, str]:
    """A folder of the user's that happens to hold files of a run's names: none of them may be lost."""
    files = {folder / "results.json": '{"my": "own results"}\n', folder / "results.md": "my notes\n",
             folder / "README.md": "my readme\n", folder / "detectors" / "knn" / "config.json": '{"mine": true}\n',
             folder / "detectors" / "knn" / "README.md": "my model card\n"}
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files


@pytest.mark.filterwarnings("ignore:.*ID validation samples")
def test_a_folder_that_is_not_a_run_is_written_only_with_overwrite(tiny, tmp_path, capsys):  # noqa: F811
    """A non-empty --output-dir that no run wrote is refused before anything is written; with --overwrite the run
    writes there and deletes nothing it did not write; the folder is then a run, rerun without --overwrite."""
    folder = tmp_path / "mine"
    files = _users_folder(folder)
    argv = ["--model", tiny["model"], *_argv(tiny, folder, "--methods", "msp,knn", "--hyperparameter", "knn.k=3",
                                             "--max-samples", "10")]
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"--output-dir {str(folder)!r} is not empty" in err and "--overwrite" in err
    assert {path: path.read_text() for path in files} == files
    assert sorted(path.name for path in folder.iterdir()) == ["README.md", "detectors", "results.json", "results.md"]
    from hf_gsc.evaluation.run_folder import RUN_MARKER

    assert cli.main([*argv, "--overwrite"]) == 0
    capsys.readouterr()
    replaced = {folder / "results.json", folder / "results.md"}  # the run's own names: replaced by its results
    assert all(path.read_text() == text for path, text in files.items() if path not in replaced)
    assert '"methods"' in (folder / "results.json").read_text() and (folder / RUN_MARKER).is_file()
    assert cli.main(argv) == 0  # a run's folder now: reused without --overwrite


@pytest.mark.filterwarnings("ignore:.*ID validation samples")
def test_a_full_disk_is_one_line_naming_the_folder_and_what_it_keeps(tiny, tmp_path, capsys, monkeypatch):  # noqa: F811
    import errno

    from hf_gsc.evaluation import evaluator

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(evaluator, "write_report", full)
    folder = tmp_path / "run"
    assert cli.main(["--model", tiny["model"], *_argv(tiny, folder, "--methods", "msp", "--max-samples", "10")]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    scores = sorted((folder / "scores").glob("*/*.safetensors"))
    assert scores  # what was computed is kept, and the line says so
    assert ": error: no space left on the device; " in errors[0]
    assert f"--output-dir {folder} keeps {len(scores)} score file(s) under scores/" in errors[0]
    assert errors[0].endswith("run the same command again to resume from them")
