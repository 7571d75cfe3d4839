"""A full-table run never dies for one method: a method that cannot be fitted or scored is skipped with its reason
(console, results.json, results.md), every other method is scored and reported; ``--methods all,-NAME`` excludes
methods; a run that fails keeps what it computed, and a rerun resumes from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import evaluate_argv
from test_evaluation import tiny  # noqa: F401  (the tiny model and data fixture)

from hf_gsc.detectors import DETECTORS
from hf_gsc.evaluation import evaluator
from hf_gsc.evaluation.options import InputError, parse_methods


def _argv(tiny, output_dir: Path, methods: str, *extra: str) -> list[str]:  # noqa: F811
    return ["--model", tiny["model"], "--id-dataset", tiny["id"], "--ood-dataset", f"noise={tiny['noise']}",
            "--methods", methods, "--output-dir", str(output_dir), "--batch-size", "4", "--no-plots",
            "--hyperparameter", "knn.k=3", *extra]


@pytest.fixture(scope="module")
def full_table(tiny, tmp_path_factory):  # noqa: F811
    output_dir = tmp_path_factory.mktemp("all")
    return output_dir, evaluate_argv(_argv(tiny, output_dir, "all"))


def test_all_methods_run_and_the_ones_that_cannot_fit_are_skipped_with_reasons(full_table):
    output_dir, results = full_table
    skipped = results["skipped"]
    assert skipped, "the tiny data (3 classes, a random ViT) leaves some method unable to fit"
    assert set(results["methods"]) | set(skipped) == set(DETECTORS)
    assert not set(results["methods"]) & set(skipped)
    for name, reason in skipped.items():
        # "cannot build": a method that does not apply to the model (BATS on this ViT: no BatchNorm before the head).
        assert reason.startswith(("fit failed:", "scoring failed:", "method ",
                                  "cannot build this detector on this model:")), (name, reason)
        assert not (output_dir / "scores" / name).exists() or not any((output_dir / "scores" / name).iterdir())
    markdown = (output_dir / "results.md").read_text()
    assert all(f"* `{name}`: {reason}" in markdown for name, reason in skipped.items())
    assert json.loads((output_dir / "results.json").read_text())["skipped"] == skipped


def test_excluding_methods_from_all(tiny, tmp_path, full_table):  # noqa: F811
    _, full = full_table
    excluded = sorted(full["skipped"])
    methods = parse_methods("all," + ",".join(f"-{name}" for name in excluded))
    assert set(methods) == set(DETECTORS) - set(excluded)
    with pytest.raises(InputError, match="did you mean 'she'"):
        parse_methods("all,-shee")
    with pytest.raises(InputError, match="must follow"):
        parse_methods("knn,-she")
    with pytest.raises(InputError, match="excludes every"):
        parse_methods("all," + ",".join(f"-{name}" for name in DETECTORS))


def test_a_method_that_raises_while_scoring_is_skipped(tiny, tmp_path, monkeypatch, capsys):  # noqa: F811
    from hf_gsc.detectors.msp import MSPDetector

    def broken(self, batch):
        raise RuntimeError("boom")

    monkeypatch.setattr(MSPDetector, "score_batch", broken)
    results = evaluate_argv(_argv(tiny, tmp_path, "msp,energy,knn"))
    assert results["skipped"] == {"msp": "scoring failed: RuntimeError: boom"}
    assert set(results["methods"]) == {"energy", "knn"}
    assert "skipped msp: scoring failed: RuntimeError: boom" in capsys.readouterr().out
    assert not (tmp_path / "scores" / "msp").exists() or not list((tmp_path / "scores" / "msp").iterdir())


def test_a_failed_run_keeps_its_fits_and_scores_and_a_rerun_resumes(tiny, tmp_path, monkeypatch):  # noqa: F811
    from hf_gsc.evaluation import scoring

    def failing_report(*args, **kwargs):
        raise RuntimeError("the disk filled up while writing the report")

    monkeypatch.setattr(evaluator, "write_report", failing_report)
    with pytest.raises(RuntimeError, match="disk filled up"):
        evaluate_argv(_argv(tiny, tmp_path, "knn,energy"))
    assert (tmp_path / "detectors" / "knn" / "fit.json").exists()
    files = sorted((tmp_path / "scores").rglob("*.safetensors"))
    assert files
    monkeypatch.undo()
    scored = []
    real = scoring.score_missing

    def spy(accelerator, plan, missing, *args, **kwargs):
        scored.extend(name for names in missing.values() for name in names)
        return real(accelerator, plan, missing, *args, **kwargs)

    monkeypatch.setattr(evaluator, "score_missing", spy)
    results = evaluate_argv(_argv(tiny, tmp_path, "knn,energy"))
    assert scored == [] and set(results["methods"]) == {"knn", "energy"}  # nothing computed again


def test_a_rerun_reuses_the_saved_tuning_search(tiny, tmp_path, monkeypatch):  # noqa: F811
    from hf_gsc.evaluation import tuning

    monkeypatch.setattr(tuning, "search_spaces", lambda: {"msp": {"temperature": (3.0, 7.0)}})
    first = evaluate_argv(_argv(tiny, tmp_path, "msp,energy,knn", "--tune"))
    assert (tmp_path / evaluator.TUNING_RECORD).exists()
    calls = []
    real = tuning.tune_hyperparameters
    monkeypatch.setattr(tuning, "tune_hyperparameters", lambda *a, **k: calls.append(1) or real(*a, **k))
    second = evaluate_argv(_argv(tiny, tmp_path, "msp,energy,knn", "--tune"))
    assert calls == [] and second["tuning"] == first["tuning"]
    evaluate_argv(_argv(tiny, tmp_path, "msp,energy,knn", "--tune", "--seed", "1"))  # other inputs: searched
    assert calls == [1]
