"""Telling a Hub repo id from a local path."""

from __future__ import annotations

import os


def check_source(value: object, name: str = "pretrained_model_name_or_path") -> None:
    """Refuse (``TypeError`` naming ``name``) a ``from_pretrained`` source that is no folder, Hub id or loaded model,
    before it reaches a library below (``from_pretrained(42)`` would end in ``os.fspath``'s message)."""
    import torch

    if not isinstance(value, (str, os.PathLike, torch.nn.Module)):
        raise TypeError(f"{name} must be a saved detector or image classifier: a folder (str or os.PathLike), a Hub "
                        f"repo id or a loaded model (torch.nn.Module); got {type(value).__name__} {value!r:.60}")


def is_hub_id(name: str | None) -> bool:
    """Whether ``name`` can only mean a Hub repo id: a valid ``[namespace/]name`` that is no local folder."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or os.path.isdir(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def looks_local(name: str | None) -> bool:
    """Whether ``name`` reads as a local path rather than a Hub repo id: absolute, starting with ``.`` / ``~``, with a
    backslash or more than one ``/``, or not a valid repo id at all. ``models/vit3`` is a valid repo id and does not
    look local (it goes to the Hub when no such folder exists); ``/home/me/models/vit3`` and ``./models/vit3`` do."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name:
        return False
    if os.path.isabs(name) or name.startswith((".", "~")) or "\\" in name or name.count("/") > 1:
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def stored_reference(name: str | None) -> str | None:
    """The form in which a base model reference is stored in a saved detector: a local folder as its absolute path
    (so that the saved folder loads from any working directory), anything else as it is."""
    if name and os.path.isdir(name):
        return os.path.abspath(name)
    return name
