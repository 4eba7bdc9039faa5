"""MkDocs hooks: the CLI reference is generated from the argparse parsers, and the benchmark figures are served from
``benchmarks/`` where the scripts write them (one copy of each PNG, no second one under ``docs/``).

``reference/cli.md`` holds the marker ``<!-- cli-reference -->``; :func:`cli_reference_markdown` replaces it with the
``--help`` text of every command, the same ``format_help()`` that ``hf-unlearn ... --help`` prints, at a fixed width
so a build does not depend on the terminal. ``tests/test_docs.py`` checks that every option of every parser is on the
built page.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

MARKER = "<!-- cli-reference -->"
WIDTH = "100"
ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "benchmarks"


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command words, parser) for the parser and every subparser, depth first in registration order."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


def cli_parsers() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    from hf_unlearn.cli import build_parser

    return list(_walk(build_parser()))


def cli_reference_markdown() -> str:
    """One section per command: its description and its ``--help`` text."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH  # argparse wraps at the terminal's width: fix it
    try:
        out = []
        for path, parser in cli_parsers():
            name = " ".join(("hf-unlearn", *path))
            level = "#" * min(2 + len(path) - (1 if path else 0), 4)
            out += [f"{level} `{name}`", "", "```text", parser.format_help().rstrip(), "```", ""]
        return "\n".join(out)
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference_markdown())
    return markdown


def on_files(files, config):
    """Serve ``benchmarks/*.png`` as ``benchmarks/<name>.png`` of the site (the benchmark pages show them)."""
    from mkdocs.structure.files import File

    for png in sorted(FIGURES.glob("*.png")):
        uri = f"benchmarks/{png.name}"
        if files.get_file_from_path(uri) is None:
            files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files
