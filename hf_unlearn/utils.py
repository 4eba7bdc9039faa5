"""Small shared helpers: atomic file writes and the like."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def current_umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux), else set and restored."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode(private: bool = False) -> int:
    """The mode a new file gets: what ``open()`` would give it (0666 minus the umask), or owner-only (0600) for a
    private file (raw ids, keys)."""
    return 0o600 if private else 0o666 & ~current_umask()


PRIVATE_DIR = "private"  # a run's or an output's owner-only folder: its token store, key, local paths


def owner_only(path: str | os.PathLike) -> Path:
    """Make ``path`` owner-only whatever the umask: a file 0600; a folder 0700 with every folder under it 0700 and
    every file 0600 (a token store holds the raw ids and token ids of every training row). Returns ``path``."""
    path = Path(path)
    if path.is_symlink() or not path.exists():
        return path
    if path.is_file():
        os.chmod(path, 0o600)
        return path
    os.chmod(path, 0o700)  # first: nothing below is reachable by others while the rest is changed
    for folder, dirs, files in os.walk(path):
        for name in dirs:
            if not os.path.islink(os.path.join(folder, name)):
                os.chmod(os.path.join(folder, name), 0o700)
        for name in files:
            if not os.path.islink(os.path.join(folder, name)):
                os.chmod(os.path.join(folder, name), 0o600)
    return path


def private_dir(folder: str | os.PathLike) -> Path:
    """``folder/private``, created (with ``folder``) before anything private is written into it and made owner-only
    (0700), so what is written there is never reachable by others, even before :func:`owner_only` sets its files."""
    path = Path(folder) / PRIVATE_DIR
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)  # mkdir's mode is masked by the umask and ignored for a folder that exists
    return path


def weights_follow_umask(path: str | os.PathLike) -> None:
    """Give the ``.safetensors`` files at ``path`` (a file, or every one under a folder) the mode ``open()`` would.

    safetensors (0.8) creates its files 0600 whatever the umask, so weights written by ``save_pretrained``,
    ``Trainer.save_model`` or ``save_file`` were unreadable to a colleague or a serving account although cards and
    receipts beside them were not. Weights are never private (raw ids and keys are, and are not safetensors)."""
    path = Path(path)
    files = [path] if path.is_file() else path.rglob("*.safetensors") if path.is_dir() else []
    mode = file_mode()
    for f in files:  # (a file named directly is weights whatever its name: save_file's "x.tmp" before the rename)
        if not f.is_symlink() and (f.stat().st_mode & 0o777) != mode:
            os.chmod(f, mode)


class WeightsFollowUmask:
    """Mix into a ``transformers.Trainer``: ``save_model`` and checkpoints write weights at the umask's mode."""

    _trace_machinery = True  # library plumbing, not a trainer a replay rebuilds (trace.recording.recorded_trainer_class)

    def _save(self, output_dir=None, state_dict=None):
        super()._save(output_dir, state_dict)
        weights_follow_umask(output_dir if output_dir is not None else self.args.output_dir)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, private: bool = False) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a torn write.

    The file's mode is what a plain ``open()`` would give it (the umask is honoured: a serving account or a
    colleague can read the weights, cards and receipts), except for ``private`` files (see :func:`file_mode`),
    which are owner-only from the first byte."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # created 0600
    try:
        os.fchmod(fd, file_mode(private))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str, *, private: bool = False) -> None:
    atomic_write_bytes(path, text.encode("utf-8"), private=private)


LOCAL_PATH = "<local path>"  # what a published record holds where this machine had a path


def withhold_local_path(value):
    """``value``, unless it is a place on this machine (an absolute path, or a file or folder that exists here):
    then :data:`LOCAL_PATH`. A record that may be published keeps a Hub id (``org/model``) and loses the user's
    folder layout."""
    if isinstance(value, (str, os.PathLike)) and str(value):
        text = os.path.expanduser(str(value))
        if os.path.isabs(text) or os.path.exists(text):
            return LOCAL_PATH
    return value


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


def independent_generator(seed: int, purpose: str) -> torch.Generator:
    """A ``torch.Generator`` for ``purpose`` whose stream is unrelated to ``torch.Generator().manual_seed(seed)``.

    The Trainer shuffles the forget set with a generator seeded by ``args.seed``; a sample drawn with that same seed
    (a probe, a held-out split) would be exactly the first rows trained on. Hashing the purpose into the seed gives
    each sample its own stream.
    """
    import torch

    digest = hashlib.sha256(f"hf_unlearn/{purpose}/{int(seed)}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def import_object(name: str):
    """The object ``module:qualified.name`` names (a class, function or nested attribute)."""
    import importlib

    module, _, qual = name.partition(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def load_processing_class(path):
    """The tokenizer (or processor) saved in ``path`` with :meth:`save_pretrained` (a recording's, a collator's)."""
    from transformers import AutoProcessor, AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception:  # noqa: BLE001 - a processor rather than a tokenizer
        return AutoProcessor.from_pretrained(str(path))

