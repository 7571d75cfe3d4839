"""The paper's benchmarks by name, read from Hugging Face Hub datasets: ``cifar10-ood``, ``cifar100-ood``,
``imagenet-ood``.

Each split is a :class:`HubSplit`: an exact Hub dataset id, split and column names (docs/data.md cites where each
id was found, with its licence). Calling a ``HubSplit`` loads it with :func:`~hf_gsc.data.splits.load_split`'s
machinery, as a ``Dataset`` or, with ``streaming=True``, an ``IterableDataset``, with the benchmark columns
``image`` and ``label`` (-1 on OOD splits).

The ID ``validation`` split (threshold calibration) must not overlap ``train`` (detector fits) nor ``test``
(metrics). The CIFAR repos have only ``train``/``test`` and ImageNet's ``validation`` is the paper's ID test set, so
``validation`` is carved out of ``train`` by content: a row belongs to it when the BLAKE2b hash of its encoded
image (its stored bytes) is 0 modulo ``HOLD_OUT_EVERY``. The rule does not depend on row order or sharding, so
streamed and downloaded copies, and every process of a distributed run, agree on it.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import datasets

from .splits import image_column_of, load_hub_split, to_benchmark_columns, with_ood_labels

#: One train row in this many (by content hash) is held out as the ID ``validation`` split.
HOLD_OUT_EVERY = 10

Part = Literal["all", "held_out", "rest"]


def is_held_out(image: Any, every: int = HOLD_OUT_EVERY) -> bool:
    """Whether a row, given its undecoded image (``{"bytes", "path"}``), is in the held-out part.

    The key is the stored image bytes; for a row that stores only a path, the file name (the directory differs
    between a downloaded and a streamed copy). The registered repos store bytes.
    """
    key = image["bytes"] if image.get("bytes") is not None else os.path.basename(str(image.get("path"))).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") % every == 0


@dataclass(frozen=True)
class HubSplit:
    """One split of a Hub dataset, and how it becomes a benchmark split.

    Attributes:
        dataset_id: exact Hub id (``namespace/name``).
        split: the Hub split; ``"a+b"`` joins splits.
        image_column: the dataset's image column.
        label_column: its integer label column for ID splits; ``None`` on OOD splits (``label`` becomes -1).
        config: the Hub config, ``None`` for the dataset's default one.
        part: ``"all"`` rows, or only the ``"held_out"`` rows / the ``"rest"`` (see the module docstring).
    """

    dataset_id: str
    split: str
    image_column: str = "image"
    label_column: str | None = None
    config: str | None = None
    part: Part = "all"

    @property
    def spec(self) -> str:
        """The ``load_split`` spec of this split (before any ``part`` selection)."""
        return ":".join(p for p in (self.dataset_id, self.config, self.split) if p is not None)

    def __call__(self, streaming: bool = False) -> Any:
        """Load it: a ``Dataset`` (``IterableDataset`` when ``streaming``) with columns ``image`` and ``label``."""
        dataset = load_hub_split(self.dataset_id, self.config, self.split, streaming=streaming)
        if self.part != "all":
            column = image_column_of(dataset, self.image_column)
            keep_held_out = self.part == "held_out"

            def keep(table: Any) -> list[bool]:
                return [is_held_out(image) == keep_held_out for image in table.column(column).to_pylist()]

            # Filtering Arrow batches reads the stored bytes without decoding any image (and, unlike a cast to
            # Image(decode=False) and back, leaves a streamed dataset decoding its images afterwards).
            dataset = dataset.with_format("arrow").filter(keep, batched=True).with_format(None)
        dataset = to_benchmark_columns(dataset, self.image_column, self.label_column, dataset_name=self.spec)
        return dataset if self.label_column is not None else with_ood_labels(dataset)


@dataclass(frozen=True)
class HubBenchmarkSpec:
    """A benchmark whose splits are Hub datasets; nothing is downloaded until it is loaded.

    ``id_builders`` maps ``train`` / ``validation`` / ``test`` and ``ood_builders`` each OOD split name to a
    :class:`HubSplit`. ``num_labels`` is checked against the ID test split's ``ClassLabel`` when loaded; the class
    names are read from it.
    """

    name: str
    description: str
    num_labels: int
    id_builders: Mapping[str, HubSplit]
    ood_builders: Mapping[str, HubSplit]


def _cifar_id(dataset_id: str, label_column: str) -> Mapping[str, HubSplit]:
    return MappingProxyType(
        {
            "train": HubSplit(dataset_id, "train", "img", label_column, part="rest"),
            "validation": HubSplit(dataset_id, "train", "img", label_column, part="held_out"),
            "test": HubSplit(dataset_id, "test", "img", label_column),
        }
    )


#: Textures: all 5,640 DTD images (its train and test splits), as in the CIFAR and ImageNet OOD benchmarks.
_TEXTURES = HubSplit("tanganke/dtd", "train+test")

#: The CIFAR OOD sets of the paper found on the Hub (not its 10,000-image Places365 subset: see docs/data.md).
_CIFAR_OOD = MappingProxyType(
    {
        "svhn": HubSplit("ufldl-stanford/svhn", "test", config="cropped_digits"),
        "textures": _TEXTURES,
        "lsun_crop": HubSplit("detectors/lsun_c-ood", "train"),
        "lsun_resize": HubSplit("detectors/lsun_r-ood", "train"),
        "isun": HubSplit("detectors/isun-ood", "train"),
    }
)

IMAGENET_ID = "ILSVRC/imagenet-1k"

HUB_BENCHMARKS: Mapping[str, HubBenchmarkSpec] = MappingProxyType(
    {
        "cifar10-ood": HubBenchmarkSpec(
            name="cifar10-ood",
            description="ID: CIFAR-10; OOD: SVHN, Textures, LSUN-Crop, LSUN-Resize, iSUN (Hub datasets).",
            num_labels=10,
            id_builders=_cifar_id("uoft-cs/cifar10", "label"),
            ood_builders=_CIFAR_OOD,
        ),
        "cifar100-ood": HubBenchmarkSpec(
            name="cifar100-ood",
            description="ID: CIFAR-100 (fine labels); OOD: SVHN, Textures, LSUN-Crop, LSUN-Resize, iSUN (Hub datasets).",
            num_labels=100,
            id_builders=_cifar_id("uoft-cs/cifar100", "fine_label"),
            ood_builders=_CIFAR_OOD,
        ),
        "imagenet-ood": HubBenchmarkSpec(
            name="imagenet-ood",
            description="ID: ImageNet-1k (gated; test = its validation set); OOD: iNaturalist, Textures (Hub datasets).",
            num_labels=1000,
            id_builders=MappingProxyType(
                {
                    "train": HubSplit(IMAGENET_ID, "train", "image", "label", part="rest"),
                    "validation": HubSplit(IMAGENET_ID, "train", "image", "label", part="held_out"),
                    "test": HubSplit(IMAGENET_ID, "validation", "image", "label"),
                }
            ),
            ood_builders=MappingProxyType(
                {"inaturalist": HubSplit("torch-uncertainty/inaturalist", "train"), "textures": _TEXTURES}
            ),
        ),
    }
)


def label_names_of(dataset: Any, num_labels: int, benchmark: str) -> tuple[str, ...]:
    """Class names from the ``label`` ``ClassLabel`` of an ID split, checked to be ``num_labels`` of them."""
    feature = dataset.features["label"]
    if not isinstance(feature, datasets.ClassLabel) or feature.num_classes != num_labels:
        raise ValueError(
            f"benchmark {benchmark!r}: expected the ID label column to be a ClassLabel of {num_labels} classes, "
            f"got {feature}"
        )
    return tuple(feature.names)
