"""Loading any one split as a benchmark-shaped dataset (columns ``image``, ``label``).

Accepted specs:

* ``"dataset_id:split"`` or ``"dataset_id:config:split"`` -- a Hub dataset (needs network or the
  local HF cache), e.g. ``"uoft-cs/cifar10:test"`` or ``"ufldl-stanford/svhn:cropped_digits:test"``;
  ``"train+test"`` joins splits;
* a local folder of images (``imagefolder``: images directly inside, or in one sub-folder per
  class), optionally followed by ``":split"`` when it has ``train`` / ``test`` sub-folders;
* a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.

The image and label columns are the ones named, else found by type (:mod:`hf_gsc.utils.dataset_columns`: the one
``datasets.Image`` column, the one ``datasets.ClassLabel`` column; several of a type are refused, listing the
columns). The result keeps only ``image`` and ``label``; ``label`` is -1 where the dataset has no label column (OOD
data has no ID label), which ID data (``need_labels``) refuses instead.

``streaming=True`` (Hub datasets only) gives a ``datasets.IterableDataset`` with the same columns: rows are read
as they are iterated, nothing is downloaded or decoded up front. A local folder is already read in place (images
are opened one batch at a time, saved datasets are memory-mapped), so streaming it gains nothing and is refused.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import datasets
from huggingface_hub.errors import GatedRepoError

from ..utils import dataset_columns
from ..utils.progress import datasets_progress_bars_off
from .decoding import check_image_column


#: The one-line refusal of ``streaming=True`` for a local folder.
LOCAL_STREAMING_ERROR = "--streaming needs a Hub dataset id; local folders are read in place anyway"


class GatedDatasetError(PermissionError):
    """A gated Hub dataset refused access; the message says how to get it."""


class ScriptDatasetError(ValueError):
    """A Hub dataset stored as a loading script, which ``datasets`` 4 refuses; the message says what to use."""


def _is_script_refusal(error: BaseException | None) -> bool:
    while error is not None:
        text = str(error)
        if "scripts are no longer supported" in text or "trust_remote_code" in text:
            return True
        error = error.__cause__ or error.__context__
    return False


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


def looks_like_path(spec: str) -> bool:
    """Whether ``spec`` can only mean a local path: absolute, or starting with ``./``, ``../`` or ``~``."""
    return os.path.isabs(spec) or spec in (".", "..") or spec.startswith(("./", "../", "~", ".\\", "..\\"))


def missing_local_folder(spec: str | Path, split_required: bool = True) -> str | None:
    """The folder ``spec`` names when it can only be a local one and does not exist; ``None`` otherwise.

    ``spec`` can only be local when it looks like a path (:func:`looks_like_path`) or, with ``split_required``
    (one split, as :func:`load_split` reads it), when it has no ``:split``, which every Hub spec needs.
    """
    if _local_path_and_split(spec) is not None:
        return None
    spec = str(spec)
    head = spec.rsplit(":", 1)[0] if ":" in spec and looks_like_path(spec) else spec
    if looks_like_path(spec) or (split_required and ":" not in spec):
        return head
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
        with datasets_progress_bars_off():
            return _pick_split(datasets.load_from_disk(str(path)), split, spec)
    if path.is_dir():
        # Listing and "Generating train split" of a local folder announce nothing the user needs on every run
        with datasets_progress_bars_off():
            loaded = datasets.load_dataset("imagefolder", data_dir=str(path))
        return _pick_split(loaded, split, spec)
    raise ValueError(f"{spec!r} is a file; give a folder of images or a saved dataset folder")


def _is_gated_refusal(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, GatedRepoError) or "gated dataset" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def load_hub_split(dataset_id: str, config: str | None, split: str, streaming: bool = False, **load_kwargs: Any) -> Any:
    """``datasets.load_dataset(dataset_id, config, split=..., **load_kwargs)``; ``"a+b"`` concatenates splits (also
    streamed).

    Raises:
        GatedDatasetError: when the dataset is gated and this user has no access, saying how to get it.
        ScriptDatasetError: when the dataset is a loading script (refused by ``datasets`` 4).
    """
    try:
        parts = [datasets.load_dataset(dataset_id, config, split=part, streaming=streaming, **load_kwargs)
                 for part in split.split("+")]
    except Exception as error:
        if _is_gated_refusal(error):
            raise GatedDatasetError(
                f"the Hub dataset {dataset_id!r} is gated and refused access: accept its terms on "
                f"https://huggingface.co/datasets/{dataset_id} while logged in, then authenticate here with "
                "`huggingface-cli login` (or set HF_TOKEN to a token of that account)"
            ) from error
        if _is_script_refusal(error):
            raise ScriptDatasetError(
                f"the Hub dataset {dataset_id!r} is stored as a loading script, which datasets "
                f"{datasets.__version__} does not run: use a copy of it stored as data files (parquet, or an image "
                "folder) with the same splits and columns, from the Hub or a local folder"
            ) from error
        raise
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def image_column_of(dataset: Any, image_column: str | None = None, dataset_name: str | None = None) -> str:
    """The named column if given (checked), else the one ``datasets.Image`` column, else a column with a usual image
    name (:func:`hf_gsc.utils.dataset_columns.image_column_of`); raises naming the columns and their types."""
    what = "the dataset" if dataset_name is None else f"dataset {dataset_name!r}"
    return dataset_columns.image_column_of(dataset, image_column, what, keyword="image_column= (--image-column)")


def with_ood_labels(dataset: Any) -> Any:
    """``dataset`` with its ``label`` column (if any) replaced by -1 (int64) on every row: OOD data has no ID
    label. Works on ``Dataset`` and ``IterableDataset``."""
    if "label" in dataset.column_names:
        dataset = dataset.remove_columns("label")
    if isinstance(dataset, datasets.Dataset):
        return dataset.add_column("label", [-1] * len(dataset), feature=datasets.Value("int64"))
    features = datasets.Features({**dataset.features, "label": datasets.Value("int64")})
    return dataset.map(lambda _: {"label": -1}, features=features)


def to_benchmark_columns(
    dataset: Any, image_column: str | None = None, label_column: str | None = None, dataset_name: str = "dataset",
    need_labels: bool = False,
) -> Any:
    """Keep only ``image`` (as ``datasets.Image``) and ``label`` (int; -1 when there is none).

    The columns are the named ones, else found by type (:mod:`hf_gsc.utils.dataset_columns`: the one ``Image``
    column, the one ``ClassLabel`` column). ``need_labels`` (ID data, whose labels the accuracy and the per-class fits
    read): a dataset without a label column, or with several ``ClassLabel`` columns and none named, is refused here
    rather than given labels of -1. A label column of class-name strings becomes a ``ClassLabel`` (its names sorted),
    mapped to the model's classes by name like class folders.

    Works on ``Dataset`` and ``IterableDataset``. A column that cannot hold images (text that is not file paths,
    numbers) is refused here, naming ``dataset_name`` (see :func:`~hf_gsc.data.decoding.check_image_column`).
    """
    if dataset.features is None:
        raise ValueError(f"dataset {dataset_name!r} does not declare its columns' types; cannot find its images")
    image_col = image_column_of(dataset, image_column, dataset_name)
    check_image_column(dataset, dataset_name, image_col)
    label_col = dataset_columns.label_column_of(dataset, label_column, f"dataset {dataset_name!r}",
                                                keyword="label_column= (--label-column)", required=need_labels)
    if label_col is not None:
        _check_label_column(dataset, label_col, dataset_name)
    keep = [image_col] + ([label_col] if label_col else [])
    dataset = dataset.select_columns(keep)
    if image_col != "image":
        dataset = dataset.rename_column(image_col, "image")
    if not isinstance(dataset.features["image"], datasets.Image):
        dataset = dataset.cast_column("image", datasets.Image())
    if label_col is None:
        return with_ood_labels(dataset)
    if label_col != "label":
        dataset = dataset.rename_column(label_col, "label")
    if _is_text(dataset.features["label"]) and isinstance(dataset, datasets.Dataset):
        dataset = dataset.class_encode_column("label")  # class names -> a ClassLabel, mapped by name later
    return dataset


def _is_text(feature: Any) -> bool:
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def _check_label_column(dataset: Any, column: str, dataset_name: str) -> None:
    """A label column holds class indices (``ClassLabel`` or integers) or class names (text); anything else (floats,
    lists, images) is refused, naming the column and its type."""
    feature = dataset.features.get(column)
    if isinstance(feature, datasets.ClassLabel) or _is_text(feature) or (
            isinstance(feature, datasets.Value) and feature.dtype.startswith(("int", "uint"))):
        return
    raise ValueError(f"dataset {dataset_name!r}: the label column {column!r} holds "
                     f"{dataset_columns.column_types(dataset.select_columns([column]))}, not class labels (expected "
                     "a ClassLabel, integer class indices or class-name strings)")


def load_split(
    spec: str | Path, image_column: str | None = None, label_column: str | None = None, streaming: bool = False,
    need_labels: bool = False,
) -> Any:
    """Load one split (see the module docstring for ``spec``) with columns ``image``, ``label``.

    ``image_column`` / ``label_column``: the dataset's columns (default: found by type,
    :mod:`hf_gsc.utils.dataset_columns`). ``need_labels``: ID data whose labels are read; one without a label column
    is refused (see :func:`to_benchmark_columns`).

    Returns a ``datasets.Dataset``, or with ``streaming=True`` a ``datasets.IterableDataset`` (Hub ids only).

    Raises:
        FileNotFoundError: ``spec`` can only be a local folder (see :func:`missing_local_folder`) and there is none.
        ValueError: an unparsable spec, a missing split or column, a column that cannot hold images, or
            ``streaming=True`` with a local folder.
        GatedDatasetError: a gated Hub dataset this user may not read.
    """
    missing = missing_local_folder(spec)
    if missing is not None:
        raise FileNotFoundError(f"no such folder: {missing!r} (a local split is a folder of images or a saved "
                                "dataset; a Hub split is 'dataset_id[:config]:split')")
    local = _local_path_and_split(spec)
    if local is not None:
        if streaming:
            raise ValueError(f"{LOCAL_STREAMING_ERROR} (got the local path {str(spec)!r})")
        dataset = _load_local(local[0], local[1], str(spec))
    else:
        dataset_id, config, split = parse_spec(str(spec))
        if split is None:
            raise ValueError(f"{spec!r}: give the split too, as 'dataset_id[:config]:split'")
        dataset = load_hub_split(dataset_id, config, split, streaming=streaming)
    return to_benchmark_columns(dataset, image_column, label_column, dataset_name=str(spec), need_labels=need_labels)
