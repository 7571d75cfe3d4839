"""The benchmark registry: benchmark name -> how to build its ``id_splits`` and ``ood_splits``.

Two kinds of benchmark share the registry:

* generated ones (``fmnist-ood``, ``fmnist-openset``, :class:`BenchmarkSpec`) run offline on any machine with the
  Debian packages ``dataset-fashion-mnist``, ``opencv-doc`` and a few font packages installed;
* the paper's benchmarks (``cifar10-ood``, ``cifar100-ood``, ``imagenet-ood``,
  :class:`~hf_gsc.data.hub_benchmarks.HubBenchmarkSpec`) read Hub datasets, downloaded or streamed.

See docs/data.md for every split's provenance and licence.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import datasets

from . import fashion_mnist
from .arrays import to_dataset
from .fashion_mnist import ArraySplit
from .fonts import build_notmnist
from .hub_benchmarks import HUB_BENCHMARKS, HubBenchmarkSpec, label_names_of
from .noise import build_noise
from .opencv_digits import build_opencv_digits
from .splits import load_split
from .textures import build_textures


@dataclass(frozen=True)
class Benchmark:
    """A loaded benchmark.

    ``id_splits`` holds ``train`` / ``validation`` / ``test``; ``ood_splits`` maps an OOD split name
    to a dataset of the same columns (``image``: ``datasets.Image``, ``label``: int, -1 for OOD
    data that has no label in the ID label space). For a Hub benchmark ``id_splits`` is a mapping that
    loads ``train`` / ``validation`` on first access (ImageNet's train split is 1.28M images), and the
    datasets are ``IterableDataset`` objects when loaded with ``streaming=True``.
    """

    name: str
    id_splits: Mapping[str, Any]
    ood_splits: Mapping[str, Any]
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
    near_ood: tuple[str, ...] = ()
    far_ood: tuple[str, ...] = ()


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


GENERATED_BENCHMARKS: Mapping[str, BenchmarkSpec] = MappingProxyType(
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
            far_ood=("mnist", "notmnist", "textures", "noise"),
        ),
        "fmnist-openset": BenchmarkSpec(
            name="fmnist-openset",
            description="ID: 6 Fashion-MNIST classes; OOD: test images of the other 4 (near-OOD).",
            label_names=tuple(fashion_mnist.LABEL_NAMES[c] for c in OPENSET_ID_CLASSES),
            id_arrays=_openset_id_arrays,
            ood_builders={"heldout_classes": _openset_ood},
            near_ood=("heldout_classes",),
        ),
    }
)

#: Every benchmark by name: the generated ones and the paper's Hub ones. Both kinds of spec have ``name``,
#: ``description`` and ``ood_builders`` (OOD split name -> builder).
BENCHMARKS: Mapping[str, BenchmarkSpec | HubBenchmarkSpec] = MappingProxyType({**GENERATED_BENCHMARKS, **HUB_BENCHMARKS})


def ood_groups(name: str) -> dict[str, list[str]]:
    """The OOD splits of benchmark ``name`` in each group of OpenOOD v1.5: ``{"near": [...], "far": [...]}``.

    Near-OOD sets share the ID data's style and differ by semantics (other classes of similar images); far-OOD
    sets differ by style or domain as well (digits, textures, scenes for natural-object ID data).
    """
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; registered: {sorted(BENCHMARKS)}")
    spec = BENCHMARKS[name]
    return {"near": list(spec.near_ood), "far": list(spec.far_ood)}


@functools.lru_cache(maxsize=4)
def _id_splits(name: str) -> datasets.DatasetDict:
    spec = GENERATED_BENCHMARKS[name]
    return datasets.DatasetDict(
        {
            split: to_dataset(arrays.images, arrays.labels, spec.label_names)
            for split, arrays in spec.id_arrays().items()
        }
    )


@functools.lru_cache(maxsize=16)
def _ood_split(name: str, split: str) -> datasets.Dataset:
    return GENERATED_BENCHMARKS[name].ood_builders[split]()


class LazySplits(Mapping):
    """A read-only mapping split name -> dataset that loads each split on first access (and keeps it)."""

    def __init__(self, builders: Mapping[str, Callable[[], Any]], loaded: Mapping[str, Any] | None = None) -> None:
        self._builders = builders
        self._loaded = dict(loaded or {})

    def __getitem__(self, split: str) -> Any:
        if split not in self._loaded:
            self._loaded[split] = self._builders[split]()
        return self._loaded[split]

    def __iter__(self) -> Iterator[str]:
        return iter(self._builders)

    def __len__(self) -> int:
        return len(self._builders)


def _load_hub_benchmark(spec: HubBenchmarkSpec, wanted: Sequence[str], streaming: bool) -> tuple[LazySplits, dict]:
    test = spec.id_builders["test"](streaming=streaming)  # always needed: the metrics, and the class names
    builders = {split: functools.partial(builder, streaming=streaming) for split, builder in spec.id_builders.items()}
    id_splits = LazySplits(builders, {"test": test})
    ood = {split: spec.ood_builders[split](streaming=streaming) for split in wanted}
    return id_splits, ood


def load_benchmark(
    name: str,
    ood_splits: Sequence[str] | None = None,
    extra_ood: Mapping[str, str | Path] | None = None,
    image_column: str | None = None,
    streaming: bool = False,
) -> Benchmark:
    """Load a registered benchmark.

    Args:
        name: a key of ``BENCHMARKS`` (``"fmnist-ood"``, ``"fmnist-openset"``, ``"cifar10-ood"``,
            ``"cifar100-ood"``, ``"imagenet-ood"``).
        ood_splits: which of the benchmark's OOD splits to build (default: all of them); each
            generated split takes a few seconds the first time, then is cached for the process.
        extra_ood: more OOD splits, name -> anything ``load_split`` accepts (a Hub
            ``"dataset_id[:config]:split"``, a local imagefolder or saved dataset folder).
        image_column: image column of the ``extra_ood`` datasets (auto-detected by default).
        streaming: read the Hub benchmarks' splits (and Hub ``extra_ood``) as ``datasets.IterableDataset``;
            refused for the generated benchmarks, which are built in memory.

    Returns:
        A ``Benchmark`` whose ``id_splits`` maps ``train``, ``validation``, ``test`` to datasets
        (a ``DatasetDict`` for the generated benchmarks) and ``ood_splits`` a mapping name -> dataset.

    Raises:
        KeyError: an unknown benchmark or OOD split name.
        ~hf_gsc.data.splits.GatedDatasetError: ``imagenet-ood`` without access to the gated ImageNet-1k.
    """
    if name not in BENCHMARKS:
        raise KeyError(f"unknown benchmark {name!r}; registered: {sorted(BENCHMARKS)}")
    spec = BENCHMARKS[name]
    wanted = list(spec.ood_builders) if ood_splits is None else list(ood_splits)
    unknown = [s for s in wanted if s not in spec.ood_builders]
    if unknown:
        raise KeyError(f"benchmark {name!r} has no OOD split {unknown}; it has {list(spec.ood_builders)}")
    if isinstance(spec, HubBenchmarkSpec):
        id_splits, ood = _load_hub_benchmark(spec, wanted, streaming)
        label_names = label_names_of(id_splits["test"], spec.num_labels, name)
    elif streaming:
        raise ValueError(
            f"benchmark {name!r} is generated on this machine, not read from the Hub: streaming applies to Hub "
            f"datasets only (the Hub benchmarks are {sorted(HUB_BENCHMARKS)})"
        )
    else:
        id_splits = _id_splits(name)
        ood = {split: _ood_split(name, split) for split in wanted}
        label_names = spec.label_names
    for split, source in (extra_ood or {}).items():
        if split in ood:
            raise ValueError(f"extra OOD split {split!r} would replace the benchmark's own split")
        ood[split] = load_split(source, image_column=image_column, streaming=streaming)
    return Benchmark(
        name=name,
        id_splits=id_splits,
        ood_splits=MappingProxyType(ood),
        num_labels=len(label_names),
        label_names=label_names,
    )
