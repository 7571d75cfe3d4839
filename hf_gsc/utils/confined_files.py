"""Reading and writing folders without following symbolic links out of them.

A folder hf_gsc reads (an evaluation's results) or writes (an evaluation's output, a saved detector) may hold
links that someone else planted. Two rules hold everywhere:

* **Reads stay inside.** A file read from a folder is refused (:class:`LinkError`, naming the link) when a link
  on its way leads outside the folder: a ``results.md`` linked to ``~/.ssh/id_rsa`` is neither pasted into a
  model card nor uploaded.
* **Writes stay inside and are atomic.** A file is written to a temporary file created in its own folder
  (``O_EXCL``, random name, so no planted link is opened) and moved into place with ``os.replace``, which
  replaces a link at the destination instead of writing through it. A folder on the way from the root to the
  file that is a link leading outside is refused. A crash leaves the old file or the new one, never half of one.

Links that stay inside the folder are followed as usual.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Union


PathLike = Union[str, "os.PathLike[str]"]


class LinkError(ValueError):
    """A symbolic link would lead a read or a write out of the folder being read or written."""


def _is_inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _relative(root: PathLike, path: PathLike) -> Path:
    """``path`` relative to ``root``: a relative ``path`` already is; an absolute one must lie under ``root``."""
    relative = Path(os.path.relpath(path, os.path.abspath(root))) if os.path.isabs(path) else Path(path)
    if relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"{path} is not inside {root}")
    return relative


def check_inside(root: PathLike, path: PathLike) -> Path:
    """``path`` (relative to ``root``, or absolute under it) after checking that no link on the way from ``root``
    to it leads outside ``root``; returns the fully resolved path.

    Only the components below ``root`` are checked: ``root`` itself may be a link (the caller named it).

    Raises:
        LinkError: naming the first link that leads outside ``root`` and where it points.
        ValueError: ``path`` is not below ``root`` (``..``, another absolute path).
    """
    root = Path(root)
    real_root = os.path.realpath(root)
    relative = _relative(root, path)
    current = root
    for part in relative.parts:
        current = current / part
        if current.is_symlink():
            target = os.path.realpath(current)
            if not _is_inside(target, real_root):
                raise LinkError(
                    f"{current} is a symbolic link to {target}, outside {root}; hf_gsc does not follow links out of "
                    "a folder it reads or writes. Replace the link by the file itself"
                )
    return Path(os.path.realpath(root / relative))


# ----------------------------------------------------------------------------- reading
def read_bytes(root: PathLike, path: PathLike) -> bytes:
    """The content of ``path`` inside ``root`` (see :func:`check_inside`)."""
    return check_inside(root, path).read_bytes()


def read_text(root: PathLike, path: PathLike) -> str:
    return read_bytes(root, path).decode("utf-8")


def is_file(root: PathLike, path: PathLike) -> bool:
    """Whether ``path`` inside ``root`` is a file; a link to a file outside ``root`` raises :class:`LinkError`
    instead of answering (a planted link is refused, not silently left out)."""
    return check_inside(root, path).is_file() if os.path.lexists(Path(root) / path) else False


def find_files(root: PathLike, pattern: str) -> list[Path]:
    """Files under ``root`` whose name matches ``pattern`` (``fnmatch``), relative to ``root``, sorted.

    Linked folders are not descended into; a matching link that leads outside ``root`` raises :class:`LinkError`.
    """
    root = Path(root)
    found = []
    for folder, _, names in os.walk(root, followlinks=False):
        for name in names:
            if fnmatch.fnmatch(name, pattern):
                path = Path(folder) / name
                check_inside(root, path.relative_to(root))
                found.append(path.relative_to(root))
    return sorted(found)


# ----------------------------------------------------------------------------- writing
def make_dirs(root: PathLike, path: PathLike) -> Path:
    """Create the folder ``path`` (relative to ``root``, or absolute under it), its parents and ``root``, refusing
    a link on the way that leads outside ``root`` (:class:`LinkError`); returns ``root / path``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    relative = _relative(root, path)
    check_inside(root, relative)
    (root / relative).mkdir(parents=True, exist_ok=True)
    # Checked again: a link planted between the check and mkdir would have been followed by mkdir.
    check_inside(root, relative)
    return root / relative


@contextlib.contextmanager
def atomic_open(path: PathLike, root: PathLike | None = None) -> Iterator[IO[bytes]]:
    """A binary handle whose content replaces ``path`` when the block ends without an error.

    ``root``: the folder ``path`` belongs to (default: ``path``'s own folder); the folders from ``root`` to
    ``path`` are created and must not be links leading outside ``root``. The destination itself is replaced,
    never written through, even when it is a link.
    """
    path = Path(os.path.abspath(path))
    folder = make_dirs(path.parent if root is None else root, path.parent)
    descriptor, tmp = _create_temporary(folder, path.name)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, folder / path.name)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _create_temporary(folder: Path, name: str) -> tuple[int, Path]:
    """A new file next to ``name`` in ``folder``: ``O_EXCL`` (a planted file or link there is never opened) and
    mode ``0o666`` less the umask, as ``open(path, "w")`` would create it (``mkstemp`` would make it 0o600)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = folder / f".{name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file next to {folder / name}")


def atomic_write_bytes(path: PathLike, data: bytes, root: PathLike | None = None) -> Path:
    """Write ``data`` to ``path`` atomically and never through a link (see :func:`atomic_open`)."""
    with atomic_open(path, root) as handle:
        handle.write(data)
    return Path(path)


def atomic_write_text(path: PathLike, text: str, root: PathLike | None = None) -> Path:
    """UTF-8 ``text`` to ``path`` atomically (no newline translation), never through a link."""
    return atomic_write_bytes(path, text.encode("utf-8"), root)


def save_file(
    tensors: Mapping[str, Any], path: PathLike, metadata: Mapping[str, str] | None = None,
    root: PathLike | None = None,
) -> Path:
    """``safetensors.torch.save_file``, written atomically and never through a link."""
    from safetensors.torch import save

    data = save({key: value.detach().cpu().contiguous() for key, value in tensors.items()},
                dict(metadata) if metadata is not None else None)
    return atomic_write_bytes(path, data, root)


def copy_file(source_root: PathLike, relative: PathLike, target_root: PathLike) -> Path:
    """Copy ``source_root/relative`` to ``target_root/relative``: read without leaving ``source_root``, written
    atomically without leaving ``target_root``."""
    source = check_inside(source_root, relative)
    target = Path(target_root) / relative
    with open(source, "rb") as reader, atomic_open(target, target_root) as writer:
        shutil.copyfileobj(reader, writer)
    return target


@contextlib.contextmanager
def staged_writes(directory: PathLike) -> Iterator[Path]:
    """A fresh empty folder for a writer that opens its files itself (``transformers``' ``save_pretrained``);
    when the block ends, every file written there is moved into ``directory`` with ``os.replace``.

    So third-party writers get the same guarantees as :func:`atomic_open`: nothing is written through a link
    planted in ``directory``, and each file appears whole.
    """
    directory = make_dirs(directory, ".")
    stage = Path(tempfile.mkdtemp(dir=directory, prefix=".staging."))
    try:
        yield stage
        for folder, _, names in os.walk(stage):
            relative_folder = Path(folder).relative_to(stage)
            target = make_dirs(directory, relative_folder)
            for name in names:
                os.replace(Path(folder) / name, target / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


__all__ = [
    "LinkError",
    "atomic_open",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_inside",
    "copy_file",
    "find_files",
    "is_file",
    "make_dirs",
    "read_bytes",
    "read_text",
    "save_file",
    "staged_writes",
]
