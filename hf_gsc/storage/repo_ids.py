"""Telling a Hub repo id from a local path."""

from __future__ import annotations

import os


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
