"""Loading any one split as a benchmark-shaped ``datasets.Dataset`` (columns ``image``, ``label``).

Accepted specs:

* ``"dataset_id:split"`` or ``"dataset_id:config:split"`` -- a Hub dataset (needs network or the
  local HF cache), e.g. ``"cifar10:test"`` or ``"zalando-datasets/fashion_mnist:test"``;
* a local folder of images (``imagefolder``: images directly inside, or in one sub-folder per
  class), optionally followed by ``":split"`` when it has ``train`` / ``test`` sub-folders;
* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.

The image column is the one named, else the first ``datasets.Image`` column, else a column called
``image`` / ``img``. The result keeps only ``image`` and ``label``; ``label`` is the dataset's
integer label column when it has one and -1 otherwise (OOD data has no ID label).
"""
from __future__ import annotations

from pathlib import Path

import datasets

_IMAGE_NAMES = ("image", "img", "images", "picture")
_LABEL_NAMES = ("label", "labels", "fine_label", "class", "target")


def parse_spec(spec: str) -> tuple[str, str | None, str | None]:
    """``"id[:config]:split"`` -> (id, config, split); a bare ``"id"`` gives (id, None, None)."""
    parts = spec.split(":")
    if len(parts) == 1:
        return parts[0], None, None
    if len(parts) == 2:
        return parts[0], None, parts[1]
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    raise ValueError(f"cannot parse {spec!r}: expected 'dataset_id[:config]:split'")


def _local_path_and_split(spec: str | Path) -> tuple[Path, str | None] | None:
    path = Path(spec)
    if path.exists():
        return path, None
    if isinstance(spec, str) and ":" in spec:
        head, split = spec.rsplit(":", 1)
        if Path(head).exists():
            return Path(head), split
    return None


def _pick_split(loaded: datasets.Dataset | datasets.DatasetDict, split: str | None, spec: str) -> datasets.Dataset:
    if isinstance(loaded, datasets.Dataset):
        return loaded
    if split is None:
        if len(loaded) == 1:
            return next(iter(loaded.values()))
        raise ValueError(f"{spec!r} has splits {sorted(loaded)}: append ':split' to choose one")
    if split not in loaded:
        raise ValueError(f"{spec!r} has no split {split!r}; it has {sorted(loaded)}")
    return loaded[split]


def _load_local(path: Path, split: str | None, spec: str) -> datasets.Dataset:
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        return _pick_split(datasets.load_from_disk(str(path)), split, spec)
    if path.is_dir():
        return _pick_split(datasets.load_dataset("imagefolder", data_dir=str(path)), split, spec)
    raise ValueError(f"{spec!r} is a file; give a folder of images or a saved dataset folder")


def image_column_of(dataset: datasets.Dataset, image_column: str | None = None) -> str:
    """The named column if given (checked), else the first ``datasets.Image`` column, else a column
    with a usual image name; raises naming the columns when there is none."""
    if image_column is not None:
        if image_column not in dataset.column_names:
            raise ValueError(f"no column {image_column!r}; columns are {dataset.column_names}")
        return image_column
    for name, feature in dataset.features.items():
        if isinstance(feature, datasets.Image):
            return name
    for name in _IMAGE_NAMES:
        if name in dataset.column_names:
            return name
    raise ValueError(f"no image column found among {dataset.column_names}; pass image_column=")


def _label_column_of(dataset: datasets.Dataset, label_column: str | None) -> str | None:
    if label_column is not None:
        return label_column
    for name in _LABEL_NAMES:
        feature = dataset.features.get(name)
        if isinstance(feature, datasets.ClassLabel) or (
            isinstance(feature, datasets.Value) and feature.dtype.startswith("int")
        ):
            return name
    return None


def to_benchmark_columns(
    dataset: datasets.Dataset, image_column: str | None = None, label_column: str | None = None
) -> datasets.Dataset:
    """Keep only ``image`` (as ``datasets.Image``) and ``label`` (int; -1 when there is none)."""
    image_col = image_column_of(dataset, image_column)
    label_col = _label_column_of(dataset, label_column)
    keep = [image_col] + ([label_col] if label_col else [])
    dataset = dataset.select_columns(keep)
    if image_col != "image":
        dataset = dataset.rename_column(image_col, "image")
    if not isinstance(dataset.features["image"], datasets.Image):
        dataset = dataset.cast_column("image", datasets.Image())
    if label_col is None:
        dataset = dataset.add_column("label", [-1] * len(dataset))
    elif label_col != "label":
        dataset = dataset.rename_column(label_col, "label")
    return dataset


def load_split(
    spec: str | Path, image_column: str | None = None, label_column: str | None = None
) -> datasets.Dataset:
    """Load one split (see the module docstring for ``spec``) with columns ``image``, ``label``."""
    local = _local_path_and_split(spec)
    if local is not None:
        dataset = _load_local(local[0], local[1], str(spec))
    else:
        dataset_id, config, split = parse_spec(str(spec))
        if split is None:
            raise ValueError(f"{spec!r}: give the split too, as 'dataset_id[:config]:split'")
        dataset = datasets.load_dataset(dataset_id, config, split=split)
    return to_benchmark_columns(dataset, image_column, label_column)
