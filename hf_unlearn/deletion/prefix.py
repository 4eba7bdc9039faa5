"""What this process has already checked of a ledger file, so the next read checks only what was appended since.

A ledger only grows, and every command reads and checks it several times (an ``add``: six times), each time
verifying every record's checksum, hash link and Ed25519 signature: an append cost time in proportion to the
ledger's length. :class:`LedgerReader` remembers, in memory and for one journal object, the byte length and the
SHA-256 of the prefix of ``ledger.jsonl`` it read (whole lines only: a torn last line is never part of it), the
records parsed from it and the signature walk (:class:`~hf_unlearn.deletion.chain.ChainWalk`) that verified them.
On the next read the whole file is read again and the prefix must still hash to what was read, in the same file
(device and inode): then only the bytes after it are parsed and checked (by the same
:func:`~hf_unlearn.deletion.records.parse_records`), and :func:`~hf_unlearn.deletion.chain.check_chain` resumes the
walk after the records it verified. Anything else (an earlier line edited, even to the same length; the file
truncated, replaced or re-grown; another anchor key) forgets everything and checks the whole ledger again, so every
verdict is the one a fresh read gives. The head is checked on every read: it is never remembered.

Records appended by another process (under the ledger's file lock, between two reads of ours) are new bytes after
the prefix: they are parsed and their signatures verified like any other. Snapshots are replaced whole, never
edited, so threads sharing one journal (the web intake) read consistent ones. The record dicts a read returns are
the remembered ones (a copy of each on every read would cost what this saves): callers read them and never modify
them.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

from .chain import ChainWalk
from .records import parse_records


@dataclass(frozen=True)
class _Read:
    identity: tuple[int, int]  # st_dev, st_ino of the file the prefix was read from
    length: int  # bytes of whole lines read
    digest: bytes  # their SHA-256
    records: tuple  # the records parsed from them (checksums and hash links checked)
    walk: ChainWalk | None = None  # the signature walk over a prefix of those records (None: not walked yet)


class LedgerReader:
    """Reads one ``ledger.jsonl`` again and again, parsing and checking only the bytes appended since the last read
    (see the module's docstring). ``read()`` returns what :func:`~hf_unlearn.deletion.records.read_records` does."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._last: _Read | None = None
        self.full_reads = 0  # reads that parsed the whole file (a first read, or one after a change): for tests

    def read(self) -> tuple[list[dict], int | None]:
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            self._last = None
            return [], None
        identity = (st.st_dev, st.st_ino)
        known = self._last
        digest = None
        if known is not None and known.identity == identity and len(data) >= known.length:
            digest = hashlib.sha256(memoryview(data)[:known.length])
            if digest.digest() != known.digest:
                digest = None  # an earlier line was edited: forget everything, read it all again
        try:
            if digest is not None:
                new, torn = parse_records(self.path, data, known.length, known.records[-1] if known.records else None)
                records = [*known.records, *new]
            else:
                known = None
                self.full_reads += 1
                records, torn = parse_records(self.path, data)
                digest = hashlib.sha256()
        except BaseException:
            self._last = None
            raise
        start = known.length if known is not None else 0
        end = torn if torn is not None else len(data)
        digest.update(memoryview(data)[start:end])
        self._last = _Read(identity, end, digest.digest(), tuple(records), known.walk if known is not None else None)
        return records, torn

    def walk_for(self, records: list[dict], anchor: str) -> ChainWalk | None:
        """The signature walk remembered for a prefix of ``records`` (the very records the last read returned), if
        it was walked for ``anchor``; else None (check everything)."""
        known = self._last
        walk = known.walk if known is not None else None
        if walk is None or walk.anchor != anchor or not 0 < walk.count <= min(len(records), len(known.records)):
            return None
        same = records[walk.count - 1] is known.records[walk.count - 1]
        return walk if same and known.records[walk.count - 1]["sha256"] == walk.last else None

    def remember(self, records: list[dict], walk: ChainWalk | None) -> None:
        """Keep ``walk`` (the signatures of ``records`` all verified) if ``records`` are what the last read returned."""
        known = self._last
        if walk is None or known is None or walk.count != len(records) or walk.count > len(known.records) \
                or records[-1] is not known.records[walk.count - 1]:
            return
        self._last = replace(known, walk=walk)
