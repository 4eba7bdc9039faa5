"""The signed record chain of a request ledger, checked with a public key alone (operator and third party alike).

Every record of ``ledger.jsonl`` carries the SHA-256 of its canonical JSON (``sha256``), the previous record's hash
(``prev``) and, from format v2 on, its own Ed25519 signature over that hash (``signature``, written in the same line,
so a record is signed or absent, never half). ``head.json`` signs the last record's sequence number and hash: it pins
the length of the chain (records removed from the end) and, for a v1 ledger whose records carry no signature, its
content. :func:`check_chain` decides what an anchor key (the operator's own, or an auditor's copy of the public key)
can trust:

* every record's signature verifies under the ledger's key at that point (the opening record names the key; a
  ``key`` record, signed by the old key, hands over to a new one: signing-key rotation); the first one that does
  not is named (an insider who removes, edits, inserts or copies a record and recomputes every hash cannot sign);
* the head verifies, belongs to this ledger and covers the record it names;
* records after the head (a crash between an append and the head's update) are a *tail*: reported, never trusted
  until :meth:`~hf_unlearn.deletion.DeletionLedger.recover` re-signs it (only when every tail record is signed).

A segment of the chain (records ``a..head``, as a receipt bundle carries) is checked the same way: its first
record's ``prev`` is taken as given, and the head's signature vouches for it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from ..errors import UnlearnError
from ..keys import public_key_fingerprint, public_key_from_hex, sign, signature_ok

GENESIS = "0" * 64
HEAD_FORMAT = "hf_unlearn.ledger_head.v1"
RECORD_DOMAIN = b"hf_unlearn.ledger_record\0"
UNHASHED = ("sha256", "signature")


def canonical(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def record_hash(record: dict) -> str:
    """SHA-256 of a record without its own ``sha256`` and ``signature``: the checksum and the next record's ``prev``."""
    return hashlib.sha256(canonical({k: v for k, v in record.items() if k not in UNHASHED})).hexdigest()


def sign_record(record: dict, private_key) -> dict:
    """The record's ``signature`` field: Ed25519 over its hash (domain-separated from heads and receipts)."""
    return {"algorithm": "ed25519", "key": public_key_fingerprint(private_key.public_key()),
            "value": sign(private_key, RECORD_DOMAIN + record["sha256"].encode())}


def head_body(ledger: str, record: dict) -> dict:
    return {"format": HEAD_FORMAT, "ledger": ledger, "seq": record["seq"], "sha256": record["sha256"],
            "time": record["time"]}


def sign_head(body: dict, private_key) -> dict:
    return {**body, "signature": {"algorithm": "ed25519", "value": sign(private_key, canonical(body)),
                                  "public_key": public_key_fingerprint(private_key.public_key())}}


def _public(hex_or_key):
    return public_key_from_hex(hex_or_key) if isinstance(hex_or_key, str) else hex_or_key


@dataclass(frozen=True)
class ChainWalk:
    """Where the walk over a chain's record signatures ended: what a later check of the same chain grown by more
    records resumes from instead of verifying every signature again (:func:`check_chain`'s ``resume``)."""

    anchor: str  # fingerprint of the anchor it was walked for (a v1 ledger's first key is the anchor)
    count: int  # records walked, each one's signature verified
    last: str  # the last one's sha256 (with read_records' hash links: the whole walked prefix)
    current: object  # the key in force after them (None: a v1 ledger not signed by the anchor)
    keys: dict
    key_at: dict
    signed: bool


@dataclass
class ChainCheck:
    """What :func:`check_chain` found. ``problem`` (one line naming the first bad record) is None when the anchor can
    trust every record up to the head; ``tail`` holds the records after the head (never trusted)."""

    records: list[dict]
    head: dict | None
    head_seq: int = 0
    tail: list[dict] = field(default_factory=list)
    problem: str | None = None
    keys: dict = field(default_factory=dict)  # fingerprint -> public key, every key the chain names (trusted if ok)
    key_at: dict = field(default_factory=dict)  # seq -> fingerprint of the key that signs that record
    signed: bool = True  # every record carries its own signature (v2); False for a v1 ledger
    walk: ChainWalk | None = None  # the key walk over every record, when each one's signature verified

    @property
    def ok(self) -> bool:
        return self.problem is None and not self.tail

    @property
    def trusted(self) -> list[dict]:
        return self.records[: len(self.records) - len(self.tail)]

    def tail_problem(self) -> str | None:
        if not self.tail:
            return None
        first, last = self.tail[0]["seq"], self.tail[-1]["seq"]
        return (f"record(s) {first}..{last} are not covered by the signed head (record {self.head_seq}): an append "
                "was interrupted before the head was signed, or the records were added without the key")


def _opening_key(records: list[dict], anchor, anchor_fp: str, segment: bool):
    """The key in force at the first record: the opening's own (v2), else (a segment or a v1 ledger) the key that
    signs the first signed record, if the anchor or a later key record vouches for it."""
    opening = records[0]
    if opening.get("type") == "open" and isinstance(opening.get("public_key"), str):
        return _public(opening["public_key"])
    if segment:
        current = anchor
        first_signed = next((r for r in records if r.get("signature")), None)
        if first_signed is not None:
            want = first_signed["signature"].get("key") if isinstance(first_signed["signature"], dict) else None
            for r in records:
                if r.get("type") == "key" and r.get("previous_fingerprint") == want:
                    return _public(r["previous_public_key"])
        return current
    return anchor if opening.get("signing_key") == anchor_fp else None


def check_chain(records: list[dict], head: dict | None, anchor, *, segment: bool = False,
                resume: ChainWalk | None = None) -> ChainCheck:
    """Check ``records`` (a whole ledger, or with ``segment`` a run of it ending at the head) and ``head`` against
    the ``anchor`` public key. Checksums and ``prev`` links are checked by :func:`hf_unlearn.deletion.records.
    read_records` for a whole ledger, and here for a segment. ``resume``: the ``walk`` of an earlier check of the
    same ledger (a whole one, same anchor) whose last walked record is still at its place here: the signatures of
    the records up to it are not verified again (the head and everything after it are). A signature is outside its
    record's hash, so a walk applies only to the very records it walked, read again from the same bytes
    (:meth:`hf_unlearn.deletion.prefix.LedgerReader.walk_for` checks both), never to records from elsewhere."""
    out = ChainCheck(records=records, head=head)
    anchor_fp = public_key_fingerprint(anchor)
    if not records:
        out.problem = "the ledger holds no record"
        return out
    if segment:
        for prev, r in zip(records, records[1:]):
            if r.get("prev") != prev.get("sha256") or r.get("seq") != prev.get("seq", 0) + 1:
                out.problem = f"record {r.get('seq')} does not chain to record {prev.get('seq')} in the bundle"
                return out
        for r in records:
            if not isinstance(r, dict) or r.get("sha256") != record_hash(r):
                out.problem = f"record {r.get('seq') if isinstance(r, dict) else '?'} fails its checksum"
                return out
    opening = records[0]
    start = 0
    if resume is not None and not segment and resume.anchor == anchor_fp and 0 < resume.count <= len(records) \
            and records[resume.count - 1].get("sha256") == resume.last:
        # a prefix walked before (hash-identical through the chain read_records checked): walk on from its end
        start, current, out.signed = resume.count, resume.current, resume.signed
        out.keys, out.key_at = dict(resume.keys), dict(resume.key_at)
    else:
        current = _opening_key(records, anchor, anchor_fp, segment)
        out.signed = opening.get("type") != "open" or isinstance(opening.get("public_key"), str)
        if current is not None:
            out.keys[public_key_fingerprint(current)] = current
    for r in records[start:]:
        sig = r.get("signature")
        if sig is None:
            if out.signed:
                out.problem = (f"record {r['seq']} carries no signature: it was written without the ledger's key "
                               "(a record removed, edited, inserted or copied and the chain recomputed)")
                return out
        else:
            ok = current is not None and isinstance(sig, dict) and isinstance(sig.get("value"), str) and \
                signature_ok(current, RECORD_DOMAIN + r["sha256"].encode(), sig["value"])
            if not ok:
                out.problem = (f"record {r['seq']} ({r.get('type')}) is not signed by the ledger's key"
                               f"{'' if current is None else ' ' + public_key_fingerprint(current)}: a record "
                               "at or before it was removed, edited, inserted or copied and the chain recomputed "
                               "without the key")
                return out
        out.key_at[r["seq"]] = public_key_fingerprint(current) if current is not None else None
        if r.get("type") == "key":  # rotation: signed above by the old key, it names the new one
            try:
                current = _public(r["public_key"])
            except (UnlearnError, KeyError, TypeError, ValueError):
                out.problem = f"record {r['seq']} (key) does not hold a valid Ed25519 public key"
                return out
            out.keys[public_key_fingerprint(current)] = current
    if not segment:
        out.walk = ChainWalk(anchor=anchor_fp, count=len(records), last=records[-1]["sha256"], current=current,
                             keys=dict(out.keys), key_at=dict(out.key_at), signed=out.signed)
    # the head: signed, this ledger's, naming a record of the chain
    if head is None:
        out.problem = "there is no signed head (head.json): restore it from a backup"
        return out
    body = {k: v for k, v in head.items() if k != "signature"}
    seq = head.get("seq")
    first_seq = records[0]["seq"]
    if not isinstance(seq, int) or seq < first_seq:
        out.problem = f"the signed head names record {seq!r}, which is not in the chain"
        return out
    last_seq = records[-1]["seq"]
    if seq > last_seq:
        out.problem = (f"the chain ends at record {last_seq} but its signed head covers record {seq}: records "
                       f"{last_seq + 1}..{seq} were removed")
        return out
    covered = records[seq - first_seq]
    head_key = out.keys.get(out.key_at.get(seq)) if out.signed else None
    if head_key is None:  # a v1 ledger (or a segment without key records): the anchor, or a key the chain names
        head_key = anchor
        if covered.get("type") == "key":
            head_key = _public(covered["public_key"])
    elif covered.get("type") == "key":
        head_key = _public(covered["public_key"])  # the head after a rotation is signed by the new key
    value = head.get("signature").get("value", "") if isinstance(head.get("signature"), dict) else ""

    if not (isinstance(value, str) and signature_ok(head_key, canonical(body), value)):
        out.problem = (f"the head (record {seq}) is not signed by the ledger's key "
                       f"{public_key_fingerprint(head_key)}")
        return out
    if head.get("ledger") != (opening.get("ledger") if opening.get("type") == "open" else head.get("ledger")):
        out.problem = "the signed head names another ledger"
        return out
    if covered["sha256"] != head.get("sha256"):
        out.problem = (f"the signed head covers record {seq} with hash {str(head.get('sha256'))[:16]}..., the chain "
                       f"holds {covered['sha256'][:16]}... there: a record at or before {seq} was removed, edited or "
                       "inserted and the chain recomputed")
        return out
    # the anchor must be one of the ledger's keys (the head vouches for every key the chain names)
    if anchor_fp not in out.keys and public_key_fingerprint(head_key) != anchor_fp:
        named = ", ".join(out.keys) or opening.get("signing_key") or "unknown"
        out.problem = f"the ledger is signed with key(s) {named}, not with the given key {anchor_fp}"
        return out
    out.keys.setdefault(anchor_fp, anchor)
    out.head_seq = seq
    out.tail = records[seq - first_seq + 1:]
    return out
