"""Quiet internal loads: ``datasets``' progress bars ("Generating train split", "Loading dataset from disk") off
around the library's own reads of local folders, and back to the user's setting after; a read that takes longer than
:data:`NOTE_AFTER_SECONDS` (the first read of a tree of class folders indexes every image: minutes for a large
one) says so in one line on stderr, and how long it took when done, instead of leaving the terminal silent."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator


#: A quiet read that lasts longer than this says that it is still reading (and, when done, how long it took).
NOTE_AFTER_SECONDS = 3.0
#: The line it prints (``{what}``: what is being read).
STILL_READING = ("hf_gsc: still reading {what} (the first read of a folder of images lists and indexes every file; "
                 "later runs read datasets' cache) ...")


@contextlib.contextmanager
def datasets_progress_bars_off(what: str = "a local dataset folder") -> Iterator[None]:
    """Inside, ``datasets`` shows no progress bars; on exit they are on again only if they were on before (a user
    who turned them off keeps them off, and one who wants them for their own loads keeps them). A block that lasts
    longer than :data:`NOTE_AFTER_SECONDS` prints :data:`STILL_READING` once, and its duration at the end."""
    import datasets

    was_on = not datasets.are_progress_bars_disabled()
    if was_on:
        datasets.disable_progress_bars()
    start, noted = time.perf_counter(), threading.Event()

    def note() -> None:
        noted.set()
        print(STILL_READING.format(what=what), file=sys.stderr, flush=True)

    timer = threading.Timer(NOTE_AFTER_SECONDS, note)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        if noted.is_set():
            print(f"hf_gsc: read {what} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        if was_on:
            datasets.enable_progress_bars()


__all__ = ["NOTE_AFTER_SECONDS", "STILL_READING", "datasets_progress_bars_off"]
