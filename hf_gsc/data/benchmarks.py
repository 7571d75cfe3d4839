"""The benchmark registry: benchmark name -> how to build its ``id_splits`` and ``ood_splits``.

Both registered benchmarks run offline on any machine with the Debian packages
``dataset-fashion-mnist``, ``opencv-doc`` and a few font packages installed (see docs/data.md).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import datasets

from . import fashion_mnist
from .arrays import to_dataset
from .fashion_mnist import ArraySplit
from .fonts import build_notmnist
from .noise import build_noise
from .opencv_digits import build_opencv_digits
from .splits import load_split
from .textures import build_textures


@dataclass(frozen=True)
class Benchmark:
    """A loaded benchmark.

    ``id_splits`` holds ``train`` / ``validation`` / ``test``; ``ood_splits`` maps an OOD split name
    to a dataset of the same columns (``image``: ``datasets.Image``, ``label``: int, -1 for OOD
    data that has no label in the ID label space).
    """

    name: str
    id_splits: datasets.DatasetDict
    ood_splits: Mapping[str, datasets.Dataset]
    num_labels: int
    label_names: tuple[str, ...]


@dataclass(frozen=True)
class BenchmarkSpec:
    """How to build one benchmark; nothing is read or generated until it is loaded.

    ``id_arrays`` returns ``train`` / ``validation`` / ``test`` as uint8 (N, 28, 28) arrays (the
    training script uses these directly, skipping PNG encoding); ``ood_builders`` maps each OOD
    split name to a zero-argument function returning a ``datasets.Dataset``.
    """

    name: str
    description: str
    label_names: tuple[str, ...]
    id_arrays: Callable[[], dict[str, ArraySplit]]
    ood_builders: Mapping[str, Callable[[], datasets.Dataset]] = field(default_factory=dict)


#: Fashion-MNIST classes kept in-distribution by ``fmnist-openset``. The other four (Pullover,
#: Coat, Shirt, Ankle boot) are near-OOD on purpose: each has a close ID sibling (T-shirt/top,
#: Dress, Sneaker/Sandal), so shape and texture alone do not separate them.
OPENSET_ID_CLASSES: tuple[int, ...] = (0, 1, 3, 5, 7, 8)
OPENSET_OOD_CLASSES: tuple[int, ...] = tuple(
    c for c in range(len(fashion_mnist.LABEL_NAMES)) if c not in OPENSET_ID_CLASSES
)


def _openset_id_arrays() -> dict[str, ArraySplit]:
    return {
        split: fashion_mnist.select_classes(arrays, OPENSET_ID_CLASSES)
        for split, arrays in fashion_mnist.load_arrays().items()
    }


def _openset_ood() -> datasets.Dataset:
    """Test images of the four held-out classes; ``label`` = -1 (not an ID class), the original
    Fashion-MNIST class is kept in ``source_label``."""
    test = fashion_mnist.load_arrays()["test"]
    keep = [i for i, label in enumerate(test.labels) if label in OPENSET_OOD_CLASSES]
    ds = to_dataset(test.images[keep], [-1] * len(keep))
    return ds.add_column("source_label", test.labels[keep].tolist())


BENCHMARKS: Mapping[str, BenchmarkSpec] = MappingProxyType(
    {
        "fmnist-ood": BenchmarkSpec(
            name="fmnist-ood",
            description="ID: Fashion-MNIST (10 classes); OOD: digits, letters, textures, noise.",
            label_names=fashion_mnist.LABEL_NAMES,
            id_arrays=fashion_mnist.load_arrays,
            ood_builders={
                "mnist": build_opencv_digits,
                "notmnist": build_notmnist,
                "textures": build_textures,
                "noise": build_noise,
            },
        ),
        "fmnist-openset": BenchmarkSpec(
            name="fmnist-openset",
            description="ID: 6 Fashion-MNIST classes; OOD: test images of the other 4 (near-OOD).",
            label_names=tuple(fashion_mnist.LABEL_NAMES[c] for c in OPENSET_ID_CLASSES),
            id_arrays=_openset_id_arrays,
            ood_builders={"heldout_classes": _openset_ood},
        ),
    }
)


@functools.lru_cache(maxsize=4)
def _id_splits(name: str) -> datasets.DatasetDict:
    spec = BENCHMARKS[name]
    return datasets.DatasetDict(
        {
            split: to_dataset(arrays.images, arrays.labels, spec.label_names)
            for split, arrays in spec.id_arrays().items()
        }
    )


@functools.lru_cache(maxsize=16)
def _ood_split(name: str, split: str) -> datasets.Dataset:
    return BENCHMARKS[name].ood_builders[split]()


def load_benchmark(
    name: str,
    ood_splits: Sequence[str] | None = None,
    extra_ood: Mapping[str, str | Path] | None = None,
    image_column: str | None = None,
) -> Benchmark:
    """Load a registered benchmark.

    Args:
        name: a key of ``BENCHMARKS`` (``"fmnist-ood"``, ``"fmnist-openset"``).
        ood_splits: which of the benchmark's OOD splits to build (default: all of them); each
            generated split takes a few seconds the first time, then is cached for the process.
        extra_ood: more OOD splits, name -> anything ``load_split`` accepts (a Hub
            ``"dataset_id[:config]:split"``, a local imagefolder or saved dataset folder).
        image_column: image column of the ``extra_ood`` datasets (auto-detected by default).

    Returns:
        A ``Benchmark`` whose ``id_splits`` is a ``DatasetDict`` (``train``, ``validation``,
        ``test``) and ``ood_splits`` a mapping name -> ``Dataset``.
    """
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; registered: {sorted(BENCHMARKS)}")
    spec = BENCHMARKS[name]
    wanted = list(spec.ood_builders) if ood_splits is None else list(ood_splits)
    unknown = [s for s in wanted if s not in spec.ood_builders]
    if unknown:
        raise KeyError(f"benchmark {name!r} has no OOD split {unknown}; it has {list(spec.ood_builders)}")
    ood = {split: _ood_split(name, split) for split in wanted}
    for split, source in (extra_ood or {}).items():
        if split in ood:
            raise ValueError(f"extra OOD split {split!r} would replace the benchmark's own split")
        ood[split] = load_split(source, image_column=image_column)
    return Benchmark(
        name=name,
        id_splits=_id_splits(name),
        ood_splits=MappingProxyType(ood),
        num_labels=len(spec.label_names),
        label_names=spec.label_names,
    )
