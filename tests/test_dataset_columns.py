"""Dataset columns as Hub datasets name them: the one ``Image`` column and the one ``ClassLabel`` column are found by
type (``picture`` / ``cls``, ``img`` / ``label``, ``image`` / ``labels``); two ``ClassLabel`` columns (CIFAR-100's
``fine_label`` and ``coarse_label``) or none where labels are read are refused, listing the columns and their types;
``--image-column`` / ``--label-column`` (and ``image_column=`` / ``label_column=`` in Python) name them. No accuracy is
computed on labels that were not read."""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
from conftest import evaluate_argv
from safetensors.torch import load_file
from test_first_hour import CLASSES, _argv, tiny  # noqa: F401  (a 1-channel ViT of classes cat, dog, bird)

from hf_gsc.data import load_split
from hf_gsc.evaluation.errors import InputError
from hf_gsc.utils.dataset_columns import image_column_of, label_column_of


def _renamed(source: str, root: Path, image: str, label: str | None, extra_label: str | None = None) -> str:
    """The ID DatasetDict of ``source`` with its columns renamed (``label=None``: without labels); ``extra_label``
    adds a second ClassLabel column (CIFAR-100's ``coarse_label``)."""
    splits = {}
    for split, dataset in datasets.load_from_disk(source).items():
        dataset = dataset if image == "image" else dataset.rename_column("image", image)
        if label is None:
            dataset = dataset.remove_columns("label")
        elif label != "label":
            dataset = dataset.rename_column("label", label)
        if extra_label is not None:
            dataset = dataset.add_column(extra_label, [0] * len(dataset),
                                         feature=datasets.ClassLabel(names=["animal", "thing"]))
        splits[split] = dataset
    datasets.DatasetDict(splits).save_to_disk(root)
    return str(root)


def _run(tiny, id_data: str, output: Path, *extra: str) -> dict:  # noqa: F811
    argv = _argv(tiny, output, "--no-selection", *extra)
    argv[argv.index("--id-dataset") + 1] = id_data
    return evaluate_argv(argv)


def _score_labels(run: Path) -> torch.Tensor:
    return load_file(str(run / "scores" / "msp" / "id_test.safetensors"))["labels"].long()


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):  # noqa: F811
    """The run on the usual image / label columns: what every schema must give."""
    output = tmp_path_factory.mktemp("reference")
    return _run(tiny, tiny["id"], output), _score_labels(output)


@pytest.mark.parametrize("image, label", [("picture", "cls"), ("img", "label"), ("image", "labels")])
def test_evaluate_finds_the_columns_by_type(tiny, reference, tmp_path, image, label):  # noqa: F811
    data = _renamed(tiny["id"], tmp_path / "data", image, label)
    results = _run(tiny, data, tmp_path / "run")
    expected, expected_labels = reference
    assert torch.equal(_score_labels(tmp_path / "run"), expected_labels)  # the labels read are the data's
    assert sorted(set(expected_labels.tolist())) == [0, 1, 2]
    assert results["id_accuracy"] == expected["id_accuracy"]
    assert results["label_check"]["status"] == "match"


def test_two_class_label_columns_are_refused_unless_one_is_named(tiny, reference, tmp_path):  # noqa: F811
    data = _renamed(tiny["id"], tmp_path / "data", "img", "fine_label", extra_label="coarse_label")
    with pytest.raises(InputError, match=r"several ClassLabel columns \(fine_label, coarse_label; its columns: img "
                                         r"\(Image\), fine_label \(ClassLabel of 3 names\).*--label-column"):
        _run(tiny, data, tmp_path / "refused")
    results = _run(tiny, data, tmp_path / "run", "--label-column", "fine_label", "--image-column", "img")
    assert torch.equal(_score_labels(tmp_path / "run"), reference[1])
    assert results["id_accuracy"] == reference[0]["id_accuracy"]
    with pytest.raises(InputError, match=r"--id-dataset.*no label column 'kind' \(its columns: img \(Image\)"):
        _run(tiny, data, tmp_path / "missing", "--label-column", "kind")


def test_id_data_without_labels_is_refused_not_scored_at_zero_accuracy(tiny, tmp_path):  # noqa: F811
    data = _renamed(tiny["id"], tmp_path / "data", "picture", None)
    with pytest.raises(InputError, match=r"no label column .*its columns: picture \(Image\)\).*--label-column"):
        _run(tiny, data, tmp_path / "run")
    assert not (tmp_path / "run" / "results.md").exists()


def test_column_flags_are_refused_with_a_benchmark(tmp_path):
    from hf_gsc.evaluation.arguments import parse_arguments

    with pytest.raises(InputError, match="--image-column names a column of --id-dataset"):
        parse_arguments(["--benchmark", "fmnist-ood", "--image-column", "img", "--output-dir", str(tmp_path)])


def test_load_split_reads_each_schema(tiny, tmp_path):  # noqa: F811
    for image, label in (("picture", "cls"), ("img", "label"), ("image", "labels")):
        loaded = load_split(f"{_renamed(tiny['id'], tmp_path / image, image, label)}:test", need_labels=True)
        assert loaded.column_names == ["image", "label"] and loaded.features["label"].names == CLASSES
    cifar100 = _renamed(tiny["id"], tmp_path / "cifar100", "img", "fine_label", extra_label="coarse_label")
    assert load_split(f"{cifar100}:test")["label"] == [-1] * 10  # OOD use: no label is read, none guessed
    assert load_split(f"{cifar100}:test", label_column="coarse_label")["label"] == [0] * 10
    with pytest.raises(ValueError, match="several ClassLabel columns"):
        load_split(f"{cifar100}:test", need_labels=True)


def test_the_column_rule():
    image = datasets.Image()
    both = datasets.Dataset.from_dict({"a": [], "b": []}, features=datasets.Features({"a": image, "b": image}))
    with pytest.raises(ValueError, match=r"several Image columns \(a, b; its columns: a \(Image\), b \(Image\)\)"):
        image_column_of(both)
    assert image_column_of(both, "b") == "b"
    paths = datasets.Dataset.from_dict({"img": ["x.png"], "target": [3], "name": ["x"]})
    assert image_column_of(paths) == "img" and label_column_of(paths) == "target"
    with pytest.raises(ValueError, match=r"no image column .*its columns: target \(int64\)"):
        image_column_of(paths.select_columns(["target"]))
    assert label_column_of(paths.select_columns(["img"])) is None
    with pytest.raises(ValueError, match="no label column"):
        label_column_of(paths.select_columns(["img"]), required=True)


def test_fit_and_calibrate_find_the_columns_by_type(tiny, tmp_path):  # noqa: F811
    from hf_gsc import AutoOODDetector

    data = datasets.load_from_disk(_renamed(tiny["id"], tmp_path / "data", "picture", "cls"))
    detector = AutoOODDetector.from_pretrained(tiny["model"], method="knn", k=2)
    detector.fit(data["train"])
    reference = AutoOODDetector.from_pretrained(tiny["model"], method="knn", k=2)
    reference.fit(datasets.load_from_disk(tiny["id"])["train"])
    assert torch.equal(detector.bank, reference.bank)
    threshold = detector.calibrate(data["validation"])
    assert threshold == reference.calibrate(datasets.load_from_disk(tiny["id"])["validation"])
    cifar100 = datasets.load_from_disk(_renamed(tiny["id"], tmp_path / "c100", "img", "fine_label", "coarse_label"))
    mahalanobis = AutoOODDetector.from_pretrained(tiny["model"], method="mahalanobis")
    with pytest.raises(ValueError, match="id_train_batches: the dataset has several ClassLabel columns.*label_column="):
        mahalanobis.fit(datasets.concatenate_datasets([cifar100["train"]] * 3))  # enough rows for its fit


def test_prepare_dataset_finds_the_columns_by_type(tiny, tmp_path):  # noqa: F811
    from hf_gsc.data import load_image_processor, prepare_dataset

    data = datasets.load_from_disk(_renamed(tiny["id"], tmp_path / "data", "picture", "cls"))["test"]
    reference = datasets.load_from_disk(tiny["id"])["test"]
    processor = load_image_processor(tiny["model"])
    prepared, expected = (prepare_dataset(d, processor, num_channels=1) for d in (data, reference))
    assert [int(prepared[i]["label"]) for i in range(len(data))] == data["cls"] == reference["label"]
    assert torch.equal(prepared[0]["pixel_values"], expected[0]["pixel_values"])
