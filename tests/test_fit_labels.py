"""Labelled fits refuse images they cannot label before reading any, naming what does not match: class folders that
are not the model's labels, a dataset whose class names are partly the model's (its indices would be silently
wrong), images without labels. A method that needs no labels still fits on them. A stacked NumPy batch says to pass
a list."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, NUM_LABELS
from PIL import Image
from test_detectors import balanced_model
from transformers import ViTImageProcessor

from hf_gsc.detectors import get_detector


NAMES = ["boot", "coat", "dress", "shirt", "bag"][:NUM_LABELS]


@pytest.fixture(scope="module")
def named():
    model = balanced_model("resnet").float()
    model.config.id2label = dict(enumerate(NAMES))
    model.config.label2id = {name: index for index, name in enumerate(NAMES)}
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)) for _ in range(60)]
    return model, ViTImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}), images


def _detector(method, model, processor):
    detector = get_detector(method, model)
    detector.image_processor = processor
    return detector


def _tree(root, images, folder_names):
    for index, image in enumerate(images):
        folder = root / folder_names[index % len(folder_names)]
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{index:03d}.png")
    return root


@pytest.mark.parametrize("method", ["mahalanobis", "she"])
def test_class_folders_that_are_not_the_models_labels_are_named(named, method, tmp_path, monkeypatch):
    model, processor, images = named
    # 'Dress' is the model's 'dress' (names compared as the evaluation compares them); 'sock' is no model label.
    root = _tree(tmp_path / "train", images, ["boot", "coat", "Dress", "sock", "bag"][:NUM_LABELS])
    detector = _detector(method, model, processor)
    opened = []
    monkeypatch.setattr("hf_gsc.utils.inputs.load_image", lambda *args, **kwargs: opened.append(args))
    with pytest.raises(ValueError, match=r"id_train_batches: the class folders of .*train must be named as the "
                                         r"model's labels: 'sock' are not among the model's labels "
                                         r"\(config.label2id: 'boot', 'coat', 'dress', 'shirt'"):
        detector.fit(root)
    assert opened == []  # refused before any image is read


def test_a_flat_folder_or_plain_images_are_refused_for_a_labelled_method(named, tmp_path):
    model, processor, images = named
    for index, image in enumerate(images[:4]):
        image.save(tmp_path / f"{index}.png")
    detector = _detector("mahalanobis", model, processor)
    with pytest.raises(ValueError, match="is not a class-folder tree"):
        detector.fit(tmp_path)
    with pytest.raises(ValueError, match="images alone carry no labels"):
        detector.fit(images)
    with pytest.raises(ValueError, match="images alone carry no labels"):
        detector.fit([np.asarray(image) for image in images])
    knn = _detector("knn", model, processor)  # needs no labels: a flat folder of images is its fitting data
    knn.fit([np.asarray(image) for image in images])
    assert knn.fitted


def test_a_dataset_whose_class_names_are_partly_the_models_is_refused(named):
    import datasets

    model, processor, images = named
    names = ["boot", "coat", "sandal", "shirt", "bag"][:NUM_LABELS]
    dataset = datasets.Dataset.from_dict(
        {"image": images, "label": [i % NUM_LABELS for i in range(len(images))]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)}))
    with pytest.raises(ValueError, match="the dataset's class names cannot be mapped to the model's labels: 'sandal'"):
        _detector("mahalanobis", model, processor).fit(dataset)
    no_label = datasets.Dataset.from_dict({"image": images}, features=datasets.Features({"image": datasets.Image()}))
    with pytest.raises(ValueError, match=r"the dataset has no label column .*its columns: image \(Image\)"):
        _detector("mahalanobis", model, processor).fit(no_label)


def test_a_dataset_with_other_class_names_keeps_its_indices(named):
    """Class names none of which are the model's (a model with default LABEL_i names): the indices are kept."""
    import datasets

    model, processor, images = named
    labels = [i % NUM_LABELS for i in range(len(images))]
    dataset = datasets.Dataset.from_dict(
        {"image": images, "label": labels},
        features=datasets.Features({"image": datasets.Image(),
                                    "label": datasets.ClassLabel(names=[f"c{i}" for i in range(NUM_LABELS)])}))
    from_dataset = _detector("mahalanobis", model, processor).fit(dataset)
    pixel_values = processor(images=images, return_tensors="pt")["pixel_values"]
    from_batches = _detector("mahalanobis", model, processor).fit([(pixel_values, torch.tensor(labels))])
    torch.testing.assert_close(from_dataset.class_means, from_batches.class_means)


def test_a_stacked_numpy_batch_says_to_pass_a_list(named):
    from hf_gsc.utils.inputs import array_to_image

    model, processor, images = named
    stacked = np.stack([np.asarray(image) for image in images])
    with pytest.raises(TypeError, match="NumPy images: pass a list of H x W"):
        _detector("energy", model, processor).calibrate(stacked)
    with pytest.raises(ValueError, match=r"got shape \(60, 20, 20, 3\) \(several images: pass a list of them\)"):
        array_to_image(stacked)
