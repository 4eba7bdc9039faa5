"""Signed receipts of the deletion service, and the check an auditor runs with the public key alone.

A receipt is JSON with an ``signature`` (Ed25519 over the canonical JSON of everything else). It names its ledger
(id and the hashes of the records it is about) and its own request's keyed tags; never a raw id. :func:`verify_receipt`
checks, and says which of these passed:

* the signature, under the given public key;
* the chain: the ledger's records are intact (checksums, hash chain), its signed head covers them, and the ledger
  holds the receipt's request record and a record that served it listing this receipt's hash;
* with ``model=``, that the model folder's state-hash root is the receipt's.

What it does not prove: that the replay was exact (that is the evidence inside the receipt, e.g. the oracle
verdict, made by the issuer) nor that the issuer, who holds the signing key, did not rewrite and re-sign a whole
ledger; publish the head (e.g. with the model) to pin it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnlearnError
from .ledger import GENESIS, HEAD_FILE, LEDGER_FORMAT, RECORDS_FILE, canonical, read_records, record_hash

REQUEST_RECEIPT_FORMAT = "hf_unlearn.request_receipt.v1"
BATCH_RECEIPT_FORMAT = "hf_unlearn.batch_receipt.v1"
FORMATS = (REQUEST_RECEIPT_FORMAT, BATCH_RECEIPT_FORMAT)


def receipt_sha256(receipt: dict) -> str:
    """The hash the ledger records for a receipt: its canonical JSON, signature included."""
    return hashlib.sha256(canonical(receipt)).hexdigest()


def sign_receipt(body: dict, private_key) -> dict:
    from ..keys import public_key_fingerprint, sign

    unsigned = {k: v for k, v in body.items() if k != "signature"}
    return {**unsigned, "signature": {"algorithm": "ed25519", "value": sign(private_key, canonical(unsigned)),
                                      "public_key": public_key_fingerprint(private_key.public_key())}}


def write_receipt(path: Path, receipt: dict) -> str:
    """Write a signed receipt atomically; returns its hash (what the ledger records)."""
    from ..utils import atomic_write_text

    atomic_write_text(path, json.dumps(receipt, indent=1, sort_keys=True) + "\n")
    return receipt_sha256(receipt)


def read_receipt(path: str | os.PathLike) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UnlearnError(f"cannot read the receipt {p}: {e}") from None
    if not isinstance(data, dict) or data.get("format") not in FORMATS:
        raise UnlearnError(f"{p} is not a receipt of `hf-unlearn requests serve` (a forget receipt.json is checked "
                           "with `hf-unlearn hub verify`)")
    return data


@dataclass
class VerifyReport:
    checks: list[tuple[str, bool, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(ok for _, ok, _ in self.checks)

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append((name, ok, detail))
        return ok

    def summary(self) -> str:
        width = max(len(n) for n, _, _ in self.checks)
        lines = [f"  {n.ljust(width)}  {'ok  ' if ok else 'FAIL'}  {d}" for n, ok, d in self.checks]
        verdict = ("verify OK: signed by this key, recorded in this ledger under its signed head"
                   + (", and the model is the receipt's" if any(n == "model" for n, _, _ in self.checks) else
                      " (no model given: its state hashes were not checked)")
                   + "; the exactness itself is the issuer's evidence (see the receipt's guarantee)") if self.ok \
            else "verify FAILED"
        return "\n".join([*lines, verdict])


def verify_receipt(receipt_path: str | os.PathLike, public_key, ledger: str | os.PathLike | None = None,
                   model: str | os.PathLike | None = None) -> VerifyReport:
    """Check a receipt with the public key alone (see the module docstring for what each check proves)."""
    from ..keys import load_public_key, public_key_fingerprint, signature_ok

    receipt_path = Path(receipt_path)
    receipt = read_receipt(receipt_path)
    public = public_key if hasattr(public_key, "verify") else load_public_key(public_key)
    report = VerifyReport()
    sig = receipt.get("signature") or {}
    unsigned = {k: v for k, v in receipt.items() if k != "signature"}
    fingerprint = public_key_fingerprint(public)
    if not report.add("signature", sig.get("algorithm") == "ed25519" and isinstance(sig.get("value"), str)
                      and signature_ok(public, canonical(unsigned), sig["value"]),
                      f"Ed25519 under key {fingerprint}" + ("" if sig.get("public_key") == fingerprint else
                                                             f" (the receipt names key {sig.get('public_key')})")):
        return report  # nothing else it says can be trusted
    folder = Path(ledger) if ledger is not None else receipt_path.resolve().parent.parent
    if not (folder / RECORDS_FILE).is_file():
        report.add("ledger", False, f"no ledger at {folder} (pass --ledger)")
        return report
    try:
        records = read_records(folder)[0]
    except UnlearnError as e:
        report.add("ledger", False, str(e))
        return report
    ok = bool(records) and records[0].get("format") == LEDGER_FORMAT and records[-1]["sha256"] != GENESIS
    _check_head(report, folder, records, public) if ok else report.add("ledger", False, "empty or foreign ledger")
    _check_chain(report, receipt, records)
    if model is not None:
        _check_model(report, receipt, Path(model))
    return report


def _check_head(report: VerifyReport, folder: Path, records: list[dict], public) -> None:
    from ..keys import signature_ok

    try:
        head = json.loads((folder / HEAD_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        report.add("ledger head", False, f"no readable signed head {folder / HEAD_FILE}")
        return
    unsigned = {k: v for k, v in head.items() if k != "signature"}
    signed = signature_ok(public, canonical(unsigned), (head.get("signature") or {}).get("value", ""))
    seq = head.get("seq")
    covers = isinstance(seq, int) and 1 <= seq <= len(records) and records[seq - 1]["sha256"] == head.get("sha256")
    same = head.get("ledger") == records[0].get("ledger")
    report.add("ledger head", signed and covers and same and seq == len(records),
               f"{len(records)} record(s), chain intact; head signed: {signed}, head = record {seq}: {covers}"
               + ("" if seq == len(records) else f" (records after {seq} are not covered by the signed head)")
               + ("" if same else "; the head names another ledger"))


def _check_chain(report: VerifyReport, receipt: dict, records: list[dict]) -> None:
    ledger_id = records[0].get("ledger") if records else None
    if not report.add("ledger id", receipt.get("ledger", {}).get("id") == ledger_id,
                      f"receipt names ledger {receipt.get('ledger', {}).get('id')}, this ledger is {ledger_id}"):
        return
    by_seq = {r["seq"]: r for r in records}
    problems = []
    for name, ref in (receipt.get("ledger_records") or {}).items():
        r = by_seq.get(ref.get("seq"))
        if r is None or r["sha256"] != ref.get("sha256") or record_hash(r) != ref.get("sha256"):
            problems.append(f"its {name} record {ref.get('seq')} is not in this ledger")
    request = receipt.get("request")
    if request is not None:
        r = by_seq.get((receipt.get("ledger_records") or {}).get("request", {}).get("seq"))
        if r is None or r.get("type") != "request" or r.get("tags") != request.get("tags") \
                or r.get("request") != request.get("id"):
            problems.append("its request's tags differ from the ledger's request record")
    h = receipt_sha256(receipt)
    served = [r for r in records if r["type"] in ("batch_done", "approximate")
              and (h in {v["sha256"] for v in (r.get("receipts") or {}).values()} or r.get("batch_receipt") == h)]
    if not served:
        problems.append("no record of the ledger lists this receipt as served (interrupted, or not from here)")
    report.add("ledger chain", not problems, "; ".join(problems) or
               f"request and serving records present (record {served[0]['seq']}, {served[0]['type']})")


def _check_model(report: VerifyReport, receipt: dict, model: Path) -> None:
    from ..hub.publish import build_manifest

    try:
        manifest = build_manifest(model)
    except (OSError, UnlearnError, ValueError) as e:
        report.add("model", False, f"cannot hash {model}: {e}")
        return
    want = (receipt.get("state_hashes") or {}).get("params_root")
    report.add("model", manifest["params_root"] == want,
               f"weights root {manifest['params_root'][:16]}... vs the receipt's {str(want)[:16]}...")
