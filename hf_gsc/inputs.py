"""Checking and normalising what users pass to a detector: ``pixel_values`` and iterables of batches."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from .label_names import label_mapping, name_key


def check_pixel_values(
    pixel_values: Any, channels: int | None, expected: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """``pixel_values`` ``(B, C, H, W)`` cast to ``dtype``, or a ``TypeError``/``ValueError`` saying what is wrong
    (not a tensor, wrong rank, empty, integer, ``channels`` or spatial size ``expected`` not matched, NaN/inf)."""
    if not isinstance(pixel_values, torch.Tensor):
        raise TypeError(f"pixel_values must be a torch.Tensor of shape (B, C, H, W), got {type(pixel_values).__name__}")
    if pixel_values.ndim != 4:
        raise ValueError(f"pixel_values must have shape (B, C, H, W), got shape {tuple(pixel_values.shape)}")
    if pixel_values.shape[0] == 0:
        raise ValueError("pixel_values is an empty batch (B=0); pass at least one image")
    if not pixel_values.is_floating_point():
        raise ValueError(f"pixel_values must be floating point (the image processor's output), got {pixel_values.dtype}")
    if channels is not None and pixel_values.shape[1] != channels:
        raise ValueError(
            f"pixel_values has {pixel_values.shape[1]} channels but the base model expects {channels}; "
            "convert the images (e.g. grayscale to RGB) with the model's image processor"
        )
    if expected is not None and tuple(pixel_values.shape[2:]) != expected:
        raise ValueError(
            f"pixel_values has spatial size {tuple(pixel_values.shape[2:])} but the base model expects "
            f"{expected}; resize with the model's image processor"
        )
    # The sum of finite values is finite unless it overflows, so one reduction clears the common case.
    if not math.isfinite(pixel_values.sum().item()) and not torch.isfinite(pixel_values).all():
        bad = (~torch.isfinite(pixel_values)).flatten(1).any(dim=1).nonzero().flatten().tolist()
        raise ValueError(f"pixel_values contains NaN or infinite values in batch rows {bad}")
    return pixel_values.to(dtype)


def batches(
    data: torch.Tensor | Iterable[Any], name: str, allow_empty: bool = False
) -> Iterable[tuple[torch.Tensor, torch.Tensor | None]]:
    """Normalise tensors, ``(pixel_values, labels)`` tuples and mappings into ``(pixel_values, labels)`` batches.
    No batch at all is an error unless ``allow_empty`` (a fit then says how many samples it needs)."""
    if data is None:
        raise TypeError(
            f"{name} is None; pass a (N, C, H, W) tensor of pixel_values or an iterable of batches "
            "(tensors, (pixel_values, labels) tuples or mappings with 'pixel_values')"
        )
    items = [data] if isinstance(data, torch.Tensor) else data
    seen = False
    for index, batch in enumerate(items):
        labels = None
        if isinstance(batch, Mapping):
            labels = batch.get("labels", batch.get("label"))
            batch = batch.get("pixel_values")
        elif isinstance(batch, (tuple, list)) and batch:
            batch, labels = batch[0], (batch[1] if len(batch) > 1 else None)
        if not isinstance(batch, torch.Tensor):
            # A stacked (N, H, W, C) NumPy array is a batch of images, not of pixel_values: say how to pass it.
            images = (" (NumPy images: pass a list of H x W, H x W x 3 or H x W x 4 arrays)"
                      if type(batch).__name__ == "ndarray" else "")
            raise TypeError(
                f"{name} batch {index} must be a tensor, a (pixel_values, labels) tuple or a "
                f"mapping with 'pixel_values'; got {type(batch).__name__}{images}"
            )
        seen = True
        yield batch, labels
    if not seen and not allow_empty:
        raise ValueError(f"{name} is empty; it must hold at least one batch of images")


#: File extensions read as images when a folder is given.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def _is_image(item: Any) -> bool:
    import numpy as np
    from PIL import Image

    return isinstance(item, (Image.Image, str, os.PathLike)) or (isinstance(item, np.ndarray) and item.ndim in (2, 3))


def array_to_image(array: Any) -> Any:
    """A NumPy image as a PIL image, as image processors take them: ``H x W`` (gray), ``H x W x 1``, ``H x W x 3``
    (RGB) or ``H x W x 4`` (RGBA, made RGB); ``uint8``, or floating point in ``[0, 1]`` (scaled to 0..255). Anything
    else is a ``ValueError`` saying what was expected."""
    import numpy as np
    from PIL import Image

    array = np.asarray(array)
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (3, 4)) or 0 in array.shape:
        several = " (several images: pass a list of them)" if array.ndim == 4 else ""
        raise ValueError(f"a NumPy image must be H x W, H x W x 1, H x W x 3 or H x W x 4, got shape "
                         f"{array.shape}{several}")
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 1:
            raise ValueError("a floating-point NumPy image must hold values in [0, 1] (uint8 images hold 0..255), got "
                             f"values in [{np.nanmin(array)}, {np.nanmax(array)}]")
        array = np.round(array * 255.0)
    elif array.dtype != np.uint8:
        if array.min() < 0 or array.max() > 255:
            raise ValueError(f"an integer NumPy image must hold values in 0..255, got {array.dtype} in "
                             f"[{array.min()}, {array.max()}]")
    image = Image.fromarray(array.astype(np.uint8))
    return image.convert("RGB") if image.mode == "RGBA" else image


def labels_by_name(names: list[str], label2id: Mapping[str, int] | None) -> list[int] | None:
    """The model's class index of each class name (``label2id``), when every name is one of the model's labels (in
    any order); ``None`` otherwise (the names cannot be mapped: the labels stay unknown)."""
    if not label2id or not names or any(name not in label2id for name in names):
        return None
    return [int(label2id[name]) for name in names]


def class_label_mapping(names: list[str], label2id: Mapping[str, int] | None) -> list[int] | None:
    """The model's class index of each ``ClassLabel`` name of a dataset, when every name is one of the model's labels
    (in any order), compared as the evaluation compares them (:func:`hf_gsc.label_names.name_key`: ignoring
    case, ``_`` / ``-`` versus spaces): a dataset that ``hf-gsc evaluate`` maps by name is fitted with the same
    labels. ``None`` otherwise (an unknown name, or one that names two of the model's labels)."""
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


def _unknown_names(names: list[str], label2id: Mapping[str, int] | None, key: Any = str) -> str:
    """The names of ``names`` that are not the model's labels (compared as ``key(name)``), and the model's labels, for
    an error message."""
    known = sorted(label2id or {}, key=lambda label: (label2id or {})[label])
    keys = {key(label) for label in label2id or {}}
    unknown = [label for label in names if key(label) not in keys]
    shown = ", ".join(repr(label) for label in known[:20]) + (", ..." if len(known) > 20 else "")
    return f"{', '.join(repr(label) for label in unknown[:10])} are not among the model's labels (config.label2id: {shown})"


def _shares_a_name(names: Iterable[str], label2id: Mapping[str, int]) -> bool:
    """Whether one of ``names`` is one of the model's labels, compared as :func:`class_label_mapping` compares them."""
    keys = {name_key(label) for label in label2id}
    return any(name_key(name) in keys for name in names)


def _image_rows(data: Any, name: str, label2id: Mapping[str, int] | None = None, need_labels: bool = False
                ) -> tuple[list[Any], list[Any] | None] | None:
    """``(images, labels or None)`` when ``data`` holds images rather than ``pixel_values``, else ``None``.

    Labels are the model's class indices: a ``datasets.Dataset``'s ``label`` column (mapped by name when its
    ``ClassLabel`` names are the model's labels in another order, compared as the evaluation compares them:
    :func:`class_label_mapping`), or a class-folder tree's folder names (each folder
    one of the model's labels, ``config.label2id``). With ``need_labels`` (a method fits per-class statistics),
    images that cannot be labelled so, or a dataset whose class names are partly the model's, are a ``ValueError``
    naming the names that do not match, here, before any image is read."""
    column_names = getattr(data, "column_names", None)
    if column_names is not None and not isinstance(data, torch.Tensor):  # a datasets.Dataset
        if "image" not in column_names:
            raise ValueError(f"{name}: the dataset has no 'image' column (columns: {', '.join(column_names)})")
        labels = list(data["label"]) if "label" in column_names else None
        class_names = getattr(getattr(data, "features", {}).get("label"), "names", None)
        mapping = class_label_mapping(list(class_names), label2id) if class_names and labels is not None else None
        if mapping is not None:
            labels = [mapping[label] if label >= 0 else label for label in labels]
        elif need_labels and class_names and label2id and _shares_a_name(class_names, label2id):
            # Some names match and some do not: the dataset's indices are not the model's, and no order is safe.
                    raise ValueError(f"{name}: the dataset's class names cannot be mapped to the model's labels: "
                             f"{_unknown_names(list(class_names), label2id, key=name_key)}")
        elif need_labels and labels is None:
            raise ValueError(f"{name}: the dataset has no 'label' column, and this method fits per-class statistics "
                             f"(columns: {', '.join(column_names)})")
        return list(data["image"]), labels
    if isinstance(data, (str, os.PathLike)):
        path = Path(data)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
            if not files:
                raise ValueError(f"{name}: the folder {path} holds no image files ({', '.join(IMAGE_EXTENSIONS)})")
            folders = sorted({file.relative_to(path).parts[0] for file in files if len(file.relative_to(path).parts) == 2})
            nested = all(len(file.relative_to(path).parts) == 2 for file in files)
            mapping = class_label_mapping(folders, label2id) if nested else None
            if mapping is not None:  # a class-folder tree: labels by name, compared as the evaluation compares them
                index = dict(zip(folders, mapping))
                return files, [index[file.relative_to(path).parts[0]] for file in files]
            if need_labels and not nested:
                raise ValueError(f"{name}: this method fits per-class statistics, and {path} is not a class-folder "
                                 "tree (one folder per class named as the model's label, its images directly inside)")
            if need_labels:
                raise ValueError(f"{name}: the class folders of {path} must be named as the model's labels: "
                                 f"{_unknown_names(folders, label2id, key=name_key)}")
            return files, None
        if not path.is_file():
            raise FileNotFoundError(f"{name}: no such file or folder: {path}")
        if need_labels:
            raise ValueError(f"{name}: this method fits per-class statistics; one image file has no label (pass a "
                             "class-folder tree, a datasets.Dataset with a 'label' column, or (pixel_values, labels) "
                             "batches)")
        return [path], None
    images = [data] if _is_image(data) else list(data) if (
        isinstance(data, (list, tuple)) and data and all(_is_image(item) for item in data)) else None
    if images is not None and need_labels:
        raise ValueError(f"{name}: this method fits per-class statistics, and images alone carry no labels (pass a "
                         "class-folder tree, a datasets.Dataset with a 'label' column, or (pixel_values, labels) "
                         "batches)")
    return None if images is None else (images, None)


def model_mode(image: Any, channels: int | None) -> Any:
    """``image`` (PIL) in the mode a model of ``channels`` input channels takes: RGB for 3, L for 1 (a gray image for
    an RGB model and the reverse would otherwise fail in the image processor's normalisation)."""
    if channels == 3 and image.mode != "RGB":
        return image.convert("RGB")
    if channels == 1 and image.mode != "L":
        return image.convert("L")
    return image


def _open_image(item: Any) -> Any:
    """A PIL image or a file, checked against the pixel limit from its header before it is decoded
    (:mod:`hf_gsc.image_limits`), as RGB (or L)."""
    from PIL import Image

    from .image_limits import check_image_size

    if not isinstance(item, (Image.Image, str, os.PathLike)):  # a NumPy image
        item = array_to_image(item)
    if isinstance(item, Image.Image):
        check_image_size(item)
        return item.convert("RGB") if item.mode not in ("RGB", "L") else item
    with Image.open(item) as image:
        check_image_size(image)
        return image.convert("RGB")


def labelled_batches(
    data: Any, name: str, image_processor: Any = None, batch_size: int = 32, allow_empty: bool = False,
    label2id: Mapping[str, int] | None = None, channels: int | None = None, need_labels: bool = False,
) -> Iterable[tuple[torch.Tensor, torch.Tensor | None]]:
    """:func:`batches`, and also images: a PIL image, a NumPy image, a file or folder path (a class-folder tree
    gives labels by folder name through ``label2id``), a list of those, or a ``datasets.Dataset`` with an ``image``
    column (and optionally ``label``, mapped by name through ``label2id``), prepared ``batch_size`` at a time by
    ``image_processor``, in the mode a model of ``channels`` input channels takes (:func:`model_mode`)."""
    rows = None if data is None else _image_rows(data, name, label2id, need_labels)
    if rows is None:
        yield from batches(data, name, allow_empty)
        return
    if image_processor is None:
        raise ValueError(
            f"{name} holds images, but the detector has no image_processor to turn them into pixel_values; load it "
            "with from_pretrained (which loads the base model's processor), set detector.image_processor = "
            "AutoImageProcessor.from_pretrained(...), or pass pixel_values"
        )
    images, labels = rows
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for start in range(0, len(images), batch_size):
        chunk = [model_mode(_open_image(item), channels) for item in images[start : start + batch_size]]
        pixel_values = image_processor(images=chunk, return_tensors="pt")["pixel_values"]
        chunk_labels = None if labels is None else torch.as_tensor(labels[start : start + batch_size])
        yield pixel_values, chunk_labels
