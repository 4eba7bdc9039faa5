"""The request ledger of a recorded run: every deletion request, what was done for it, and when.

A ledger is a folder (default ``RUN/requests``) holding:

* ``ledger.jsonl``: one JSON record per line, append-only. Each record carries its sequence number, the SHA-256 of
  its own canonical JSON (a checksum) and the previous record's hash (a hash chain), and is fsync'd before the
  call returns. A torn last line (an append cut off by a crash: never acknowledged) is ignored and cut off by the
  next append; any other broken, edited, reordered or removed record is named and refused. Ids appear only as
  keyed tags (HMAC, :mod:`hf_unlearn.trace.tags`), ticket references too. Readable by the group (umask).
* ``private/ids.jsonl`` (mode 0600, folder 0700): the raw ids (and ticket references) of each request, the only
  place they are kept; the public record's tags are checked against them on every read.
* ``head.json``: the last record's hash, signed with the Ed25519 signing key (:mod:`hf_unlearn.keys`), so a copy of
  the ledger can be checked by anyone holding the public key.
* ``batches/batch-NNNN/`` (exact deletions), ``provisional/approx-NNNN/`` (approximate ones), ``receipts/``.

Appends are serialised by a file lock (``filelock``), so parallel ``hf-unlearn requests add`` processes are safe.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnlearnError

LEDGER_FORMAT = "hf_unlearn.request_ledger.v1"
HEAD_FORMAT = "hf_unlearn.ledger_head.v1"
LEDGER_DIR = "requests"
RECORDS_FILE = "ledger.jsonl"
PRIVATE_FILE = ("private", "ids.jsonl")
HEAD_FILE = "head.json"
DEFAULT_DEADLINE_DAYS = 30
GENESIS = "0" * 64
PENDING, APPROXIMATE, EXACT = "pending", "approximate", "exact"


def canonical(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def record_hash(record: dict) -> str:
    """SHA-256 of a record without its own ``sha256`` field: the checksum and the next record's ``prev``."""
    return hashlib.sha256(canonical({k: v for k, v in record.items() if k != "sha256"})).hexdigest()


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


class DeletionLedger:
    """The deletion requests of one recorded run, and the service that honours them.

    Args:
        run: the recorded run (the ``trace_dir`` of a ``TraceRecordingTrainer``).
        path: the ledger folder (default ``RUN/requests``); created by the first :meth:`add`.
        deadline_days: the deadline of a new request, in days after it was received (default 30: GDPR's month).
        signing_key: the Ed25519 private key that signs receipts and the ledger head (default: the library's,
            :func:`hf_unlearn.keys.load_signing_key`, created on first use).
    """

    def __init__(self, run: str | os.PathLike, path: str | os.PathLike | None = None, *,
                 deadline_days: float = DEFAULT_DEADLINE_DAYS, signing_key=None):
        from ..validation import is_trace_run

        self.run = Path(run)
        if not is_trace_run(os.fspath(self.run)):
            raise UnlearnError(f"{self.run} is not a recorded run (the trace_dir of a TraceRecordingTrainer)")
        self.path = Path(path) if path is not None else self.run / LEDGER_DIR
        if self.path.exists() and not self.path.is_dir():
            raise UnlearnError(f"--ledger {self.path} is a file: the ledger is a folder (ledger.jsonl, receipts/, "
                               "private/); give a folder that does not exist yet or an existing ledger")
        if not deadline_days > 0:
            raise UnlearnError(f"--deadline-days must be > 0, got {deadline_days}")
        self.deadline_days = deadline_days
        self._signing_key = signing_key

    # -- keys ---------------------------------------------------------------------------------------------------
    @property
    def signing_key(self):
        if self._signing_key is None:
            from ..keys import load_signing_key

            self._signing_key = load_signing_key()
        return self._signing_key

    @property
    def tag_key(self) -> bytes:
        from ..trace.tags import run_key

        return run_key(self.run)

    # -- reading ------------------------------------------------------------------------------------------------
    @property
    def records_path(self) -> Path:
        return self.path / RECORDS_FILE

    def _read(self) -> tuple[list[dict], int | None]:
        return read_records(self.path)

    def records(self) -> list[dict]:
        """Every acknowledged record, checked (checksums, chain, the private part's tags)."""
        records, _ = self._read()
        if records:
            self._check_binding(records[0])
        return records

    def _check_binding(self, opening: dict) -> None:
        header = json.loads((self.run / "header.json").read_text())
        run_ids = {header.get("run_id"), header.get("origin_run_id")}
        if opening.get("origin_run_id") not in run_ids and opening.get("run_id") not in run_ids:
            raise UnlearnError(f"the ledger {self.path} belongs to run {opening.get('run_id')}, not to {self.run} "
                               f"(run {header.get('run_id')})")

    @property
    def ledger_id(self) -> str | None:
        records = self.records()
        return records[0]["ledger"] if records else None

    def requests(self) -> list[Request]:
        """Every request with its state folded from the records after it."""
        out: dict[str, Request] = {}
        for r in self.records():
            kind = r["type"]
            if kind == "request":
                out[r["request"]] = Request(id=r["request"], tags=r["tags"], received=r["received"],
                                            deadline=r["deadline"], ref_tag=r.get("ref_tag"), seq=r["seq"],
                                            sha256=r["sha256"])
            elif kind == "approximate":
                for rid in r["requests"]:
                    req = out[rid]
                    req.provisional.append(r["receipts"][rid]["path"])
                    if req.state == PENDING:
                        req.state = APPROXIMATE
            elif kind == "batch_start":
                for rid in r["requests"]:
                    out[rid].running = r["batch"]
            elif kind == "batch_done":
                for rid in r["requests"]:
                    req = out[rid]
                    req.state, req.batch, req.served, req.running = EXACT, r["batch"], r["time"], None
        return list(out.values())

    def pending(self) -> list[Request]:
        """Requests without an exact deletion yet (pending or approximately served)."""
        return [r for r in self.requests() if r.state != EXACT]

    def unfinished_batch(self) -> dict | None:
        """The ``batch_start`` record of a batch that never recorded ``batch_done`` (interrupted), if any."""
        started, done = {}, set()
        for r in self.records():
            if r["type"] == "batch_start":
                started[r["batch"]] = r
            elif r["type"] == "batch_done":
                done.add(r["batch"])
        left = [r for b, r in started.items() if b not in done]
        return left[-1] if left else None

    def last(self, kind: str) -> dict | None:
        return next((r for r in reversed(self.records()) if r["type"] == kind), None)

    def current_run(self) -> Path:
        """The run the next exact batch deletes from: the last batch's replay (a run without every row deleted so
        far), else the recorded run. Never an approximately unlearned model."""
        done = self.last("batch_done")
        return Path(os.path.normpath(self.path / done["run"])) if done else self.run

    def served_model(self) -> Path | None:
        """The model served now: the newest of the last exact batch's model and later provisional ones."""
        for r in reversed(self.records()):
            if r["type"] in ("batch_done", "approximate"):
                return self.path / r["model"]
        return None

    def private_ids(self, request_ids) -> dict[str, list]:
        """The raw ids of the given requests (from the owner-only private part), checked against their tags."""
        from ..trace.tags import keyed_tags

        wanted = set(request_ids)
        tags = {r.id: r.tags for r in self.requests() if r.id in wanted}
        found: dict[str, list] = {}
        path = self.path.joinpath(*PRIVATE_FILE)
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            lines = []
        key = self.tag_key
        for line in lines:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn private line belongs to an add that never reached the public ledger
            rid = entry.get("request")
            if rid in wanted and rid not in found and keyed_tags(entry["ids"], key) == tags[rid]:
                found[rid] = entry["ids"]
        missing = sorted(wanted - set(found))
        if missing:
            raise UnlearnError(f"the private part {path} has no ids matching the ledger's tags for request(s) "
                               f"{', '.join(missing)}: it was lost or edited; restore it from a backup")
        return found

    # -- writing ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, timeout: float = 600):
        """The ledger's file lock (every append holds it)."""
        from filelock import FileLock, Timeout

        if getattr(self, "_lock", None) is None:  # one lock object: it is re-entrant, a second one would deadlock
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock = FileLock(str(self.path / ".lock"))
        try:
            with self._lock.acquire(timeout=timeout):
                yield
        except Timeout:
            raise UnlearnError(f"the ledger {self.path} stayed locked for {timeout:.0f} s; is another process "
                               "stuck?") from None

    def append(self, kind: str, private: dict | None = None, **fields) -> dict:
        """Append one record (and, first, its private part); the caller may hold :meth:`lock` already."""
        with self.lock():
            records, torn = self._read()
            if torn is not None:  # an append cut off by a crash: never acknowledged, so cut it off
                with open(self.records_path, "r+b") as f:
                    f.truncate(torn)
                    os.fsync(f.fileno())
            if not records and kind != "open":
                records = [self._append_record(records, self._opening())]
            elif records:
                self._check_binding(records[0])
            if private is not None:
                self._append_private(private)
            record = self._append_record(records, {"type": kind, **fields})
            self._write_head(record, records[0]["ledger"])
            return record

    def _opening(self) -> dict:
        from ..keys import key_fingerprint, public_key_fingerprint

        header = json.loads((self.run / "header.json").read_text())
        return {"type": "open", "format": LEDGER_FORMAT, "ledger": uuid.uuid4().hex, "run_id": header.get("run_id"),
                "origin_run_id": header.get("origin_run_id", header.get("run_id")),
                "key_fingerprint": key_fingerprint(self.tag_key), "deadline_days": self.deadline_days,
                "signing_key": public_key_fingerprint(self.signing_key.public_key())}

    def _append_record(self, records: list[dict], fields: dict) -> dict:
        record = {**fields, "seq": len(records) + 1, "prev": records[-1]["sha256"] if records else GENESIS,
                  "time": fields.get("time") or iso(utc_now())}
        record["sha256"] = record_hash(record)
        new = not self.records_path.exists()
        fd = os.open(self.records_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # the umask decides the rest
        try:
            os.write(fd, canonical(record) + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        if new:
            _fsync_dir(self.path)
        records.append(record)
        return record

    def _append_private(self, entry: dict) -> None:
        folder = self.path / PRIVATE_FILE[0]
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
        path = folder / PRIVATE_FILE[1]
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)  # raw ids: owner only, whatever the umask
            os.write(fd, json.dumps(entry, sort_keys=True).encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_head(self, record: dict, ledger: str) -> None:
        from ..keys import public_key_fingerprint, sign
        from ..utils import atomic_write_text

        head = {"format": HEAD_FORMAT, "ledger": ledger, "seq": record["seq"],
                "sha256": record["sha256"], "time": record["time"]}
        head["signature"] = {"algorithm": "ed25519", "value": sign(self.signing_key, canonical(head)),
                             "public_key": public_key_fingerprint(self.signing_key.public_key())}
        atomic_write_text(self.path / HEAD_FILE, json.dumps(head, indent=1) + "\n")

    def add(self, ids, ref: str | None = None, received=None, deadline_days: float | None = None) -> Request:
        """Append a deletion request; the ids are checked against the run first (unknown or wrongly typed ids are
        refused, naming them). Returns the request as recorded."""
        from ..trace.tags import keyed_tags, tag
        from ..validation import load_request_ids
        from .forgetting import _validate_run

        received_at = parse_time(received, "--received")
        days = self.deadline_days if deadline_days is None else deadline_days
        if not days > 0:
            raise UnlearnError(f"--deadline-days must be > 0, got {days}")
        ids = load_request_ids(ids)
        _validate_run(os.fspath(self.current_run() if self.records_path.exists() else self.run), ids)
        key = self.tag_key
        with self.lock():
            number = 1 + sum(1 for r in self._read()[0] if r["type"] == "request")
            rid = f"r-{number:04d}"
            record = self.append(
                "request", private={"request": rid, "ids": ids, "ref": ref}, request=rid,
                tags=keyed_tags(ids, key), count=len(ids), received=iso(received_at),
                deadline=iso(received_at + dt.timedelta(days=days)),
                ref_tag=tag(key, ref) if ref is not None else None)
        return next(r for r in self.requests() if r.seq == record["seq"])


    # -- serving (hf_unlearn.deletion.service) ---------------------------------------------------------------------
    def serve_exact(self, **options):
        """One exact batch over every pending request (:func:`hf_unlearn.deletion.service.serve_exact`)."""
        from .service import serve_exact

        return serve_exact(self, **options)

    def serve_approximate(self, **options):
        """The approximate hot path (:func:`hf_unlearn.deletion.service.serve_approximate`)."""
        from .service import serve_approximate

        return serve_approximate(self, **options)

    def serve_due(self, policy=None, **options):
        """Apply a :class:`~hf_unlearn.deletion.service.Policy` once (what cron runs)."""
        from .service import Policy, serve_due

        return serve_due(self, policy if isinstance(policy, Policy) else Policy.load(policy), **options)

    def plan(self, now=None) -> dict:
        """Replay cost of the pending set: one batch now, each alone, waiting for the earliest deadline."""
        from .service import plan

        return plan(self, now)

    def status(self, now=None) -> dict:
        from .service import status

        return status(self, now)


def read_records(folder: str | os.PathLike) -> tuple[list[dict], int | None]:
    """A ledger folder's (records, byte offset of a torn last line or None); any other damage is an error naming
    the record. Needs no run and no key: an auditor's copy of the ledger is read the same way."""
    path = Path(folder) / RECORDS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], None
    records, prev, offset, torn = [], GENESIS, 0, None
    lines = data.split(b"\n")
    for n, line in enumerate(lines, 1):
        last = n == len(lines)
        if last and not line:
            break
        if last:  # no newline: the append was cut off before its end, so it was never acknowledged
            torn = offset
            break
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
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
    if records and records[0].get("format") != LEDGER_FORMAT:
        raise UnlearnError(f"{path} is not an hf_unlearn request ledger")
    return records, torn



def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
