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
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from ..utils.label_names import SHOWN, label_mapping, listed, name_key

#: ``label_check.status`` values: names and order agree / same names, other order / other names / not checkable.
MATCH, ORDER_DIFFERS, NAMES_DIFFER, UNCHECKED = "match", "order_differs", "names_differ", "unchecked"


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
    id2label = getattr(config, "id2label", None) or {}
    names = [id2label[i] for i in sorted(id2label, key=int)] if id2label else []
    if not names or all(re.fullmatch(r"LABEL_\d+", str(name)) for name in names):
        return None
    return [str(name) for name in names]


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

    feature = datasets.ClassLabel(names=list(model_names))
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
    """``label_check.mapping``: data name -> model label, for the classes whose index changes."""
    return {str(name): str(model_names[index]) for position, (name, index) in enumerate(zip(data_names, mapping))
            if index != position or name_key(name) != name_key(model_names[index])}


__all__ = [
    "MATCH",
    "NAMES_DIFFER",
    "ORDER_DIFFERS",
    "UNCHECKED",
    "LabelMismatchWarning",
    "class_names_of",
    "compare_labels",
    "label_warning",
    "label_mapping",
    "map_labels",
    "mapping_record",
    "parse_label_map",
    "model_class_names",
]
