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


def evidence(folder: Path, ledger_id: str, keys) -> list[tuple[int, str, str | None]]:
    """``(seq, sha256 or None, where)`` for every record the service's own files say the ledger holds: the heads of
    signed bundles, the records signed receipts name. ``keys(fingerprint)`` is a public key or None."""
    out = []
    receipts = folder / "receipts"
    for path in sorted(receipts.glob("*.json")) if receipts.is_dir() else []:
        data = _load(path)
        if data is None:
            continue
        where = f"receipts/{path.name}"
        if data.get("format") == "hf_unlearn.receipt_bundle.v1":
            head = data.get("head")
            if isinstance(head, dict) and head.get("ledger") == ledger_id and isinstance(head.get("seq"), int) \
                    and _signed_by(head, keys):
                out.append((head["seq"], head.get("sha256"), f"{where} (its signed head)"))
            receipt = data.get("receipt")
            if isinstance(receipt, dict):
                data, where = receipt, f"{where} (its receipt)"
        if (data.get("ledger") or {}).get("id") if isinstance(data.get("ledger"), dict) else None:
            if data["ledger"]["id"] == ledger_id and _signed_by(data, keys):
                out += [(seq, sha, f"{where} ({name} record)") for name, seq, sha in _refs(data)]
    return out


def rollback_problem(folder: Path, records: list[dict], head_seq: int, keys) -> str | None:
    """One line naming the newest evidence the ledger (``records`` under a head at ``head_seq``) is older than or
    differs from, or None."""
    if not records or records[0].get("type") != "open":
        return None
    ledger_id = records[0].get("ledger")
    by_seq = {r["seq"]: r for r in records[:head_seq]}
    worst = None
    for seq, sha, where in evidence(folder, ledger_id, keys):
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
