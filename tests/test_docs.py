"""The documentation site builds in strict mode, its CLI reference is the parsers' own help, its API reference holds
every public name.

``mkdocs build --strict`` fails on a broken link or anchor, a page missing from the nav (or a nav entry without a
page), and a docstring reference mkdocstrings cannot resolve: this is the check CI runs through ``make test``. The
build writes to a temporary folder (about 15 s on 2 cores).
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from .conftest import ROOT


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_reference_hooks", ROOT / "docs" / "hooks" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        pytest.fail("the docs site needs the docs extra: pip install -e '.[docs]' (part of dev, which `make test` installs)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-6000:]}"
    return out


def _text(path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", path.read_text(encoding="utf-8")))


def test_every_cli_command_and_option_is_in_the_cli_reference(site):
    page = _text(site / "reference" / "cli.html")
    missing = []
    for path, parser in _hooks().cli_parsers():
        name = " ".join(("hf-unlearn", *path))
        if name not in page:
            missing.append(name)
        for action in parser._actions:
            missing += [f"{name} {o}" for o in action.option_strings if o not in page]
    assert missing == []


def test_cli_reference_is_the_parsers_help_text(site):
    """Each command's section is exactly what ``--help`` prints at the reference's width."""
    from contextlib import redirect_stdout
    from io import StringIO

    from hf_unlearn.cli import build_parser

    page = _text(site / "reference" / "cli.html")
    os.environ["COLUMNS"], old = _hooks().WIDTH, os.environ.get("COLUMNS")
    try:
        for argv in (["forget"], ["trace", "replay"], ["requests", "serve"], ["hub", "verify"]):
            out = StringIO()
            with redirect_stdout(out), pytest.raises(SystemExit):
                build_parser().parse_args([*argv, "--help"])
            assert out.getvalue().strip() in page, f"hf-unlearn {' '.join(argv)} --help differs from the reference"
    finally:
        os.environ.pop("COLUMNS") if old is None else os.environ.__setitem__("COLUMNS", old)


def test_every_public_name_is_in_the_api_reference(site):
    import hf_unlearn

    page = (site / "reference" / "api.html").read_text(encoding="utf-8")
    anchors = set(re.findall(r'id="(hf_unlearn\.[\w.]+)"', page))
    missing = [n for n in hf_unlearn.__all__ if n != "__version__"
               and f"{hf_unlearn._LAZY[n]}.{n}" not in anchors]
    assert missing == []


def test_benchmark_figures_are_on_the_pages(site):
    """The figures named by the issue are shown (the PNGs come from benchmarks/, where the scripts write them)."""
    shown = {}
    for page in (site / "benchmarks").glob("*.html"):
        for src in re.findall(r'<img[^>]+src="([^"]+\.png)"', page.read_text(encoding="utf-8")):
            target = (page.parent / src).resolve()
            assert target.is_file(), f"{page}: {src} is not in the site"
            shown[target.name] = page
    for name in ("trace_replay_cost.png", "checkpoint_storage.png", "requests_batching.png", "robustness_tiny.png"):
        assert name in shown, f"{name} is not shown on any benchmark page"


def test_the_site_keeps_file_urls_and_offline_search(site):
    """Opened as build/docs/index.html (file://, as the README says), a link to a folder shows a directory listing and a
    search worker cannot start: every link is to a NAME.html file, and search has its inlined index and its local
    worker shim (nothing fetched from the network). tests/test_docs_browser.py loads the pages in Chromium."""
    import yaml

    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"), Loader=yaml.BaseLoader)
    assert config["use_directory_urls"] == "false"
    assert "offline" in config["plugins"] and "search" in config["plugins"]
    for shim in config["extra"]["polyfills"]:
        assert not re.match(r"^[a-z]+://", shim) and (ROOT / "docs" / shim).is_file(), shim
    assert (site / "search" / "search_index.js").is_file()
    folders = []
    for page in set(site.rglob("*.html")) - {site / "404.html"}:  # 404.html is for servers: its links are absolute
        for href in re.findall(r'<a [^>]*href="([^"]*)"', page.read_text(encoding="utf-8")):
            if re.match(r"^([a-z]+:|#)", href):
                continue
            target = page.parent / href.split("#")[0]
            if href.split("#")[0] and not target.is_file():
                folders.append(f"{page.relative_to(site)}: {href}")
    assert folders == []


ISSUE_NUMBER = re.compile(r"(?i)\bissues?[ -]*#?\d+|(?<![\w&/#])#\d+\b")


def test_no_page_names_an_issue_number(site):
    """A reader cannot see the project's tracker: the docs name capabilities, never "issue #31" or "#16"."""
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    hits = [f"{path.relative_to(ROOT)}:{n}: {m.group(0)}" for path in sources
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            for m in ISSUE_NUMBER.finditer(line)]
    hits += [f"{page.relative_to(site)}: {m.group(0)}" for page in site.rglob("*.html")
             for m in ISSUE_NUMBER.finditer(_text(page))]
    assert hits == []
    assert ISSUE_NUMBER.search("the guards (issue #31)") and ISSUE_NUMBER.search("issues #15/#16")
    assert ISSUE_NUMBER.search("the issue-#16 run") and not ISSUE_NUMBER.search("seed 16, step #")


def test_readme_links_lead_to_files():
    """README.md and benchmarks/README.md are outside the site (mkdocs does not check them): their relative links must
    name files that exist."""
    broken = []
    for readme in (ROOT / "README.md", ROOT / "benchmarks" / "README.md"):
        for target in re.findall(r"\]\(([^)\s]+)\)", readme.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+://", target):
                continue
            path = (readme.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{readme.relative_to(ROOT)}: {target}")
    assert broken == []


def test_sphinx_roles_in_docstrings_become_links_to_rendered_objects_or_code():
    spec = importlib.util.spec_from_file_location("docs_sphinx_roles", ROOT / "docs" / "hooks" / "sphinx_roles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    convert = module.SphinxRoles()._convert
    assert convert("see :func:`forget`.") == "see [`forget`][hf_unlearn.deletion.forget]."
    assert convert(":class:`~hf_unlearn.TraceRecordingTrainer`") == \
        "[`TraceRecordingTrainer`][hf_unlearn.trace.recording.TraceRecordingTrainer]"
    assert convert("raises :class:`UnlearnError`") == "raises `UnlearnError`"  # not on the API page: code, no link
    assert convert(":mod:`hf_unlearn.keys`") == "`hf_unlearn.keys`"
