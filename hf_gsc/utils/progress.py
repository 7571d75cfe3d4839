"""Quiet internal loads: ``datasets``' progress bars ("Generating train split", "Loading dataset from disk") off
around the library's own reads of local folders, and back to the user's setting after."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def datasets_progress_bars_off() -> Iterator[None]:
    """Inside, ``datasets`` shows no progress bars; on exit they are on again only if they were on before (a user
    who turned them off keeps them off, and one who wants them for their own loads keeps them)."""
    import datasets

    was_on = not datasets.are_progress_bars_disabled()
    if was_on:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


__all__ = ["datasets_progress_bars_off"]
