"""Fashion-MNIST, the in-distribution data of the offline benchmarks.

Read from the Debian package ``dataset-fashion-mnist`` (idx-ubyte ``.gz`` files under
``/usr/share/datasets/fashion-mnist``) so that every machine can run the benchmarks offline; when
those files are missing, the Hub dataset ``zalando-datasets/fashion_mnist`` is tried instead.

Sizes: 60,000 train images (split here into 55,000 ``train`` + a fixed seeded 5,000 ``validation``)
and 10,000 ``test`` images; each image is 28x28 uint8 grayscale, labels are ints in ``[0, 10)``.
"""
from __future__ import annotations

import functools
import gzip
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np


#: Where ``apt-get install dataset-fashion-mnist`` puts the files; overridable for other layouts.
DEBIAN_DIR = Path(os.environ.get("HF_GSC_FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
HUB_ID = "zalando-datasets/fashion_mnist"

LABEL_NAMES: tuple[str, ...] = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

VALIDATION_SIZE = 5_000
#: Seed of the permutation that picks the validation images out of the 60,000 train images.
VALIDATION_SEED = 0

_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}


@dataclass(frozen=True)
class ArraySplit:
    """One split as arrays: ``images`` (N, 28, 28) uint8, ``labels`` (N,) int64, ``indices`` (N,)
    int64 = row numbers in the original source file (train rows for train/validation, test rows
    for test), kept so that disjointness can be checked."""

    images: np.ndarray
    labels: np.ndarray
    indices: np.ndarray


def _read_idx(path: Path) -> np.ndarray:
    """Parse one idx-ubyte(.gz) file: big-endian magic (0, 0, dtype=0x08 uint8, ndim) then ndim
    int32 sizes, then the raw data."""
    with gzip.open(path, "rb") as f:
        raw = f.read()
    if raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an idx-ubyte file of uint8 data")
    ndim = raw[3]
    shape = tuple(int(s) for s in np.frombuffer(raw, dtype=">i4", count=ndim, offset=4))
    # copy(): np.frombuffer views are read-only, and torch.from_numpy warns on those.
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).copy()
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: expected {shape} values, found {data.size}")
    return data.reshape(shape)


def _load_debian(directory: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {
        split: (_read_idx(directory / images), _read_idx(directory / labels).astype(np.int64))
        for split, (images, labels) in _FILES.items()
    }


def _load_hub() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    import datasets

    out = {}
    for split in ("train", "test"):
        ds = datasets.load_dataset(HUB_ID, split=split)
        images = np.stack([np.asarray(im.convert("L"), dtype=np.uint8) for im in ds["image"]])
        out[split] = (images, np.asarray(ds["label"], dtype=np.int64))
    return out


@functools.lru_cache(maxsize=1)
def _raw() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    if all((DEBIAN_DIR / f).is_file() for pair in _FILES.values() for f in pair):
        return _load_debian(DEBIAN_DIR)
    try:
        return _load_hub()
    except Exception as err:  # noqa: BLE001 -- any Hub failure means "offline and not installed"
        raise FileNotFoundError(
            f"Fashion-MNIST not found in {DEBIAN_DIR} and the Hub dataset {HUB_ID!r} could not be "
            "loaded. Install it with `apt-get install dataset-fashion-mnist` "
            "(or set HF_GSC_FASHION_MNIST_DIR to a folder holding the four idx-ubyte .gz files)."
        ) from err


def validation_rows() -> np.ndarray:
    """The 5,000 rows of the 60,000 original train images held out as ``validation`` (sorted)."""
    perm = np.random.default_rng(VALIDATION_SEED).permutation(60_000)
    return np.sort(perm[:VALIDATION_SIZE])


@functools.lru_cache(maxsize=1)
def load_arrays() -> dict[str, ArraySplit]:
    """Fashion-MNIST as arrays: ``train`` (55,000), ``validation`` (5,000), ``test`` (10,000).

    Validation is a fixed seeded subset of the original train set, never the test set.
    """
    raw = _raw()
    train_images, train_labels = raw["train"]
    test_images, test_labels = raw["test"]
    held_out = np.zeros(len(train_images), dtype=bool)
    held_out[validation_rows()] = True
    rows = np.arange(len(train_images), dtype=np.int64)
    return {
        "train": ArraySplit(train_images[~held_out], train_labels[~held_out], rows[~held_out]),
        "validation": ArraySplit(train_images[held_out], train_labels[held_out], rows[held_out]),
        "test": ArraySplit(test_images, test_labels, np.arange(len(test_images), dtype=np.int64)),
    }


def select_classes(split: ArraySplit, classes: tuple[int, ...]) -> ArraySplit:
    """Keep only the rows whose label is in ``classes`` and renumber labels to ``0..len(classes)-1``
    in the order given (so ``classes[k]`` becomes label ``k``)."""
    remap = np.full(len(LABEL_NAMES), -1, dtype=np.int64)
    remap[list(classes)] = np.arange(len(classes))
    keep = remap[split.labels] >= 0
    return ArraySplit(split.images[keep], remap[split.labels[keep]], split.indices[keep])
