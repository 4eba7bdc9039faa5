"""Signed receipts of the deletion service, receipt bundles, and the check anyone runs with the public key alone.

A receipt is JSON with a ``signature`` (Ed25519 over the canonical JSON of everything else). It names its ledger
(id and the hashes of the records it is about) and its own request's keyed tags; never a raw id. Kinds: ``exact``
(a batch), ``approximate`` (provisional, superseded by the exact batch), ``acknowledgement`` (written by ``add``:
the request is recorded). A *bundle* (:func:`make_bundle`) carries a receipt with the ledger records it depends on,
up to and including a signed head, so a third party checks it with nothing else. :func:`verify_receipt` checks, and
says which of these passed:

* the signature, under the given public key (or a key the ledger hands over to or from, signed: key rotation);
* the chain: the records are intact (checksums, hash chain, each record's own signature), the signed head covers
  them, and they hold the receipt's request record and a record that served it listing this receipt's hash;
* with ``model=``, that the model folder's state-hash root is the receipt's, or that of a later exact batch of the
  same ledger that deletes from this one's replay (an exclusion carries to every later exact model), or, for a
  provisional receipt, of the exact batch that superseded it.

It names the request and its kind. What it does not prove: that the replay was exact (that is the evidence inside
the receipt, e.g. the oracle verdict, made by the issuer) nor that the issuer, who holds the signing key, did not
rewrite and re-sign a whole ledger; a rollback to an older head is refused when the ledger's folder still holds newer
evidence (:mod:`hf_unlearn.deletion.evidence`), and for a bundle with ``ledger=`` when the ledger no longer holds the
bundle's records under a head at least as new (the auditor's check); publish the bundles (or the head) to pin it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnlearnError
from ..keys import key_fingerprint, load_public_key, public_key_fingerprint, sign, signature_ok
from ..utils import atomic_write_text
from .chain import ChainCheck, canonical, check_chain, record_hash
from .evidence import key_lookup, rollback_problem
from .records import LEDGER_FORMAT, RECORDS_FILE, read_head, read_records

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)

REQUEST_RECEIPT_FORMAT = "hf_unlearn.request_receipt.v1"
BATCH_RECEIPT_FORMAT = "hf_unlearn.batch_receipt.v1"
ACK_FORMAT = "hf_unlearn.request_ack.v1"
BUNDLE_FORMAT = "hf_unlearn.receipt_bundle.v1"
FORMATS = (REQUEST_RECEIPT_FORMAT, BATCH_RECEIPT_FORMAT, ACK_FORMAT)


def receipt_sha256(receipt: dict) -> str:
    """The hash the ledger records for a receipt: its canonical JSON, signature included."""
    return hashlib.sha256(canonical(receipt)).hexdigest()


def sign_receipt(body: dict, private_key) -> dict:
    unsigned = {k: v for k, v in body.items() if k != "signature"}
    return {**unsigned, "signature": {"algorithm": "ed25519", "value": sign(private_key, canonical(unsigned)),
                                      "public_key": public_key_fingerprint(private_key.public_key())}}


def write_receipt(path: Path, receipt: dict) -> str:
    """Write a signed receipt atomically; returns its hash (what the ledger records)."""
    atomic_write_text(path, json.dumps(receipt, indent=1, sort_keys=True) + "\n")
    return receipt_sha256(receipt)


def read_receipt(path: str | os.PathLike) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnlearnError(f"cannot read the receipt {p}: {e}") from None
    except RecursionError:
        raise UnlearnError(f"cannot read the receipt {p}: its JSON is nested too deeply to be a receipt") from None
    if isinstance(data, dict) and data.get("format") == BUNDLE_FORMAT:
        return data
    if not isinstance(data, dict) or data.get("format") not in FORMATS:
        raise UnlearnError(f"{p} is not a receipt of `hf-unlearn requests serve` (a forget receipt.json is checked "
                           "with `hf-unlearn hub verify`)")
    return data


def acknowledge(ledger, request, records: list[dict] | None = None) -> Path:
    """The signed acknowledgement of a request just added (``receipts/r-NNNN.ack.json``) and its bundle: the
    requester can show that the request was recorded, when, with which deadline, under a signed head. ``records``:
    the ledger's records as ``ledger.records()`` just returned them (under the lock of the append), or read now."""
    records = ledger.records() if records is None else records
    opening = records[0]
    body = {"format": ACK_FORMAT, "kind": "acknowledgement",
            "ledger": {"id": opening["ledger"], "run_id": opening["run_id"]},
            "request": {"id": request.id, "tags": request.tags, "count": len(request.tags),
                        "received": request.received, "deadline": request.deadline, "ref_tag": request.ref_tag,
                        "key_fingerprint": key_fingerprint(ledger.tag_key)},
            "ledger_records": {"request": {"seq": request.seq, "sha256": request.sha256}},
            "guarantee": (f"request {request.id} is recorded in the ledger (record {request.seq}) with "
                          f"{len(request.tags)} id(s) as keyed tags, received {request.received}, due by "
                          f"{request.deadline}; it is not a deletion"),
            "created": records[-1]["time"]}
    path = ledger.path / "receipts" / f"{request.id}.ack.json"
    write_receipt(path, sign_receipt(body, ledger.signing_key))
    write_bundle(ledger, path, records=records)
    return path


def make_bundle(ledger, receipt_path: str | os.PathLike, records: list[dict] | None = None) -> dict:
    """A receipt with the ledger records it depends on, from the earliest one it names up to and including the
    signed head (the head's signature vouches for every record of the segment through the hash chain). ``records``:
    see :func:`acknowledge`."""
    receipt = read_receipt(receipt_path)
    if receipt.get("format") == BUNDLE_FORMAT:
        receipt = receipt["receipt"]
    records = ledger.records() if records is None else records
    head = read_head(ledger.path)
    seqs = [ref.get("seq") for ref in (receipt.get("ledger_records") or {}).values() if isinstance(ref, dict)]
    first = min([s for s in seqs if isinstance(s, int)] or [1])
    return {"format": BUNDLE_FORMAT, "receipt": receipt, "records": records[first - 1: head["seq"]], "head": head}


def bundle_path(receipt_path: str | os.PathLike) -> Path:
    p = Path(receipt_path)
    return p.with_name(p.name[: -len(".json")] + ".bundle.json") if p.name.endswith(".json") else Path(f"{p}.bundle")


def write_bundle(ledger, receipt_path: str | os.PathLike, out: str | os.PathLike | None = None,
                 records: list[dict] | None = None) -> Path:
    out = Path(out) if out is not None else bundle_path(receipt_path)
    atomic_write_text(out, json.dumps(make_bundle(ledger, receipt_path, records), indent=1, sort_keys=True) + "\n")
    return out


def write_missing_bundles(ledger, log=None) -> list[Path]:
    """The acknowledgements and bundles an interrupted ``add`` or ``serve`` did not write (killed after its record):
    made now, under today's head, for every request and every receipt the records list. Returns what was written;
    nothing that exists is rewritten."""
    log = log or (lambda m: None)
    written = []
    records = ledger.records()
    requests = {r.id: r for r in ledger.requests()}
    folder = ledger.path / "receipts"
    for r in records:
        paths = []
        if r["type"] == "request" and not (folder / f"{r['request']}.ack.json").exists():
            written.append(acknowledge(ledger, requests[r["request"]]))
            log(f"wrote the missing acknowledgement {written[-1].name} and its bundle")
            continue
        if r["type"] == "request":
            paths = [folder / f"{r['request']}.ack.json"]
        elif r["type"] in ("batch_done", "approximate"):
            paths = [ledger.path / e["path"] for e in (r.get("receipts") or {}).values() if isinstance(e, dict)]
            if r["type"] == "batch_done":
                paths.append(folder / f"{r['batch']}.json")
        for path in paths:
            if path.is_file() and not bundle_path(path).exists():
                written.append(write_bundle(ledger, path))
                log(f"wrote the missing bundle {written[-1].name}")
    return written


@dataclass
class VerifyReport:
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    request: str | None = None
    kind: str = "unknown"
    proves: str = ""
    model_says: str = ""  # what the model check proved, in the receipt kind's own terms

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(ok for _, ok, _ in self.checks)

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append((name, ok, detail))
        return ok

    def summary(self) -> str:
        width = max(len(n) for n, _, _ in self.checks)
        lines = [f"  {n.ljust(width)}  {'ok  ' if ok else 'FAIL'}  {d}" for n, ok, d in self.checks]
        if not self.ok:
            return "\n".join([*lines, "verify FAILED"])
        model = any(n == "model" for n, _, _ in self.checks)
        what = f"{self.request or 'batch receipt'}: {self.kind}"
        return "\n".join([*lines, f"verify OK: {what}. Signed by this key, recorded in this ledger under its signed "
                           "head" + (f", and {self.model_says}" if model
                                     else " (no model given: no state hashes were checked)")
                           + f". {self.proves}".rstrip() + " The exactness itself is the issuer's evidence (see the "
                           "receipt's guarantee)."])


def verify_receipt(receipt_path: str | os.PathLike, public_key, ledger: str | os.PathLike | None = None,
                   model: str | os.PathLike | None = None) -> VerifyReport:
    """Check a receipt or a receipt bundle with the public key alone (see the module docstring). A malformed
    receipt or bundle (a field of the wrong type) fails, naming the field's error, never with a traceback."""
    try:
        return _verify(receipt_path, public_key, ledger, model)
    except UnlearnError:
        raise
    except (AttributeError, TypeError, KeyError, ValueError, IndexError) as e:
        report = VerifyReport()
        report.add("format", False, f"the receipt, bundle or ledger is malformed ({type(e).__name__}: {e}); it was "
                   "not written by this library as it stands")
        return report


def _verify(receipt_path, public_key, ledger, model) -> VerifyReport:
    receipt_path = Path(receipt_path)
    data = read_receipt(receipt_path)
    public = public_key if hasattr(public_key, "verify") else load_public_key(public_key)
    report = VerifyReport()
    chain, where = _load_chain(data, receipt_path, ledger, public)
    receipt = data["receipt"] if data.get("format") == BUNDLE_FORMAT else data
    if not isinstance(receipt, dict) or receipt.get("format") not in FORMATS:
        report.add("signature", False, "the bundle holds no receipt")
        return report
    sig = receipt.get("signature") if isinstance(receipt.get("signature"), dict) else {}
    unsigned = {k: v for k, v in receipt.items() if k != "signature"}
    keys = {public_key_fingerprint(public): public}
    if chain is not None and chain.problem is None:
        keys.update(chain.keys)  # the head vouches for every key the ledger names (rotation)
    signer = keys.get(sig.get("public_key")) or public
    fingerprint = public_key_fingerprint(signer)
    ok = sig.get("algorithm") == "ed25519" and isinstance(sig.get("value"), str) \
        and signature_ok(signer, canonical(unsigned), sig["value"])
    named = sig.get("public_key")
    if not ok and isinstance(named, str) and named not in keys:  # e.g. signed before a rotation, checked with the new key
        report.add("signature", False, f"signed by key {named}, not by the given key {fingerprint}: verify it with "
                   f"the public key {named} (a key rotated out: publish every key), or make a fresh bundle "
                   "(`hf-unlearn requests bundle`), which carries the key hand-over")
        return report
    if not report.add("signature", ok, f"Ed25519 under key {fingerprint}"
                      + ("" if fingerprint == public_key_fingerprint(public) else
                         f" (a key of this ledger; the given key is {public_key_fingerprint(public)})")):
        return report  # nothing else it says can be trusted
    request = receipt.get("request") or {}
    report.request = request.get("id")
    if chain is None:
        report.add("ledger", False, where)
        return report
    report.add("ledger head", chain.ok,
               chain.problem or chain.tail_problem() or f"{len(chain.records)} record(s) from {where}, chain intact, "
               f"every record signed, the signed head covers record {chain.head_seq}")
    trusted = chain.trusted if chain.problem is None else []
    if ledger is not None and data.get("format") == BUNDLE_FORMAT and chain.ok:
        trusted = _check_ledger_holds(report, chain, Path(ledger), public) or []
        if not trusted:
            return report
    _check_chain(report, receipt, trusted, chain.head.get("ledger") if chain.head else None)
    _describe(report, receipt, trusted)
    if model is not None:
        _check_model(report, receipt, trusted, Path(model))
    return report


def _check_ledger_holds(report: VerifyReport, bundle: ChainCheck, folder: Path, public) -> list[dict] | None:
    """The auditor's check of the operator's current ledger against a bundle they hold: the ledger is intact under
    its signed head, holds every record of the bundle unchanged under a head at least as new, and is not older than
    the service's own evidence in its folder (a rollback). Returns the ledger's trusted records (None: failed)."""
    ledger = ChainCheck(records=[], head=None, problem=f"no ledger at {folder}")
    if (folder / RECORDS_FILE).is_file():
        try:
            ledger = check_chain(read_records(folder)[0], read_head(folder), public)
        except UnlearnError as e:
            ledger.problem = str(e)
    problem = ledger.problem or ledger.tail_problem()
    if problem is None:
        held = {r["seq"]: r["sha256"] for r in ledger.trusted}
        head_seq = bundle.head_seq
        if ledger.head_seq < head_seq:
            problem = (f"its signed head covers record {ledger.head_seq}, older than the bundle's head (record "
                       f"{head_seq}): the ledger was rolled back")
        else:
            lost = [r["seq"] for r in bundle.trusted if held.get(r["seq"]) != r["sha256"]]
            if lost:
                problem = (f"it does not hold the bundle's record(s) {', '.join(map(str, lost))} (missing or "
                           "different): the ledger was rolled back or replaced")
        if problem is None:
            problem = rollback_problem(folder, ledger.trusted, ledger.head_seq, key_lookup(ledger.keys, public))
    if not report.add("ledger now", problem is None, problem or
                      f"{folder} holds the bundle's {len(bundle.trusted)} record(s) unchanged under its signed head "
                      f"(record {ledger.head_seq} >= the bundle's {bundle.head_seq})"):
        return None
    return ledger.trusted


def _load_chain(data: dict, receipt_path: Path, ledger, public) -> tuple[ChainCheck | None, str]:
    if data.get("format") == BUNDLE_FORMAT:
        records, head = data.get("records"), data.get("head")
        if not isinstance(records, list) or not records or not all(isinstance(r, dict) for r in records) \
                or not isinstance(head, dict):
            return None, "the bundle holds no records or no head"
        return check_chain(records, head, public, segment=True), "the bundle"
    folder = Path(ledger) if ledger is not None else receipt_path.resolve().parent.parent
    if not (folder / RECORDS_FILE).is_file():
        return None, f"no ledger at {folder} (pass --ledger, or verify the receipt's bundle)"
    try:
        records = read_records(folder)[0]
    except UnlearnError as e:
        return None, str(e)
    if not records or records[0].get("format") != LEDGER_FORMAT:
        return None, "empty or foreign ledger"
    chain = check_chain(records, read_head(folder), public)
    if chain.ok:  # a ledger older than the service's own evidence beside it (a rollback) is not trusted
        chain.problem = rollback_problem(folder, chain.trusted, chain.head_seq, key_lookup(chain.keys, public))
    return chain, f"the ledger {folder}"


def _check_chain(report: VerifyReport, receipt: dict, records: list[dict], head_ledger: str | None) -> None:
    ledger_id = records[0].get("ledger") if records and records[0].get("type") == "open" else head_ledger
    if not report.add("ledger id", bool(records) and receipt.get("ledger", {}).get("id") == ledger_id,
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
    if receipt.get("format") == ACK_FORMAT:
        report.add("ledger chain", not problems, "; ".join(problems) or
                   f"the request record {request.get('seq', '') or receipt['ledger_records']['request']['seq']} is "
                   "in the ledger under its signed head")
        return
    served = _serving(receipt, records)
    if served is None:
        problems.append("no record of the ledger lists this receipt as served (interrupted, or not from here)")
    report.add("ledger chain", not problems, "; ".join(problems) or
               f"request and serving records present (record {served['seq']}, {served['type']})")


def _later_exact(records: list[dict], after_seq: int, start_run: str | None) -> list[dict]:
    """The ``batch_done`` records after ``after_seq`` that delete, batch after batch, from ``start_run`` (the replay
    an earlier batch left): each of their models excludes every row that replay excludes."""
    starts = {r["batch"]: r for r in records if r["type"] == "batch_start"}
    out, run = [], start_run
    for r in records:
        if r["seq"] <= after_seq or r["type"] != "batch_done":
            continue
        start = starts.get(r["batch"])
        if run is None or start is None or start.get("run") != run:
            break  # deleted from another run: the exclusion does not carry past it
        out.append(r)
        run = r.get("run")
    return out


def _serving(receipt: dict, records: list[dict]) -> dict | None:
    h = receipt_sha256(receipt)
    return next((r for r in records if r["type"] in ("batch_done", "approximate")
                 and (h in {v["sha256"] for v in (r.get("receipts") or {}).values()} or r.get("batch_receipt") == h)),
                None)


def _exact_for(request_id: str | None, records: list[dict]) -> dict | None:
    return next((r for r in records if r["type"] == "batch_done" and request_id in r.get("requests", [])), None)


def _describe(report: VerifyReport, receipt: dict, records: list[dict]) -> None:
    """The receipt's kind as the ledger now knows it: exact, provisional (superseded or not), an acknowledgement."""
    rid = report.request
    if receipt.get("format") == ACK_FORMAT:
        done = _exact_for(rid, records)
        report.kind = "acknowledgement" + (f", since served exactly by {done['batch']} (record {done['seq']})"
                                           if done else ", not yet served exactly (as of the head)")
        report.proves = "It proves the request was recorded with these tags, received and due as it says."
        return
    serving = _serving(receipt, records)
    if receipt.get("kind") == "approximate":
        done = _exact_for(rid, records)
        report.kind = ("provisional (approximate" + (f", {receipt.get('method')}" if receipt.get("method") else "")
                       + ")" + (f", superseded by exact {done['batch']} (record {done['seq']})" if done else
                                ", not yet superseded by an exact deletion"))
        report.proves = "A provisional receipt proves an approximate method ran, not that the rows are gone."
        return
    name = (receipt.get("batch") or {}).get("name")
    later = _later_exact(records, serving["seq"], serving.get("run")) if serving else []
    report.kind = f"exact ({name})" + (f"; later exact models that also exclude its rows: "
                                       f"{', '.join(r['batch'] for r in later)}" if later else "")
    report.proves = ("It proves this ledger recorded an exact deletion of the request's rows (keyed tags) in "
                     f"{name} and the model's state hashes.")


def _check_model(report: VerifyReport, receipt: dict, records: list[dict], model: Path) -> None:
    from ..hub.publish import build_manifest

    try:
        manifest = build_manifest(model)
    except (OSError, UnlearnError, ValueError) as e:
        report.add("model", False, f"cannot hash {model}: {e}")
        return
    root = manifest["params_root"]
    want = (receipt.get("state_hashes") or {}).get("params_root")
    if root == want:
        report.add("model", True, f"saved-tensor root {root[:16]}... is the receipt's")
        report.model_says = ("the model is the provisional model this receipt names (an approximate method ran on it; "
                             "that does not prove the rows gone)" if receipt.get("kind") == "approximate" else
                             "the model is the one this ledger records for the exact deletion of the request's rows")
        return
    # a later model of the same ledger that also excludes the rows: later exact batches in the replay chain, or,
    # for a provisional receipt (or an acknowledgement), the exact batch that served the request and those after it
    serving = _serving(receipt, records)
    if receipt.get("kind") == "exact" and serving is not None:
        chain = _later_exact(records, serving["seq"], serving.get("run"))
    else:
        done = _exact_for(report.request, records)
        chain = [done, *_later_exact(records, done["seq"], done.get("run"))] if done else []
    via = [r for r in chain if r.get("params_root") == root]
    if via:
        own = [serving["batch"]] if receipt.get("kind") == "exact" and serving is not None else []
        path = own + [r["batch"] for r in chain[: chain.index(via[0]) + 1]]
        report.add("model", True, f"saved-tensor root {root[:16]}... is {via[0]['batch']}'s (record {via[0]['seq']}), "
                   f"which excludes the request's rows via {' -> '.join(path)}")
        report.model_says = (f"the model is exact {via[0]['batch']}'s, which excludes the request's rows by this "
                             "ledger's record")
        return
    report.add("model", False, f"saved-tensor root {root[:16]}... is neither the receipt's {str(want)[:16]}... nor a later "
               "exact model of this ledger that excludes its rows")
