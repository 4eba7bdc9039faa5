"""A ledger checked against the service's own evidence: the signed heads and records its bundles and receipts hold,
and the batch folders it wrote.

An insider who keeps no backup can still roll a ledger back: every bundle in ``receipts/`` holds a signed head of
its time, so truncating ``ledger.jsonl`` to that head and copying it gives a valid, older ledger. The service itself
holds the evidence that it is older: a bundle whose signed head covers a later record (or another record at the same
number), a signed receipt naming a record the ledger lacks or holds differently, a ``batches/batch-NNNN`` folder
without its ``batch_start``. :func:`rollback_problem` names the newest such evidence; every command that reads or
writes a ledger refuses then (a request number or batch folder would otherwise be reused and newer receipts
overwritten). Evidence signed by no key of the ledger (nor of this machine) is not the service's and is ignored.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..keys import find_signing_key, public_key_fingerprint, signature_ok
from .chain import canonical

BATCH_DIR = re.compile(r"^batch-\d{4,}$")


def _load(path: Path):
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _signed_by(body: dict, keys) -> bool:
    sig = body.get("signature")
    if not isinstance(sig, dict) or not isinstance(sig.get("value"), str):
        return False
    key = keys(sig.get("public_key"))
    unsigned = {k: v for k, v in body.items() if k != "signature"}
    return key is not None and signature_ok(key, canonical(unsigned), sig["value"])


def _refs(receipt: dict) -> list[tuple[str, int, str]]:
    refs = receipt.get("ledger_records")
    if not isinstance(refs, dict):
        return []
    return [(name, ref["seq"], ref["sha256"]) for name, ref in refs.items()
            if isinstance(ref, dict) and isinstance(ref.get("seq"), int) and isinstance(ref.get("sha256"), str)]


def listing(folder: Path) -> tuple:
    """``(name, (inode, size, mtime_ns))`` of every entry of ``folder`` by name (empty if it is not a folder): what
    tells a file changed since it was read (an atomic rewrite is a new inode)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return ()
    out = []
    for e in entries:
        try:
            st = e.stat()
        except OSError:
            continue
        out.append((e.name, (st.st_ino, st.st_size, st.st_mtime_ns)))
    return tuple(sorted(out))


def evidence(folder: Path, ledger_id: str, keys, seen: dict | None = None,
             receipts: tuple | None = None) -> list[tuple[int, str, str | None]]:
    """``(seq, sha256 or None, where)`` for every record the service's own files say the ledger holds: the heads of
    signed bundles, the records signed receipts name. ``keys(fingerprint)`` is a public key or None. ``seen``
    (``name -> ((inode, size, mtime_ns), evidence)``, kept by the caller for one ledger id and one set of keys)
    spares re-reading and re-verifying a file unchanged since: a changed, new or removed file is read (or dropped)
    again, and a file signed by a key not found is never kept (the key may turn up). The service rewrites a file by
    renaming a new one over it (a new inode); a file edited in place that keeps its inode, size and time keeps the
    evidence it held when read, which was signed: it can only refuse more. ``receipts``: the :func:`listing` of
    ``receipts/`` if the caller has it."""
    out = []
    entries = [e for e in (listing(folder / "receipts") if receipts is None else receipts) if e[0].endswith(".json")]
    for name, stamp in entries:
        known = seen.get(name) if seen is not None else None
        if known is None or known[0] != stamp:
            found, complete = _file_evidence(folder / "receipts" / name, ledger_id, keys)
            known = (stamp, found)
            if seen is not None and complete:
                seen[name] = known
        out += known[1]
    if seen is not None:
        for name in set(seen) - {name for name, _ in entries}:
            seen.pop(name, None)
    return out


def _file_evidence(path: Path, ledger_id: str, keys) -> tuple[list[tuple[int, str, str | None]], bool]:
    """One file's evidence, and whether every key it names was found (what is found may be remembered)."""
    unknown = []

    def lookup(fingerprint):
        key = keys(fingerprint)
        if key is None:
            unknown.append(fingerprint)
        return key

    data = _load(path)
    if data is None:
        return [], True
    out = []
    where = f"receipts/{path.name}"
    if data.get("format") == "hf_unlearn.receipt_bundle.v1":
        head = data.get("head")
        if isinstance(head, dict) and head.get("ledger") == ledger_id and isinstance(head.get("seq"), int) \
                and _signed_by(head, lookup):
            out.append((head["seq"], head.get("sha256"), f"{where} (its signed head)"))
        receipt = data.get("receipt")
        if isinstance(receipt, dict):
            data, where = receipt, f"{where} (its receipt)"
    if (data.get("ledger") or {}).get("id") if isinstance(data.get("ledger"), dict) else None:
        if data["ledger"]["id"] == ledger_id and _signed_by(data, lookup):
            out += [(seq, sha, f"{where} ({name} record)") for name, seq, sha in _refs(data)]
    return out, not unknown


def rollback_problem(folder: Path, records: list[dict], head_seq: int, keys, seen: dict | None = None,
                     receipts: tuple | None = None) -> str | None:
    """One line naming the newest evidence the ledger (``records`` under a head at ``head_seq``) is older than or
    differs from, or None. ``seen`` and ``receipts``: see :func:`evidence`."""
    if not records or records[0].get("type") != "open":
        return None
    ledger_id = records[0].get("ledger")
    by_seq = {r["seq"]: r for r in records[:head_seq]}
    worst = None
    for seq, sha, where in evidence(folder, ledger_id, keys, seen, receipts):
        if seq not in by_seq or (sha is not None and by_seq[seq]["sha256"] != sha):
            if worst is None or seq > worst[0]:
                worst = (seq, where, seq not in by_seq)
    if worst is not None:
        seq, where, missing = worst
        what = (f"holds a signed head or record {seq} while the ledger's signed head covers record {head_seq}"
                if missing else f"holds record {seq} with another hash than the ledger's")
        return (f"the ledger is older than the service's own evidence: {where} {what} (the newest head found: "
                f"record {seq}); it was rolled back or replaced (truncated to an older head, restored from an old "
                "copy): restore the newest ledger")
    started = {r.get("batch") for r in records if r.get("type") == "batch_start"}
    batches = folder / "batches"
    for entry in sorted(batches.iterdir()) if batches.is_dir() else []:
        if BATCH_DIR.match(entry.name) and entry.name not in started:
            return (f"the ledger is older than the service's own evidence: the folder batches/{entry.name} exists "
                    f"but no record starts {entry.name} (the ledger's signed head covers record {head_seq}); it was "
                    "rolled back or replaced: restore the newest ledger (a batch folder is never reused)")
    return None


def key_lookup(chain_keys: dict, anchor):
    """``fingerprint -> public key``: the ledger's keys, this machine's, and the keys archived here by a rotation."""
    known = dict(chain_keys)
    known.setdefault(public_key_fingerprint(anchor), anchor)

    def lookup(fingerprint):
        if not isinstance(fingerprint, str) or not re.fullmatch(r"[0-9a-f]{16}", fingerprint):
            return None
        if fingerprint not in known:
            private = find_signing_key(fingerprint)
            known[fingerprint] = private.public_key() if private is not None else None
        return known[fingerprint]
    return lookup
