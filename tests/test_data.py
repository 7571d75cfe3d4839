"""Tests of hf_gsc.data: benchmark splits, generated OOD data, local/Hub split loading, preprocessing."""
from __future__ import annotations

import io

import datasets
import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

from hf_gsc.data import BENCHMARKS, collate, fashion_mnist, load_benchmark, load_split, make_transform, prepare_dataset
from hf_gsc.data.arrays import to_dataset
from hf_gsc.data.fonts import generate_letters
from hf_gsc.data.noise import generate_noise
from hf_gsc.data.opencv_digits import load_digits
from hf_gsc.data.splits import parse_spec
from hf_gsc.data.textures import generate_textures


def as_array(dataset, rows=None) -> np.ndarray:
    """Decoded images of ``dataset`` (all rows or ``rows``) as uint8 (N, H, W).

    Decodes the stored bytes with PIL directly: the same decoder ``datasets.Image`` uses, without
    its per-row overhead (3x faster on the whole OOD splits).
    """
    if rows is not None:
        dataset = dataset.select(rows)
    raw = dataset.cast_column("image", datasets.Image(decode=False))["image"]
    return np.stack([np.asarray(Image.open(io.BytesIO(r["bytes"])).convert("L")) for r in raw])


@pytest.fixture(scope="module")
def fmnist_ood():
    return load_benchmark("fmnist-ood")


@pytest.fixture(scope="module")
def openset():
    return load_benchmark("fmnist-openset")


def test_registry_names():
    assert {"fmnist-ood", "fmnist-openset"} <= set(BENCHMARKS)
    assert set(BENCHMARKS["fmnist-ood"].ood_builders) == {"mnist", "notmnist", "textures", "noise"}


def test_id_split_sizes_and_columns(fmnist_ood):
    sizes = {split: len(ds) for split, ds in fmnist_ood.id_splits.items()}
    assert sizes == {"train": 55_000, "validation": 5_000, "test": 10_000}
    for ds in fmnist_ood.id_splits.values():
        assert ds.column_names == ["image", "label"]
        assert ds.features["label"].names == list(fashion_mnist.LABEL_NAMES)
    assert fmnist_ood.num_labels == 10
    first = fmnist_ood.id_splits["test"][0]["image"]
    assert first.mode == "L" and first.size == (28, 28)


def test_ood_split_sizes_and_shape(fmnist_ood):
    assert set(fmnist_ood.ood_splits) == {"mnist", "notmnist", "textures", "noise"}
    for name, ds in fmnist_ood.ood_splits.items():
        assert len(ds) >= 2_000, name
        assert set(ds["label"]) == {-1}, name
        image = ds[0]["image"]
        assert image.mode == "L" and image.size == (28, 28), name
    assert len(fmnist_ood.ood_splits["mnist"]) == 5_000  # every digit of digits.png


def test_train_validation_test_are_disjoint(fmnist_ood):
    arrays = fashion_mnist.load_arrays()
    train, val = set(arrays["train"].indices), set(arrays["validation"].indices)
    assert not train & val
    assert train | val == set(range(60_000))
    # Validation comes from the original *train* file, never from the test file: its images are
    # exactly the raw train rows at the held-out indices.
    raw_train_images, _ = fashion_mnist._raw()["train"]
    rows = fashion_mnist.validation_rows()
    np.testing.assert_array_equal(as_array(fmnist_ood.id_splits["validation"], range(50)), raw_train_images[rows[:50]])
    np.testing.assert_array_equal(as_array(fmnist_ood.id_splits["train"], range(50)),
                                  raw_train_images[np.setdiff1d(np.arange(60_000), rows)[:50]])
    # And no validation image is byte-identical to a test image (an accidental test leak would be).
    test_hashes = {im.tobytes() for im in arrays["test"].images}
    assert sum(im.tobytes() in test_hashes for im in arrays["validation"].images) < 5


def test_validation_subset_is_fixed():
    first = fashion_mnist.validation_rows()
    assert len(first) == 5_000
    np.testing.assert_array_equal(first, fashion_mnist.validation_rows())


@pytest.mark.parametrize(
    "generate", [generate_noise, generate_letters, generate_textures], ids=["noise", "notmnist", "textures"]
)
def test_generated_ood_is_deterministic(generate):
    a, b, c = generate(60, seed=0)[0], generate(60, seed=0)[0], generate(60, seed=1)[0]
    assert a.shape == (60, 28, 28) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_loaded_ood_splits_are_the_seeded_generation(fmnist_ood):
    np.testing.assert_array_equal(as_array(fmnist_ood.ood_splits["noise"], range(30)), generate_noise(30)[0])
    np.testing.assert_array_equal(as_array(fmnist_ood.ood_splits["notmnist"], range(30)), generate_letters(30)[0])
    np.testing.assert_array_equal(as_array(fmnist_ood.ood_splits["textures"], range(30)), generate_textures(30)[0])


def test_ood_images_are_not_constant(fmnist_ood):
    for name, ds in fmnist_ood.ood_splits.items():
        images = as_array(ds).astype(np.float32)
        per_image_std = images.reshape(len(images), -1).std(axis=1)
        assert per_image_std.min() > 5.0, f"{name} has a (near-)constant image"
        # Not all the same image either.
        assert np.abs(images[0] - images[1:]).max() > 0, name


def test_mnist_split_is_mnist_like():
    images, digits = load_digits()
    assert images.shape == (5_000, 28, 28)
    np.testing.assert_array_equal(np.bincount(digits), [500] * 10)
    # Centre of mass in the middle, as in MNIST, and a black border.
    mass = images.astype(np.float64)
    ys, xs = np.indices((28, 28))
    cy = (mass * ys).sum((1, 2)) / mass.sum((1, 2))
    cx = (mass * xs).sum((1, 2)) / mass.sum((1, 2))
    assert np.abs(cy - 13.5).max() < 1.5 and np.abs(cx - 13.5).max() < 1.5
    assert images[:, :2, :].max() == 0 and images[:, -2:, :].max() == 0


def test_openset_label_sets(openset):
    assert openset.num_labels == 6
    assert openset.label_names == ("T-shirt/top", "Trouser", "Dress", "Sandal", "Sneaker", "Bag")
    for split, ds in openset.id_splits.items():
        assert set(ds["label"]) == set(range(6)), split
    ood = openset.ood_splits["heldout_classes"]
    assert set(ood["source_label"]) == {2, 4, 6, 9}  # Pullover, Coat, Shirt, Ankle boot
    assert len(ood) == 4_000  # 1,000 test images per held-out class
    # The ID splits hold exactly the 6 classes' images: 6 x 1,000 in test.
    assert len(openset.id_splits["test"]) == 6_000
    assert len(openset.id_splits["train"]) + len(openset.id_splits["validation"]) == 36_000
    assert len(openset.id_splits["validation"]) == 3_029  # the 6 classes' rows of the fixed 5,000


def _write_pngs(folder, count, rng):
    folder.mkdir(parents=True)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (20, 24), dtype=np.uint8), mode="L").save(folder / f"{i}.png")


def test_local_imagefolder_as_ood_split(tmp_path):
    rng = np.random.default_rng(0)
    _write_pngs(tmp_path / "cats", 3, rng)
    _write_pngs(tmp_path / "dogs", 2, rng)
    ds = load_split(tmp_path)
    assert len(ds) == 5 and ds.column_names == ["image", "label"]
    assert sorted(ds["label"]) == [0, 0, 0, 1, 1]

    flat = tmp_path / "flat"
    _write_pngs(flat, 4, rng)
    bench = load_benchmark("fmnist-openset", ood_splits=[], extra_ood={"mine": flat})
    assert list(bench.ood_splits) == ["mine"]
    mine = bench.ood_splits["mine"]
    assert len(mine) == 4 and mine[0]["image"].size == (24, 20)


def test_saved_dataset_with_named_image_column(tmp_path):
    ds = to_dataset(np.full((3, 28, 28), 7, dtype=np.uint8), [1, 2, 3]).rename_column("image", "picture")
    ds = ds.rename_column("label", "fine_label")
    ds.save_to_disk(str(tmp_path / "saved"))
    loaded = load_split(tmp_path / "saved", image_column="picture")
    assert loaded.column_names == ["image", "label"] and loaded["label"] == [1, 2, 3]


def test_parse_hub_spec():
    assert parse_spec("cifar10:test") == ("cifar10", None, "test")
    assert parse_spec("ylecun/mnist:mnist:train") == ("ylecun/mnist", "mnist", "train")
    with pytest.raises(ValueError):
        parse_spec("a:b:c:d")


@pytest.fixture()
def gray_processor():
    return ViTImageProcessorPil(size={"height": 28, "width": 28}, image_mean=[0.5], image_std=[0.5],
                                do_convert_rgb=False)


def test_transform_channels(gray_processor):
    ds = to_dataset(np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28), [0, 1])
    one = prepare_dataset(ds, gray_processor, num_channels=1)
    assert one[0]["pixel_values"].shape == (1, 28, 28)
    rgb = ViTImageProcessorPil(size={"height": 32, "width": 32})  # ImageNet-style 3-channel processor
    three = prepare_dataset(ds, rgb, num_channels=3)
    item = three[1]
    assert item["pixel_values"].shape == (3, 32, 32) and int(item["label"]) == 1
    # Grayscale -> RGB replicates the channel.
    torch.testing.assert_close(item["pixel_values"][0], item["pixel_values"][2])
    batch = collate([three[0], three[1]])
    assert batch["pixel_values"].shape == (2, 3, 32, 32) and batch["label"].tolist() == [0, 1]
    # Pixel values match the processor applied directly.
    direct = gray_processor(ds[0]["image"], return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(one[0]["pixel_values"], direct)


def test_unreadable_image_names_dataset_and_row(gray_processor):
    ds = to_dataset(np.zeros((3, 28, 28), dtype=np.uint8), [0, 0, 0])
    table = ds.data.table.to_pydict()
    table["image"][2] = {"bytes": b"definitely not an image", "path": None}
    broken = datasets.Dataset.from_dict(table, features=ds.features)
    prepared = prepare_dataset(broken, gray_processor, num_channels=1, dataset_name="my-ood")
    assert prepared[0]["pixel_values"].shape == (1, 28, 28)
    with pytest.raises(ValueError, match=r"my-ood.*row 2"):
        prepared[2]
    with pytest.raises(ValueError, match=r"my-ood.*row 2"):
        next(iter(torch.utils.data.DataLoader(prepared, batch_size=3, collate_fn=collate)))
    with pytest.raises(ValueError, match="num_channels"):
        make_transform(gray_processor, num_channels=2)


def test_texture_sources_do_not_depend_on_where_the_packages_live(tmp_path, monkeypatch):
    """The split's crops follow the source order; it must not change with the virtual environment's path."""
    from hf_gsc.data import textures

    orders = []
    for skimage_parent, opencv_parent in [("a", "z"), ("z", "a")]:
        skimage_dir, opencv_dir = tmp_path / skimage_parent / "skimage", tmp_path / opencv_parent / "opencv"
        for directory, names in [(skimage_dir, ["b.png", "a.jpg"]), (opencv_dir, ["d.png", "c.jpg", "digits.png"])]:
            directory.mkdir(parents=True)
            for name in names:
                (directory / name).write_bytes(b"")
        monkeypatch.setattr(textures, "_skimage_dir", lambda skimage_dir=skimage_dir: skimage_dir)
        monkeypatch.setattr(textures, "OPENCV_DATA", opencv_dir)
        orders.append([path.name for path in textures.source_files()])
    assert orders[0] == orders[1] == ["c.jpg", "d.png", "a.jpg", "b.png"]


# --- Data that cannot be decoded (issue 16, error 9) and streaming refusals ----------------------------------------


def test_text_image_column_is_refused_at_load_time(tmp_path):
    """A dataset whose ``image`` column holds captions fails when loaded, naming dataset, column and row."""
    captions = datasets.Dataset.from_dict({"image": ["a photo of a cat", "a dog"], "label": [0, 1]})
    captions.save_to_disk(str(tmp_path / "captions"))
    with pytest.raises(ValueError) as caught:
        load_split(tmp_path / "captions")
    message = str(caught.value)
    assert "\n" not in message
    assert f"dataset '{tmp_path / 'captions'}'" in message
    assert "column 'image' holds text, not images: row 0 is 'a photo of a cat'" in message

    numbers = datasets.Dataset.from_dict({"image": [1, 2], "label": [0, 1]})
    numbers.save_to_disk(str(tmp_path / "numbers"))
    with pytest.raises(ValueError, match=r"column 'image' holds int64 values, not images"):
        load_split(tmp_path / "numbers")


def test_text_column_of_image_paths_is_accepted(tmp_path):
    rng = np.random.default_rng(1)
    _write_pngs(tmp_path / "pngs", 2, rng)
    paths = [str(tmp_path / "pngs" / f"{i}.png") for i in range(2)]
    datasets.Dataset.from_dict({"image": paths}).save_to_disk(str(tmp_path / "paths"))
    loaded = load_split(tmp_path / "paths")
    assert loaded["label"] == [-1, -1]
    assert np.array_equal(np.asarray(loaded[1]["image"]), np.asarray(Image.open(paths[1])))


def test_corrupt_png_in_a_folder_names_dataset_row_and_file(tmp_path, gray_processor):
    from hf_gsc.data.decoding import UndecodableImageError

    rng = np.random.default_rng(2)
    _write_pngs(tmp_path / "ood", 3, rng)
    (tmp_path / "ood" / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")  # PNG signature, then garbage
    split = load_split(tmp_path / "ood")  # loading lists files only; the bad one shows when decoded
    bad_row = next(i for i, item in enumerate(split.cast_column("image", datasets.Image(decode=False)))
                   if item["image"]["path"].endswith("1.png"))
    prepared = prepare_dataset(split, gray_processor, num_channels=1, dataset_name="ood")
    with pytest.raises(UndecodableImageError) as caught:
        next(iter(torch.utils.data.DataLoader(prepared, batch_size=3, collate_fn=collate)))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"cannot decode the image of dataset 'ood', row {bad_row}, file ")
    assert str(tmp_path / "ood" / "1.png") in message

    # on_error="skip": the batch keeps the two readable images, their labels and rows, and counts the skipped one.
    skip = make_transform(gray_processor, num_channels=1, dataset_name="ood", on_error="skip")
    raw = split.cast_column("image", datasets.Image(decode=False))
    batch = skip({"image": raw["image"], "label": [5, 6, 7], "row": [10, 11, 12]})
    kept = [i for i in range(3) if i != bad_row]
    assert batch["pixel_values"].shape == (2, 1, 28, 28)
    assert batch["label"].tolist() == [[5, 6, 7][i] for i in kept]
    assert batch["row"].tolist() == [10 + i for i in kept]
    assert int(batch["num_skipped"]) == 1
    everything_bad = skip({"image": [raw["image"][bad_row]], "label": [0]})
    assert everything_bad["pixel_values"].shape[0] == 0 and int(everything_bad["num_skipped"]) == 1
    with pytest.raises(ValueError, match="on_error must be one of"):
        make_transform(gray_processor, num_channels=1, on_error="ignore")


def test_decode_images_skip_and_raise():
    from hf_gsc.data.decoding import UndecodableImageError, decode_images

    good = io.BytesIO()
    Image.new("L", (4, 4)).save(good, format="PNG")
    values = [{"bytes": good.getvalue(), "path": None}, {"bytes": b"junk", "path": "x.png"}]
    decoded = decode_images(values, [7, 8], "set", on_error="skip")
    assert decoded.rows == [7] and decoded.positions == [0] and decoded.skipped_rows == [8]
    with pytest.raises(UndecodableImageError, match=r"^cannot decode the image of dataset 'set', row 8, file x.png: "):
        decode_images(values, [7, 8], "set")


def test_streaming_refuses_local_folders_and_generated_benchmarks(tmp_path):
    _write_pngs(tmp_path / "imgs", 1, np.random.default_rng(3))
    with pytest.raises(ValueError, match="^--streaming needs a Hub dataset id; local folders are read in place anyway"):
        load_split(tmp_path / "imgs", streaming=True)
    with pytest.raises(ValueError, match="generated on this machine, not read from the Hub"):
        load_benchmark("fmnist-openset", ood_splits=[], streaming=True)
