"""The paper's benchmarks by name, read from Hugging Face Hub datasets: ``cifar10-ood``, ``cifar100-ood``,
``imagenet-ood``.

Each split is a :class:`HubSplit`: an exact Hub dataset id, split and column names (docs/data.md cites where each
id was found, with its licence). Calling a ``HubSplit`` loads it with :func:`~hf_gsc.data.splits.load_split`'s
machinery, as a ``Dataset`` or, with ``streaming=True``, an ``IterableDataset``, with the benchmark columns
``image`` and ``label`` (-1 on OOD splits).

OOD splits are grouped as OpenOOD v1.5 groups them (``near_ood``; the rest of a benchmark's OpenOOD sets are
far-OOD, see :func:`~hf_gsc.data.benchmarks.ood_groups`). Where OpenOOD evaluates a subset of a published set, its
image list is applied: a :class:`HubSplit` with ``image_list`` keeps only the rows whose image file is listed in
that file of OpenOOD's lists, as mirrored in :data:`OPENOOD_LISTS_REPO` (``splits.zip``).

The ID ``validation`` split (threshold calibration) must not overlap ``train`` (detector fits) nor ``test``
(metrics). The CIFAR repos have only ``train``/``test`` and ImageNet's ``validation`` is the paper's ID test set, so
``validation`` is carved out of ``train`` by content: a row belongs to it when the BLAKE2b hash of its encoded
image (its stored bytes) is 0 modulo ``HOLD_OUT_EVERY``. The rule does not depend on row order or sharding, so
streamed and downloaded copies, and every process of a distributed run, agree on it.
"""
from __future__ import annotations

import functools
import hashlib
import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

import datasets

from .splits import ScriptDatasetError, image_column_of, load_hub_split, to_benchmark_columns, with_ood_labels


#: One train row in this many (by content hash) is held out as the ID ``validation`` split.
HOLD_OUT_EVERY = 10

#: The Hub dataset holding OpenOOD v1.5's image lists (``splits.zip``: ``[splits/]<benchmark>/test_<set>.txt``,
#: one ``<relative image path> <label>`` per line), as the Torch-Uncertainty library reads them.
OPENOOD_LISTS_REPO = "torch-uncertainty/ood-datasets-splits"
OPENOOD_LISTS_FILE = "splits.zip"

#: Environment variable naming the ImageNet-1k copy to read instead of ``ILSVRC/imagenet-1k``: a Hub dataset id or
#: a local folder, either with ``train`` and ``validation`` splits and columns ``image`` and ``label`` (ClassLabel).
IMAGENET_ENV = "HF_GSC_IMAGENET"

Part = Literal["all", "held_out", "rest"]


@functools.lru_cache(maxsize=8)
def openood_image_list(member: str) -> frozenset[str]:
    """The relative image paths listed in ``member`` (e.g. ``"cifar10/test_tin.txt"``) of OpenOOD's image lists."""
    from huggingface_hub import hf_hub_download

    archive = hf_hub_download(OPENOOD_LISTS_REPO, OPENOOD_LISTS_FILE, repo_type="dataset")
    with zipfile.ZipFile(archive) as lists:
        names = [n for n in lists.namelist() if n == member or n.endswith("/" + member)]
        if not names:
            raise ValueError(f"OpenOOD image list {member!r} not found in {OPENOOD_LISTS_REPO}/{OPENOOD_LISTS_FILE}")
        text = lists.read(names[0]).decode()
    return frozenset(line.rsplit(maxsplit=1)[0] for line in text.splitlines() if line.strip())


def _relative_paths(path: str | None, depths: frozenset[int]) -> list[str]:
    """The trailing 1, 2, ... path components of an image's stored path (``zip://a/b.jpg::url`` when streamed from an
    archive, a local file path when downloaded), for matching against an image list's relative paths."""
    if not path:
        return []
    path = path.split("::", 1)[0].removeprefix("zip://").replace("\\", "/")
    parts = path.split("/")
    return ["/".join(parts[-depth:]) for depth in depths if depth <= len(parts)]


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
        image_list: keep only the rows whose image file is listed in this member of OpenOOD's image lists
            (:func:`openood_image_list`); for archives of image files, whose rows keep their file path.
        env: an environment variable that, when set, replaces ``dataset_id`` (a Hub id or a local folder).
        archive: the repo is an archive of image files (read by ``datasets``' image-folder loader); its folder
            names are not classes, so no label column is inferred from them.
    """

    dataset_id: str
    split: str
    image_column: str = "image"
    label_column: str | None = None
    config: str | None = None
    part: Part = "all"
    image_list: str | None = None
    env: str | None = None
    archive: bool = False

    @property
    def source(self) -> str:
        """The dataset id, or the value of ``env`` when that variable is set."""
        return (os.environ.get(self.env) or self.dataset_id) if self.env else self.dataset_id

    @property
    def spec(self) -> str:
        """The ``load_split`` spec of this split (before any ``part`` selection)."""
        return ":".join(p for p in (self.source, self.config, self.split) if p is not None)

    def __call__(self, streaming: bool = False) -> Any:
        """Load it: a ``Dataset`` (``IterableDataset`` when ``streaming``) with columns ``image`` and ``label``."""
        try:
            # A streamed archive gives each image's bytes but not its file name, which an image list selects by:
            # such a split is downloaded (the OpenOOD archives are at most a few hundred MB) and then streamed.
            dataset = load_hub_split(self.source, self.config, self.split, streaming=streaming and not self.image_list,
                                     **({"drop_labels": True} if self.archive else {}))
        except ScriptDatasetError as error:
            if self.env is None:
                raise
            raise ScriptDatasetError(f"{error}; then point {self.env} at it (a Hub id or a local folder with "
                                     f"splits {self.split!r} and columns {self.image_column!r}, "
                                     f"{self.label_column!r} as a ClassLabel)") from error.__cause__
        if self.image_list is not None:
            dataset = self._keep_listed(dataset)
        if self.part != "all":
            column = image_column_of(dataset, self.image_column)
            keep_held_out = self.part == "held_out"

            def keep(table: Any) -> list[bool]:
                return [is_held_out(image) == keep_held_out for image in table.column(column).to_pylist()]

            # Filtering Arrow batches reads the stored bytes without decoding any image (and, unlike a cast to
            # Image(decode=False) and back, leaves a streamed dataset decoding its images afterwards).
            dataset = dataset.with_format("arrow").filter(keep, batched=True).with_format(None)
        dataset = to_benchmark_columns(dataset, self.image_column, self.label_column, dataset_name=self.spec)
        dataset = dataset if self.label_column is not None else with_ood_labels(dataset)
        return dataset.to_iterable_dataset() if streaming and isinstance(dataset, datasets.Dataset) else dataset

    def _keep_listed(self, dataset: Any) -> Any:
        listed = openood_image_list(self.image_list)
        depths = frozenset(path.count("/") + 1 for path in listed)
        column = image_column_of(dataset, self.image_column)

        def keep(table: Any) -> list[bool]:
            return [any(p in listed for p in _relative_paths(image.get("path"), depths))
                    for image in table.column(column).to_pylist()]

        kept = dataset.with_format("arrow").filter(keep, batched=True).with_format(None)
        if isinstance(kept, datasets.Dataset) and len(kept) == 0:
            raise ValueError(f"{self.spec}: no image is listed in OpenOOD's {self.image_list!r} "
                             f"({OPENOOD_LISTS_REPO}); the archive's file names do not match the list")
        return kept


@dataclass(frozen=True)
class HubBenchmarkSpec:
    """A benchmark whose splits are Hub datasets; nothing is downloaded until it is loaded.

    ``id_builders`` maps ``train`` / ``validation`` / ``test`` and ``ood_builders`` each OOD split name to a
    :class:`HubSplit`. ``num_labels`` is checked against the ID test split's ``ClassLabel`` when loaded; the class
    names are read from it. ``near_ood`` and ``far_ood`` name the OOD splits of OpenOOD v1.5's near- and far-OOD
    groups; other OOD splits (the paper's sets OpenOOD does not use) belong to neither.
    """

    name: str
    description: str
    num_labels: int
    id_builders: Mapping[str, HubSplit]
    ood_builders: Mapping[str, HubSplit]
    near_ood: tuple[str, ...] = ()
    far_ood: tuple[str, ...] = ()


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


def _openood(repo: str, image_list: str) -> HubSplit:
    """An OpenOOD set stored as one archive of image files (read by ``datasets``' image-folder loader), restricted
    to the images of one of OpenOOD's lists."""
    return HubSplit(repo, "train", image_list=image_list, archive=True)


def _cifar_ood(id_name: str, other_cifar: str) -> Mapping[str, HubSplit]:
    """OpenOOD v1.5's near- and far-OOD sets of CIFAR-``id_name`` (``other_cifar``: the other CIFAR's test split),
    then the paper's sets OpenOOD does not use."""
    return MappingProxyType(
        {
            other_cifar.split("/")[1]: HubSplit(other_cifar, "test", "img"),
            "tin": _openood("torch-uncertainty/tiny-imagenet-200", f"{id_name}/test_tin.txt"),
            "mnist": HubSplit("ylecun/mnist", "train+test", config="mnist"),
            "svhn": HubSplit("ufldl-stanford/svhn", "test", config="cropped_digits"),
            "textures": _TEXTURES,
            "places365": _openood("torch-uncertainty/Places365", f"{id_name}/test_places365.txt"),
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
            description="ID: CIFAR-10; near-OOD: CIFAR-100, TinyImageNet; far-OOD: MNIST, SVHN, Textures, Places365 "
            "(OpenOOD v1.5); also LSUN-Crop, LSUN-Resize, iSUN (Hub datasets).",
            num_labels=10,
            id_builders=_cifar_id("uoft-cs/cifar10", "label"),
            ood_builders=_cifar_ood("cifar10", "uoft-cs/cifar100"),
            near_ood=("cifar100", "tin"),
            far_ood=("mnist", "svhn", "textures", "places365"),
        ),
        "cifar100-ood": HubBenchmarkSpec(
            name="cifar100-ood",
            description="ID: CIFAR-100 (fine labels); near-OOD: CIFAR-10, TinyImageNet; far-OOD: MNIST, SVHN, Textures, "
            "Places365 (OpenOOD v1.5); also LSUN-Crop, LSUN-Resize, iSUN (Hub datasets).",
            num_labels=100,
            id_builders=_cifar_id("uoft-cs/cifar100", "fine_label"),
            ood_builders=_cifar_ood("cifar100", "uoft-cs/cifar10"),
            near_ood=("cifar10", "tin"),
            far_ood=("mnist", "svhn", "textures", "places365"),
        ),
        "imagenet-ood": HubBenchmarkSpec(
            name="imagenet-ood",
            description="ID: ImageNet-1k (gated; test = its validation set); near-OOD: SSB-hard, NINCO; far-OOD: "
            "iNaturalist, Textures, OpenImage-O (OpenOOD v1.5; Hub datasets).",
            num_labels=1000,
            id_builders=MappingProxyType(
                {
                    "train": HubSplit(IMAGENET_ID, "train", "image", "label", part="rest", env=IMAGENET_ENV),
                    "validation": HubSplit(IMAGENET_ID, "train", "image", "label", part="held_out", env=IMAGENET_ENV),
                    "test": HubSplit(IMAGENET_ID, "validation", "image", "label", env=IMAGENET_ENV),
                }
            ),
            ood_builders=MappingProxyType(
                {
                    "ssb_hard": _openood("torch-uncertainty/SSB_hard", "imagenet1k/test_ssb_hard.txt"),
                    "ninco": _openood("torch-uncertainty/Ninco", "imagenet1k/test_ninco.txt"),
                    "inaturalist": HubSplit("torch-uncertainty/inaturalist", "train", archive=True),
                    "textures": _TEXTURES,
                    "openimage_o": _openood("torch-uncertainty/Openimage-O", "imagenet1k/test_openimage_o.txt"),
                }
            ),
            near_ood=("ssb_hard", "ninco"),
            far_ood=("inaturalist", "textures", "openimage_o"),
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
