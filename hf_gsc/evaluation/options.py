"""The vocabulary of the evaluation's options: the registered methods (``--methods``, ``--list-methods``),
``--hyperparameter`` parsing, and the allowed values of the device options. The options themselves are
:data:`~hf_gsc.evaluation.arguments.EvaluationArguments`; their checks, :mod:`.validation`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import InputError


#: ``--tpr``'s default: the ID TPR thresholds are calibrated to (FPR@95's operating point).
DEFAULT_TPR = 0.95
#: ``--mixed-precision`` values (accelerate's names); unset = accelerate's config / ``ACCELERATE_MIXED_PRECISION``.
PRECISIONS = ("no", "fp16", "bf16")
#: ``--image-backend`` values: ``auto`` = transformers' default (torchvision when installed, else PIL).
IMAGE_BACKENDS = ("auto", "pil", "torchvision")


def describe_method(cls: type) -> str:
    """One line about a registered method: the first sentence of its docstring, without reST markup and without the
    names of the library's classes (a user names methods, not classes: ``(see ASHDetector)`` is left out, another
    class is named by its method)."""
    text = plain_text((cls.__doc__ or "").strip().split("\n\n")[0])
    text = re.sub(r"\s*\((?:see [^)]*|[^)]*\bhf_gsc\.[^)]*)\)", "", text)
    for name, other in registered_methods().items():
        text = re.sub(rf"\b(?:[\w.]+\.)?{other.__name__}\b", f"the {name} method", text)
    sentence = text.split(". ")[0].rstrip(".")
    return sentence + "."


def plain_text(text: str) -> str:
    """reStructuredText as the terminal shows it: one line, roles (``:class:`~x.Y```) and literals without their
    markup."""
    return re.sub(r":\w+:`~?([^`]+)`", r"\1", " ".join(text.split())).replace("``", "")


def method_lines() -> list[str]:
    """``--list-methods``: one line per registered method (name, what it scores, what it needs)."""
    registered = registered_methods()
    width = max(map(len, registered))
    lines = []
    for name in sorted(registered):
        cls = registered[name]
        notes = [f"fitted on ID {cls.fit_split}"] if getattr(cls, "needs_fit", False) else []
        if name in default_methods():
            notes.append("default")
        suffix = f" [{', '.join(notes)}]" if notes else ""
        lines.append(f"{name:<{width}}  {describe_method(cls)}{suffix}")
    return lines


def registered_methods() -> dict[str, Any]:
    from ..detectors import DETECTORS

    return DETECTORS


def default_methods() -> list[str]:
    """The default of ``--methods`` (and of ``make demo``): the methods whose class sets ``in_default_table``."""
    from ..settings.registry import default_methods as registered_defaults

    registered_methods()  # every method's module imported, so that each has registered
    return registered_defaults()


def parse_methods(text: str | None) -> list[str]:
    """``"gsc, msp"`` -> ``["gsc", "msp"]``; ``"all"`` -> every registered method; ``"all,-she,-knn"`` -> every
    registered method but those; ``None`` -> :func:`default_methods`.

    Unknown or repeated names raise :class:`InputError` naming the nearest registered one.
    """
    registered = registered_methods()
    if text is None:
        return default_methods()
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise InputError(f"--methods is empty; registered methods: {', '.join(sorted(registered))}")
    excluded = [name[1:].strip() for name in names if name.startswith("-")]
    if excluded and names[0] != "all":
        raise InputError(f"--methods {text!r}: '-NAME' excludes a method from 'all' and must follow it "
                         "(--methods all,-she,-knn)")
    methods = sorted(registered) if names[0] == "all" else names
    if names[0] == "all" and len(names) > 1 + len(excluded):
        raise InputError(f"--methods {text!r}: after 'all' only '-NAME' exclusions may follow")
    _check_names(methods if names[0] != "all" else excluded, registered)
    if names[0] == "all":
        methods = [name for name in methods if name not in excluded]
        if not methods:
            raise InputError(f"--methods {text!r} excludes every registered method")
    repeated = sorted({name for name in methods if methods.count(name) > 1})
    if repeated:
        raise InputError(f"--methods: {', '.join(repeated)} given more than once")
    return methods


def _check_names(names: Sequence[str], registered: Mapping[str, Any]) -> None:
    unknown = [name for name in names if name not in registered]
    if unknown:
        from ..settings.registry import suggest_names

        raise InputError(
            f"--methods: unknown method(s) {', '.join(map(repr, unknown))}{suggest_names(unknown, sorted(registered))}; "
            f"registered methods: {', '.join(sorted(registered))}"
        )


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_hyperparameters(items: Sequence[str], methods: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["odin.temperature=1000"]`` -> ``{"odin": {"temperature": 1000}}``."""
    result: dict[str, dict[str, Any]] = {name: {} for name in methods}
    for item in items:
        key, sep, value = item.partition("=")
        method, dot, name = key.partition(".")
        if not sep or not dot or not method or not name:
            raise InputError(f"--hyperparameter {item!r}: expected METHOD.NAME=VALUE, e.g. odin.temperature=1000")
        if method not in result:
            raise InputError(f"--hyperparameter {item!r}: method {method!r} is not in --methods ({', '.join(methods)})")
        result[method][name] = _parse_value(value)
    return result


__all__ = [
    "DEFAULT_TPR",
    "IMAGE_BACKENDS",
    "PRECISIONS",
    "InputError",
    "default_methods",
    "describe_method",
    "method_lines",
    "parse_hyperparameters",
    "parse_methods",
    "registered_methods",
]
