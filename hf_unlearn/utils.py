"""Small shared helpers: atomic file writes and the like."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a torn write."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def activation_checkpointing_kwargs(enabled: bool) -> dict:
    """The ``TrainingArguments`` keyword for activation (gradient) checkpointing under the installed transformers.

    transformers 5 renamed ``gradient_checkpointing`` to ``activation_checkpointing`` and warns (FutureWarning) for
    the old name; older versions only know the old one.
    """
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return {"activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing": enabled}


def has_cuda() -> bool:
    """Whether a CUDA device is usable (pinned dataloader memory only helps then, and warns otherwise)."""
    import torch

    return torch.cuda.is_available()


def import_object(name: str):
    """The object ``module:qualified.name`` names (a class, function or nested attribute)."""
    import importlib

    module, _, qual = name.partition(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj
