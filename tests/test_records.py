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

from hf_gsc.detectors import DETECTORS


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
    base = project / "models" / "vit3"
    # From another folder: the detector loads; then, its base moved away, it fails before any Hub call (the endpoint
    # is a closed port: a Hub call would be a connection error), naming the folder and both ways out.
    script = f"""
        import os, torch
        from hf_gsc import AutoOODDetector
        detector = AutoOODDetector.from_pretrained({str(project / "saved")!r})
        print("OK", detector.config.base_model_name_or_path, detector(torch.rand(2, 3, 16, 16)).ood_score.shape)
        os.rename({str(base)!r}, {str(project / "models" / "moved")!r})
        try:
            AutoOODDetector.from_pretrained({str(project / "saved")!r})
        except FileNotFoundError as error:
            print("ERROR", error)
    """
    loaded = _python(script, cwd=elsewhere, HF_HUB_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    assert loaded.returncode == 0, loaded.stderr
    ok, error = loaded.stdout.splitlines()[0], "\n".join(loaded.stdout.splitlines()[1:])
    assert ok == f"OK {base} torch.Size([2])", loaded.stdout
    assert error.startswith("ERROR"), loaded.stdout
    for named in (str(base), "model=", "save_base_model=True"):
        assert named in error
    assert "connection" not in (loaded.stdout + loaded.stderr).lower()


def test_evaluate_save_detectors_with_a_relative_model_path_stores_where_it_is(tmp_path, monkeypatch):
    import json

    import numpy as np
    from test_first_hour import CLASSES, _id_data, _images, save_tiny_vit

    from hf_gsc import cli as hf_gsc_cli

    save_tiny_vit(tmp_path / "models" / "vit3")
    rng = np.random.default_rng(0)
    (tmp_path / "far").mkdir()
    for i, image in enumerate(_images(rng, 6, True)):
        image.save(tmp_path / "far" / f"{i}.png")
    _id_data(tmp_path / "id", CLASSES, rng)
    monkeypatch.chdir(tmp_path)  # the command as typed in the project folder, with relative paths
    assert hf_gsc_cli.main(["evaluate", "--model", "models/vit3", "--id-dataset", "id", "--ood-dataset", "far=far",
                            "--methods", "msp", "--output-dir", "run", "--batch-size", "4", "--no-plots",
                            "--no-selection", "--save-detectors"]) == 0
    saved = json.loads((tmp_path / "run" / "detectors" / "msp" / "detector_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(tmp_path / "models" / "vit3")


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
    ordered = json.loads((tmp_path / "ordered" / "results.json").read_text())
    check = ordered["label_check"]
    # The thresholds' record names what the run read: the validation split of this dataset root.
    assert ordered["methods"]["msp"]["calibration"]["source"] == (
        f"split 'validation' of dataset root {os.path.abspath(generic['id'])}")
    assert check["status"] == "by_order" and check["data_classes"] == ["cat", "dog", "bird"]

    # --label-map by index or LABEL_i: every class on the console line, as data class -> model index and label.
    assert hf_gsc_cli.main(_evaluate(generic, tmp_path / "mapped", "--label-map", "cat=1,dog=LABEL_0,bird=2")) == 0
    console = capsys.readouterr().out
    assert ("data class 'cat' -> model class 1 'LABEL_1', data class 'dog' -> model class 0 'LABEL_0', "
            "data class 'bird' -> model class 2 'LABEL_2'") in console
    assert "**Labels unchecked:**" not in (tmp_path / "mapped" / "results.md").read_text()

    # Named classes that are not the model's: the console's warning is also above results.md's tables.
    from hf_gsc.evaluation.labels import compare_labels
    from hf_gsc.evaluation.report import markdown_table

    results = json.loads((tmp_path / "ordered" / "results.json").read_text())
    results["label_check"] = compare_labels(["cat", "dog", "bird"], ["cat", "dog", "fish"])
    report = markdown_table(results)
    note = report.index("**Labels do not match:**")
    assert note < report.index("| Method") and "the ID accuracy means nothing" in report[note:]


# ------------------------------------------------------------------------------------------- the command line
def _command(*args: str, cwd: Path = ROOT) -> tuple[str, bool]:
    """``python -m hf_gsc ARGS`` as typed (the ``hf-gsc`` console script runs the same ``main``): its output, and
    whether torch was imported (``-X importtime`` lists every module imported)."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "hf_gsc", *args], cwd=cwd, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")}
    return result.stdout, "torch" in imported


def test_the_command_answers_at_once_without_torch(tmp_path):
    from hf_gsc.cli import COMMANDS
    from hf_gsc.utils.version import __version__

    version, torch_imported = _command("--version", cwd=tmp_path)
    assert version.strip() == f"hf-gsc {__version__}" and not torch_imported
    usage, torch_imported = _command("--help", cwd=tmp_path)
    assert not torch_imported and all(name in usage for name in COMMANDS)
    for command in COMMANDS:
        help_text, torch_imported = _command(command, "--help", cwd=tmp_path)
        assert f"usage: hf-gsc {command}" in help_text and not torch_imported, command
    # A bare `import hf_gsc` is light and still registers the pipeline task once transformers' pipelines are imported.
    script = ("import sys, hf_gsc; light = 'torch' not in sys.modules; from transformers.pipelines import "
              "PIPELINE_REGISTRY; print(light, 'ood-image-classification' in PIPELINE_REGISTRY.get_supported_tasks())")
    assert _python(script, cwd=tmp_path).stdout.split() == ["True", "True"]


def test_docs_name_the_installed_pages(tmp_path):
    listing, torch_imported = _command("docs", cwd=tmp_path)
    assert not torch_imported
    folder = Path(listing.splitlines()[0].rsplit(": ", 1)[1])
    assert (folder / "index.md").is_file() and "evaluation" in listing
    page, _ = _command("docs", "evaluation", cwd=tmp_path)
    assert page.strip() == (folder / "evaluation.md").read_text(encoding="utf-8").strip()


# ------------------------------------------------------------------------------------------- figures
def test_figures_stay_readable_with_every_method_and_heavy_tails(tmp_path):
    import matplotlib
    import numpy as np
    from matplotlib.colors import to_rgb

    from hf_gsc.evaluation import plots

    rng = np.random.default_rng(0)
    correct = rng.random(300) > 0.2
    count = len(DETECTORS)  # --methods all
    id_scores = {f"method_{i:02d}": rng.normal(size=300) + 0.05 * i * correct for i in range(count)}
    fig, axes = plots.risk_coverage_figure(id_scores, correct, {name: 0.0 for name in id_scores})
    ax = axes[0, 0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    assert ax.get_legend().get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1  # covers no curve
    curves = [line for line in ax.get_lines() if line.get_label().startswith("method_")]
    assert len(curves) == count
    assert len({(to_rgb(line.get_color()), line.get_linestyle()) for line in curves}) == count
    matplotlib.pyplot.close(fig)
    assert plots.plot_risk_coverage(id_scores, correct, tmp_path / "risk_coverage.png").stat().st_size > 0

    # Densities: ID in a colour no OOD set has; a heavy tail does not set the axis (clipped, and said).
    ood = {"near": rng.normal(-1.0, 1.0, 500), "far": rng.normal(-3.0, 1.0, 500),
           "heavy": np.concatenate([rng.normal(-2.0, 1.0, 497), np.array([3e6, -2e6, 8e5])])}
    arrays = {"ID test": rng.normal(0.0, 1.0, 500), **ood}
    fig, axes = plots.density_figure({"knn": arrays}, {"knn": 0.0})
    ax = axes[0, 0]
    handles, labels = ax.get_legend_handles_labels()
    colors = {label: to_rgb(handle.get_facecolor() if label == "ID test" else handle.get_edgecolor())
              for handle, label in zip(handles, labels) if label != "threshold"}
    assert colors["ID test"] not in [colors[name] for name in ood]
    assert len({colors[name] for name in ood}) == len(ood)
    low = min(np.quantile(values, plots.SCORE_QUANTILES[0]) for values in arrays.values())
    high = max(np.quantile(values, plots.SCORE_QUANTILES[1]) for values in arrays.values())
    left, right = ax.get_xlim()
    assert low - 1e-9 <= left < right <= high + 1e-9 and right - left < 100, (left, right)
    assert "quantiles" in ax.get_xlabel() and "scores outside" in ax.get_xlabel()
    matplotlib.pyplot.close(fig)


# ------------------------------------------------------------------------------------------- model cards
def _card(method: str, hyperparameters: dict, calibration: dict | None, **results) -> str:
    from hf_gsc.storage.model_card import render_model_card

    values = {"method": method, "hyperparameters": hyperparameters, "threshold": 1.23456789,
              "calibration": calibration, "base_model_name_or_path": "user/vit", "hf_gsc_version": "0.4.0"}
    table = "| Method | far |\n|---|---|\n| x | 90.00 |\n"
    return str(render_model_card(values, "user/card", {"methods": {}, **results} if results else None,
                                 table if results else None))


def test_cards_skip_empty_sections_format_numbers_and_claim_only_what_happened():
    chosen = {"method": "quantile", "num_samples": 120, "tpr": 0.95, "delta": None, "split": "validation",
              "source": "split 'validation' of dataset root /data/id"}
    given = {**chosen, "split": None, "source": "folder /data/id/test"}
    plain = _card("msp", {}, chosen, id_accuracy=0.9666666666666667, benchmark="fmnist-ood")
    assert "## Hyperparameters" not in plain and "| hyperparameter |" not in plain  # MSP has none
    assert "96.67%" in plain and "0.9666666666666667" not in plain
    assert "`1.23457`" in plain and "1.23456789" not in plain  # the threshold as results.md writes it
    assert "120 samples of the ID `validation` split" in plain and "never on test or OOD data" in plain
    tuned = _card("knn", {"k": 50}, given)
    assert "## Hyperparameters" in tuned and "| `k` | `50` |" in tuned
    # The caller chose the data: the card names what was read and claims nothing about test data.
    assert "folder /data/id/test" in tuned and "never on test" not in tuned and "`validation`" not in tuned
