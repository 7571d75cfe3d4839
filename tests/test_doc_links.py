"""Every relative link in the README, CONTRIBUTING.md and the pages under docs/ resolves: the file (or folder)
exists, and a ``#anchor`` names a heading of the target page (GitHub's heading ids)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (a bracket there is code, not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def heading_ids(path: Path) -> set[str]:
    """The ids GitHub gives the page's headings: lower case, punctuation but ``-`` and ``_`` dropped, each space a
    ``-``; a repeated id gets ``-1``, ``-2``, ..."""
    ids: set[str] = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    for title in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        unique, count = slug, 0
        while unique in ids:
            count += 1
            unique = f"{slug}-{count}"
        ids.add(unique)
    return ids


def relative_links(path: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(path.read_text()))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not relative


def test_the_pages_exist_and_hold_links():
    assert (ROOT / "CONTRIBUTING.md").is_file() and (ROOT / "docs" / "index.md").is_file()
    assert relative_links(ROOT / "README.md"), "the link check found no link in the README"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in relative_links(page):
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve() if file_part else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_ids(resolved):
            broken.append(f"{target}: no heading with id {anchor!r} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_heading_ids_are_githubs():
    page = ROOT / "docs" / "evaluation.md"
    assert "hyperparameter-selection-on-validation---tune" in heading_ids(page)  # "(`--tune`)" loses its punctuation


def test_the_readme_is_a_front_door():
    """At most 16 KB, and it names the two commands, the install line and links the pages the rest moved to."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 16 * 1024
    for needed in ("make demo", "make test", "pip install torch --index-url https://download.pytorch.org/whl/cpu",
                   "CONTRIBUTING.md", "docs/gsc.md", "docs/architectures.md", "docs/saved_format.md",
                   "docs/reliability.md", "docs/evaluation.md", "@inproceedings"):
        assert needed in readme, needed


def test_the_site_lists_every_page_and_documents_public_names():
    """mkdocs.yml's nav holds every top-level page of docs/, and the API reference is keyed on public names
    (``::: hf_gsc.OODDetector``), which survive a module moving inside the package."""
    import hf_gsc

    site = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s*([\w/]+\.md)\s*$", site, flags=re.M))
    pages = {str(path.relative_to(ROOT / "docs")) for path in (ROOT / "docs").glob("*.md")}
    pages |= {str(path.relative_to(ROOT / "docs")) for path in (ROOT / "docs" / "api").glob("*.md")}
    assert pages <= listed, f"pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    for page in (ROOT / "docs" / "api").glob("*.md"):
        for name in re.findall(r"^::: ([\w.]+)", page.read_text(), flags=re.M):
            if name.startswith("hf_gsc.app."):  # the demo extra's entry points (gradio): at their module path only
                importlib.import_module(name.rpartition(".")[0])
                continue
            public = name.rsplit(".", 1)[1]
            assert public in hf_gsc.__all__, (page.name, name)
            # A deeper path is only for a name the package exports on first use (the evaluation's, which the site's
            # static reader cannot follow): it must be the very object ``hf_gsc`` exports, or the page goes stale.
            module, _, attribute = name.rpartition(".")
            assert getattr(importlib.import_module(module), attribute) is getattr(hf_gsc, public), (page.name, name)
