"""One input contract: every method that fits on labelled data takes a class-folder tree (labels by folder name
through the model's label2id), a datasets.Dataset (its ClassLabel names mapped to the model's labels) or batches;
fit, calibrate and the pipeline take NumPy images (H x W, H x W x 3, H x W x 4, uint8 or float) like PIL images."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import NUM_LABELS
from test_fit_labels import NAMES, _detector, named  # noqa: F401  (a balanced 5-class model named boot, coat, ...)

from hf_gsc.utils.inputs import array_to_image


@pytest.fixture(scope="module")
def labelled(named):
    """``named``'s model, processor and images, with labels: the model's own predictions, so that SHE has correct
    samples of every class, and every class present."""
    model, processor, images = named
    with torch.no_grad():
        predicted = model(**processor(images=images, return_tensors="pt")).logits.argmax(-1).tolist()
    labels = [label if i % 3 else i % NUM_LABELS for i, label in enumerate(predicted)]  # every class, some correct
    return model, processor, images, labels


@pytest.mark.parametrize("method", ["mahalanobis", "gem", "rmds", "conjnorm"])  # SHE reads the labels the same way
def test_labelled_methods_fit_on_a_class_folder_tree(labelled, method, tmp_path):
    model, processor, images, labels = labelled
    for index, (image, label) in enumerate(zip(images, labels)):
        folder = tmp_path / NAMES[label]
        folder.mkdir(exist_ok=True)
        image.save(folder / f"{index:03d}.png")
    from_folder = _detector(method, model, processor)
    from_folder.fit(tmp_path)
    files = sorted(tmp_path.rglob("*.png"))  # the folder's order
    order = [int(path.stem) for path in files]
    pixel_values = processor(images=[images[i] for i in order], return_tensors="pt")["pixel_values"]
    from_batches = _detector(method, model, processor)
    from_batches.fit([(pixel_values, torch.tensor([labels[i] for i in order]))])
    for name in from_batches.state_names:  # equal up to the float32 rounding of other batch sizes
        expected = getattr(from_batches, name)
        torch.testing.assert_close(getattr(from_folder, name), expected, rtol=1e-5, atol=1e-6 * expected.abs().max())


def test_a_dataset_with_class_names_in_another_order_is_mapped_by_name(labelled):
    import datasets

    model, processor, images, labels = labelled
    shuffled = NAMES[::-1]  # the dataset's own class order
    dataset = datasets.Dataset.from_dict(
        {"image": images, "label": [shuffled.index(NAMES[label]) for label in labels]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=shuffled)}))
    from_dataset = _detector("mahalanobis", model, processor)
    from_dataset.fit(dataset)
    pixel_values = processor(images=images, return_tensors="pt")["pixel_values"]
    from_batches = _detector("mahalanobis", model, processor)
    from_batches.fit([(pixel_values, torch.tensor(labels))])
    torch.testing.assert_close(from_dataset.class_means, from_batches.class_means)


def test_numpy_images_are_images(labelled):
    model, processor, images, _ = labelled
    rgb = np.asarray(images[0])
    as_float = rgb.astype(np.float32) / 255.0
    rgba = np.concatenate([rgb, np.full((*rgb.shape[:2], 1), 255, np.uint8)], axis=2)
    for array in (rgb, as_float, rgba):
        assert np.array_equal(np.asarray(array_to_image(array)), rgb)
    gray = rgb[:, :, 0]
    assert array_to_image(gray).mode == "L"
    with pytest.raises(ValueError, match="H x W x 3 or H x W x 4"):
        array_to_image(np.zeros((4, 4, 2), np.uint8))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        array_to_image(np.full((4, 4), 2.0))
    detector = _detector("knn", model, processor)
    detector.fit([np.asarray(image) for image in images])  # fit and calibrate take NumPy images
    from_arrays = detector.calibrate([np.asarray(image) for image in images], tpr=0.9)
    from_pil = detector.calibrate(images, tpr=0.9)
    assert from_arrays == from_pil


def test_the_pipeline_serves_numpy_images(labelled, tmp_path):
    import transformers

    model, processor, images, _ = labelled
    detector = _detector("energy", model, processor)
    detector.save_pretrained(tmp_path / "energy", save_base_model=True)
    ood = transformers.pipeline("ood-image-classification", model=str(tmp_path / "energy"))
    rgb = np.asarray(images[0])
    rgba = np.concatenate([rgb, np.full((*rgb.shape[:2], 1), 255, np.uint8)], axis=2)
    expected = ood(images[0])["ood_score"]
    for array in (rgb, rgb.astype(np.float64) / 255.0, rgba):
        assert ood(array)["ood_score"] == pytest.approx(expected, rel=1e-6)
    gray = ood(rgb[:, :, 0])  # H x W: served (the processor makes the channels the model expects)
    assert np.isfinite(gray["ood_score"])
