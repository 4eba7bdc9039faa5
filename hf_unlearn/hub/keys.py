"""Keyed id tags: what may be published instead of a raw sample id.

A tag is HMAC-SHA256(key, id) with a key that never leaves the machine (``$HF_UNLEARN_TAG_KEY`` as hex, or the
file ``$HF_UNLEARN_KEY_FILE``, default ``~/.cache/hf_unlearn/id_tag.key``, created on first use with mode 0600).
Whoever holds the key can check that a given sample was deleted; nobody else can enumerate the ids or learn which
rows were removed. The key's fingerprint (a hash of the key, not the key) is published so auditors know which key
the tags were made with.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from ..errors import UnlearnError
from ..trace.tags import canonical_id  # one id encoding for every keyed tag in the library

TAG_FORMAT = "hf_unlearn.id_tag.v1"
TAG_HEX_CHARS = 32


def default_key_path() -> Path:
    return Path(os.environ.get("HF_UNLEARN_KEY_FILE") or Path.home() / ".cache" / "hf_unlearn" / "id_tag.key")


def load_key(path: str | os.PathLike | None = None, *, create: bool = True) -> bytes:
    """The local tagging key: ``$HF_UNLEARN_TAG_KEY`` (hex), else the key file (created if missing)."""
    env = os.environ.get("HF_UNLEARN_TAG_KEY")
    if env and path is None:
        try:
            key = bytes.fromhex(env)
        except ValueError:
            raise UnlearnError("HF_UNLEARN_TAG_KEY must be hex (e.g. `python -c 'import secrets; "
                               "print(secrets.token_hex(32))'`)") from None
        if len(key) < 16:
            raise UnlearnError("HF_UNLEARN_TAG_KEY is too short: use at least 16 bytes (32 hex characters)")
        return key
    path = Path(path) if path is not None else default_key_path()
    if path.is_file():
        key = path.read_bytes()
        if len(key) < 16:
            raise UnlearnError(f"the tag key file {path} holds {len(key)} bytes; it needs at least 16")
        return key
    if not create:
        raise UnlearnError(f"no tag key at {path}; set HF_UNLEARN_TAG_KEY or HF_UNLEARN_KEY_FILE")
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def keyed_tag(sample_id, key: bytes) -> str:
    """The keyed tag of one sample id (ids 7 and "7" get different tags)."""
    msg = TAG_FORMAT.encode() + b"\0" + canonical_id(sample_id)
    return hmac.new(key, msg, hashlib.sha256).hexdigest()[:TAG_HEX_CHARS]


def keyed_tags(sample_ids: Iterable, key: bytes) -> list[str]:
    """Sorted keyed tags of ``sample_ids`` (sorting hides the order the ids came in)."""
    return sorted({keyed_tag(i, key) for i in sample_ids})


def key_fingerprint(key: bytes) -> str:
    """A public name for the key (a hash of it), so published tags say which key made them."""
    return hashlib.sha256(b"hf_unlearn.key-fingerprint\0" + key).hexdigest()[:16]
