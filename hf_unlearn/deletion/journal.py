"""The request journal of a recorded run: the signed, append-only store of every deletion request, what was done
for it, and when (:class:`~hf_unlearn.deletion.DeletionLedger` adds the service's entry points on top).

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
import json
import math
import os
import tempfile
import uuid
from pathlib import Path

from ..errors import UnlearnError
from ..keys import (
    find_signing_key,
    key_fingerprint,
    load_signing_key,
    public_key_fingerprint,
    public_key_from_hex,
    public_key_hex,
)
from ..utils import atomic_write_text, current_umask
from ..validation import is_trace_run, load_request_ids
from .chain import GENESIS, ChainCheck, canonical, check_chain, head_body, record_hash, sign_head, sign_record
from .evidence import key_lookup, listing, rollback_problem
from .prefix import LedgerReader
from .receipts import acknowledge, read_receipt, receipt_sha256, write_missing_bundles
from .records import (
    APPENDED,
    EXACT,
    HEAD_FILE,
    LEDGER_DIR,
    LEDGER_FORMAT,
    PRIVATE_FILE,
    RECORDS_FILE,
    Request,
    fold,
    iso,
    parse_time,
    read_head,
    request_of,
    utc_now,
)

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)

DEFAULT_DEADLINE_DAYS = 30
MAX_DEADLINE_DAYS = 3650
CLOCK_SKEW = dt.timedelta(minutes=5)


class LedgerTail(UnlearnError):
    """Records after the signed head (an append in progress, or one a crash cut off: see ``recover``)."""


class RequestJournal:
    """The deletion requests of one recorded run as a signed journal: read checked, appended atomically, recovered.

    Args:
        run: the recorded run (the ``trace_dir`` of a ``TraceRecordingTrainer``).
        path: the ledger folder (default ``RUN/requests``); created by the first :meth:`add`.
        deadline_days: the deadline of a new request, in days after it was received (default 30: GDPR's month).
        signing_key: the Ed25519 private key that signs receipts and the ledger head (default: the library's,
            :func:`hf_unlearn.keys.load_signing_key`, created on first use).
    """

    def __init__(self, run: str | os.PathLike, path: str | os.PathLike | None = None, *,
                 deadline_days: float = DEFAULT_DEADLINE_DAYS, signing_key=None):
        self.run = Path(run)
        if not is_trace_run(os.fspath(self.run)):
            raise UnlearnError(f"{self.run} is not a recorded run (the trace_dir of a TraceRecordingTrainer)")
        self.path = Path(path) if path is not None else self.run / LEDGER_DIR
        if self.path.exists() and not self.path.is_dir():
            raise UnlearnError(f"--ledger {self.path} is a file: the ledger is a folder (ledger.jsonl, receipts/, "
                               "private/); give a folder that does not exist yet or an existing ledger")
        self.deadline_days = check_deadline_days(deadline_days)
        self._signing_key = signing_key

    # -- keys ---------------------------------------------------------------------------------------------------
    @property
    def signing_key(self):
        if self._signing_key is None:
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

    @property
    def reader(self) -> LedgerReader:
        """What this object has checked of ``ledger.jsonl`` so far (:mod:`hf_unlearn.deletion.prefix`)."""
        reader = getattr(self, "_reader", None)
        if reader is None or reader.path != self.records_path:
            reader = self._reader = LedgerReader(self.records_path)
        return reader

    def _read(self) -> tuple[list[dict], int | None]:
        """What :func:`~hf_unlearn.deletion.records.read_records` returns, parsing only what was appended since the
        last read when the bytes before it are still those read then (:class:`~hf_unlearn.deletion.prefix.
        LedgerReader`)."""
        return self.reader.read()

    def check(self, records: list[dict] | None = None) -> ChainCheck:
        """The chain checked against the signed head and this machine's signing key (what every command does
        first); ``records`` already read, or read now. The signatures of records this object verified before (the
        same bytes of the same file, the same anchor) are not verified again; the head always is, and a refusal
        is always the verdict of a check of the whole ledger."""
        if records is None:
            records = self._read()[0]
        anchor = self.signing_key.public_key()
        last = (records[-1].get("signature") or {}).get("key") if records else None
        if last is not None and last != public_key_fingerprint(anchor) and records[-1].get("type") != "key":
            old = find_signing_key(last)  # rotated here: the archived key we hold vouches until the hand-over
            anchor = old.public_key() if old is not None else anchor
        head = read_head(self.path)
        walk = self.reader.walk_for(records, public_key_fingerprint(anchor))
        result = check_chain(records, head, anchor, resume=walk)
        if result.problem is not None and walk is not None:
            result = check_chain(records, head, anchor)
        if result.problem is None:
            self.reader.remember(records, result.walk)
        return result

    def checked(self, records: list[dict]) -> list[dict]:
        """``records`` if the signed head and every record's signature vouch for them, else one line naming the first
        record they do not cover (and how to recover from an interrupted append)."""
        if not records:
            return records
        result = self.check(records)
        if result.problem is not None:
            raise UnlearnError(f"the ledger {self.path} cannot be trusted: {result.problem}; nothing was done")
        if result.tail:
            raise LedgerTail(f"the ledger {self.path}: {result.tail_problem()}; nothing was done. `hf-unlearn "
                               "requests recover` re-signs the head if the tail is exactly what an interrupted serve or "
                               "add writes, and refuses anything else")
        self._check_binding(records[0])
        folded = (len(records), records[-1]["sha256"])  # the hash chain: the same records as the last ones folded
        if getattr(self, "_folded", None) != folded:
            fold(records)  # request numbers used once, batches started before done, ...
            self._folded = folded
        self._check_evidence(records, result)
        return records

    def _check_evidence(self, records: list[dict], result: ChainCheck) -> None:
        """Refuse a ledger older than the service's own evidence (a rollback: :mod:`hf_unlearn.deletion.evidence`),
        naming the newest signed head found. Cached per state of the ledger and its receipts and batches, and each
        receipt is read and verified once while it is unchanged (same inode, size and time: the ``seen`` of
        :func:`~hf_unlearn.deletion.evidence.evidence`, for one ledger id and one set of keys)."""
        state = (records[-1]["sha256"], *(listing(self.path / d) for d in ("receipts", "batches")))
        if getattr(self, "_evidence_ok", None) == state:
            return
        anchor = self.signing_key.public_key()
        scope = (records[0].get("ledger"), tuple(sorted(result.keys)), public_key_fingerprint(anchor))
        seen = getattr(self, "_evidence_seen", None)
        if seen is None or seen[0] != scope:  # another ledger or other keys: read every file again
            seen = self._evidence_seen = (scope, {})
        problem = rollback_problem(self.path, records, result.head_seq, key_lookup(result.keys, anchor), seen[1],
                                   state[1])
        if problem is not None:
            raise UnlearnError(f"the ledger {self.path} cannot be trusted: {problem}; nothing was done")
        self._evidence_ok = state

    def records(self) -> list[dict]:
        """Every acknowledged record, checked: checksums, chain, every record's signature and the signed head. A tail
        seen while another process appends (its record written, its head not yet) is read again under the lock. The
        record dicts are the ones this object remembers as verified (:mod:`hf_unlearn.deletion.prefix`): read them,
        never modify them (copy one to change it)."""
        try:
            return self.checked(self._read()[0])
        except LedgerTail:
            with self.lock():
                return self.checked(self._read()[0])

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
        return list(fold(self.records()).values())

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
        """Append one record (with, first, its private part), all or nothing: the new head is prepared first (an
        unwritable folder fails before anything is recorded), a failed append of the record takes its private line
        back, and a crash after the record is written leaves a signed tail that :meth:`recover` re-signs. The
        caller may hold :meth:`lock` already."""
        with self.lock():
            records, torn = self._read()
            if torn is not None:  # an append cut off by a crash: never acknowledged, so cut it off
                with open(self.records_path, "r+b") as f:
                    f.truncate(torn)
                    os.fsync(f.fileno())
            self.checked(records)
            new = []
            if not records and kind != "open":
                new.append(self._record(records + new, self._opening()))
            new.extend(self._rotation(records + new))
            new.append(self._record(records + new, {"type": kind, **fields}))
            ledger = (records or new)[0]["ledger"]
            self._commit(new, ledger, private)
            records.extend(new)
            return new[-1]

    def _opening(self) -> dict:
        header = json.loads((self.run / "header.json").read_text())
        public = self.signing_key.public_key()
        return {"type": "open", "format": LEDGER_FORMAT, "ledger": uuid.uuid4().hex, "run_id": header.get("run_id"),
                "origin_run_id": header.get("origin_run_id", header.get("run_id")),
                "key_fingerprint": key_fingerprint(self.tag_key), "deadline_days": self.deadline_days,
                "signing_key": public_key_fingerprint(public), "public_key": public_key_hex(public)}

    def _rotation(self, records: list[dict]) -> list[dict]:
        """A ``key`` record when this machine's signing key is not the one the ledger's last record is signed with
        (``hf_unlearn.keys.rotate_signing_key``): signed by the old key (found in its archive), naming the new one."""
        if not records or not records[0].get("public_key"):
            return []
        now = public_key_fingerprint(self.signing_key.public_key())
        last = (records[-1].get("signature") or {}).get("key")
        if records[-1].get("type") == "key":
            last = public_key_fingerprint(public_key_from_hex(records[-1]["public_key"]))
        if last == now or last is None:
            return []
        old = find_signing_key(last)
        if old is None:
            raise UnlearnError(f"the ledger {self.path} is signed with key {last}, and this machine's signing key is "
                               f"{now}; restore the old key (or its archive signing_ed25519.{last}.pem) so it can "
                               "hand over to the new one")
        record = {"type": "key", "previous_fingerprint": last, "previous_public_key": public_key_hex(
            old.public_key()), "fingerprint": now, "public_key": public_key_hex(self.signing_key.public_key())}
        return [self._record(records, record, key=old)]

    def _record(self, records: list[dict], fields: dict, key=None) -> dict:
        record = {**fields, "seq": len(records) + 1, "prev": records[-1]["sha256"] if records else GENESIS,
                  "time": fields.get("time") or iso(utc_now())}
        record["sha256"] = record_hash(record)
        record["signature"] = sign_record(record, key or self.signing_key)
        return record

    def _commit(self, new: list[dict], ledger: str, private: dict | None) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        head = sign_head(head_body(ledger, new[-1]), self.signing_key)
        try:
            fd, tmp_head = tempfile.mkstemp(dir=self.path, prefix=".head.", suffix=".tmp")  # unwritable folder: here
        except OSError as e:
            raise UnlearnError(f"cannot write to the ledger folder {self.path}: {e.strerror or e}; nothing was "
                               "recorded") from None
        try:
            os.fchmod(fd, 0o666 & ~current_umask())
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(head, indent=1) + "\n")
                f.flush()
                os.fsync(f.fileno())
            undo_private = self._append_private(private) if private is not None else None
            created = not self.records_path.exists()
            try:
                _append_bytes(self.records_path, b"".join(canonical(r) + b"\n" for r in new), 0o666)  # what open() gives: a public file
            except BaseException:
                if undo_private is not None:
                    undo_private()
                raise
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp_head)
            raise UnlearnError(f"cannot append to the ledger {self.path}: {e.strerror or e}; nothing was "
                               "recorded") from None
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp_head)
            raise
        try:
            if created:
                _fsync_dir(self.path)
            os.replace(tmp_head, self.path / HEAD_FILE)  # a crash before this: a signed tail, see recover()
            _fsync_dir(self.path)
        except OSError as e:
            raise UnlearnError(f"record {new[-1]['seq']} was appended to {self.path} but its head could not be "
                               f"signed ({e.strerror or e}); `hf-unlearn requests recover` re-signs it") from None
        finally:
            if os.path.exists(tmp_head):
                os.unlink(tmp_head)

    def _append_private(self, entry: dict):
        """Append the private line; returns the function that takes it back."""
        folder = self.path / PRIVATE_FILE[0]
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)
        path = folder / PRIVATE_FILE[1]
        size = path.stat().st_size if path.exists() else 0
        _append_bytes(path, json.dumps(entry, sort_keys=True).encode() + b"\n", 0o600, private=True)

        def undo():
            with open(path, "r+b") as f:
                f.truncate(size)
                os.fsync(f.fileno())
        return undo

    def recover(self, log=None) -> dict | None:
        """Re-sign the head over a tail left by an interrupted append, only if every tail record is exactly what this
        library writes: signed with the ledger's key (no one without the key can write that), of a kind it appends,
        and, for a serving record, every receipt it lists present and hashing to what it records. Returns the new
        head (None: nothing to recover); anything else is refused, naming the first record."""
        log = log or (lambda m: None)
        with self.lock():
            records, _ = self._read()
            result = self.check(records)
            if result.problem is not None and not (result.head is None and len(records) <= 3):
                raise UnlearnError(f"cannot recover the ledger {self.path}: {result.problem}")
            if result.head is None:  # the very first append (opening [+ key] + its record) crashed before the head
                if result.problem and "no signed head" not in result.problem:
                    raise UnlearnError(f"cannot recover the ledger {self.path}: {result.problem}")
                if public_key_fingerprint(self.signing_key.public_key()) not in result.keys:
                    raise UnlearnError(f"cannot recover the ledger {self.path}: it has no signed head and its "
                                       f"records are signed with key(s) {', '.join(result.keys) or 'none'}, not "
                                       "this machine's")
                result.tail = records
            if result.head is not None:  # the tail's own receipts name tail records: compare with all of them
                self._check_evidence(records, ChainCheck(records=records, head=result.head, head_seq=len(records),
                                                         keys=result.keys))
            if not result.tail:
                write_missing_bundles(self, log)
                return None
            for r in result.tail:
                if r.get("type") not in APPENDED:
                    raise UnlearnError(f"cannot recover: record {r['seq']} is of type {r.get('type')!r}, which this "
                                       "library does not append")
                for rid, entry in (r.get("receipts") or {}).items():
                    path = self.path / entry.get("path", "")
                    try:
                        ok = receipt_sha256(read_receipt(path)) == entry.get("sha256")
                    except UnlearnError:
                        ok = False
                    if not ok:
                        raise UnlearnError(f"cannot recover: record {r['seq']} ({r['type']}) lists a receipt for "
                                           f"{rid} that is missing or differs ({entry.get('path')})")
            fold(records)
            self._check_binding(records[0])
            head = sign_head(head_body(records[0]["ledger"], records[-1]), self.signing_key)
            atomic_write_text(self.path / HEAD_FILE, json.dumps(head, indent=1) + "\n")
            log(f"re-signed the head over record(s) {result.tail[0]['seq']}..{records[-1]['seq']} "
                f"({', '.join(r['type'] for r in result.tail)}): an interrupted append of this library")
        write_missing_bundles(self, log)  # the acknowledgements and bundles the interrupted command did not write
        return head

    def add(self, ids, ref: str | None = None, received=None, deadline_days: float | None = None, *,
            check=None) -> Request:
        """Append a deletion request; the ids are checked against the run first (unknown or wrongly typed ids are
        refused, naming them). Returns the request as recorded; a signed acknowledgement is written to
        ``receipts/r-NNNN.ack.json`` (:func:`hf_unlearn.deletion.receipts.acknowledge`). ``check(run, ids)`` checks
        the ids against the run they will be deleted from (:func:`hf_unlearn.deletion.checks.check_request`, which
        :class:`~hf_unlearn.deletion.DeletionLedger` passes), before anything is written."""
        from ..trace.tags import keyed_tags, tag

        received_at = parse_time(received, "--received")
        if received_at > utc_now() + CLOCK_SKEW:
            raise UnlearnError(f"--received {iso(received_at)} is in the future (now {iso(utc_now())}); give the date "
                               "the request was received")
        days = check_deadline_days(self.deadline_days if deadline_days is None else deadline_days)
        if ref is not None and not isinstance(ref, str):
            raise UnlearnError(f"ref must be a string (a ticket reference), not {type(ref).__name__}")
        ids = load_request_ids(ids)
        if check is not None:  # a pipeline: every stage
            check(self.current_run() if self.records_path.exists() else self.run, ids)
        key = self.tag_key
        _check_writable(self.path / "receipts")  # the acknowledgement goes there: fail before recording, not after

        with self.lock():  # the acknowledgement too: it reads the ledger another add may be appending to
            number = 1 + sum(1 for r in self.checked(self._read()[0]) if r["type"] == "request")
            rid = f"r-{number:04d}"
            used = sorted((self.path / "receipts").glob(f"{rid}.*"))
            if used:  # a number is never reused, a receipt never overwritten
                raise UnlearnError(f"the ledger {self.path} would number this request {rid}, but receipts/"
                                   f"{used[0].name} exists: the number was used before and the ledger rolled back "
                                   "or replaced; restore the newest ledger; nothing was recorded")
            record = self.append(
                "request", private={"request": rid, "ids": ids, "ref": ref}, request=rid,
                tags=keyed_tags(ids, key), count=len(ids), received=iso(received_at),
                deadline=iso(received_at + dt.timedelta(days=days)),
                ref_tag=tag(key, ref) if ref is not None else None)
            records = self.records()  # checked once more, with the new record; the acknowledgement reuses them
            if records[-1]["sha256"] != record["sha256"]:
                raise UnlearnError(f"the ledger {self.path} changed while its lock was held (record {record['seq']} "
                                   "is not the one appended): restore the newest ledger; nothing was acknowledged")
            request = request_of(records[-1])  # pending: no record after it
            acknowledge(self, request, records)
        return request


class ServeBusy(UnlearnError):
    """Another serve (or purge) holds the ledger's serve lock."""


@contextlib.contextmanager
def serving(ledger: RequestJournal):
    """The serve lock: one serve per ledger at a time; a second one is refused at once (not queued)."""
    from filelock import FileLock, Timeout

    ledger.path.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(ledger.path / ".serve.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise ServeBusy(f"another `requests serve` is running on {ledger.path}; nothing was done") from None
    try:
        yield
    finally:
        lock.release()


def check_deadline_days(days) -> float:
    if isinstance(days, bool) or not isinstance(days, (int, float)) or not math.isfinite(days) \
            or not 0 < days <= MAX_DEADLINE_DAYS:
        raise UnlearnError(f"--deadline-days must be a number of days > 0 and <= {MAX_DEADLINE_DAYS}, got {days!r}")
    return float(days)


def _append_bytes(path: Path, data: bytes, mode: int, private: bool = False) -> None:
    """One ``write`` of ``data`` at the end of ``path`` (created with ``mode``), fsync'd; a short write is undone."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    try:
        if private:
            os.fchmod(fd, 0o600)  # raw ids: owner only, whatever the umask
        size = os.fstat(fd).st_size
        try:
            if os.write(fd, data) != len(data):
                raise OSError(f"short write to {path}")
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise UnlearnError(f"cannot write to {folder}: {e.strerror or e}; nothing was recorded") from None


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
