"""Small evaluation items: ``hf-gsc publish`` names its own option, an OOD split that is the ID test split is warned
about and recorded, ``--id-dataset``'s help names image folders."""

from __future__ import annotations

import json
import warnings

import pytest
from conftest import evaluate_argv
from test_evaluation import tiny  # noqa: F401  (the tiny model and data fixture)

from hf_gsc import AutoOODDetector
from hf_gsc import cli as hf_gsc_cli
from hf_gsc.evaluation.arguments import EvaluationArgumentParser


def test_publish_without_save_base_model_names_the_cli_option(tiny, tmp_path, capsys):  # noqa: F811
    folder = tmp_path / "msp"
    AutoOODDetector.from_pretrained(tiny["model"], method="msp").save_pretrained(folder)  # base: a local folder
    assert hf_gsc_cli.main(["publish", "--detector-dir", str(folder), "--repo-id", "user/msp"]) == 1
    error = capsys.readouterr().err
    assert "pass --save-base-model" in error and "save_base_model=True" not in error, error


def test_an_ood_split_that_is_the_id_test_split_is_warned_about(tiny, tmp_path):  # noqa: F811
    argv = ["--model", tiny["model"], "--id-dataset", tiny["id"], "--ood-dataset", f"same={tiny['id']}:test",
            "--ood-dataset", f"noise={tiny['noise']}", "--methods", "msp", "--output-dir", str(tmp_path),
            "--batch-size", "8", "--no-plots", "--no-selection"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = evaluate_argv(argv)
    messages = [str(w.message) for w in caught if "same images as the ID test split" in str(w.message)]
    assert len(messages) == 1 and "'same'" in messages[0] and "'noise'" not in messages[0]
    assert results["methods"]["msp"]["ood"]["same"]["auroc"] == pytest.approx(0.5)
    assert json.loads((tmp_path / "results.json").read_text())["ood_same_as_id_test"] == ["same"]
    assert "same images as the ID test split" in (tmp_path / "results.md").read_text()


def test_id_dataset_help_names_image_folders():
    help_text = next(action.help for action in EvaluationArgumentParser()._actions if "--id-dataset" in action.option_strings)
    assert "image folders" in help_text and "train/" in help_text
