"""Every README snippet runs as written.

Fenced ``python`` and ``bash`` blocks are run, in README order, in one scratch working folder that sits beside a
``shared`` link (so ``../shared/...`` paths resolve as from a checkout) with the repository's ``examples/`` and
``benchmarks/`` linked in, offline (``HF_HUB_OFFLINE=1``) and without ``HF_UNLEARN_DATA_DIR``: what a reader gets
by pasting them. ``text`` (or unlabelled) blocks are command synopses with placeholders and are not run; their
``hf-unlearn`` commands and options are checked against the real parser instead.

Running the blocks trains small models (minutes on 2 cores), so it belongs to ``pytest -m slow``; the synopsis
check is in the fast suite. A block that cannot run here (a real Hub login, a fragment of a larger script) is
marked by an HTML comment on the line before it, ``<!-- readme-test: skip REASON -->``, and reported as skipped
with its reason. A block that talks only to a local Hub server it starts itself says so with
``<!-- readme-test: local-hub REASON -->`` and runs without ``HF_HUB_OFFLINE`` (huggingface_hub's offline mode
refuses every request, the loopback included); every other Hub request still has nowhere to go.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import ROOT, SHARED

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!--\s*readme-test:\s*(skip|local-hub)\s*(.*?)\s*-->\s*$")


@dataclass
class Snippet:
    index: int
    line: int
    lang: str
    code: str
    mark: str | None
    reason: str

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.lang}"


def snippets(text: str | None = None) -> list[Snippet]:
    text = text if text is not None else (ROOT / "README.md").read_text()
    out = []
    for n, m in enumerate(FENCE.finditer(text)):
        before = text[: m.start()].rstrip("\n").splitlines()
        mark = MARK.search(before[-1]) if before else None
        out.append(Snippet(n, text[: m.start()].count("\n") + 1, m.group(1) or "text", m.group(2),
                           mark.group(1) if mark else None, mark.group(2) if mark else ""))
    return out


RUNNABLE = [s for s in snippets() if s.lang in ("python", "bash")]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    base = tmp_path_factory.mktemp("readme")
    (base / "shared").symlink_to(SHARED)
    work = base / "work"
    work.mkdir()
    for name in ("examples", "benchmarks"):
        (work / name).symlink_to(ROOT / name)
    return work


def _env(work: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HF_UNLEARN_DATA_DIR"}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_UNLEARN_KEY_FILE=str(work / ".key" / "id_tag.key"), PATH=f"{Path(sys.executable).parent}:"
               f"{env.get('PATH', '')}")
    return env


@pytest.mark.slow
@pytest.mark.parametrize("snippet", [pytest.param(s, id=s.id) for s in RUNNABLE])
def test_readme_snippet_runs_as_written(snippet: Snippet, workdir):
    if snippet.mark == "skip":
        pytest.skip(f"README line {snippet.line}: {snippet.reason}")
    if snippet.lang == "python":
        cmd = [sys.executable, "-c", snippet.code]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", snippet.code]
    env = _env(workdir)
    if snippet.mark == "local-hub":
        env.pop("HF_HUB_OFFLINE")
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # a closed port: a request to any Hub but its own server fails at once
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (f"README line {snippet.line} ({snippet.lang}) failed:\n{snippet.code}\n"
                                  f"--- stderr ---\n{proc.stderr[-4000:]}")


def _commands(code: str) -> list[list[str]]:
    """``hf-unlearn ...`` invocations in a block (comments and continuation lines folded)."""
    code = code.replace("\\\n", " ")
    out = []
    for line in code.splitlines():
        line = line.split("  #")[0].split(" # ")[0].strip()
        if line.startswith("hf-unlearn "):
            try:
                out.append(shlex.split(line)[1:])
            except ValueError:
                continue
    return out


def test_synopses_name_real_commands_and_options():
    """Placeholders are fine in a synopsis; a command or option that does not exist is not."""
    import argparse

    from hf_unlearn.cli import build_parser

    parser = build_parser()
    problems = []
    for s in snippets():
        for argv in _commands(s.code):
            node, words = parser, list(argv)
            while words:
                sub = next((a for a in node._actions if isinstance(a, argparse._SubParsersAction)), None)
                names = words[0].split("|")  # `a|b|c`: alternatives, each must exist
                if sub is None or names[0] not in sub.choices:
                    break
                problems += [f"line {s.line}: unknown command {n!r}" for n in names if n not in sub.choices]
                node = sub.choices[names[0]]
                words.pop(0)
            if node is parser:
                problems.append(f"line {s.line}: unknown command in {' '.join(argv)!r}")
                continue
            known = {o for a in node._actions for o in a.option_strings}
            for w in words:
                flag = w.strip("[]|").split("=")[0]
                if flag.startswith("--") and flag not in known and flag != "--help":
                    problems.append(f"line {s.line}: {' '.join(argv[:2])} has no option {flag}")
    assert problems == []


def test_the_marker_syntax_is_understood():
    text = "x\n<!-- readme-test: skip needs a Hub login -->\n```bash\nhf auth login\n```\n```text\nA B\n```\n"
    got = snippets(text)
    assert [(s.lang, s.mark, s.reason) for s in got] == [("bash", "skip", "needs a Hub login"), ("text", None, "")]
    local = snippets("<!-- readme-test: local-hub starts its own server -->\n```python\nprint(1)\n```\n")
    assert [(s.mark, s.reason) for s in local] == [("local-hub", "starts its own server")]
