"""Which columns of a ``datasets.Dataset`` hold the images and the labels: one rule for ``hf-gsc evaluate``
(:func:`hf_gsc.data.load_split`), ``Detector.fit`` and ``Detector.calibrate`` (:mod:`hf_gsc.utils.image_data`).

* A column named by the caller (``image_column=`` / ``label_column=``; ``--image-column`` / ``--label-column``) is
  that column; one the dataset does not have is refused, listing the columns.
* Otherwise by type: the one ``datasets.Image`` column holds the images, the one ``datasets.ClassLabel`` column the
  labels. Hub datasets name them ``image`` / ``label``, ``img`` / ``label`` (CIFAR-10), ``img`` / ``fine_label``
  (CIFAR-100), ``image`` / ``labels``, or anything else (``picture`` / ``cls``): the type says which, not the name.
* Two columns of that type (CIFAR-100's ``fine_label`` and ``coarse_label``) are ambiguous: refused, listing every
  column with its type and naming the keyword that chooses. No column of that type: an image column of a usual name
  holding file paths (``image``, ``img``, ...), the first label column of a usual name (:data:`LABEL_NAMES`) holding
  integers (the model's class indices) or class-name strings; else, where labels are needed, a refusal listing the
  columns.

Labels that were not read are never compared with predictions: a caller that needs labels (the evaluation's ID
splits, a fit of per-class statistics) gets an error here, never a column of ``-1``.
"""

from __future__ import annotations

from typing import Any


#: Usual names of an image column that is not of the ``datasets.Image`` type (a column of file paths).
IMAGE_NAMES = ("image", "img", "images", "picture")
#: Names of a label column that is not a ``datasets.ClassLabel`` (integers, or class-name strings).
LABEL_NAMES = ("label", "labels", "fine_label", "class", "target")


def _feature_type(feature: Any) -> str:
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        return f"ClassLabel of {feature.num_classes} names"
    if isinstance(feature, datasets.Image):
        return "Image"
    if isinstance(feature, datasets.Value):
        return str(feature.dtype)
    return type(feature).__name__


def column_types(dataset: Any) -> str:
    """Every column with its type, for messages: ``picture (Image), cls (ClassLabel of 3 names), id (int64)``."""
    features = getattr(dataset, "features", None)
    if features is None:
        return ", ".join(dataset.column_names or [])
    return ", ".join(f"{name} ({_feature_type(feature)})" for name, feature in features.items())


def _by_type(dataset: Any, column: str | None, kind: type, what: str, noun: str, keyword: str,
             required: bool) -> str | None:
    """``column`` when named (it must exist), else the one column of type ``kind``; ``None`` when there is none, or
    several and they are not ``required`` (several ``required`` ones are refused, listing the columns)."""
    if column is not None:
        if column not in (dataset.column_names or []):
            raise ValueError(f"{what} has no {noun} column {column!r} (its columns: {column_types(dataset)})")
        return column
    features = getattr(dataset, "features", None) or {}
    found = [name for name, feature in features.items() if isinstance(feature, kind)]
    if len(found) > 1 and required:
        raise ValueError(f"{what} has several {kind.__name__} columns ({', '.join(found)}; its columns: "
                         f"{column_types(dataset)}): name the {noun} column to read with {keyword}")
    return found[0] if len(found) == 1 else None


def image_column_of(dataset: Any, image_column: str | None = None, what: str = "the dataset",
                    keyword: str = "image_column=") -> str:
    """The column of ``dataset`` that holds its images (see the module docstring). Raises ``ValueError`` naming
    ``what`` (the dataset), the columns with their types, and ``keyword`` (how the caller names a column)."""
    import datasets

    found = _by_type(dataset, image_column, datasets.Image, what, "image", keyword, required=True)
    named = [name for name in IMAGE_NAMES if name in (dataset.column_names or [])]
    if found is not None or named:
        return found or named[0]
    raise ValueError(f"{what} has no image column (no datasets.Image column, none named {', '.join(IMAGE_NAMES)}; "
                     f"its columns: {column_types(dataset)}): name it with {keyword}")


def label_column_of(dataset: Any, label_column: str | None = None, what: str = "the dataset",
                    keyword: str = "label_column=", required: bool = False) -> str | None:
    """The column of ``dataset`` that holds its labels (see the module docstring); ``None`` when it has none and
    ``required`` is false (OOD data, calibration: nothing reads them). Raises ``ValueError`` naming ``what``, the
    columns with their types and ``keyword`` when a named column is missing, or when labels are ``required`` and
    none is found or several ``ClassLabel`` columns could be meant."""
    import datasets

    found = _by_type(dataset, label_column, datasets.ClassLabel, what, "label", keyword, required)
    features = getattr(dataset, "features", None) or {}
    if found is not None or len([f for f in features.values() if isinstance(f, datasets.ClassLabel)]) > 1:
        return found
    for name in LABEL_NAMES:
        feature = features.get(name)
        if name in (dataset.column_names or []) and (feature is None or (isinstance(feature, datasets.Value) and (
                feature.dtype.startswith(("int", "uint")) or feature.dtype in ("string", "large_string")))):
            return name
    if required:
        raise ValueError(f"{what} has no label column (no datasets.ClassLabel column, no integer or text column "
                         f"named {', '.join(LABEL_NAMES)}; its columns: {column_types(dataset)}): name it with "
                         f"{keyword}")
    return None


__all__ = ["IMAGE_NAMES", "LABEL_NAMES", "column_types", "image_column_of", "label_column_of"]
