"""Which images (and labels) a user's data holds, for ``fit`` and ``calibrate``: files, folders, dataset roots,
``datasets`` objects, PIL and NumPy images.

* A **dataset root** (a folder with ``train/``, ``validation/``, ``test/`` sub-folders, a folder written by
  ``DatasetDict.save_to_disk``, or a ``datasets.DatasetDict``) is read at one split only: the one the caller names
  (``fit``: the detector's ``fit_split``; ``calibrate``: validation). The split read is logged in one line; a root
  without that split is refused, naming it; a test split is never read.
* **Labels** are the model's class indices: a class-folder tree's folder names, a ``ClassLabel`` column's names, or
  a column of class-name strings, each mapped to the model's ``id2label`` by the one rule of
  :mod:`hf_gsc.utils.label_names` (a name the model gives two classes is refused where labels are needed). The
  columns of a ``datasets.Dataset`` are found by type unless named (:mod:`hf_gsc.utils.dataset_columns`).
* A ``datasets`` image column is read undecoded (``{"bytes", "path"}``) so that :func:`hf_gsc.utils.images.load_image`,
  the decoding rule of every entry point, decodes it, and an unreadable image is named by its row and file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from .dataset_columns import image_column_of, label_column_of
from .images import describe
from .label_names import (
    ambiguous_names,
    ambiguous_names_error,
    generic_labels,
    generic_labels_error,
    label_mapping,
    name_key,
)
from .progress import datasets_progress_bars_off


logger = logging.getLogger(__name__)

#: File extensions read as images when a folder is given.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
#: Folder names of a dataset root's splits (as ``datasets``' image-folder loader names them), by split.
SPLIT_FOLDERS: dict[str, tuple[str, ...]] = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval"),
}


@dataclass(frozen=True)
class ImageRows:
    """Images to prepare, and their labels (model class indices, or ``None`` when unknown).

    ``sources`` is a list of inputs :func:`hf_gsc.utils.images.load_image` takes, or (``column`` set) a
    ``datasets.Dataset`` whose ``column`` holds undecoded cells, read a chunk at a time.
    """

    sources: Any
    labels: list[int] | None
    origin: str  # how the data is named in messages: "id_validation_data", "the 'validation' split of photos"
    column: str | None = None
    #: What was read, for records: "folder /abs/path", "split 'validation' of dataset root /abs/path",
    #: "datasets.Dataset (N rows)", "3 images given by the caller".
    source: str = ""
    #: The split chosen from a dataset root by :func:`select_split`; ``None`` when the data was read as given.
    split: str | None = None

    def __len__(self) -> int:
        return len(self.sources)

    def chunk(self, start: int, stop: int) -> list[tuple[Any, str]]:
        """``(source, name)`` of rows ``start`` to ``stop``; ``name`` says where a row comes from, for errors."""
        if self.column is None:
            return [(source, describe(source) if isinstance(source, (str, os.PathLike))
                     else f"{self.origin}, item {start + i} ({describe(source)})")
                    for i, source in enumerate(self.sources[start:stop])]
        cells = self.sources[start:stop][self.column]
        return [(cell, f"{self.origin}, row {start + i}" + (f" (file {cell['path']})" if isinstance(cell, dict)
                                                            and cell.get("path") else ""))
                for i, cell in enumerate(cells)]


# ----------------------------------------------------------------------------- labels by name
def labels_by_name(names: list[str], label2id: Mapping[str, int] | None) -> list[int] | None:
    """The model's class index of each class name (``label2id``), when every name is one of the model's labels (in
    any order); ``None`` otherwise (the names cannot be mapped: the labels stay unknown)."""
    if not label2id or not names or any(name not in label2id for name in names):
        return None
    return [int(label2id[name]) for name in names]


def class_label_mapping(names: list[str], label2id: Mapping[str, int] | None,
                        model_names: Sequence[str] | None = None) -> list[int] | None:
    """The model's class index of each class name of a dataset, when every name is one of the model's labels (in any
    order), compared as the evaluation compares them (:func:`hf_gsc.utils.label_names.name_key`: ignoring case, ``_`` /
    ``-`` versus spaces): data that ``hf-gsc evaluate`` maps by name is fitted with the same labels. ``None``
    otherwise (an unknown name, or one that names two of the model's labels).

    ``model_names``: the model's class names in index order (``config.id2label``), which unlike ``label2id`` keeps a
    name the model gives two classes (ImageNet-1k's ``crane``); given, the mapping is read from it."""
    if model_names is not None:
        return label_mapping(list(map(str, names)), list(map(str, model_names))) if names else None
    exact = labels_by_name(names, label2id)
    if exact is not None or not label2id or not names:
        return exact
    indices = {int(index) for index in label2id.values()}
    if indices != set(range(len(label2id))):  # not one name per class index: nothing to compare in index order
        return None
    model_names = [""] * len(label2id)
    for label, index in label2id.items():
        model_names[int(index)] = str(label)
    return label_mapping(list(map(str, names)), model_names)


def unknown_names(names: list[str], label2id: Mapping[str, int] | None, key: Any = str) -> str:
    """The names of ``names`` that are not the model's labels (compared as ``key(name)``), and the model's labels, for
    an error message."""
    known = sorted(label2id or {}, key=lambda label: (label2id or {})[label])
    keys = {key(label) for label in label2id or {}}
    unknown = [label for label in names if key(label) not in keys]
    shown = ", ".join(repr(label) for label in known[:20]) + (", ..." if len(known) > 20 else "")
    return f"{', '.join(repr(label) for label in unknown[:10])} are not among the model's labels (config.label2id: {shown})"


def _refuse_ambiguous(name: str, names: Sequence[str], model_names: Sequence[str] | None, need_labels: bool) -> None:
    """A class of the data whose name the model gives several classes (ImageNet-1k's ``crane``) cannot be labelled:
    refused, naming the classes, where labels are needed."""
    ambiguous = ambiguous_names(list(map(str, names)), list(map(str, model_names))) if need_labels and model_names else {}
    if ambiguous:
        raise ValueError(f"{name}: {ambiguous_names_error(ambiguous, list(map(str, model_names or [])))}")


def _shares_a_name(names: Iterable[str], label2id: Mapping[str, int]) -> bool:
    """Whether one of ``names`` is one of the model's labels, compared as :func:`class_label_mapping` compares them."""
    keys = {name_key(label) for label in label2id}
    return any(name_key(name) in keys for name in names)


# ----------------------------------------------------------------------------- dataset roots and splits
def _is_dataset_dict(data: Any) -> bool:
    return isinstance(data, dict) and bool(data) and all(hasattr(value, "column_names") for value in data.values())


def _split_folders(path: Path) -> dict[str, Path]:
    """A dataset root's split folders by split: ``{}`` for a folder that is no root, one with a sub-folder that names
    no split (a class-folder tree with a class called ``test`` stays a class-folder tree)."""
    found: dict[str, Path] = {}
    for child in sorted(child for child in path.iterdir() if child.is_dir()):
        split = next((split for split, names in SPLIT_FOLDERS.items() if child.name.lower() in names), None)
        if split is None:
            return {}
        found.setdefault(split, child)
    return found


#: The call each data parameter belongs to: the name the console lines give it.
_CALLS = {"id_train_batches": "fit", "id_validation_data": "calibrate"}


class Selected(NamedTuple):
    """What :func:`select_split` chose: the data to read, how to name it in messages, and for records the sentence
    of what it is (``""``: the data as given, described by its reader) and the split chosen from a root."""

    data: Any
    name: str
    source: str = ""
    split: str | None = None


def select_split(data: Any, split: str | None, name: str) -> Selected:
    """``(the data of split, how to name it, what it is, split)`` when ``data`` is a dataset root; ``(data, name)``
    otherwise.

    ``split=None`` (a caller that reads whatever it is given) refuses a root: it would read every split, test too.

    Raises:
        ValueError: ``split`` is ``"test"``, the root has no such split (naming it and the root's splits), or a
            root is given where no split is chosen.
    """
    if split is not None and split in SPLIT_FOLDERS["test"]:
        raise ValueError(f"{name}: split={split!r}: fit and calibrate never read a test split; pass ID train or "
                         "validation data")
    if _is_dataset_dict(data):
        splits, label, root = dict(data), "the DatasetDict", "a DatasetDict given by the caller"
    elif isinstance(data, (str, os.PathLike)) and Path(data).is_dir():
        path = Path(data)
        if (path / "dataset_dict.json").is_file():
            import datasets

            with datasets_progress_bars_off():
                splits, root = dict(datasets.load_from_disk(str(path))), f"dataset root {path.resolve()}"
        elif (path / "dataset_info.json").is_file():
            import datasets

            with datasets_progress_bars_off():
                dataset = datasets.load_from_disk(str(path))
            return Selected(dataset, f"{name} (the dataset saved in {path})",
                            f"datasets.Dataset saved in {path.resolve()} ({len(dataset)} rows)")
        else:
            splits, root = _split_folders(path), f"dataset root {path.resolve()}"
            if not splits:
                return Selected(data, name)
        label = str(path)
    else:
        return Selected(data, name)
    if split is None:
        raise ValueError(f"{name}: {label} is a dataset root with the splits {sorted(splits)}; pass one split's data "
                         "(fit and calibrate read one split, and never test)")
    chosen = splits.get(split)
    if chosen is None:
        aliases = SPLIT_FOLDERS.get(split, (split,))
        chosen = next((value for key, value in splits.items() if str(key).lower() in aliases), None)
    if chosen is None:
        raise ValueError(f"{name}: {label} has no {split!r} split (it has {sorted(map(str, splits))}); this reads "
                         f"the {split!r} split of a dataset root and never test: add it, or pass the {split} data "
                         "itself")
    where = f" ({chosen})" if isinstance(chosen, Path) else ""
    # The console line names what the user called (fit, calibrate), not the parameter the data came in.
    logger.warning("%s: reading the %r split of %s%s; its other splits are not read", _CALLS.get(name, name), split,
                   label, where)
    return Selected(chosen, f"the {split!r} split of {label}", f"split {split!r} of {root}", split)


# ----------------------------------------------------------------------------- images and labels
def _dataset_rows(data: Any, name: str, label2id: Mapping[str, int] | None, need_labels: bool,
                  image_column: str | None, label_column: str | None,
                  model_names: Sequence[str] | None = None) -> ImageRows:
    import datasets

    columns = list(data.column_names)
    image_column = image_column_of(data, image_column, f"{name}: the dataset")
    label_column = label_column_of(data, label_column, f"{name}: the dataset", required=need_labels)
    feature = data.features.get(image_column)
    if isinstance(feature, datasets.Image) and feature.decode:
        # decoded by hf_gsc.utils.images (EXIF, bit depth, alpha as every entry point), not by datasets
        data = data.cast_column(image_column, datasets.Image(decode=False))
    labels = None if label_column is None else list(data[label_column])
    label_feature = data.features.get(label_column) if label_column else None
    class_names = getattr(label_feature, "names", None)
    if labels is not None and class_names is None and any(isinstance(label, str) for label in labels):
        class_names = sorted({label for label in labels if isinstance(label, str)})
        index = {label: i for i, label in enumerate(class_names)}
        _refuse_ambiguous(name, class_names, model_names, need_labels)
        mapping = class_label_mapping(class_names, label2id, model_names)
        if mapping is None:
            if need_labels and generic_labels(label2id):
                raise ValueError(f"{name}: the label column {label_column!r}: "
                                 f"{generic_labels_error(class_names, list(label2id or {}))}")
            if need_labels:
                raise ValueError(f"{name}: the label column {label_column!r} holds class names that cannot be mapped "
                                 f"to the model's labels: {unknown_names(class_names, label2id, key=name_key)}")
            labels = None
        else:
            labels = [mapping[index[label]] if isinstance(label, str) else -1 for label in labels]
        class_names = None
    mapping = None
    if class_names and labels is not None:
        _refuse_ambiguous(name, list(class_names), model_names, need_labels)
        mapping = class_label_mapping(list(class_names), label2id, model_names)
        if mapping is not None:
            labels = [mapping[label] if label >= 0 else label for label in labels]
    if mapping is None and need_labels:
        if class_names and generic_labels(label2id):
            raise ValueError(f"{name}: {generic_labels_error(list(class_names), list(label2id or {}))}")
        if class_names and label2id and _shares_a_name(class_names, label2id):
            # Some names match and some do not: the dataset's indices are not the model's, and no order is safe.
            raise ValueError(f"{name}: the dataset's class names cannot be mapped to the model's labels: "
                             f"{unknown_names(list(class_names), label2id, key=name_key)}")
        if labels is None:
            raise ValueError(f"{name}: the dataset has no 'label' column, and this method fits per-class statistics "
                             f"(columns: {', '.join(columns)}; name another with label_column=)")
    return ImageRows(data, labels, name, column=image_column)


def _folder_rows(path: Path, name: str, label2id: Mapping[str, int] | None, need_labels: bool,
                 model_names: Sequence[str] | None = None) -> ImageRows:
    files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    if not files:
        raise ValueError(f"{name}: the folder {path} holds no image files ({', '.join(IMAGE_EXTENSIONS)})")
    folders = sorted({file.relative_to(path).parts[0] for file in files if len(file.relative_to(path).parts) == 2})
    nested = all(len(file.relative_to(path).parts) == 2 for file in files)
    if nested:
        _refuse_ambiguous(name, folders, model_names, need_labels)
    mapping = class_label_mapping(folders, label2id, model_names) if nested else None
    if mapping is not None:  # a class-folder tree: labels by name, compared as the evaluation compares them
        index = dict(zip(folders, mapping))
        return ImageRows(files, [index[file.relative_to(path).parts[0]] for file in files], name)
    if need_labels and not nested:
        raise ValueError(f"{name}: this method fits per-class statistics, and {path} is not a class-folder "
                         "tree (one folder per class named as the model's label, its images directly inside)")
    if need_labels and generic_labels(label2id):
        raise ValueError(f"{name}: the class folders of {path}: {generic_labels_error(folders, list(label2id or {}))}")
    if need_labels:
        raise ValueError(f"{name}: the class folders of {path} must be named as the model's labels: "
                         f"{unknown_names(folders, label2id, key=name_key)}")
    return ImageRows(files, None, name)


def _is_image(item: Any) -> bool:
    import numpy as np
    from PIL import Image

    return isinstance(item, (Image.Image, str, os.PathLike)) or (isinstance(item, np.ndarray) and item.ndim in (2, 3))


def image_rows(data: Any, name: str, label2id: Mapping[str, int] | Sequence[str] | None = None,
               need_labels: bool = False, split: str | None = None, image_column: str | None = None,
               label_column: str | None = None) -> ImageRows | None:
    """The images (and labels) ``data`` holds, or ``None`` when it holds ``pixel_values`` batches instead.

    ``label2id``: the model's classes, as ``config.label2id`` or (better) the names of ``config.id2label`` in index
    order (:func:`~hf_gsc.utils.label_names.model_label_names`), which keeps a name given to two classes (ImageNet-1k's
    ``crane``, 134 and 517), so that data using it is refused instead of labelled with one of them.
    ``split``: the split read from a dataset root (:func:`select_split`). ``image_column`` / ``label_column``: the
    columns of a ``datasets.Dataset`` (by default found by type: :mod:`hf_gsc.utils.dataset_columns`). With
    ``need_labels`` (a method fits per-class statistics), images that cannot be labelled are a ``ValueError`` naming
    the names that do not match, here, before any image is read.
    """
    if isinstance(data, ImageRows):
        return data
    model_names = None
    if label2id is not None and not isinstance(label2id, Mapping):
        model_names = [str(label) for label in label2id]
        label2id = {label: index for index, label in reversed(list(enumerate(model_names)))}
    selected = select_split(data, split, name)
    rows = _rows(selected.data, selected.name, label2id, need_labels, image_column, label_column, model_names)
    if rows is None:
        return None
    if selected.source:
        return replace(rows, source=selected.source, split=selected.split)
    return rows


def _rows(data: Any, name: str, label2id: Mapping[str, int] | None, need_labels: bool, image_column: str | None,
          label_column: str | None, model_names: Sequence[str] | None = None) -> ImageRows | None:
    """:func:`image_rows` of data that is no dataset root, each described by what it is (``source``)."""
    if (image_column is not None or label_column is not None) and getattr(data, "column_names", None) is None:
        raise ValueError(f"{name}: image_column / label_column name columns of a datasets.Dataset; got "
                         f"{type(data).__name__}")
    if getattr(data, "column_names", None) is not None:  # a datasets.Dataset
        rows = _dataset_rows(data, name, label2id, need_labels, image_column, label_column, model_names)
        return replace(rows, source=f"datasets.Dataset ({len(rows)} rows)")
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if path.is_dir():
            return replace(_folder_rows(path, name, label2id, need_labels, model_names),
                           source=f"folder {path.resolve()}")
        if not path.is_file():
            raise FileNotFoundError(f"{name}: no such file or folder: {path}")
        if need_labels:
            raise ValueError(f"{name}: this method fits per-class statistics; one image file has no label (pass a "
                             "class-folder tree, a datasets.Dataset with a 'label' column, or (pixel_values, labels) "
                             "batches)")
        return ImageRows([path], None, name, source=f"file {path.resolve()}")
    images = [data] if _is_image(data) else list(data) if (
        isinstance(data, (list, tuple)) and data and all(_is_image(item) for item in data)) else None
    if images is not None and need_labels:
        raise ValueError(f"{name}: this method fits per-class statistics, and images alone carry no labels (pass a "
                         "class-folder tree, a datasets.Dataset with a 'label' column, or (pixel_values, labels) "
                         "batches)")
    if images is None:
        return None
    return ImageRows(images, None, name, source=f"{len(images)} image{'s' * (len(images) != 1)} given by the caller")


__all__ = ["IMAGE_EXTENSIONS", "SPLIT_FOLDERS", "ImageRows", "Selected", "class_label_mapping", "image_rows", "labels_by_name",
           "select_split"]
