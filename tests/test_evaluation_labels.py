"""Labels by name in the evaluation: ID data whose class names are the model's in another order (or a subset) is
mapped by name before anything reads the labels; ``--label-map`` gives the mapping where the names differ; the
mapping is recorded in ``results.json``'s ``label_check`` and the ID accuracy uses the mapped labels."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import evaluate_argv
from safetensors.torch import load_file
from test_first_hour import CLASSES, _argv, _id_data, tiny  # noqa: F401  (model classes cat, dog, bird)

from hf_gsc.evaluation import labels
from hf_gsc.evaluation.labels import LabelMismatchWarning
from hf_gsc.evaluation.options import InputError
from hf_gsc.evaluation.score_cache import BASE_MODEL, PREDICTIONS_KEY


def _labels_of(run: Path) -> torch.Tensor:
    return load_file(str(run / "scores" / "msp" / "id_test.safetensors"))["labels"]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):  # noqa: F811
    """ID data with the model's class names in another order."""
    root = tmp_path_factory.mktemp("labels")
    shuffled = ["dog", "bird", "cat"]  # data label i is class shuffled[i]: the same images, other label indices
    reordered = _id_data(root / "reordered", shuffled, np.random.default_rng(0))
    return {"reordered": reordered}


def _run(tiny, id_data: str, output: Path, *extra: str) -> dict:  # noqa: F811
    argv = _argv(tiny, output, *extra)
    argv[argv.index("--id-dataset") + 1] = id_data
    return evaluate_argv(argv)


def test_names_in_another_order_are_mapped_by_name(tiny, runs, tmp_path):  # noqa: F811
    import datasets

    with warnings.catch_warnings():
        warnings.simplefilter("error", LabelMismatchWarning)  # mapped: nothing to warn about
        results = _run(tiny, runs["reordered"], tmp_path / "run")
    check = results["label_check"]
    assert check["status"] == "order_differs" and check["mapped_by"] == "name"
    assert check["mapping"] == {"dog": "dog", "bird": "bird", "cat": "cat"}
    assert json.loads((tmp_path / "run" / "results.json").read_text())["label_check"]["mapping"] == check["mapping"]
    # The score files carry the model's label indices; the ID accuracy is computed on them.
    data_labels = torch.tensor(datasets.load_from_disk(runs["reordered"])["test"]["label"])
    expected = torch.tensor([CLASSES.index(["dog", "bird", "cat"][i]) for i in data_labels.tolist()])
    assert torch.equal(_labels_of(tmp_path / "run").long(), expected)
    predictions = load_file(str(tmp_path / "run" / "scores" / BASE_MODEL / "id_test.safetensors"))[PREDICTIONS_KEY]
    assert results["id_accuracy"] == float((predictions == expected).double().mean())
    assert "ID labels mapped to the model's id2label (by name)" in (tmp_path / "run" / "results.md").read_text()


def test_a_label_map_maps_other_names(tiny, runs, tmp_path):  # noqa: F811
    argv_map = "apple=cat,pear=dog,plum=2"  # a model label by name or by index
    with warnings.catch_warnings():
        warnings.simplefilter("error", LabelMismatchWarning)
        results = _run(tiny, tiny["id_other"], tmp_path / "run", "--label-map", argv_map)
    assert results["label_check"]["status"] == "names_differ"
    assert results["label_check"]["mapping"] == {"apple": "cat", "pear": "dog", "plum": "bird"}
    assert results["label_check"]["mapped_by"] == "--label-map"
    # The same pairs from a JSON file, in another order: pear=cat, apple=dog, so labels 0 and 1 swap.
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"pear": "cat", "apple": "dog", "plum": "bird"}))
    swapped = _run(tiny, tiny["id_other"], tmp_path / "json", "--label-map", str(path))
    first, second = _labels_of(tmp_path / "run"), _labels_of(tmp_path / "json")
    assert torch.equal(second, torch.where(first == 2, first, 1 - first))
    assert swapped["label_check"]["mapping"] == {"apple": "dog", "pear": "cat", "plum": "bird"}


def test_bad_label_maps_are_refused_naming_the_option(tiny, runs, tmp_path):  # noqa: F811
    for value, match in (("apple", "not DATA_NAME=MODEL_LABEL"), ("kiwi=cat", "'kiwi' not among the ID data's class"),
                         ("apple=wolf", "'wolf' is not a model label"),
                         ("apple=cat,pear=dog", "leaves the ID data's class\\(es\\) 'plum' unmapped")):
        with pytest.raises(InputError, match=f"--label-map.*{match}"):
            _run(tiny, tiny["id_other"], tmp_path / "bad", "--label-map", value)


def test_label_mapping() -> None:
    assert labels.label_mapping(["dog", "cat", "bird"], CLASSES) == [1, 0, 2]
    assert labels.label_mapping(["Bird", "cat"], CLASSES) == [2, 0]  # a subset, by name
    assert labels.label_mapping(["apple", "cat"], CLASSES) is None  # not the model's names: warned, not guessed
    assert labels.label_mapping(["a", "b"], ["crane", "crane"], {"a": "0", "b": "1"}) == [0, 1]
    with pytest.raises(ValueError, match="names several of the model's classes"):
        labels.label_mapping(["a"], ["crane", "crane"], {"a": "crane"})
