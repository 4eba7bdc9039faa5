"""Every code block of the docs pages runs as written, page by page, in the order the page gives.

Each page's ``python`` and ``bash`` blocks run in one folder of their own, which a page directive sets up (an HTML
comment before the page's first block; the block markers are those of ``tests/snippets.py``):

- no directive: a checkout folder (``../shared`` beside it, ``examples/`` and ``benchmarks/`` linked in);
- ``<!-- docs-test: page empty-folder -->``: an empty folder with nothing beside it (the quickstart: what a reader
  has after ``pip install``);
- ``<!-- docs-test: page after PAGE.md -->``: the folder starts as PAGE's does once its blocks have run (PAGE's blocks
  run there first), so a page that continues another says so and is tested that way;
- ``<!-- docs-test: page skip REASON -->``: no block of the page runs, each is reported as skipped with REASON (the
  benchmark pages: their blocks are the commands that produced the recorded figures, minutes to hours each).

A block marked ``standalone`` runs alone in a new empty folder. Running the blocks trains small models (minutes on
2 cores): ``pytest -m slow``, like the README's. The fast suite checks the directives and every ``hf-unlearn``
synopsis against the parser.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from . import snippets as sn
from .conftest import ROOT

DOCS = ROOT / "docs"
PAGE = re.compile(r"^<!--\s*docs-test:\s*page\s+(.*?)\s*-->\s*$", re.M)  # on a line of its own
ANY_DIRECTIVE = re.compile(r"^<!--\s*(?:docs|readme)-test:\s*(\S+)", re.M)
PAGES = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md") if p.name != "README_MAP.md")


def directive(page: str) -> tuple[str, str | None]:
    """``("checkout", None)``, ``("empty-folder", None)``, ``("after", "other.md")`` or ``("skip", REASON)``."""
    text = (DOCS / page).read_text()
    found = PAGE.findall(text)
    if not found:
        return "checkout", None
    words = found[0].split()
    if words == ["empty-folder"]:
        return "empty-folder", None
    if len(words) == 2 and words[0] == "after":
        return "after", words[1]
    if len(words) >= 2 and words[0] == "skip":
        return "skip", " ".join(words[1:])
    raise ValueError(f"docs/{page}: unknown page directive {found[0]!r}")


def _blocks(page: str) -> list[sn.Snippet]:
    return sn.runnable((DOCS / page).read_text())


@pytest.fixture(scope="session")
def page_folders(tmp_path_factory):
    """page -> the folder its blocks run in, created (and set up) on first use."""
    folders: dict[str, Path] = {}

    def get(page: str, chain: tuple[str, ...] = ()) -> Path:
        if page in folders:
            return folders[page]
        kind, other = directive(page)
        base = tmp_path_factory.mktemp("docs-" + page.replace("/", "-").removesuffix(".md"))
        if kind == "empty-folder":
            work = base / "work"
            work.mkdir()
        elif kind == "checkout":
            work = sn.checkout_folder(base)
        else:
            assert other not in chain, f"docs/{page}: a cycle of `after` directives"
            work = base / "work"
            work.mkdir()
            _replay(other, work, chain + (page,), get)
        folders[page] = work
        return work

    return get


def _replay(page: str, work: Path, chain, get) -> None:
    """Run ``page``'s blocks (and what it needs first) in ``work``: the state a continuing page starts from."""
    kind, other = directive(page)
    if kind == "checkout":
        for name in ("examples", "benchmarks"):
            (work / name).symlink_to(ROOT / name)
        (work.parent / "shared").symlink_to(sn.SHARED)
    elif kind == "after":
        _replay(other, work, chain + (page,), get)
    for s in _blocks(page):
        if s.mark in ("skip", "standalone"):
            continue
        proc = sn.run(s, work)
        assert proc.returncode == 0, f"setting up from docs/{page} line {s.line} failed:\n{proc.stderr[-3000:]}"


CASES = [pytest.param(page, s, id=f"{page}:{s.id}") for page in PAGES for s in _blocks(page)]


@pytest.mark.slow
@pytest.mark.parametrize("page,snippet", CASES)
def test_docs_block_runs_as_written(page: str, snippet: sn.Snippet, page_folders, tmp_path):
    kind, reason = directive(page)
    if kind == "skip":
        pytest.skip(f"docs/{page}: {reason}")
    if snippet.mark == "skip":
        pytest.skip(f"docs/{page} line {snippet.line}: {snippet.reason}")
    work = tmp_path if snippet.mark == "standalone" else page_folders(page)
    proc = sn.run(snippet, work)
    assert proc.returncode == 0, (f"docs/{page} line {snippet.line} ({snippet.lang}) failed:\n{snippet.code}\n"
                                  f"--- stderr ---\n{proc.stderr[-4000:]}")


def test_page_directives_are_understood_and_name_real_pages():
    for page in PAGES:
        text = (DOCS / page).read_text()
        for word in ANY_DIRECTIVE.findall(text):
            assert word in ("page", "skip", "local-hub", "standalone"), f"docs/{page}: unknown marker {word!r}"
        kind, other = directive(page)
        if kind == "after":
            assert other in PAGES, f"docs/{page}: `after {other}` names no page"
            assert directive(other)[0] != "skip", f"docs/{page}: continues {other}, whose blocks do not run"
            assert directive(other)[0] != "after" or directive(other)[1] != page, f"docs/{page}: a cycle"


def test_docs_synopses_name_real_commands_and_options():
    problems = []
    for page in PAGES:
        problems += sn.synopsis_problems((DOCS / page).read_text(), f"docs/{page}")
    assert problems == []


def test_the_readme_example_is_the_tested_quickstart():
    """The README's example blocks are the quickstart's (run in an empty folder above), so they cannot drift."""
    quick = [s.code for s in _blocks("quickstart.md")]
    readme = [s.code for s in sn.runnable((ROOT / "README.md").read_text()) if s.mark != "skip"]
    assert readme and all(code in quick for code in readme)


def test_the_directive_parser():
    assert directive("quickstart.md") == ("empty-folder", None)
    assert directive("service.md") == ("after", "quickstart.md")
    assert directive("exact-deletion.md") == ("checkout", None)
    assert directive("development.md") == ("checkout", None)  # it names the directives inline: not one itself
    for page in PAGES:  # a block of a benchmark page runs a benchmark (minutes to hours): never in the tests
        if page.startswith("benchmarks/") and _blocks(page):
            assert directive(page)[0] == "skip", f"docs/{page} has runnable blocks and no `page skip` directive"
