"""Keyed id tags: what published trace files say instead of raw sample ids.

A tag is the first 8 bytes of HMAC-SHA256(key, canonical id). The key is generated once per recorded run and
stays in the run's ``private/`` folder: without it nobody can test whether a given id was in a plan, a WAL or
the deletion log, while the key holder can map ids to slots exactly.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from ..errors import UnlearnError

TAG_BYTES = 8
KEY_BYTES = 32
NULL_TAG = b"\0" * TAG_BYTES  # a slot already filled by the dummy (deleted by an earlier request)


def canonical_id(sample_id) -> bytes:
    """Ids are ints or strings; ``1`` and ``"1"`` are different ids."""
    if isinstance(sample_id, bool):
        raise UnlearnError(f"sample id {sample_id!r} is a bool; ids must be ints or strings (int or str)")
    if isinstance(sample_id, int) or (hasattr(sample_id, "item") and not isinstance(sample_id, str)):
        return b"i:" + str(int(sample_id)).encode()
    if isinstance(sample_id, str):
        return b"s:" + sample_id.encode("utf-8")
    raise UnlearnError(f"sample id {sample_id!r} has type {type(sample_id).__name__}; ids must be ints or strings "
                       "(int or str)")


def tag_bytes(key: bytes, sample_id) -> bytes:
    return hmac.new(key, canonical_id(sample_id), hashlib.sha256).digest()[:TAG_BYTES]


def tag(key: bytes, sample_id) -> str:
    """The 16-hex-digit keyed tag of one id."""
    return tag_bytes(key, sample_id).hex()


def ids_digest(key: bytes, tags: list[str | None]) -> int:
    """An 8-byte keyed digest over a microbatch's ordered slot tags (``None`` = dummy slot), as an int."""
    h = hmac.new(key, b"hf_unlearn.ids_digest.v1", hashlib.sha256)
    for t in tags:
        h.update(bytes.fromhex(t) if t else NULL_TAG)
    return int.from_bytes(h.digest()[:8], "little")


def load_or_create_key(path: str | os.PathLike, key: bytes | None = None) -> bytes:
    """Read the run's HMAC key from ``path``; create it (random, or ``key``) if it does not exist yet."""
    path = Path(path)
    if path.exists():
        existing = path.read_bytes()
        if key is not None and key != existing:
            raise UnlearnError(f"{path} holds a different HMAC key than the one passed; use a fresh trace_dir")
        return existing
    key = key if key is not None else secrets.token_bytes(KEY_BYTES)
    from ..utils import atomic_write_bytes

    atomic_write_bytes(path, key)
    os.chmod(path, 0o600)
    return key
