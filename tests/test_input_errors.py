"""Inputs that fail loudly, naming what happened, and inputs read as documented:

* a missing, private or gated Hub repo, or an unreachable Hub, raises the Hub's own error, not "is an image
  classifier"; a detector folder without its config names the files it expected;
* the pipeline's empty input, a truncated file and a URL answering 404 are named; so is a truncated file in
  ``calibrate(folder)``;
* ``fit`` and ``calibrate`` read one split of a dataset root (the fit split; validation), say which, refuse a root
  without it, and never read test;
* labels by name from a column of class-name strings, with the image and label columns named;
* grey images in the README's manual call ``det(**det.image_processor(images=pil_images, return_tensors="pt"))``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from http_files import serve_files
from hub_server import LoopbackHub
from PIL import Image
from test_first_hour import CLASSES, save_tiny_vit

from hf_gsc import AutoOODDetector
from hf_gsc.utils.images import UnreadableImageError


@pytest.fixture(scope="module")
def rgb_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("rgb_vit") / "model"
    save_tiny_vit(folder, num_channels=3)
    return str(folder)


def _images(n: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (18, 22, 3), dtype=np.uint8)) for _ in range(n)]


def _tree(root: Path, images: list[Image.Image]) -> Path:
    """A class-folder tree of ``images`` under ``root`` (cat, dog, bird in turn)."""
    for index, image in enumerate(images):
        folder = root / CLASSES[index % len(CLASSES)]
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{index:02d}.png")
    return root


# ------------------------------------------------------------------------------- the Hub
def test_hub_errors_are_the_hubs_own(rgb_model, tmp_path):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    with LoopbackHub(tokens={"hf_owner": "owner", "hf_other": "other"}) as hub:
        with hub.patch_client(cache_dir=tmp_path / "cache", token="hf_owner"):
            api = HfApi()
            for repo_id, private in (("owner/private-vit", True), ("owner/gated-vit", False)):
                api.create_repo(repo_id, private=private)
                api.upload_folder(repo_id=repo_id, folder_path=rgb_model)
            hub.get_repo("owner/gated-vit").gated = "manual"
        with hub.patch_client(cache_dir=tmp_path / "cache2", token="hf_other"):
            for method in (None, "energy"):
                with pytest.raises(RepositoryNotFoundError):
                    AutoOODDetector.from_pretrained("owner/never-pushed", method=method)
                with pytest.raises(RepositoryNotFoundError):
                    AutoOODDetector.from_pretrained("owner/private-vit", method=method)
                with pytest.raises(GatedRepoError):
                    AutoOODDetector.from_pretrained("owner/gated-vit", method=method)
    with hub.patch_client(cache_dir=tmp_path / "cache3"):  # the server is closed: its port answers nothing
        with pytest.raises(LocalEntryNotFoundError):
            AutoOODDetector.from_pretrained("owner/never-pushed")


def test_a_detector_folder_without_its_config_names_the_files_it_expected(rgb_model, tmp_path):
    detector = AutoOODDetector.from_pretrained(rgb_model, method="energy")
    detector.save_pretrained(tmp_path / "energy")
    (tmp_path / "energy" / "detector_config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"holds config.json but neither detector_config.json .* nor a "
                                                r"classifier's weights \(model.safetensors"):
        AutoOODDetector.from_pretrained(str(tmp_path / "energy"))


# ------------------------------------------------------------------------------- unreadable inputs
def test_the_pipeline_names_empty_truncated_and_missing_inputs(rgb_model, tmp_path):
    import transformers

    ood = transformers.pipeline("ood-image-classification",
                                model=AutoOODDetector.from_pretrained(rgb_model, method="energy"))
    with pytest.raises(ValueError, match="got an empty list of images"):
        ood([])
    good = tmp_path / "good.jpg"
    _images(1, 0)[0].save(good)
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(good.read_bytes()[:-200])
    with pytest.raises(UnreadableImageError, match=f"cannot read the image {truncated}: image file is truncated"):
        ood([str(good), str(truncated)])
    with serve_files({"/good.jpg": good.read_bytes()}) as base:
        assert np.isfinite(ood(f"{base}/good.jpg")["ood_score"])
        with pytest.raises(UnreadableImageError, match=f"cannot fetch the image {base}/gone.png: HTTP 404"):
            ood(f"{base}/gone.png")
    with pytest.raises(UnreadableImageError, match=f"{tmp_path / 'nowhere.png'}: no such file"):
        ood(str(tmp_path / "nowhere.png"))


def test_calibrate_names_the_truncated_file(rgb_model, tmp_path):
    detector = AutoOODDetector.from_pretrained(rgb_model, method="energy")
    folder = tmp_path / "validation"
    folder.mkdir()
    for index, image in enumerate(_images(3, 1)):
        image.save(folder / f"{index}.jpg")
    data = (folder / "1.jpg").read_bytes()
    (folder / "1.jpg").write_bytes(data[: len(data) // 2])
    with pytest.raises(UnreadableImageError, match=f"cannot read the image {folder / '1.jpg'}: "):
        detector.calibrate(folder)


# ------------------------------------------------------------------------------- dataset roots
def test_fit_and_calibrate_read_one_split_of_a_root_and_never_test(rgb_model, tmp_path, caplog, recwarn):
    import datasets

    sizes = {"train": 4, "validation": 5, "test": 7}
    root = tmp_path / "photos"
    for seed, (split, n) in enumerate(sizes.items()):
        _tree(root / split, _images(n, seed))
    knn = AutoOODDetector.from_pretrained(rgb_model, method="knn", k=1)
    with caplog.at_level(logging.WARNING, logger="hf_gsc"):
        knn.fit(root)
        knn.calibrate(root)
    assert knn.bank.shape[0] == sizes["train"]  # the train split only, not train + validation + test
    assert knn.config.calibration["num_samples"] == sizes["validation"]
    said = [record.getMessage() for record in caplog.records]
    # The calls the user made, in their words (not the parameters' names).
    assert any(f"fit: reading the 'train' split of {root}" in line for line in said), said
    assert any(f"calibrate: reading the 'validation' split of {root}" in line for line in said), said
    assert not [line for line in said if "id_train_batches" in line or "id_validation_data" in line], said

    # The same as a DatasetDict, in memory and saved.
    splits = datasets.DatasetDict({split: datasets.Dataset.from_dict({"image": _images(n, 9)}) for split, n in
                                   sizes.items()})
    splits.save_to_disk(tmp_path / "saved")
    for data in (splits, str(tmp_path / "saved")):
        other = AutoOODDetector.from_pretrained(rgb_model, method="knn", k=1)
        other.fit(data)
        other.calibrate(data)
        assert other.bank.shape[0] == sizes["train"] and other.config.calibration["num_samples"] == sizes["validation"]

    # A root without the split is refused, naming it; test is never read.
    (root / "validation").rename(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=rf"{root} has no 'validation' split \(it has \['test', 'train'\]\)"):
        knn.calibrate(root)
    with pytest.raises(ValueError, match="has no 'validation' split"):
        knn.calibrate(datasets.DatasetDict({"train": splits["train"], "test": splits["test"]}))
    with pytest.raises(ValueError, match="never read a test split"):
        knn.calibrate(root, split="test")


# ------------------------------------------------------------------------------- labels by name
def test_string_labels_in_named_columns_map_through_label2id(rgb_model, tmp_path):
    import datasets

    images = _images(21, 4)
    paths = []
    for index, image in enumerate(images):
        paths.append(str(tmp_path / f"{index}.png"))
        image.save(paths[-1])
    species = ["Bird", "cat", "dog"] * 7  # names as the model's labels, compared as the evaluation compares them
    dataset = datasets.Dataset.from_dict({"photo": paths, "species": species})
    from_names = AutoOODDetector.from_pretrained(rgb_model, method="mahalanobis")
    from_names.fit(dataset, image_column="photo", label_column="species")
    from_batches = AutoOODDetector.from_pretrained(rgb_model, method="mahalanobis")
    pixel_values = from_batches.image_processor(images=images, return_tensors="pt")["pixel_values"]
    label2id = from_batches.label2id
    from_batches.fit([(pixel_values, torch.tensor([label2id[name.lower()] for name in species]))])
    torch.testing.assert_close(from_names.class_means, from_batches.class_means)
    with pytest.raises(ValueError, match="'fish' are not among the model's labels"):
        AutoOODDetector.from_pretrained(rgb_model, method="mahalanobis").fit(
            datasets.Dataset.from_dict({"photo": paths, "species": ["fish", *species[1:]]}),
            image_column="photo", label_column="species")
    with pytest.raises(ValueError, match="the dataset has no image column 'picture'"):
        from_names.fit(dataset, image_column="picture")


# ------------------------------------------------------------------------------- the README's manual call
def test_grey_images_in_the_readmes_manual_call(rgb_model):
    det = AutoOODDetector.from_pretrained(rgb_model, method="energy")
    grey = Image.fromarray(np.asarray(_images(1, 5)[0].convert("L")))
    pil_images = [grey, grey.convert("RGB")]
    out = det(**det.image_processor(images=pil_images, return_tensors="pt"))  # README: Quickstart
    torch.testing.assert_close(out.ood_score[0], out.ood_score[1])  # grey is the RGB image with three equal channels
    # docs/inputs.md: decoding first, as the pipeline does
    from hf_gsc.utils.images import load_image, model_mode

    images = [load_image(image, model_mode(det.num_channels)) for image in pil_images]
    decoded = det(**det.image_processor(images=images, return_tensors="pt"))
    torch.testing.assert_close(decoded.ood_score, out.ood_score)
