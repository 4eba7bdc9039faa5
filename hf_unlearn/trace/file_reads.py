"""The files a run's own code read while it trained, and whether a deleting process holds the same.

A trainer subclass's ``compute_loss`` or a recorded callback may act on a file (``w = float(Path(W).read_text())``).
Replays run that code again, in the deleting process: where the file holds other content there, the replay and the
oracle both follow it and agree with each other, not with the run that trained, and the environment probe sees it
only at the steps it re-runs. So, as :mod:`~hf_unlearn.trace.environment_reads` does for environment variables, the
recording notes every file that code of the program's own opened for reading while ``train()`` ran (``open``,
``io.open``, ``pathlib.Path.open`` / ``read_text`` / ``read_bytes``, ``os.open``; and through a reader the code calls
with a path: ``numpy.load``, ``torch.load``, ``json.load(open(...))``), by its resolved path, with a digest of its
content at each read (a sha256, kept in memory; the header keeps a keyed digest of it under the run key, so it never
reveals the content); a deletion compares them before any compute, and a replay notes the reads its own run of that
code makes.

Left out: files opened by installed packages, this library and the standard library on their own account (a
tokenizer's files, a logging integration's settings, the source ``linecache`` reads for a warning), the run's own trace
folder and output folder (written by the run), the rows the Trainer's data loader reads (a torch dataset's reads
under ``torch.utils.data``: the rows are checked by their keyed digests), ``/proc``, ``/sys`` and ``/dev``. A
collator's reads are noted: replays run it too.
Not seen: reads from C (a native library's ``fopen``, ``mmap``, ``np.memmap``, ``torch.load(mmap=True)``,
safetensors' ``safe_open``), a file object opened before ``train()``, ``io.FileIO``, and ``open`` or ``os.open`` bound
under another name before training started (``from io import open as o``; ``tarfile``'s own; numpy's text readers'
is followed).
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import hmac
import io
import os
import stat
import sys
import threading

from .environment_reads import is_user_code, quiet

# installed readers that open a file their caller names: the caller is who read it
READERS = ("numpy", "torch.serialization", "safetensors", "pandas", "yaml", "toml", "tomli", "PIL")
# the standard library reading source code for display (a warning, a traceback): not the program's input
DISPLAY = ("linecache", "tokenize", "inspect", "traceback")
PSEUDO = ("/proc/", "/sys/", "/dev/")

_lock = threading.Lock()
_local = threading.local()  # .busy: this module hashing a file (its own open is not a read)
_watching: list[FileReads] = []
_ORIGINAL = {"open": builtins.open, "os.open": os.open}


class FileReads(dict):
    """A read log: ``{resolved path: {"sha256": hex | None (missing), "by": module, "as": path as named, "step": int,
    "changed": step}}``; ``changed``: the first step at which it was read with other content."""

    def __init__(self, exclude=(), step=None):
        super().__init__()
        self.exclude = tuple(os.path.join(os.path.realpath(str(d)), "") for d in exclude if d)
        self.step = step

    def wants(self, path: str) -> bool:
        return not path.startswith(self.exclude)

    def note(self, path: str, named: str, sha: str | None, by: str) -> None:
        step = self.step() if self.step is not None else None
        entry = self.get(path)
        if entry is None:
            self[path] = {"sha256": sha, "by": by, "as": named, "step": step}
        elif sha != entry["sha256"] and "changed" not in entry:
            entry["changed"] = step


def _reader(frame) -> str | None:
    """The module of the program's own code that had the file opened (None: the frameworks', the standard library's
    on its own account, or the data loader's)."""
    while frame is not None:
        name = frame.f_globals.get("__name__") or ""
        top = name.split(".", 1)[0]
        if top in DISPLAY:
            return None
        if not (top in sys.stdlib_module_names or any(name == r or name.startswith(r + ".") for r in READERS)):
            break
        frame = frame.f_back
    if frame is None or not is_user_code(name, frame.f_code.co_filename):
        return None
    outer = frame.f_back
    while outer is not None:  # under the data loader: the rows (checked by their digests), not the program's input
        name = outer.f_globals.get("__name__") or ""
        if name.startswith("torch.utils.data"):
            return None
        if name.split(".", 1)[0] == "hf_unlearn":
            break
        outer = outer.f_back
    return frame.f_globals.get("__name__")


def content_sha256(path: str) -> str | None:
    """The sha256 of a file's content, read in chunks (None: missing or unreadable); ``"-"``: not a regular file."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return "-"
        with _ORIGINAL["open"](path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None


def _seen(file, reading: bool, depth: int = 2) -> None:
    if not reading or getattr(_local, "busy", False) or isinstance(file, int) or quiet():
        return
    try:
        named = os.fsdecode(os.fspath(file))
    except TypeError:
        return
    by = _reader(sys._getframe(depth))
    if by is None:
        return
    path = os.path.realpath(named)
    if path.startswith(PSEUDO):
        return
    with _lock:
        logs = [log for log in _watching if log.wants(path)]
    if not logs:
        return
    _local.busy = True
    try:
        sha = content_sha256(path)
    finally:
        _local.busy = False
    if sha == "-":  # a pipe, a device: no content to compare
        return
    with _lock:
        for log in logs:
            log.note(path, named, sha, by)


def _open(file, mode="r", *args, **kwargs):
    if _watching:
        _seen(file, "r" in mode or "+" in mode)
    return _ORIGINAL["open"](file, mode, *args, **kwargs)


def _os_open(path, flags, *args, **kwargs):
    if _watching and kwargs.get("dir_fd") is None:
        _seen(path, flags & os.O_ACCMODE in (os.O_RDONLY, os.O_RDWR))
    return _ORIGINAL["os.open"](path, flags, *args, **kwargs)


@contextlib.contextmanager
def watching(exclude=(), step=None):
    """Note the files that the program's own code opens for reading inside the block (not under ``exclude``'s
    folders): yields a :class:`FileReads`; ``step()`` says the optimizer step a read belongs to. ``open`` and
    ``os.open`` are wrapped while a log is open (nothing is wrapped outside training)."""
    log = FileReads(exclude, step)
    with _lock:
        if not _watching:
            _wrap(_open, _os_open)
        _watching.append(log)
    try:
        yield log
    finally:
        with _lock:
            _watching.remove(log)
            if not _watching:
                _wrap(_ORIGINAL["open"], _ORIGINAL["os.open"])


def _wrap(opener, os_opener) -> None:
    builtins.open = io.open = opener
    os.open = os_opener
    numpy_openers = getattr(sys.modules.get("numpy.lib._datasource"), "_file_openers", None)
    if numpy_openers is not None and isinstance(getattr(numpy_openers, "_file_openers", None), dict):
        numpy_openers._file_openers[None] = opener  # np.loadtxt / np.genfromtxt hold the open they were imported with


def content_digest(key: bytes, path: str, sha: str | None) -> str | None:
    """A keyed digest of a file's content (None: missing): equal contents give equal digests under one run key, and
    the content cannot be read back or confirmed from it without the key."""
    if sha is None:
        return None
    return hmac.new(key, b"hf_unlearn.file_read.v1\0" + path.encode() + b"\0" + sha.encode(),
                    hashlib.sha256).hexdigest()[:32]


def sealed(key: bytes, log: dict) -> dict:
    """What the header keeps of a recording's reads: ``{path: {"content": digest | None, "by": module, "as": the path
    as the code named it (when it is not the resolved one), "changed": step}}``."""
    return {path: {"content": content_digest(key, path, read["sha256"]), "by": read["by"],
                   **({"as": read["as"]} if read["as"] != path else {}),
                   **({"changed": read["changed"]} if read.get("changed") is not None else {})}
            for path, read in sorted(log.items())}


def differences(key: bytes, recorded: dict) -> list[tuple[str, str]]:
    """The recorded reads this process's files do not reproduce: ``(path, why in words)``."""
    out = []
    for path, read in sorted(recorded.items()):
        by = read.get("by", "?")
        named = read.get("as")
        if read.get("changed") is not None:
            out.append((path, f"{path} (read by {by}: its content changed at optimizer step {read['changed']} while "
                              "training, which no replay can reproduce)"))
            continue
        here = os.path.realpath(named) if named else path  # a relative path, a link: what it names here
        if here != path:
            out.append((path, f"{named} (read by {by}: it named {path} while recording, {here} here)"))
            continue
        now = content_digest(key, path, content_sha256(path))
        if now != read.get("content"):
            was = "missing" if read.get("content") is None else "present"
            is_ = "missing" if now is None else ("present with other content" if was == "present" else "present")
            out.append((path, f"{path} (read by {by}: {was} while recording, {is_} here)"))
    return out


def unrecorded(key: bytes, recorded: dict, log: dict) -> list[str]:
    """A replay's reads (``log``, from :func:`watching`) of a file the recording's code never read, or with other
    content, in words."""
    out = []
    for path, read in sorted(log.items()):
        if path not in recorded:
            out.append(f"{path} (read by {read['by']}, which the recording's code never read)")
        elif content_digest(key, path, read["sha256"]) != recorded[path].get("content") \
                or read.get("changed") is not None:
            out.append(f"{path} (read by {read['by']}: its content differs from the recording's)")
    return out
