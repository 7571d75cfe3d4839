"""What the library writes says what happened: a saved detector's base model reference loads from any working
directory (and a missing base fails at once, naming the ways out), the labels of a run are checked or the run says
they could not be, the command line answers at once, the figures and cards are readable."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter in ``cwd``, with this checkout's ``hf_gsc`` (as a user's script would)."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------------- base model path
def test_a_relative_base_path_loads_from_any_directory_and_a_missing_one_fails_at_once(tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    elsewhere.mkdir()
    make_tiny_model("vit").save_pretrained(project / "models" / "vit3")
    saved = _python("""
        from hf_gsc import AutoOODDetector
        AutoOODDetector.from_pretrained("models/vit3", method="msp").save_pretrained("saved")
    """, cwd=project)
    assert saved.returncode == 0, saved.stderr
    load = f"""
        import torch
        from hf_gsc import AutoOODDetector
        try:
            detector = AutoOODDetector.from_pretrained({str(project / "saved")!r})
        except FileNotFoundError as error:
            print("ERROR", error)
        else:
            print("OK", detector.config.base_model_name_or_path, detector(torch.rand(2, 3, 16, 16)).ood_score.shape)
    """
    loaded = _python(load, cwd=elsewhere)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.startswith(f"OK {project / 'models' / 'vit3'} torch.Size([2])"), loaded.stdout
    # The base moved away: the load fails before any Hub call, naming the folder and both ways out.
    (project / "models" / "vit3").rename(project / "models" / "moved")
    missing = _python(load, cwd=elsewhere, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    assert missing.returncode == 0, missing.stderr
    assert missing.stdout.startswith("ERROR"), missing.stdout
    for named in (str(project / "models" / "vit3"), "model=", "save_base_model=True"):
        assert named in missing.stdout
    assert "connection" not in (missing.stdout + missing.stderr).lower()


# ------------------------------------------------------------------------------------------- generic labels
@pytest.fixture(scope="module")
def generic(tmp_path_factory):
    """The first-hour tiny ViT with transformers' generic labels (LABEL_0..2) and ID data of named classes."""
    import json

    import numpy as np

    from test_first_hour import CLASSES, _id_data, _images, save_tiny_vit

    root = tmp_path_factory.mktemp("generic")
    save_tiny_vit(root / "model")
    config = json.loads((root / "model" / "config.json").read_text())
    config["id2label"] = {str(i): f"LABEL_{i}" for i in range(len(CLASSES))}
    config["label2id"] = {f"LABEL_{i}": i for i in range(len(CLASSES))}
    (root / "model" / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    for name in CLASSES:  # a class-folder tree, as a user's own photos
        (root / "folders" / name).mkdir(parents=True)
        for i, image in enumerate(_images(rng, 4, False)):
            image.save(root / "folders" / name / f"{i}.png")
    (root / "far").mkdir()
    for i, image in enumerate(_images(rng, 6, True)):
        image.save(root / "far" / f"{i}.png")
    return {"model": str(root / "model"), "id": _id_data(root / "id", CLASSES, rng), "far": str(root / "far"),
            "folders": str(root / "folders")}


def _evaluate(generic, output: Path, *extra: str) -> list[str]:
    return ["evaluate", "--model", generic["model"], "--id-dataset", generic["id"], "--ood-dataset",
            f"far={generic['far']}", "--methods", "msp,energy", "--output-dir", str(output), "--batch-size", "4",
            "--no-plots", "--no-selection", *extra]


def test_generic_labels_are_refused_or_said_unchecked_above_the_tables(generic, tmp_path, capsys):
    import json

    from hf_gsc import AutoOODDetector
    from hf_gsc import cli as hf_gsc_cli

    with pytest.raises(SystemExit) as stop:
        hf_gsc_cli.main(_evaluate(generic, tmp_path / "refused"))
    assert stop.value.code == 2
    refusal = capsys.readouterr().err
    for way_out in ("id2label", "--label-map", "--labels-by-order", "LABEL_0", "'cat'"):
        assert way_out in refusal, refusal
    # Python refuses with the same rule and words (a method that fits per-class statistics on class folders).
    detector = AutoOODDetector.from_pretrained(generic["model"], method="mahalanobis")
    with pytest.raises(ValueError) as python_refusal:
        detector.fit(generic["folders"])
    shared = "cannot be matched to its classes: nothing says which model class each one is"  # one function, both
    assert shared in str(python_refusal.value) and shared in refusal, (str(python_refusal.value), refusal)

    # Accepted folder order: said on the console and above results.md's tables; recorded in results.json.
    assert hf_gsc_cli.main(_evaluate(generic, tmp_path / "ordered", "--labels-by-order")) == 0
    console = capsys.readouterr().out
    assert "taken in their own order as the model's classes (--labels-by-order), unchecked" in console
    report = (tmp_path / "ordered" / "results.md").read_text()
    note, first_table = report.index("**Labels unchecked:**"), report.index("| Method")
    assert note < first_table and "'cat' = class 0" in report[note:first_table]
    check = json.loads((tmp_path / "ordered" / "results.json").read_text())["label_check"]
    assert check["status"] == "by_order" and check["data_classes"] == ["cat", "dog", "bird"]

    # --label-map by index or LABEL_i: every class on the console line, as data class -> model index and label.
    assert hf_gsc_cli.main(_evaluate(generic, tmp_path / "mapped", "--label-map", "cat=1,dog=LABEL_0,bird=2")) == 0
    console = capsys.readouterr().out
    assert ("data class 'cat' -> model class 1 'LABEL_1', data class 'dog' -> model class 0 'LABEL_0', "
            "data class 'bird' -> model class 2 'LABEL_2'") in console
    assert "**Labels unchecked:**" not in (tmp_path / "mapped" / "results.md").read_text()
