"""Do the ID data's class names match the model's ``id2label``?

The evaluation compares predicted class *indices* with label *indices*: ID data whose classes are other ones,
or the same ones in another order, gives a meaningless ID accuracy (0% in the worst case) and no error.
:func:`compare_labels` checks the class names of the ID test split's ``ClassLabel`` against
``model.config.id2label`` when the data is loaded, before any scoring; the evaluator warns
(:class:`LabelMismatchWarning`) and records the result in ``results.json`` (``label_check``).

Names are compared ignoring case, ``_`` / ``-`` versus spaces and surrounding whitespace (folder names such as
``ankle_boot`` match ``Ankle boot``).

When every class name of the data is one of the model's (the same names in another order, or a subset), the
labels are mapped by name (:func:`label_mapping`, :func:`map_labels`) before anything reads them: fits, scoring,
ID accuracy. ``--label-map DATA_NAME=MODEL_LABEL,...`` (or a JSON file of the same pairs) gives the mapping where
the names differ. ``label_check`` then records ``mapping`` (data name -> model label) and ``mapped_by``.

A model may name two classes alike (ImageNet-1k's ``crane``: 134, the bird, and 517, the machine): unique names are
still mapped by name, and a data class whose name names several model classes is refused, naming them and
``--label-map NAME=INDEX`` (:func:`~hf_gsc.utils.label_names.ambiguous_names`); the mapped labels are then plain
model class indices, since a ``ClassLabel`` holds each name once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ..utils.label_names import (
    SHOWN,
    ambiguous_names,
    ambiguous_names_error,
    generic_labels,
    generic_labels_error,
    label_mapping,
    listed,
    model_label_names,
    name_key,
)
from .errors import InputError


#: ``label_check.status`` values: names and order agree / same names, other order / other names / not checkable.
MATCH, ORDER_DIFFERS, NAMES_DIFFER, UNCHECKED = "match", "order_differs", "names_differ", "unchecked"
#: ``label_check.status`` of a run on named classes with a generic-label model, in the data's class order because
#: ``--labels-by-order`` said so: nothing was checked.
BY_ORDER = "by_order"
#: How many class pairs the console line lists (the full table is ``results.json``'s ``label_check.mapping``).
SHOWN_PAIRS = 10


class LabelMismatchWarning(UserWarning):
    """The ID data's class names differ from the model's ``id2label`` (names, or order)."""


def class_names_of(dataset: Any) -> list[str] | None:
    """The names of the ``label`` column's ``ClassLabel``; ``None`` when the column has no class names."""
    import datasets

    features = getattr(dataset, "features", None)
    feature = None if features is None else features.get("label")
    return list(feature.names) if isinstance(feature, datasets.ClassLabel) else None


def model_class_names(config: Any) -> list[str] | None:
    """``config.id2label`` in index order; ``None`` when it holds only transformers' generic ``LABEL_i`` names."""
    names = _id2label_names(config)
    return None if not names or generic_labels(names) else names


def _id2label_names(config: Any) -> list[str]:
    return model_label_names(config) or []


def compare_labels(data_names: Sequence[str] | None, model_names: Sequence[str] | None) -> dict[str, Any]:
    """The ``label_check`` record: ``status`` (:data:`MATCH`, :data:`ORDER_DIFFERS`, :data:`NAMES_DIFFER`,
    :data:`UNCHECKED`) and the details: ``only_in_data`` / ``only_in_model`` (names), ``positions`` (index,
    data name, model name where the same names sit at other indices), or ``reason``."""
    if data_names is None:
        return {"status": UNCHECKED, "reason": "the ID data's label column has no class names (not a ClassLabel)"}
    if model_names is None:
        return {"status": UNCHECKED, "reason": "the model's id2label has only generic names (LABEL_0, ...)"}
    data, model = list(map(name_key, data_names)), list(map(name_key, model_names))
    if data == model:
        return {"status": MATCH}
    if sorted(data) == sorted(model):
        positions = [{"index": i, "data": data_names[i], "model": model_names[i]}
                     for i in range(len(data)) if data[i] != model[i]]
        return {"status": ORDER_DIFFERS, "positions": positions}
    return {
        "status": NAMES_DIFFER,
        "num_data_classes": len(data), "num_model_classes": len(model),
        "only_in_data": [name for name, key in zip(data_names, data) if key not in set(model)],
        "only_in_model": [name for name, key in zip(model_names, model) if key not in set(data)],
    }


def label_warning(record: Mapping[str, Any]) -> str | None:
    """The warning for a mismatch (``None`` when the names match or could not be compared)."""
    hint = "predictions are compared with labels by index, so the ID accuracy means nothing"
    if record.get("mapping"):  # mapped by name or by --label-map: the accuracy compares the right classes
        return None
    if record["status"] == ORDER_DIFFERS:
        shown = "; ".join(f"{p['index']} is {p['data']!r} in the data, {p['model']!r} in the model"
                          for p in record["positions"][:SHOWN])
        return (f"the ID data has the model's class names in another order (label {shown}): {hint}; align the "
                "data's labels with datasets.Dataset.align_labels_with_mapping(model.config.label2id, 'label')")
    if record["status"] == NAMES_DIFFER:
        return (f"the ID data's class names differ from the model's id2label ({record['num_data_classes']} classes "
                f"in the data, {record['num_model_classes']} in the model; only in the data: "
                f"{listed(record['only_in_data']) or 'none'}; only in the model: "
                f"{listed(record['only_in_model']) or 'none'}): {hint}; give ID data of the model's classes "
                "(class folders or ClassLabel names as in model.config.id2label), or the mapping with "
                "--label-map DATA_NAME=MODEL_LABEL,...")
    return None


def parse_label_map(value: str | None) -> dict[str, str]:
    """``--label-map``: ``DATA_NAME=MODEL_LABEL,...`` or the path of a JSON object ``{data name: model label}``.
    Raises ``ValueError`` naming the option and the expected form."""
    if not value:
        return {}
    expected = "DATA_NAME=MODEL_LABEL[,DATA_NAME=MODEL_LABEL...] or a .json file of {\"data name\": \"model label\"}"
    if value.endswith(".json") or os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as handle:
                pairs = json.load(handle)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"--label-map {value!r}: could not read it as JSON ({error}); expected {expected}") from None
        if not isinstance(pairs, dict) or not all(isinstance(v, (str, int)) for v in pairs.values()):
            raise ValueError(f"--label-map {value!r}: expected a JSON object of data name -> model label")
        return {str(k): str(v) for k, v in pairs.items()}
    pairs = {}
    for item in value.split(","):
        data_name, sep, model_label = (part.strip() for part in item.partition("="))
        if not sep or not data_name or not model_label:
            raise ValueError(f"--label-map: {item.strip()!r} is not DATA_NAME=MODEL_LABEL; expected {expected}")
        if data_name in pairs:
            raise ValueError(f"--label-map: {data_name!r} is mapped twice")
        pairs[data_name] = model_label
    return pairs


def map_labels(dataset: Any, mapping: Sequence[int], model_names: Sequence[str]) -> Any:
    """``dataset`` with its ``label`` column mapped through ``mapping`` (data index -> model index), a ``ClassLabel``
    of the model's names. A ``datasets.Dataset`` gets a new label column (its images are not rewritten); a streamed
    one maps lazily. Rows without a class (a negative label) keep it."""
    import datasets

    # A ClassLabel holds each name once; a model whose id2label names two classes alike (ImageNet-1k's "crane", 134
    # and 517) gets plain model class indices.
    unique = len(set(map(str, model_names))) == len(model_names)
    feature = datasets.ClassLabel(names=list(map(str, model_names))) if unique else datasets.Value("int64")
    table = list(mapping)

    def mapped(labels: Sequence[int]) -> list[int]:
        return [table[label] if 0 <= label < len(table) else label for label in labels]

    if isinstance(dataset, datasets.Dataset):
        labels = mapped(list(dataset["label"]))
        return dataset.remove_columns("label").add_column("label", labels, feature=feature)
    features = dataset.features.copy() if dataset.features is not None else None
    if features is not None:
        features["label"] = feature
    return dataset.map(lambda batch: {"label": mapped(batch["label"])}, batched=True, features=features)


def mapping_record(data_names: Sequence[str], model_names: Sequence[str], mapping: Sequence[int]) -> dict[str, str]:
    """``label_check.mapping``: data name -> model label, every class of the data."""
    return {str(name): str(model_names[index]) for name, index in zip(data_names, mapping)}


def check_labels(id_splits: Mapping[str, Any], config: Any, given: Mapping[str, str],
                 by_order: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(ID splits with their labels mapped to the model's classes, label_check)``. Each split is mapped by its own
    class names (an image-folder split without some class folder numbers its classes differently); the record is
    the test split's comparison plus ``mapping`` (data name -> model label, every class), ``model_index`` (data name
    -> model class index) and ``mapped_by`` where labels were mapped.

    A model whose ``id2label`` is generic (``LABEL_0``, ...) meets named classes only through ``given``
    (``--label-map``, a model label given as its index or ``LABEL_i``) or ``by_order`` (``--labels-by-order``: the
    data's class i is the model's class i, recorded as :data:`BY_ORDER`); otherwise it is refused
    (:func:`~hf_gsc.utils.label_names.generic_labels_error`, as ``Detector.fit`` refuses)."""
    raw_names = _id2label_names(config)
    model_names = model_class_names(config)
    data_names = class_names_of(id_splits["test"])
    label_check = compare_labels(data_names, model_names)
    generic = model_names is None and bool(raw_names) and data_names is not None
    if given and not generic and (model_names is None or data_names is None):
        raise InputError(f"--label-map: cannot map by name: {label_check.get('reason', 'no class names')}")
    if generic and not given:
        assert data_names is not None  # generic: the data's classes have names
        if not by_order:
            raise InputError(f"the ID data: {generic_labels_error(data_names, raw_names)}")
        return dict(id_splits), {"status": BY_ORDER, "reason": "--labels-by-order: the model's labels are generic "
                                 "(LABEL_0, ...); the data's class i is taken as the model's class i, unchecked",
                                 "data_classes": list(data_names)}
    if generic:
        model_names = raw_names
    if model_names is None:
        return dict(id_splits), label_check
    mapped = {}
    for split, dataset in id_splits.items():
        names = class_names_of(dataset)
        if names is None or (compare_labels(names, model_names)["status"] == MATCH and not given):
            mapped[split] = dataset
            continue
        ambiguous = ambiguous_names(names, model_names, given)
        if ambiguous:
            raise InputError(f"ID {split!r} split: {ambiguous_names_error(ambiguous, model_names)}")
        try:
            mapping = label_mapping(names, model_names, given)
        except ValueError as error:
            raise InputError(f"ID {split!r} split: {error}") from None
        if mapping is None:  # names that are not the model's: nothing to map by; the warning says so
            mapped[split] = dataset
            continue
        mapped[split] = map_labels(dataset, mapping, model_names)
        if split == "test" and (given or list(mapping) != list(range(len(names)))):
            label_check = {**label_check, "mapping": mapping_record(names, model_names, mapping),
                           "model_index": {str(name): int(index) for name, index in zip(names, mapping)},
                           "mapped_by": "--label-map" if given else "name"}
    return mapped, label_check


def labels_note(record: Mapping[str, Any]) -> str | None:
    """The sentence above ``results.md``'s tables (and on the console) when the labels were not checked because
    ``--labels-by-order`` said to take the data's class order as the model's (``None`` otherwise)."""
    if record.get("status") != BY_ORDER:
        return None
    return ("the model's labels are generic (LABEL_0, ...), so the ID data's classes were taken in their own order as "
            "the model's classes (--labels-by-order), unchecked: the ID accuracy, the accuracy on accepted samples, "
            "AURC and every per-class fit assume data class i is model class i ("
            + ", ".join(f"{name!r} = class {index}" for index, name in enumerate(record["data_classes"][:SHOWN_PAIRS]))
            + (f" and {len(record['data_classes']) - SHOWN_PAIRS} more" if len(record["data_classes"]) > SHOWN_PAIRS
               else "") + ")")


def mapping_line(record: Mapping[str, Any]) -> str | None:
    """The console line of a mapping: each data class and the model class it became (index and label), every class
    up to :data:`SHOWN_PAIRS`, then the count and where the full table is (``None`` when nothing was mapped)."""
    mapping, index = record.get("mapping"), record.get("model_index") or {}
    if not mapping:
        return None
    pairs = [f"data class {name!r} -> model class {index[name]} {label!r}" if name in index
             else f"data class {name!r} -> model class {label!r}" for name, label in mapping.items()]
    more = (f"; and {len(pairs) - SHOWN_PAIRS} more (all {len(pairs)} in results.json's label_check.mapping)"
            if len(pairs) > SHOWN_PAIRS else "")
    return (f"ID labels mapped to the model's id2label (by {record['mapped_by']}), {len(pairs)} classes: "
            + ", ".join(pairs[:SHOWN_PAIRS]) + more)


__all__ = [
    "BY_ORDER",
    "MATCH",
    "NAMES_DIFFER",
    "ORDER_DIFFERS",
    "UNCHECKED",
    "LabelMismatchWarning",
    "check_labels",
    "class_names_of",
    "compare_labels",
    "label_mapping",
    "label_warning",
    "labels_note",
    "map_labels",
    "mapping_line",
    "mapping_record",
    "model_class_names",
    "parse_label_map",
]
