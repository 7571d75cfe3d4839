"""A folder written as a unit: every file is written into a staging folder beside it, which then replaces it in one
step, so that a save killed at any point leaves the old folder or the new one, never a mix of the two.

On Linux the two folders are exchanged by one ``renameat2(RENAME_EXCHANGE)`` call; where that is missing (another
system, a file system without it) the old folder is renamed aside and the new one renamed in, two steps between
which the folder's name is briefly absent (the old one waits beside it, ``.NAME.old.*``). What the writer did not
write and the caller keeps (``keep``: a run's ``fit.json``, the user's own notes) is carried into the new folder
as hard links (copies where links cannot be made). Leftovers of a killed write (``.NAME.staging.*``,
``.NAME.old.*`` beside the folder; ``.staging.*`` folders and ``.*.tmp`` files inside it) are removed by the next
write. Two processes writing one folder at once are not supported: the last one wins.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from .confined_files import PathLike


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def is_leftover(name: str) -> bool:
    """Whether ``name``, inside a folder, is what a killed atomic write left (never carried into a new folder)."""
    return name.startswith(".staging.") or (name.startswith(".") and name.endswith(".tmp"))


@contextlib.contextmanager
def written_whole(directory: PathLike, keep: Callable[[str], bool] = lambda name: False) -> Iterator[Path]:
    """A fresh staging folder beside ``directory`` to write the new folder into; when the block ends without an
    error, the entries of the old ``directory`` that the block did not write and that ``keep(name)`` accepts are
    carried over, and the staging folder replaces ``directory`` in one step. On an error nothing of ``directory``
    changes. ``directory`` may be a link named by the caller: the folder it leads to is replaced."""
    directory = Path(os.path.realpath(directory))
    if directory.exists() and not directory.is_dir():
        raise NotADirectoryError(f"{directory} exists and is not a folder; pass a folder to save into")
    parent = directory.parent
    parent.mkdir(parents=True, exist_ok=True)
    aside = sorted(parent.glob(f".{directory.name}.old.*"))
    if aside and not directory.exists():  # killed between the two renames: the old folder comes back first
        os.rename(aside.pop(), directory)
    for leftover in [*parent.glob(f".{directory.name}.staging.*"), *aside]:
        shutil.rmtree(leftover, ignore_errors=True)
    stage = parent / f".{directory.name}.staging.{secrets.token_hex(6)}"
    stage.mkdir()  # the mode a folder gets (not mkdtemp's 0o700): it becomes the saved folder
    try:
        yield stage
        if directory.is_dir():
            _carry_over(directory, stage, keep)
            _swap(stage, directory)
        else:
            os.rename(stage, directory)
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # after the swap: the old folder


def _carry_over(old: Path, stage: Path, keep: Callable[[str], bool]) -> None:
    for name in os.listdir(old):
        if is_leftover(name) or not keep(name) or os.path.lexists(stage / name):
            continue
        source = old / name
        if source.is_symlink():
            os.symlink(os.readlink(source), stage / name)
        elif source.is_dir():
            shutil.copytree(source, stage / name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(source, stage / name)


def _link_or_copy(source: PathLike, target: PathLike) -> None:
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError:
        shutil.copy2(source, target, follow_symlinks=False)


def _swap(stage: Path, directory: Path) -> None:
    """``stage`` becomes ``directory``; the old ``directory`` ends up at ``stage`` (removed by the caller)."""
    if exchange(stage, directory):
        return
    aside = directory.parent / f".{directory.name}.old.{secrets.token_hex(6)}"
    os.rename(directory, aside)
    os.rename(stage, directory)
    os.rename(aside, stage)


def exchange(first: Path, second: Path) -> bool:
    """Exchange two folders in one step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where the system or the
    file system cannot, so that the caller takes two renames instead."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"could not exchange {first} and {second}: {os.strerror(code)}")


__all__ = ["exchange", "is_leftover", "written_whole"]
