"""Validation ranking and selection: every scored method ranked on validation data only, the choice recorded with
its rule and table, stated in results.md, saved as detectors/selected with a card saying why; no test split is read
for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import evaluate_argv
from test_evaluation import tiny  # noqa: F401  (the tiny model and data fixture)

from hf_gsc import AutoOODDetector
from hf_gsc.evaluation.ranking import validation_metrics
from hf_gsc.evaluation.selection import SELECTION_RULE, VAL_OOD_PREFIX
from hf_gsc.evaluation.validation_sets import split_halves


METHODS = "msp,energy,knn,mahalanobis"


def _argv(tiny, output_dir: Path, *extra: str, ood: str = "noise") -> list[str]:  # noqa: F811
    return ["--model", tiny["model"], "--id-dataset", tiny["id"], "--ood-dataset", f"{ood}={tiny[ood]}",
            "--methods", METHODS, "--output-dir", str(output_dir), "--batch-size", "4", "--no-plots",
            "--hyperparameter", "knn.k=3", *extra]


@pytest.fixture(scope="module")
def selected(tiny, tmp_path_factory):  # noqa: F811
    output_dir = tmp_path_factory.mktemp("selected")
    return output_dir, evaluate_argv(_argv(tiny, output_dir, "--save-detectors"))


def test_every_method_is_ranked_on_validation_and_one_is_chosen(selected):
    output_dir, results = selected
    record = results["selection"]
    assert set(record["validation"]) == set(results["methods"]) == set(METHODS.split(","))
    assert record["rule"] == SELECTION_RULE and record["method"] in record["validation"]
    best = max(record["validation"].values(), key=lambda entry: entry["auroc"])["auroc"]
    assert record["validation"][record["method"]]["auroc"] == best
    assert set(next(iter(record["validation"].values()))["ood"]) == {"val_noise", "val_jigsaw"}
    markdown = (output_dir / "results.md").read_text()
    assert markdown.index("Selected on validation data only") < markdown.index("| Method |")
    assert "Validation ranking" in markdown


def test_the_table_is_computed_from_the_validation_score_files_only(selected):
    """ID side: the tune_select half of ID validation; OOD side: the generated validation sets."""
    from safetensors.torch import load_file

    output_dir, results = selected
    record = results["selection"]
    for name, entry in record["validation"].items():
        validation = load_file(str(output_dir / "scores" / name / "id_validation.safetensors"))["ood_score"]
        _, select_rows = split_halves(validation.numel(), 0)
        ood = {s: load_file(str(output_dir / "scores" / name / f"{VAL_OOD_PREFIX}{s}.safetensors"))["ood_score"]
               for s in entry["ood"]}
        expected = validation_metrics(validation[torch.tensor(select_rows)], ood)
        assert json.dumps(entry, sort_keys=True) == json.dumps(expected, sort_keys=True)


def test_the_choice_does_not_depend_on_the_test_splits(tiny, tmp_path, selected):  # noqa: F811
    """Other test OOD data, the same choice and the same validation table (test splits are never read for it)."""
    _, results = selected
    other = evaluate_argv(_argv(tiny, tmp_path, ood="flat"))
    strip = lambda record: {k: v for k, v in record.items() if k != "seconds"}  # noqa: E731
    assert strip(other["selection"]) == strip(results["selection"])
    assert other["methods"] != results["methods"]  # the test figures did change


def test_the_chosen_detector_is_saved_as_selected_with_its_reason(selected):
    output_dir, results = selected
    chosen = results["selection"]["method"]
    folder = output_dir / "detectors" / "selected"
    detector = AutoOODDetector.from_pretrained(folder)
    assert detector.method == chosen
    assert detector.config.threshold == pytest.approx(results["methods"][chosen]["threshold"])
    card = (folder / "README.md").read_text()
    assert "## Why this detector" in card and "on validation data only" in card
    assert f"Selected on validation data only: **{chosen}**" in card and "Validation ranking (" in card


def test_each_card_says_what_its_method_was_fitted_on_and_only_the_selected_names_the_choice(selected):
    """A method's card states its own fit (from results.json's split_sizes.fit), or that it fitted nothing; the
    selection's sentence and ranking appear in the selected detector's card only."""
    output_dir, results = selected
    chosen = results["selection"]["method"]
    fits = results["split_sizes"]["fit"]
    assert {"knn", "mahalanobis"} <= set(fits) and "msp" not in fits
    for method in METHODS.split(","):
        card = (output_dir / "detectors" / method / "README.md").read_text()
        if method in fits:
            assert f"Fitted on {fits[method]:,} images of the `train` split of the ID data (`" in card, card
        else:
            assert "Fitted on nothing" in card
        named = "Selected on validation data only" in card or "Validation ranking (" in card
        assert named == (method == chosen), method
        assert "| Method |" in card  # the test table of every method stays


def test_user_validation_ood_sets_and_no_selection(tiny, tmp_path):  # noqa: F811
    given = evaluate_argv(_argv(tiny, tmp_path / "given", "--val-ood-dataset", f"flatval={tiny['flat']}"))
    record = given["selection"]
    assert "--val-ood-dataset flatval=" in record["data"]["ood"]
    assert set(next(iter(record["validation"].values()))["ood"]) == {"flatval"}
    assert record["data"]["num_samples"]["id"] == given["split_sizes"]["id_validation"]  # the whole ID validation
    none = evaluate_argv(_argv(tiny, tmp_path / "none", "--no-selection"))
    assert "selection" not in none
    assert not list((tmp_path / "none" / "scores").rglob(f"{VAL_OOD_PREFIX}*"))
    assert "Selected on" not in (tmp_path / "none" / "results.md").read_text()


def test_test_data_given_as_validation_is_refused(tiny, tmp_path, monkeypatch):  # noqa: F811
    """An --ood-dataset, a folder inside one, the ID test split, or a copy of a test split's images (another path)
    given as --val-ood-dataset is refused: the selection is made on validation data only."""
    from hf_gsc.evaluation import evaluator
    from hf_gsc.evaluation.errors import InputError

    def forbidden(*args, **kwargs):
        raise AssertionError("a fit started before the validation data was checked")

    monkeypatch.setattr(evaluator, "fit_detectors", forbidden)
    inside = tmp_path / "photos" / "part"  # a folder inside an --ood-dataset folder
    inside.mkdir(parents=True)
    copy = tmp_path / "copy"
    import datasets

    datasets.load_from_disk(tiny["noise"]).save_to_disk(copy)  # the same images under another path
    photos = ("--far-ood-dataset", f"photos={tmp_path / 'photos'}")  # refused before it is loaded
    for value, match, extra in ((f"same={tiny['noise']}", r"reads the test data of --ood-dataset", ()),
                                (f"inside={inside}", r"reads the test data of --far-ood-dataset", photos),
                                (f"idtest={tiny['id']}:test", r"reads the test data of --id-dataset \(its test split\)",
                                 ()),
                                (f"copy={copy}", r"holds the same images as the test split OOD noise", ())):
        with pytest.raises(InputError, match=f"--val-ood-dataset {value.split('=')[0]}=.*{match}"):
            evaluate_argv(_argv(tiny, tmp_path / "run", *extra, "--val-ood-dataset", value))
    monkeypatch.undo()
    # OOD validation data that is no test split: read, and the sentence says what was read.
    results = evaluate_argv(_argv(tiny, tmp_path / "ok", "--val-ood-dataset", f"flatval={tiny['flat']}"))
    markdown = (tmp_path / "ok" / "results.md").read_text()
    assert f"it read the ID validation subset and --val-ood-dataset flatval={tiny['flat']}" in markdown
    assert "test splits are never read" not in markdown and results["selection"]["data"]["read"] in markdown


def test_which_specs_read_a_test_split(tmp_path):
    from hf_gsc.evaluation.errors import InputError
    from hf_gsc.evaluation.validation import check_validation_is_not_test

    root = tmp_path / "id"
    for folder in ("train/cat", "validation/cat", "test/cat", "extra"):
        (root / folder).mkdir(parents=True)
    id_test = [("--id-dataset (its test split)", f"{root}:test")]
    for spec in (f"{root}/test", f"{root}/test/cat", f"{root}:test", str(root)):
        with pytest.raises(InputError, match="reads the test data of --id-dataset"):
            check_validation_is_not_test([("v", spec)], id_test)
    for spec in (f"{root}/validation", f"{root}/extra", f"{root}:validation"):
        check_validation_is_not_test([("v", spec)], id_test)  # beside the test split: accepted
    hub = [("--ood-dataset", "org/places:test"), ("--ood-dataset", "org/svhn:cropped:train+test")]
    for spec in ("org/places:test", "org/svhn:cropped:test", "org/places:validation+test"):
        with pytest.raises(InputError, match="reads the test data of --ood-dataset"):
            check_validation_is_not_test([("v", spec)], hub)
    check_validation_is_not_test([("v", "org/places:validation"), ("w", "org/svhn:full:test")], hub)
