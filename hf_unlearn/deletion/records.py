"""A request ledger's records as they are on disk, read without a run or a key (an auditor's copy reads the same).

The names of a ledger folder's files, the states a request goes through, the time helpers every record uses,
:func:`read_records` (checksums and the hash chain; a torn last line is reported, any other damage named),
:func:`read_head` and :func:`fold` (every request's state from the records after it). Signatures are checked by
:mod:`hf_unlearn.deletion.chain`; the writing side is :class:`hf_unlearn.deletion.journal.RequestJournal`.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnlearnError
from .chain import GENESIS, record_hash

LEDGER_FORMAT = "hf_unlearn.request_ledger.v1"  # v1 and v2 read alike; a v2 opening names its key (public_key)
LEDGER_DIR = "requests"
RECORDS_FILE = "ledger.jsonl"
PRIVATE_FILE = ("private", "ids.jsonl")
HEAD_FILE = "head.json"
PENDING, APPROXIMATE, EXACT = "pending", "approximate", "exact"
APPENDED = ("open", "key", "request", "batch_start", "batch_done", "approximate", "purge_start", "purge")


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(microsecond=0)


def parse_time(value: str | dt.datetime | dt.date | None, what: str = "date") -> dt.datetime:
    """An ISO date or date-time (naive means UTC); None is now."""
    if value is None:
        return utc_now()
    if isinstance(value, dt.datetime):
        parsed = value
    elif isinstance(value, dt.date):
        parsed = dt.datetime(value.year, value.month, value.day)
    else:
        try:
            parsed = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            raise UnlearnError(f"{what} {value!r} is not an ISO date (2026-01-31 or 2026-01-31T09:00:00Z)") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.timezone.utc)


def iso(t: dt.datetime) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Request:
    """One request as the ledger knows it (tags only); ``state`` folds every later record about it."""

    id: str
    tags: list[str]
    received: str
    deadline: str
    ref_tag: str | None
    seq: int
    sha256: str
    state: str = PENDING
    batch: str | None = None  # the exact batch that served it
    served: str | None = None  # when the exact deletion was recorded
    provisional: list[str] = field(default_factory=list)  # approximate receipts it has
    running: str | None = None  # a batch started for it and not finished (running, or interrupted)

    def age_days(self, now: dt.datetime | None = None) -> float:
        return ((now or utc_now()) - parse_time(self.received)).total_seconds() / 86400

    def days_left(self, now: dt.datetime | None = None) -> float:
        return (parse_time(self.deadline) - (now or utc_now())).total_seconds() / 86400


def read_records(folder: str | os.PathLike) -> tuple[list[dict], int | None]:
    """A ledger folder's (records, byte offset of a torn last line or None); any other damage is an error naming
    the record. Needs no run and no key: an auditor's copy of the ledger is read the same way."""
    path = Path(folder) / RECORDS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], None
    return parse_records(path, data)


def parse_records(path: Path, data: bytes, start: int = 0, before: dict | None = None) -> tuple[list[dict], int | None]:
    """The records of ``data[start:]`` (the bytes of ``path``) and the offset in ``data`` of a torn last line or
    None. ``before`` is the record that ends ``data[:start]`` (None: ``start`` is 0, the opening comes first): the
    first record read must chain to it, with the next sequence number. The same checks and messages whichever the
    start (:class:`hf_unlearn.deletion.prefix.LedgerReader` reads only what was appended since its last read)."""
    records, offset, torn = [], start, None
    prev, seq = (before["sha256"], before["seq"]) if before is not None else (GENESIS, 0)
    lines = data[start:].split(b"\n")
    for k, line in enumerate(lines, 1):
        n, last = seq + k, k == len(lines)
        if last and not line:
            break
        if last:  # no newline: the append was cut off before its end, so it was never acknowledged
            torn = offset
            break
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise UnlearnError(f"{path}: record {n} (line {n}) is not valid JSON: the ledger was "
                               "damaged or edited; restore it from a backup") from None
        if not isinstance(record, dict) or record.get("sha256") != record_hash(record):
            raise UnlearnError(f"{path}: record {n} (line {n}) fails its checksum: it was edited "
                               "after it was written")
        if record.get("seq") != n or record.get("prev") != prev:
            raise UnlearnError(f"{path}: record {n} (line {n}) does not chain to record {n - 1}: a "
                               "record was removed, reordered or inserted")
        records.append(record)
        prev = record["sha256"]
        offset += len(line) + 1
    if before is None and records and records[0].get("format") != LEDGER_FORMAT:
        raise UnlearnError(f"{path} is not an hf_unlearn request ledger")
    return records, torn


def read_head(folder: str | os.PathLike) -> dict | None:
    try:
        head = json.loads((Path(folder) / HEAD_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        return {}
    return head if isinstance(head, dict) else {}


def request_of(record: dict) -> Request:
    """The request a ``request`` record adds, as it stands when no later record is about it (pending)."""
    return Request(id=record["request"], tags=record["tags"], received=record["received"],
                   deadline=record["deadline"], ref_tag=record.get("ref_tag"), seq=record["seq"],
                   sha256=record["sha256"])


def fold(records: list[dict]) -> dict[str, Request]:
    """Every request with its state folded from the records after it; a record that contradicts the ones before
    it (a request number used twice, a batch done that was never started or is done twice, a served request that
    does not exist) is refused, naming it."""
    out: dict[str, Request] = {}
    started: dict[str, dict] = {}
    done: set[str] = set()

    def bad(r, why):
        return UnlearnError(f"record {r['seq']} ({r['type']}) {why}: the ledger was edited; restore it from a backup")

    for r in records:
        kind = r.get("type")
        if kind not in APPENDED:
            raise bad(r, "is of a type this library does not write")
        if kind == "open" and r["seq"] != 1 or kind != "open" and r["seq"] == 1:
            raise bad(r, "is out of place (the opening record is record 1, and only it)")
        for rid in r.get("requests") or []:
            if rid not in out:
                raise bad(r, f"names request {rid}, which no earlier record adds")
        if kind == "request":
            if r["request"] in out:
                raise bad(r, f"adds request {r['request']} a second time")
            out[r["request"]] = request_of(r)
        elif kind == "approximate":
            for rid in r["requests"]:
                req = out[rid]
                req.provisional.append(r["receipts"][rid]["path"])
                if req.state == PENDING:
                    req.state = APPROXIMATE
        elif kind == "batch_start":
            if r["batch"] in started:
                raise bad(r, f"starts {r['batch']} a second time")
            started[r["batch"]] = r
            for rid in r["requests"]:
                out[rid].running = r["batch"]
        elif kind == "batch_done":
            start = started.get(r["batch"])
            if start is None or r["batch"] in done or start["requests"] != r["requests"]:
                raise bad(r, f"records {r['batch']} as done, which was not started with these requests or is done "
                             "already")
            done.add(r["batch"])
            for rid in r["requests"]:
                req = out[rid]
                req.state, req.batch, req.served, req.running = EXACT, r["batch"], r["time"], None
    return out


def unfinished_purge(records: list[dict]) -> dict | None:
    """The last ``purge_start`` record no ``purge`` record follows (a purge that was cut off), if any."""
    for r in reversed(records):
        if r["type"] == "purge":
            return None
        if r["type"] == "purge_start":
            return r
    return None
