"""The names a split point may have (:mod:`hf_gsc.classifier.split_points` resolves them on a model): the named
ones and the dotted module paths, checked without a model and without torch, so that the config checks
(:func:`hf_gsc.settings.config.split_point_check`) and the command line read them at once.
"""

from __future__ import annotations

import re
from collections.abc import Sequence


NAMED_SPLIT_POINTS = ("final_encoder_output", "penultimate")
_PATH_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.([A-Za-z_][A-Za-z0-9_]*|-?[0-9]+))*$")


def validate_split_point_name(split_point: str) -> None:
    """Raise ``ValueError`` unless ``split_point`` is a named split point or a well-formed dotted path."""
    if not isinstance(split_point, str) or not (
        split_point in NAMED_SPLIT_POINTS or _PATH_PATTERN.match(split_point)
    ):
        raise ValueError(
            f"split_point must be one of {NAMED_SPLIT_POINTS} or a dotted module path such as "
            f"'vit.layers.-2' (names and integer indices only), got {split_point!r}"
        )


def split_point_name_list(name: str, value: object, example: str, *, distinct: bool = False) -> tuple[str, ...] | None:
    """A setting holding ``None`` or a non-empty list of split point names (``distinct``: no name twice), as a tuple
    (saved as a JSON list); ``ValueError`` naming the setting ``name`` and showing ``example`` otherwise."""
    if value is None:
        return None
    if (isinstance(value, str) or not isinstance(value, Sequence) or not value
            or (distinct and len(set(value)) != len(value))):
        raise ValueError(f"{name} must be None or a non-empty list of {'distinct ' if distinct else ''}split points "
                         f"such as {example}, got {value!r}")
    for point in value:
        try:
            validate_split_point_name(point)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None
    return tuple(value)
