"""Where the documentation installed with hf_gsc is: the pages of ``docs/`` travel inside the package (pyproject.toml
maps the top-level ``docs/`` to the package ``hf_gsc.docs``), so a pip user reads the pages of the
version they run without a network; ``hf-gsc docs`` prints the folder and ``hf-gsc docs PAGE`` a page. The project
has no hosted documentation site, so no URL is named anywhere (``make docs`` builds one locally from the same
pages).

The API pages (``api/*.md``) are written for the site's generator: a line ``::: hf_gsc.NAME`` stands for that
object's reference, generated from its docstring. Printed here, each such line becomes the object's signature and
docstring (what ``help(hf_gsc.NAME)`` shows, which the page also names), so the installed pages read whole.
Output to a pipe that closes early (``hf-gsc docs evaluation | head``) ends quietly.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path


#: The documentation's folder inside the installed package (and at the top of a checkout): the one place it is named.
DOCS_FOLDER = "docs"
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: Where the pages are looked for: inside the installed package (a wheel), then beside it (a checkout).
DOCS_CANDIDATES = (_PACKAGE_DIR / DOCS_FOLDER, _PACKAGE_DIR.parent / DOCS_FOLDER)
#: The ``hf-gsc docs`` line of ``hf-gsc --help``.
DOCS_HELP = "print where the documentation installed with the package is; 'hf-gsc docs PAGE' prints a page"


def docs_dir() -> Path | None:
    """The folder of the documentation pages (``index.md`` and the others), ``None`` when neither candidate has them."""
    return next((path for path in DOCS_CANDIDATES if (path / "index.md").is_file()), None)


#: The pages (pyproject.toml's package data for ``hf_gsc.docs`` holds the same, with the figures the pages show).
PAGE_GLOBS = ("*.md", "api/*.md")


def pages(folder: Path) -> list[str]:
    """The page names of ``folder`` (``evaluation`` for ``evaluation.md``, ``api/pipeline`` for the API pages)."""
    return sorted(path.relative_to(folder).with_suffix("").as_posix() for pattern in PAGE_GLOBS
                  for path in folder.glob(pattern))


def docs_main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """``hf-gsc docs [PAGE]``: the documentation folder and its pages, or one page's markdown."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("page", nargs="?", help="a page to print, e.g. evaluation, inputs, saved_format")
    args = parser.parse_args(argv)
    folder = docs_dir()
    if folder is None:
        print(f"error: no documentation found at {' or '.join(map(str, DOCS_CANDIDATES))}", file=sys.stderr)
        return 1
    names = pages(folder)
    if args.page is None:
        print(f"The documentation of this hf_gsc installation: {folder}\npages (markdown): {', '.join(names)}\n"
              f"Print one with '{prog or 'hf-gsc docs'} PAGE'; start at index.md.")
        return 0
    page = args.page.removesuffix(".md")
    if page not in names:
        print(f"error: no page {args.page!r} in {folder}; pages: {', '.join(names)}", file=sys.stderr)
        return 2
    text = (folder / f"{page}.md").read_text(encoding="utf-8")
    _write(render_references(text) if page.startswith("api/") else text)
    return 0


#: A site generator's reference line (mkdocstrings): ``::: dotted.name``, options indented below it.
_REFERENCE = re.compile(r"^::: *([A-Za-z_][\w.]*)[ \t]*\n((?:[ \t]+.*\n)*)", re.MULTILINE)


def render_references(text: str) -> str:
    """``text`` with each ``::: dotted.name`` line replaced by that object's signature and docstring."""
    return _REFERENCE.sub(lambda match: _reference(match.group(1)), text if text.endswith("\n") else text + "\n")


def _reference(dotted: str) -> str:
    found = _resolve(dotted)
    if found is None:
        return f"`{dotted}`: see `help({dotted})` in Python.\n"
    signature = ""
    if callable(found):
        try:
            signature = str(inspect.signature(found))
        except (TypeError, ValueError):
            pass
    doc = inspect.getdoc(found) or "(no docstring)"
    return f"### `{dotted}{signature}`\n\n(`help({dotted})` in Python)\n\n{doc}\n"


def _resolve(dotted: str) -> object | None:
    """The object a dotted name names (module attributes followed from the longest importable module)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                found = getattr(found, name)
        except AttributeError:
            return None
        return found
    return None


def _write(text: str) -> None:
    """Print ``text``; a reader that closed the pipe early (``| head``) ends the output quietly."""
    try:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would report the broken pipe again when it flushes stdout at exit: point stdout at devnull.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


__all__ = ["DOCS_CANDIDATES", "DOCS_FOLDER", "DOCS_HELP", "PAGE_GLOBS", "docs_dir", "docs_main", "pages",
           "render_references"]
