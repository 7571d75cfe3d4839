"""Do the ID data's class names match the model's ``id2label``?

The evaluation compares predicted class *indices* with label *indices*: ID data whose classes are other ones,
or the same ones in another order, gives a meaningless ID accuracy (0% in the worst case) and no error.
:func:`compare_labels` checks the class names of the ID test split's ``ClassLabel`` against
``model.config.id2label`` when the data is loaded, before any scoring; the runner warns
(:class:`LabelMismatchWarning`) and records the result in ``results.json`` (``label_check``).

Names are compared ignoring case, ``_`` / ``-`` versus spaces and surrounding whitespace (folder names such as
``ankle_boot`` match ``Ankle boot``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

#: ``label_check.status`` values: names and order agree / same names, other order / other names / not checkable.
MATCH, ORDER_DIFFERS, NAMES_DIFFER, UNCHECKED = "match", "order_differs", "names_differ", "unchecked"
#: How many differing names or positions a message lists.
SHOWN = 5


class LabelMismatchWarning(UserWarning):
    """The ID data's class names differ from the model's ``id2label`` (names, or order)."""


def _normalized(name: str) -> str:
    return " ".join(re.sub(r"[_\-]", " ", str(name)).casefold().split())


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
    data, model = list(map(_normalized, data_names)), list(map(_normalized, model_names))
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


def _listed(names: Sequence[Any]) -> str:
    shown = ", ".join(map(repr, names[:SHOWN]))
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def label_warning(record: Mapping[str, Any]) -> str | None:
    """The warning for a mismatch (``None`` when the names match or could not be compared)."""
    hint = "predictions are compared with labels by index, so the ID accuracy means nothing"
    if record["status"] == ORDER_DIFFERS:
        shown = "; ".join(f"{p['index']} is {p['data']!r} in the data, {p['model']!r} in the model"
                          for p in record["positions"][:SHOWN])
        return (f"the ID data has the model's class names in another order (label {shown}): {hint}; align the "
                "data's labels with datasets.Dataset.align_labels_with_mapping(model.config.label2id, 'label')")
    if record["status"] == NAMES_DIFFER:
        return (f"the ID data's class names differ from the model's id2label ({record['num_data_classes']} classes "
                f"in the data, {record['num_model_classes']} in the model; only in the data: "
                f"{_listed(record['only_in_data']) or 'none'}; only in the model: "
                f"{_listed(record['only_in_model']) or 'none'}): {hint}; give ID data of the model's classes "
                "(class folders or ClassLabel names as in model.config.id2label)")
    return None


__all__ = [
    "MATCH",
    "NAMES_DIFFER",
    "ORDER_DIFFERS",
    "UNCHECKED",
    "LabelMismatchWarning",
    "class_names_of",
    "compare_labels",
    "label_warning",
    "model_class_names",
]
