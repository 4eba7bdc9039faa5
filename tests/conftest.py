"""Shared fixtures. Tests are offline: data and tokenizers come from ../shared, models are built from configs."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("HF_UNLEARN_SHARED", ROOT.parent / "shared")).resolve()
TOFU_DIR = SHARED / "data" / "tofu"
TASKS_DIR = SHARED / "data" / "tasks"
MUSE_DIR = SHARED / "data" / "muse_news"
TOKENIZERS = SHARED / "tokenizers"
SMOLLM2_DIR = SHARED / "models" / "SmolLM2-135M-Instruct"

# Never reach the network: local data, offline Hub clients (tests that need a Hub start a local server).
os.environ["HF_UNLEARN_DATA_DIR"] = str(SHARED / "data")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_DISABLED", "true")
# pytest-xdist (`make test` runs two workers on CI's two cores): one torch thread per worker, not two each
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
# keyed id tags: a throwaway key per test session, never the user's ~/.cache/hf_unlearn key
os.environ.setdefault("HF_UNLEARN_KEY_FILE", os.path.join(tempfile.mkdtemp(prefix="hfu-key-"), "id_tag.key"))


@pytest.fixture(scope="session")
def gpt2_tokenizer():
    from hf_unlearn.models import load_tokenizer

    return load_tokenizer(TOKENIZERS / "gpt2")


@pytest.fixture(scope="session")
def neox_tokenizer():
    from hf_unlearn.models import load_tokenizer

    return load_tokenizer(TOKENIZERS / "gpt-neox-20b")


@pytest.fixture(scope="session")
def tofu_full():
    from hf_unlearn.data import load_tofu

    return load_tofu("full", TOFU_DIR)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, gpt2_tokenizer):
    """A saved tiny Llama (hidden 32, 2 layers) with the GPT-2 tokenizer; read-only: copy it before writing."""
    from hf_unlearn.models import build_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama-gpt2")
    build_tiny_model("llama", gpt2_tokenizer, hidden_size=32, num_layers=2, num_heads=2).save_pretrained(path)
    gpt2_tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def tiny_llama(gpt2_tokenizer):
    from hf_unlearn.models import build_tiny_model

    return build_tiny_model("llama", gpt2_tokenizer, hidden_size=32, num_layers=2, num_heads=2)


def run_cli(*args: str, check: bool = False, env: dict | None = None):
    """Run ``python -m hf_unlearn ARGS`` in a subprocess against this checkout; returns CompletedProcess."""
    import subprocess
    import sys

    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "hf_unlearn", *map(str, args)], capture_output=True, text=True,
                          env=full_env, cwd=str(ROOT))
    if check and proc.returncode != 0:
        raise AssertionError(f"hf-unlearn {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


_TWO_PROCESSES = """
import importlib, pathlib, sys
from accelerate import debug_launcher
func = getattr(importlib.import_module(sys.argv[1]), sys.argv[2])
out = pathlib.Path(sys.argv[3])
debug_launcher(lambda: func(out), num_processes=2)
"""


def mentions(text: str, sample_id) -> bool:
    """Whether ``text`` names ``sample_id`` as a word of its own: a numeric id such as 3600 also occurs by chance
    inside a hex digest or key fingerprint, which does not carry it."""
    return re.search(rf"(?<![0-9A-Za-z]){re.escape(str(sample_id))}(?![0-9A-Za-z])", text) is not None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_launch(cmd, out: Path, **kwargs):
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)`` of a multi-process launch writing into ``out``
    (``cmd``: the command, or a function making it, called again for a second attempt: a fresh port),
    launched once more (``out`` emptied first) when a worker died by SIGSEGV or SIGABRT: a native crash of a 2-process
    gloo launch on a loaded 2-core machine (about one CI run in ten; a segmentation fault, or "terminate called without
    an active exception" after a refusal, root cause not found), never an outcome of the code under test, whose
    failures exit 1 and are not retried. The first attempt's end is given as a warning."""
    import re
    import shutil
    import subprocess
    import warnings

    make = cmd if callable(cmd) else (lambda: cmd)
    # a native crash prints every thread's Python stack (the one clue to its cause), kept in the warning below
    kwargs["env"] = {**(kwargs.get("env") or os.environ), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run(make(), capture_output=True, text=True, **kwargs)
    if proc.returncode != 0 and re.search(r"exitcode\s*:\s*-(6|11)\b", proc.stderr):
        fatal = proc.stderr.find("Fatal Python error")
        stack = proc.stderr[fatal:fatal + 4000] if fatal >= 0 else ""
        warnings.warn(f"a worker of the launch died by a signal; launched once more. Its stack: {stack or '(none)'} "
                      f"Its end: {proc.stderr[-1500:]}", stacklevel=2)
        for child in (Path(out).iterdir() if Path(out).is_dir() else ()):
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        proc = subprocess.run(make(), capture_output=True, text=True, **kwargs)
    return proc


def run_on_two_processes(module: str, func: str, out_dir: Path) -> list[dict]:
    """Run ``module.func(out_dir)`` on 2 CPU processes (accelerate's gloo ``debug_launcher``); each process writes
    ``out_dir/rank{r}.json``, returned in rank order. A fresh interpreter forks the workers before any torch
    computation (forking after it can hang)."""
    import json
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = run_launch([sys.executable, "-c", _TWO_PROCESSES, module, func, str(out_dir)], out_dir, cwd=str(ROOT),
                      env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]


def write_rank_record(out_dir: Path, trainer, **record) -> None:
    """In a worker of :func:`run_on_two_processes`: write ``record`` + the world size to ``out_dir/rank{r}.json``."""
    import json

    rank = trainer.accelerator.process_index
    record["world"] = trainer.accelerator.num_processes
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
