"""A run's files at the ground of the engine: SHA-256 sidecars and ``header.json``, read by every floor above.

Checkpoints, shards, the base model's files, the fidelity evidence and the run's own check all hash files and
write or check their ``.sha256`` sidecars; the run key and every reader of a run read its header. They live here,
below all of them, so no floor of :mod:`hf_unlearn.trace` reaches up to :mod:`hf_unlearn.trace.run` for them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import UnlearnError
from ..utils import atomic_write_text

BUFFERS_FILE = "model/buffers.safetensors"  # the model's recorded non-persistent buffers (hf_unlearn.trace.fidelity)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def model_file_digests(run: Path) -> dict[str, str]:
    """SHA-256 of every file a replay rebuilds the model from (``model/config.json``, the adapter's config, ...; the
    buffers file has its own digest), by path in the run: sealed in the header, so an edited file is named."""
    folder = Path(run) / "model"
    return {f.relative_to(run).as_posix(): file_sha256(f) for f in sorted(folder.rglob("*"))
            if f.is_file() and f.relative_to(run).as_posix() != BUFFERS_FILE}


def write_sidecar(path: Path) -> None:
    atomic_write_text(Path(str(path) + ".sha256"), f"{file_sha256(path)}  {Path(path).name}\n")


def check_sidecar(path: Path) -> bool | None:
    """True/False when a sidecar exists and matches/does not; None when there is none."""
    side = Path(str(path) + ".sha256")
    if not side.exists():
        return None
    return side.read_text().split()[0] == file_sha256(path)


def read_header(path: str | Path) -> dict:
    """A run's ``header.json``; a damaged one is named in one line (never a JSON parser's traceback)."""
    f = Path(path) / "header.json"
    try:
        header = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnlearnError(f"{f} is damaged (it does not read as JSON: {e}); the run cannot be used: restore it from "
                           "a copy") from None
    if not isinstance(header, dict):
        raise UnlearnError(f"{f} is damaged (a JSON {type(header).__name__}, not a run's header); the run cannot be "
                           "used: restore it from a copy")
    return header
