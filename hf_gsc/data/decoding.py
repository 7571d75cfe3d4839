"""Reading the images of a split: load-time checks of the image column, and decoding that names what failed.

Two kinds of bad data, caught at two moments:

* a column that cannot hold images at all (text such as captions, numbers) is visible in the dataset's features
  and is refused when the split is loaded (:func:`check_image_column`), before any model work;
* a single unreadable file (a corrupt PNG in a folder, truncated bytes in a parquet row) is only found when it is
  decoded; :func:`decode_image` then raises :class:`UndecodableImageError` in one line naming the dataset, the row
  and the file, or, with ``on_error="skip"``, drops the image so the caller can count it.

Decoding happens here rather than inside ``datasets`` (whose errors name neither dataset nor row, and whose rules
for bit depth and alpha are not the pipeline's): callers switch the image column to ``datasets.Image(decode=False)``
with :func:`without_decoding` and decode each batch with :func:`decode_images`, which decodes through
:func:`hf_gsc.utils.images.decode`, the one rule of every entry point (``fit``, ``calibrate``, the pipeline).
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import datasets
from PIL import Image

from ..utils.image_limits import max_image_pixels
from ..utils.images import UnreadableImageError, decode, reason


#: What to do with an image that cannot be decoded: raise :class:`UndecodableImageError`, or leave it out.
OnError = Literal["raise", "skip"]
ON_ERROR_CHOICES: tuple[str, ...] = ("raise", "skip")

#: Rows of a text image column shown in the error (all rows are checked).
_TEXT_PREVIEW = 60


class UndecodableImageError(UnreadableImageError):
    """An image of a dataset could not be decoded; the message names the dataset, the row and the file."""


def check_on_error(on_error: str) -> None:
    """``ValueError`` unless ``on_error`` is one of :data:`ON_ERROR_CHOICES`."""
    if on_error not in ON_ERROR_CHOICES:
        raise ValueError(f"on_error must be one of {ON_ERROR_CHOICES}, got {on_error!r}")


def _file_of(value: Any) -> str:
    """Where the image of a row came from, for error messages."""
    if isinstance(value, Mapping):
        if value.get("path"):
            return str(value["path"])
        return "bytes stored in the dataset" if value.get("bytes") is not None else "no file"
    if isinstance(value, (str, os.PathLike)):
        return str(value)
    return f"a {type(value).__name__} value"


@overload
def decode_image(value: Any, dataset_name: str, row: int | str, on_error: Literal["raise"] = "raise") -> Image.Image: ...
@overload
def decode_image(value: Any, dataset_name: str, row: int | str, on_error: OnError) -> Image.Image | None: ...
def decode_image(value: Any, dataset_name: str, row: int | str, on_error: OnError = "raise") -> Image.Image | None:
    """The 8-bit, upright PIL image (``L`` or ``RGB``) of what a ``datasets.Image(decode=False)`` column holds
    (``{"bytes", "path"}``), a file path, or an already decoded PIL image, decoded by
    :func:`hf_gsc.utils.images.decode`, the rule of every entry point (EXIF orientation, bit depth, alpha, palette).

    Returns ``None`` instead of raising when ``on_error="skip"`` and the image cannot be decoded. An image above
    ``HF_GSC_MAX_IMAGE_PIXELS`` pixels (:mod:`hf_gsc.utils.image_limits`) counts as one that cannot be decoded: it is
    refused from its header, before decoding.

    Raises:
        UndecodableImageError: (``on_error="raise"``) naming ``dataset_name``, ``row`` and the file.
    """
    check_on_error(on_error)
    max_image_pixels()  # outside the try: a bad HF_GSC_MAX_IMAGE_PIXELS is an error, never a skipped image
    try:
        return decode(value)
    except Exception as err:  # noqa: BLE001 -- PIL and the file system raise many types for bad files
        if on_error == "skip":
            return None
        raise UndecodableImageError(
            f"cannot decode the image of dataset {dataset_name!r}, row {row}, file {_file_of(value)}: {reason(err)}"
        ) from err


@dataclass(frozen=True)
class DecodedImages:
    """The images of one batch that could be decoded.

    ``images[i]`` is the image of row ``rows[i]``, at ``positions[i]`` in the batch; ``skipped_rows`` lists the
    rows left out (always empty with ``on_error="raise"``) and ``errors`` why, one message each (what
    :class:`UndecodableImageError` would have said).
    """

    images: list[Image.Image]
    rows: list[int | str]
    positions: list[int]
    skipped_rows: list[int | str]
    errors: list[str] = field(default_factory=list)


def decode_images(
    values: Sequence[Any], rows: Sequence[int | str], dataset_name: str, on_error: OnError = "raise",
) -> DecodedImages:
    """Decode a batch (see :func:`decode_image`); ``rows`` are the values' row numbers in the dataset."""
    if len(values) != len(rows):
        raise ValueError(f"{len(values)} images but {len(rows)} row numbers")
    check_on_error(on_error)
    images, kept, positions, skipped, errors = [], [], [], [], []
    for position, (value, row) in enumerate(zip(values, rows)):
        try:
            image = decode_image(value, dataset_name, row)
        except UndecodableImageError as error:
            if on_error == "raise":
                raise
            skipped.append(row)
            errors.append(str(error))
            continue
        images.append(image)
        kept.append(row)
        positions.append(position)
    return DecodedImages(images, kept, positions, skipped, errors)


def without_decoding(dataset: Any, image_column: str = "image") -> Any:
    """``dataset`` (``Dataset`` or ``IterableDataset``) with ``image_column`` as ``datasets.Image(decode=False)``,
    so that rows hold ``{"bytes", "path"}`` and :func:`decode_images` does the decoding."""
    feature = (dataset.features or {}).get(image_column)
    if isinstance(feature, datasets.Image) and feature.decode:
        return dataset.cast_column(image_column, datasets.Image(decode=False))
    return dataset


def _is_text(feature: Any) -> bool:
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def check_image_column(dataset: Any, dataset_name: str, image_column: str = "image") -> None:
    """Refuse, before any decoding, a column that cannot hold images.

    Accepted: a ``datasets.Image`` column, or a text column whose every value is the path of an existing file (or a
    URL, which ``datasets.Image`` fetches). For an ``IterableDataset`` only the feature type is checked (its rows
    are not read here). Cost: one ``stat`` per row of a text column, nothing for an image column.

    Raises:
        ValueError: naming the dataset, the column, and for text the first row that is not an image file.
    """
    feature = (dataset.features or {}).get(image_column)
    if isinstance(feature, datasets.Image):
        return
    if not _is_text(feature):
        kind = feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__
        raise ValueError(
            f"dataset {dataset_name!r}: column {image_column!r} holds {kind} values, not images "
            "(expected a datasets.Image column or paths of image files)"
        )
    if not isinstance(dataset, datasets.Dataset):
        return
    for row, text in enumerate(dataset[image_column]):
        if text is None or not ("://" in text or os.path.isfile(text)):
            shown = text if text is None or len(text) <= _TEXT_PREVIEW else text[:_TEXT_PREVIEW] + "..."
            raise ValueError(
                f"dataset {dataset_name!r}: column {image_column!r} holds text, not images: row {row} is {shown!r}, "
                "which is not an image file (expected a datasets.Image column or paths of image files)"
            )
