"""Keyed id tags: what published trace files say instead of raw sample ids.

A tag is the first 8 bytes of HMAC-SHA256(key, canonical id). The key is the library's one key
(:mod:`hf_unlearn.keys`: the same key tags model cards, so a card's tags match a deletion log's), and the
run's header records its fingerprint. Without it nobody can test whether a given id was in a plan, a WAL or
the deletion log, while the key holder can map ids to slots exactly. Runs recorded before the one key (or with
``trace_key=``) keep their own key in ``private/hmac.key`` and go on using it: their sealed plan, WAL and
deletion log are tagged with it, and re-tagging them would rewrite sealed (possibly published) files.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

from ..errors import UnlearnError
from ..keys import (
    KEY_ENV,
    KEY_FILE_ENV,
    default_key_path,
    find_key,
    key_fingerprint,
    load_key,
    load_or_create_key,  # noqa: F401  (re-exported: it lived here)
    read_key_file,
)
from .files import read_header

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


RUN_KEY = ("private", "hmac.key")  # a run's own key: runs recorded before the one key, or with trace_key=


def recording_key(run_dir: str | os.PathLike, key: bytes | None = None) -> bytes:
    """The key a recording tags ids with: ``key`` if given (kept as the run's own key), the run's own key when
    resuming a run that has one, else the library's one key (created on first use)."""
    own = Path(run_dir).joinpath(*RUN_KEY)
    if key is not None or own.exists():
        return load_or_create_key(own, key)
    return load_key()


def launch_key(run_dir: str | os.PathLike, key: bytes | None = None) -> bytes | None:
    """The recording key, checked to be the one every process of the launch holds (a collective; one process:
    :func:`recording_key`). The main process reads or creates it (created once: :func:`hf_unlearn.keys.load_key`),
    the others then find the key of its fingerprint themselves (the run's own key file, else the library key or an
    archived one); returns the key on the main process, None on the others. A process that cannot (another
    ``$HF_UNLEARN_KEY_FILE``, a node without the key file) fails on every process in one line before any step, not
    at the end of training when the run is proven on every process."""
    from .processes import agreed_value, gathered, rank, world_size

    if world_size() == 1:
        return recording_key(run_dir, key)
    main = rank() == 0
    mine = agreed_value(lambda: recording_key(run_dir, key) if main else None)  # the others wait for it here
    fingerprint = gathered(key_fingerprint(mine) if main else None)[0]

    def held() -> None:
        if main:
            return
        own = Path(run_dir).joinpath(*RUN_KEY)
        found = read_key_file(own) if own.exists() else find_key(fingerprint)
        if found is None or key_fingerprint(found) != fingerprint:
            where = f"{own} holds key {key_fingerprint(found)}" if found is not None else (
                f"{os.environ.get(KEY_ENV) and KEY_ENV or default_key_path()} holds another key or none")
            raise UnlearnError(f"a process of the launch cannot find the key the main process records with "
                               f"(fingerprint {fingerprint}; there {where}): every process of a launch must read the same key, set "
                               f"{KEY_FILE_ENV} (or {KEY_ENV}) to it on every process (on several machines: copy the "
                               "key file to each)")

    agreed_value(held)
    return mine


def run_key(run_dir: str | os.PathLike, header: dict | None = None, *, required: bool = True) -> bytes | None:
    """The key a recorded run's tags were made with.

    The run's own ``private/hmac.key`` if it has one; else the library key whose fingerprint ``header.json``
    records (the current key, or one archived by a rotation). A key file others can read is always refused;
    otherwise, with ``required=False``, a key that cannot be found gives None (integrity checks then skip the
    keyed digests).
    """
    run_dir = Path(run_dir)
    if header is None and (run_dir / "header.json").is_file():
        header = read_header(run_dir)
    fingerprint = (header or {}).get("key_fingerprint")
    own = run_dir.joinpath(*RUN_KEY)
    if own.exists():
        key = read_key_file(own)
        if fingerprint and key_fingerprint(key) != fingerprint:
            if not required:
                return None
            raise UnlearnError(f"{own} has fingerprint {key_fingerprint(key)} but the run was recorded with key "
                               f"{fingerprint}; restore the run's own key")
        return key
    key = find_key(fingerprint) if fingerprint else None
    if key is None and required:
        if fingerprint:
            raise UnlearnError(f"{run_dir} was recorded with the key of fingerprint {fingerprint}, which is neither "
                               "the current key nor an archived one; set HF_UNLEARN_KEY_FILE to that key (see "
                               "`hf-unlearn hub key`)")
        raise UnlearnError(f"{own} is missing and the run records no key fingerprint: the run's HMAC key is needed "
                           "to map ids to slots (it never leaves the machine that recorded the run)")
    return key


def keyed_tag(sample_id, key: bytes) -> str:
    """The keyed tag of one sample id (ids 7 and "7" get different tags); the same as a trace's slot tag."""
    return tag(key, sample_id)


def keyed_tags(sample_ids, key: bytes) -> list[str]:
    """Sorted keyed tags of ``sample_ids`` (sorting hides the order the ids came in)."""
    return sorted({tag(key, i) for i in sample_ids})


# ---- keyed controls -----------------------------------------------------------------------------------------
# The ids digest covers which rows a microbatch holds; these MACs cover everything else that decides the state
# (seeds, learning rates, steps, flags, normalisers, lengths, the run's arguments), so that editing a control in
# the plan and the WAL, with their CRCs and sidecars recomputed, needs the key.
MAC_BYTES = 8


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    h = hmac.new(key, b"hf_unlearn." + label + b"\0", hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def record_digester(key: bytes):
    """:func:`record_digest` for many records under one key (the keyed state is set up once, then copied)."""
    import struct

    base = hmac.new(key, b"hf_unlearn.wal_record.v2", hashlib.sha256)

    def digest(tags: list[str | None], seed: int, lr32: float, step: int, length: int, flags: int) -> int:
        h = base.copy()
        for t in tags:
            h.update(bytes.fromhex(t) if t else NULL_TAG)
        h.update(struct.pack("<QfIHH", seed, lr32, step, length, flags))
        return int.from_bytes(h.digest()[:8], "little")

    return digest


def record_digest(key: bytes, tags: list[str | None], seed: int, lr32: float, step: int, length: int,
                  flags: int) -> int:
    """The WAL record digest of runs with keyed controls: the ids digest's slots and the record's own controls under
    the key (so a WAL edited alone, or a run rewritten in the older unkeyed format, fails the check)."""
    return record_digester(key)(tags, seed, lr32, step, length, flags)


def controls_chain_start(key: bytes, run_id: str) -> bytes:
    """The value the first segment's MAC chains from: binds the chain to one run (the key tags many runs)."""
    return _mac(key, b"controls.start.v1", str(run_id).encode())[:MAC_BYTES]


def segment_mac(key: bytes, previous: bytes, controls: bytes) -> bytes:
    """The keyed MAC of one accumulation segment's controls, chained to the previous segment's MAC (so segments
    cannot be dropped, reordered or spliced from another run)."""
    return _mac(key, b"controls.segment.v1", previous, controls)[:MAC_BYTES]


def seal_mac(key: bytes, last: bytes, header_controls: bytes) -> str:
    """The keyed seal over the last segment MAC and the header's state-deciding fields (a cut plan, an edited
    learning rate in ``training_args``, ... fail it)."""
    return _mac(key, b"controls.seal.v1", last, header_controls).hex()


def verdict_mac(key: bytes, run_id: str, verdict: dict) -> str:
    """The keyed seal of a replay's ``verification.json``: the canonical JSON of the verdict (every field but
    ``mac``: the verdict, the oracle's run id and both final state roots among them) bound to the replay's run id,
    so an edited verdict, or one copied from another replay of the same run and request (the same roots), fails."""
    import json

    body = json.dumps({k: v for k, v in verdict.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return _mac(key, b"verification.v1", str(run_id).encode(), body.encode()).hex()
