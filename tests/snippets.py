"""Code blocks of the README and of the docs pages, and how the tests run them as a reader would.

Fenced ``python`` and ``bash`` blocks are run; ``text`` (or unlabelled) blocks are command synopses with placeholders
and are not run, but their ``hf-unlearn`` commands and options are checked against the real parser. A block is
marked by an HTML comment on the line before it (``readme-test:`` and ``docs-test:`` mean the same):

- ``<!-- docs-test: skip REASON -->``: not run here (a real Hub login, a fragment of a larger script); reported as
  skipped with its reason;
- ``<!-- docs-test: local-hub REASON -->``: talks only to a Hub server it starts itself on 127.0.0.1, so it runs
  without ``HF_HUB_OFFLINE`` (huggingface_hub's offline mode refuses the loopback too); any other Hub is a closed port;
- ``<!-- docs-test: standalone REASON -->``: runs on its own in a new empty folder, as a reader who pastes only it.

Everything runs offline (``HF_HUB_OFFLINE=1``), without ``HF_UNLEARN_DATA_DIR``, with a throwaway id-tag key.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .conftest import ROOT, SHARED

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!--\s*(?:readme|docs)-test:\s*(skip|local-hub|standalone)\s*(.*?)\s*-->\s*$")
RUNNABLE_LANGS = ("python", "bash")


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


def snippets(text: str) -> list[Snippet]:
    out = []
    for n, m in enumerate(FENCE.finditer(text)):
        before = text[: m.start()].rstrip("\n").splitlines()
        mark = MARK.search(before[-1]) if before else None
        out.append(Snippet(n, text[: m.start()].count("\n") + 1, m.group(1) or "text", m.group(2),
                           mark.group(1) if mark else None, mark.group(2) if mark else ""))
    return out


def runnable(text: str) -> list[Snippet]:
    return [s for s in snippets(text) if s.lang in RUNNABLE_LANGS]


def checkout_folder(base: Path) -> Path:
    """``base/work`` beside a ``shared`` link, with the repository's examples/ and benchmarks/ linked in: what a
    reader has in a checkout with ../shared beside it."""
    (base / "shared").symlink_to(SHARED)
    work = base / "work"
    work.mkdir()
    for name in ("examples", "benchmarks"):
        (work / name).symlink_to(ROOT / name)
    return work


def env_for(work: Path, local_hub: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_UNLEARN_DATA_DIR", "HF_ENDPOINT", "HF_TOKEN")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_UNLEARN_KEY_FILE=str(work / ".key" / "id_tag.key"),
               PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '')}")
    if local_hub:
        env.pop("HF_HUB_OFFLINE")
        env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # a closed port: a request to any Hub but its own server fails at once
    return env


def run(snippet: Snippet, work: Path) -> subprocess.CompletedProcess:
    if snippet.lang == "python":
        cmd = [sys.executable, "-c", snippet.code]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", snippet.code]
    return subprocess.run(cmd, cwd=work, env=env_for(work, snippet.mark == "local-hub"), capture_output=True,
                          text=True, timeout=1800)


def commands(code: str) -> list[list[str]]:
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


def synopsis_problems(text: str, where: str) -> list[str]:
    """Commands or options named in ``text``'s blocks that the ``hf-unlearn`` parser does not have."""
    from hf_unlearn.cli import build_parser

    parser = build_parser()
    problems = []
    for s in snippets(text):
        for argv in commands(s.code):
            node, words = parser, list(argv)
            while words:
                sub = next((a for a in node._actions if isinstance(a, argparse._SubParsersAction)), None)
                names = words[0].split("|")  # `a|b|c`: alternatives, each must exist
                if sub is None or names[0] not in sub.choices:
                    break
                problems += [f"{where} line {s.line}: unknown command {n!r}" for n in names if n not in sub.choices]
                node = sub.choices[names[0]]
                words.pop(0)
            if node is parser:
                problems.append(f"{where} line {s.line}: unknown command in {' '.join(argv)!r}")
                continue
            known = {o for a in node._actions for o in a.option_strings}
            for w in words:
                flag = w.strip("[]|").split("=")[0]
                if flag.startswith("--") and flag not in known and flag != "--help":
                    problems.append(f"{where} line {s.line}: {' '.join(argv[:2])} has no option {flag}")
    return problems
