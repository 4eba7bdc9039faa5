"""The library's one id-tagging key, and keyed tags: what may be published instead of a raw sample id.

One key serves everything that names a sample: model cards (``forget_request.json``), trace plans, WALs and
deletion logs. A tag is the first 8 bytes of HMAC-SHA256(key, canonical id) (:func:`hf_unlearn.trace.tags.tag`),
so a card's tags can be matched one to one against the ``forget_tags`` of a run's deletion log. Whoever holds the
key can check that a given sample was deleted; nobody else can enumerate the ids or learn which rows were removed.

Where the key comes from: ``$HF_UNLEARN_TAG_KEY`` (hex), else the file ``$HF_UNLEARN_KEY_FILE``, default
``~/.cache/hf_unlearn/id_tag.key``, created on first use (32 random bytes, mode 0600, in a 0700 folder). Like ssh
with a private key, a key file that group or others may read is refused. The key's fingerprint (a hash of the
key, never the key) is published with every tag set and recorded in every run's header, so it is always known
which key a tag was made with. Rotation (:func:`rotate_key`) archives the old key next to the new one as
``id_tag.<fingerprint>.key``; :func:`find_key` finds it again by fingerprint, so older runs keep working.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from ..errors import UnlearnError

KEY_ENV = "HF_UNLEARN_TAG_KEY"
KEY_FILE_ENV = "HF_UNLEARN_KEY_FILE"
KEY_BYTES = 32
MIN_KEY_BYTES = 16
TAG_FORMAT = "hf_unlearn.id_tag.v2"  # hex of HMAC-SHA256(key, canonical id)[:8], the trace's tag function
TAG_HEX_CHARS = 16


def default_key_path() -> Path:
    return Path(os.environ.get(KEY_FILE_ENV) or Path.home() / ".cache" / "hf_unlearn" / "id_tag.key")


def key_fingerprint(key: bytes) -> str:
    """A public name for the key (a hash of it), so published tags and recorded runs say which key made them."""
    return hashlib.sha256(b"hf_unlearn.key-fingerprint\0" + key).hexdigest()[:16]


def read_key_file(path: str | os.PathLike) -> bytes:
    """Read a key file, refusing one that group or others may read (or write), that is not a regular file, or that
    belongs to another user: a key others can read makes every published tag reversible for them."""
    path = Path(path)
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise UnlearnError(f"no key file at {path}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnlearnError(f"the key {path} is not a regular file (a symlink or device is refused)")
    if os.name == "posix":
        if st.st_mode & 0o077:
            raise UnlearnError(f"the key file {path} is accessible by group or others (mode "
                               f"{stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}` (keys others can read "
                               "are refused, as ssh does)")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise UnlearnError(f"the key file {path} belongs to another user (uid {st.st_uid}); use your own key")
    key = path.read_bytes()
    if len(key) < MIN_KEY_BYTES:
        raise UnlearnError(f"the key file {path} holds {len(key)} bytes; it needs at least {MIN_KEY_BYTES}")
    return key


def write_key_file(path: str | os.PathLike, key: bytes) -> bool:
    """Create ``path`` holding ``key`` (mode 0600, folder 0700) atomically; False if it already exists.

    The key is written to a private temporary file and linked into place, so a concurrent reader never sees a
    half-written key and two processes creating the key at once agree on one of them.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)


def load_key(path: str | os.PathLike | None = None, *, create: bool = True) -> bytes:
    """The library's key: ``$HF_UNLEARN_TAG_KEY`` (hex), else the key file (created if missing and ``create``)."""
    env = os.environ.get(KEY_ENV)
    if env and path is None:
        try:
            key = bytes.fromhex(env)
        except ValueError:
            raise UnlearnError(f"{KEY_ENV} must be hex (e.g. `python -c 'import secrets; "
                               "print(secrets.token_hex(32))'`)") from None
        if len(key) < MIN_KEY_BYTES:
            raise UnlearnError(f"{KEY_ENV} is too short: use at least {MIN_KEY_BYTES} bytes "
                               f"({2 * MIN_KEY_BYTES} hex characters)")
        return key
    path = Path(path) if path is not None else default_key_path()
    if not path.exists() and not path.is_symlink():
        if not create:
            raise UnlearnError(f"no tag key at {path}; set {KEY_ENV} or {KEY_FILE_ENV}")
        write_key_file(path, secrets.token_bytes(KEY_BYTES))
    return read_key_file(path)


def archived_key_path(fingerprint: str, path: str | os.PathLike | None = None) -> Path:
    current = Path(path) if path is not None else default_key_path()
    return current.with_name(f"{current.stem}.{fingerprint}{current.suffix or '.key'}")


def find_key(fingerprint: str) -> bytes | None:
    """The key with this fingerprint: the current key, else one archived by :func:`rotate_key`; None if neither."""
    try:
        current = load_key(create=False)
    except UnlearnError as e:
        if "accessible by" in str(e) or "another user" in str(e):
            raise
        current = None
    if current is not None and key_fingerprint(current) == fingerprint:
        return current
    archived = archived_key_path(fingerprint)
    if archived.exists():
        key = read_key_file(archived)
        if key_fingerprint(key) == fingerprint:
            return key
    return None


def rotate_key(path: str | os.PathLike | None = None) -> tuple[str, str, Path]:
    """Archive the current key as ``id_tag.<fingerprint>.key`` and create a new one; (old, new fingerprint, archive).

    Published tags keep their meaning (they name the old fingerprint); runs recorded with the old key find it in
    the archive. Not possible with ``$HF_UNLEARN_TAG_KEY`` (rotate the variable yourself).
    """
    if os.environ.get(KEY_ENV) and path is None:
        raise UnlearnError(f"the key comes from {KEY_ENV}; rotate it by setting a new value (keep the old one)")
    path = Path(path) if path is not None else default_key_path()
    old = load_key(path, create=False)
    old_fp = key_fingerprint(old)
    archive = archived_key_path(old_fp, path)
    if not write_key_file(archive, old) and read_key_file(archive) != old:
        raise UnlearnError(f"{archive} exists and holds another key; move it away first")
    path.unlink()
    new = secrets.token_bytes(KEY_BYTES)
    if not write_key_file(path, new):
        raise UnlearnError(f"{path} was re-created concurrently; run the rotation again")
    return old_fp, key_fingerprint(new), archive


def keyed_tag(sample_id, key: bytes) -> str:
    """The keyed tag of one sample id (ids 7 and "7" get different tags); the same as a trace's slot tag."""
    from ..trace.tags import tag

    return tag(key, sample_id)


def keyed_tags(sample_ids: Iterable, key: bytes) -> list[str]:
    """Sorted keyed tags of ``sample_ids`` (sorting hides the order the ids came in)."""
    return sorted({keyed_tag(i, key) for i in sample_ids})
