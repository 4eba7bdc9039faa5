"""Every README snippet runs as written.

Fenced ``python`` and ``bash`` blocks are run, in README order, in one scratch working folder that sits beside a
``shared`` link (so ``../shared/...`` paths resolve as from a checkout) with the repository's ``examples/`` and
``benchmarks/`` linked in, offline (``HF_HUB_OFFLINE=1``) and without ``HF_UNLEARN_DATA_DIR``: what a reader gets
by pasting them. ``text`` (or unlabelled) blocks are command synopses with placeholders and are not run; their
``hf-unlearn`` commands and options are checked against the real parser instead. The markers (``skip``,
``local-hub``, ``standalone``) are described in ``tests/snippets.py``; the docs pages' blocks run the same way
(``tests/test_docs_blocks.py``).

Running the blocks trains small models (minutes on 2 cores), so it belongs to ``pytest -m slow``; the synopsis
check is in the fast suite.
"""

from __future__ import annotations

import pytest

from . import snippets as sn
from .conftest import ROOT

README = (ROOT / "README.md").read_text()
RUNNABLE = sn.runnable(README)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return sn.checkout_folder(tmp_path_factory.mktemp("readme"))


@pytest.mark.slow
@pytest.mark.parametrize("snippet", [pytest.param(s, id=s.id) for s in RUNNABLE])
def test_readme_snippet_runs_as_written(snippet: sn.Snippet, workdir, tmp_path):
    if snippet.mark == "skip":
        pytest.skip(f"README line {snippet.line}: {snippet.reason}")
    proc = sn.run(snippet, tmp_path if snippet.mark == "standalone" else workdir)
    assert proc.returncode == 0, (f"README line {snippet.line} ({snippet.lang}) failed:\n{snippet.code}\n"
                                  f"--- stderr ---\n{proc.stderr[-4000:]}")


def test_synopses_name_real_commands_and_options():
    """Placeholders are fine in a synopsis; a command or option that does not exist is not."""
    assert sn.synopsis_problems(README, "README") == []


def test_the_marker_syntax_is_understood():
    text = "x\n<!-- readme-test: skip needs a Hub login -->\n```bash\nhf auth login\n```\n```text\nA B\n```\n"
    got = sn.snippets(text)
    assert [(s.lang, s.mark, s.reason) for s in got] == [("bash", "skip", "needs a Hub login"), ("text", None, "")]
    local = sn.snippets("<!-- docs-test: local-hub starts its own server -->\n```python\nprint(1)\n```\n")
    assert [(s.mark, s.reason) for s in local] == [("local-hub", "starts its own server")]
    alone = sn.snippets("<!-- docs-test: standalone -->\n```bash\nls\n```\n")
    assert [(s.mark, s.reason) for s in alone] == [("standalone", "")]
