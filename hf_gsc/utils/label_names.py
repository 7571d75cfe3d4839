"""Class names compared and mapped: the one rule by which a dataset's class names meet a model's labels.

Names are compared ignoring case, ``_`` / ``-`` versus spaces and surrounding whitespace (folder names such as
``ankle_boot`` match ``Ankle boot``). The evaluation (:mod:`hf_gsc.evaluation.labels`) and ``Detector.fit`` /
``calibrate`` (:mod:`hf_gsc.utils.inputs`) both map labels through :func:`label_mapping`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any


#: How many names a message lists.
SHOWN = 5
#: transformers' placeholder class names (``id2label`` of a model trained without names): ``LABEL_0``, ``LABEL_1``, ...
GENERIC_LABEL = re.compile(r"LABEL_\d+")


def name_key(name: str) -> str:
    """The form in which class names are compared (here and in ``Detector.fit`` on a ``datasets.Dataset``):
    case-folded, ``_`` / ``-`` as spaces, runs of whitespace as one space, no surrounding whitespace."""
    return " ".join(re.sub(r"[_\-]", " ", str(name)).casefold().split())


def listed(names: Sequence[Any]) -> str:
    shown = ", ".join(map(repr, names[:SHOWN]))
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def label_mapping(data_names: Sequence[str], model_names: Sequence[str],
                  given: Mapping[str, str] | None = None) -> list[int] | None:
    """Data label index -> model class index, by name, with the ``--label-map`` pairs ``given`` first (a model label
    given as a number not among the names is a class index); ``None`` when a data class stays unmapped (its name is
    not the model's, or names two of the model's classes) and nothing was given. Raises ``ValueError`` when
    ``given`` names a class the data or the model does not have, or leaves a data class unmapped."""
    given = dict(given or {})
    model_index = _model_index(model_names)
    data_keys = {name_key(name): name for name in data_names}
    unknown = [name for name in given if name_key(name) not in data_keys]
    if unknown:
        raise ValueError(f"--label-map: {listed(unknown)} not among the ID data's class names "
                         f"({listed(list(data_names))})")
    resolved = {}
    for data_name, label in given.items():
        matches = model_index.get(name_key(label), [])
        if not matches and label.isdigit() and int(label) < len(model_names):
            matches = [int(label)]
        if len(matches) != 1:
            why = "names several of the model's classes; give its index" if matches else "is not a model label"
            raise ValueError(f"--label-map {data_name}={label}: {label!r} {why} (model labels: "
                             f"{listed(list(model_names))})")
        resolved[name_key(data_name)] = matches[0]
    mapping, unmapped = [], []
    for name in data_names:
        key = name_key(name)
        matches = _closest(str(name), model_index.get(key, []), model_names)
        index = resolved[key] if key in resolved else (matches[0] if len(matches) == 1 else None)
        unmapped += [name] if index is None else []
        mapping.append(-1 if index is None else index)
    if unmapped:
        if given:
            raise ValueError(f"--label-map leaves the ID data's class(es) {listed(unmapped)} unmapped: give each a "
                             f"model label (model labels: {listed(list(model_names))})")
        return None
    return mapping


def _model_index(model_names: Sequence[str]) -> dict[str, list[int]]:
    """Compared name (:func:`name_key`) -> the model's class indices of that name (several for ImageNet's "crane")."""
    index: dict[str, list[int]] = {}
    for position, name in enumerate(model_names):
        index.setdefault(name_key(name), []).append(position)
    return index


def _closest(name: str, matches: list[int], model_names: Sequence[str]) -> list[int]:
    """``matches`` (the model's classes whose names compare equal to ``name``), narrowed to the one spelled exactly as
    ``name`` where several differ only in case or spacing (``Crane`` and ``crane``): a name the data spells exactly as
    one label is that label."""
    if len(matches) < 2:
        return matches
    exact = [index for index in matches if str(model_names[index]) == name]
    return exact if len(exact) == 1 else matches


def ambiguous_names(data_names: Sequence[str], model_names: Sequence[str],
                    given: Mapping[str, str] | None = None) -> dict[str, list[int]]:
    """The data's class names that name several of the model's classes (ImageNet-1k's ``crane`` is class 134, the bird,
    and class 517, the machine), each with those class indices; names ``given`` a model class are not ambiguous."""
    given_keys = {name_key(name) for name in given or {}}
    model_index = _model_index(model_names)
    found = {}
    for name in data_names:
        matches = _closest(str(name), model_index.get(name_key(name), []), model_names)
        if len(matches) > 1 and name_key(name) not in given_keys:
            found[str(name)] = matches
    return found


def ambiguous_names_error(ambiguous: Mapping[str, Sequence[int]], model_names: Sequence[str]) -> str:
    """Why data classes whose names the model holds twice cannot be labelled, and the way out (``--label-map``, or
    renaming the data's class)."""
    shown = "; ".join(f"{name!r} is model class " + " and ".join(f"{index} ({model_names[index]!r})" for index in indices)
                      for name, indices in list(ambiguous.items())[:SHOWN])
    name, indices = next(iter(ambiguous.items()))
    flag = (f"--label-map {name}={indices[0]}" if "," not in name and "=" not in name
            else f"--label-map FILE.json holding {{{name!r}: {indices[0]}}}")
    return (f"the data's class name(s) name several of the model's classes ({shown}), so nothing says which one the "
            f"data's images are: give each its model class by index (hf-gsc evaluate {flag}; Detector.fit: a "
            "datasets.Dataset whose label column holds the model's class indices as plain integers)")


def model_label_names(config: Any) -> list[str] | None:
    """The names of ``config.id2label`` in class-index order (``None`` when it has none). Unlike ``config.label2id``,
    which holds each name once, it keeps a name given to two classes (ImageNet-1k's ``crane``: 134 and 517)."""
    id2label = getattr(config, "id2label", None) or {}
    return [str(id2label[index]) for index in sorted(id2label, key=int)] or None


def generic_labels(model_names: Sequence[Any] | Mapping[str, Any] | None) -> bool:
    """Whether the model's class names (``id2label`` values, or ``label2id``'s keys) are only transformers'
    placeholders ``LABEL_0``, ``LABEL_1``, ...: nothing a dataset's class names can be matched to."""
    names = list(model_names or [])
    return bool(names) and all(GENERIC_LABEL.fullmatch(str(name)) for name in names)


def generic_labels_error(data_names: Sequence[Any], model_names: Sequence[Any]) -> str:
    """Why named classes cannot meet a model with generic labels, and the ways out: one message for ``Detector.fit`` /
    ``calibrate`` (:mod:`hf_gsc.utils.image_data`) and ``hf-gsc evaluate`` (:mod:`hf_gsc.evaluation.labels`)."""
    example = ", ".join(f"{index}: {name!r}" for index, name in enumerate(list(data_names)[:2]))
    return (f"the model's labels are generic ({listed(sorted(model_names, key=_label_number))}), so the data's "
            f"classes {listed(list(data_names))} cannot be matched to its classes: nothing says which model class "
            "each one is, and a label or an accuracy would compare the data's class order with the model's unchecked. "
            f"Name the model's classes (model.config.id2label = {{{example}, ...}}, model.config.label2id to match, "
            "then save it), or with hf-gsc evaluate give each class its model class (--label-map "
            "DATA_NAME=MODEL_INDEX,...) or accept the data's class order as the model's (--labels-by-order)")


def _label_number(name: Any) -> int:
    match = re.search(r"\d+", str(name))
    return int(match.group()) if match else -1


__all__ = ["GENERIC_LABEL", "ambiguous_names", "ambiguous_names_error", "generic_labels", "generic_labels_error",
           "label_mapping", "listed", "model_label_names", "name_key"]
