"""The evaluation's input error (and the full disk's), in a module of its own so that every layer (the loop, the
plan, the models, the options) raises it without importing the command line."""


class InputError(ValueError):
    """Bad input, found before any expensive work; the message names the argument."""


class DiskFullError(OSError):
    """The disk of ``--output-dir`` filled up during a run; one line naming the folder and what it keeps."""


__all__ = ["DiskFullError", "InputError"]
