"""A ledger object checks each record once (hf_unlearn.deletion.prefix): after a read it remembers the SHA-256 of the
bytes it read and the signature walk over them, and the next read checks only what was appended. The attacks an
insider tries once that memory is warm (an earlier line edited to the same length, a record removed, the file
truncated and re-grown, a badly signed record appended by another process, the head rolled back, the file replaced
by another ledger's, a receipt rewritten after it was read) are refused exactly as a fresh object refuses them; the
signatures verified per add do not grow with the ledger."""

from __future__ import annotations

import functools
import json
import os
import shutil

import pytest

from hf_unlearn.errors import UnlearnError

from .test_deletion_integrity import rechain
from .test_requests import ledger_at
from .test_trace_common import get_recorded, ids_at_step


@functools.cache
def every_id() -> list:
    run = get_recorded()
    return [i for s in range(1, 9) for i in ids_at_step(run, s)]


def ids(k: int) -> list:
    return [every_id()[k % len(every_id())]]


@pytest.fixture
def warm(tmp_path):
    """A ledger of four requests whose object has read and checked it (its memory is warm), and a pristine copy."""
    ledger = ledger_at(tmp_path / "ledger")
    for k in range(4):
        ledger.add(ids(k), received="2026-11-01")
    ledger.requests()
    assert ledger.reader.walk_for(ledger._read()[0], ledger.check().walk.anchor) is not None
    shutil.copytree(ledger.path, tmp_path / "pristine")
    return ledger


def verdict(ledger) -> str:
    """What reading the ledger and adding to it say: the records' ids, or the refusal."""
    try:
        out = [r.id for r in ledger.requests()]
        ledger.add(ids(9), received="2026-11-02")
        return f"accepted {out}"
    except UnlearnError as e:
        return f"refused: {e}"


def fresh_verdict(ledger) -> str:
    """The verdict of an object that remembers nothing, on a copy of the same files (so the two do not interfere)."""
    copy = ledger.path.parent / "copy"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(ledger.path, copy)
    return verdict(ledger_at(copy)).replace(str(copy), str(ledger.path))


def refused_as_fresh(ledger, match: str) -> None:
    fresh = fresh_verdict(ledger)
    warm = verdict(ledger)
    assert warm == fresh and warm.startswith("refused") and match in warm, (warm, fresh)


def lines(ledger) -> list[bytes]:
    return (ledger.path / "ledger.jsonl").read_bytes().splitlines(keepends=True)


def test_an_earlier_record_edited_in_place_to_the_same_length_is_refused(warm):
    path = warm.path / "ledger.jsonl"
    before, st = path.read_bytes(), path.stat()
    record = json.loads(lines(warm)[2])
    tag = record["tags"][0]
    record["tags"][0] = ("0" if tag[0] != "0" else "1") + tag[1:]  # another id's tag, same length
    rechain(path, lambda rs: [*rs[:2], record, *rs[3:]])  # every hash recomputed: only the signatures tell
    after = path.read_bytes()
    assert len(after) == len(before) and after != before
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same time, same inode: only the bytes differ
    assert path.stat().st_ino == st.st_ino
    refused_as_fresh(warm, "record 3 (request) is not signed by the ledger's key")


def test_an_earlier_signature_replaced_in_place_is_refused(warm):
    # a signature is outside its record's hash: the chain of hashes is intact, only the bytes read tell
    path = warm.path / "ledger.jsonl"
    data = lines(warm)
    record = json.loads(data[1])
    value = record["signature"]["value"]
    data[1] = data[1].replace(value.encode(), (("0" if value[0] != "0" else "1") + value[1:]).encode())
    path.write_bytes(b"".join(data))
    refused_as_fresh(warm, "record 2 (request) is not signed by the ledger's key")


def test_an_edited_line_that_fails_its_checksum_is_named_as_by_a_fresh_read(warm):
    path = warm.path / "ledger.jsonl"
    data = lines(warm)
    data[1] = data[1].replace(b'"count":1', b'"count":2')
    path.write_bytes(b"".join(data))
    refused_as_fresh(warm, "record 2 (line 2) fails its checksum")


def test_a_removed_record_is_refused(warm):
    path = warm.path / "ledger.jsonl"
    path.write_bytes(b"".join(lines(warm)[:2] + lines(warm)[3:]))
    refused_as_fresh(warm, "record 3 (line 3) does not chain to record 2")
    rechain(path, lambda rs: rs)  # and with the chain recomputed: the signatures
    refused_as_fresh(warm, "is not signed by the ledger's key")


def test_a_truncated_and_regrown_file_is_refused(warm, tmp_path):
    other = ledger_at(tmp_path / "other")  # the same run, the same key: its records are signed, by the same key
    for k in range(5):
        other.add(ids(k + 1), received="2026-11-01")
    path = warm.path / "ledger.jsonl"
    size = path.stat().st_size
    with open(path, "r+b") as f:  # same inode, cut to two records, then grown past its old length
        f.truncate(len(b"".join(lines(warm)[:2])))
        f.seek(0, os.SEEK_END)
        f.write(b"".join(lines(other)[2:]))
    assert path.stat().st_size > size
    refused_as_fresh(warm, "record 3 (line 3) does not chain to record 2")


def test_a_record_appended_by_another_process_with_a_bad_signature_is_refused(warm):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from hf_unlearn.deletion.chain import canonical

    records = warm._read()[0]
    forged = warm._record(records, {"type": "request", "request": "r-0005", "tags": [], "count": 0,
                                    "received": "2026-11-01T00:00:00Z", "deadline": "2026-12-01T00:00:00Z",
                                    "ref_tag": None}, key=Ed25519PrivateKey.generate())
    with open(warm.path / "ledger.jsonl", "ab") as f:
        f.write(canonical(forged) + b"\n")
    refused_as_fresh(warm, "record 6 (request) is not signed by the ledger's key")


def test_a_good_record_appended_by_another_process_is_read_without_rereading_the_rest(warm):
    other = ledger_at(warm.path)  # another process: its own memory, the same file and lock
    other.add(ids(5), received="2026-11-01")
    reads = warm.reader.full_reads
    assert [r.id for r in warm.requests()][-1] == "r-0005"
    assert warm.reader.full_reads == reads  # the new record checked alone, the prefix by its hash


def test_a_head_rolled_back_is_refused(warm, tmp_path):
    old_head = (warm.path / "head.json").read_bytes()
    warm.add(ids(5), received="2026-11-01")
    warm.requests()
    (warm.path / "head.json").write_bytes(old_head)  # a signed head of the ledger, one record short
    refused_as_fresh(warm, "not covered by the signed head")
    lines_now = lines(warm)
    (warm.path / "ledger.jsonl").write_bytes(b"".join(lines_now[:-1]))  # and the records cut back to it
    refused_as_fresh(warm, "older than the service's own evidence")


@pytest.mark.parametrize("how", ["renamed over", "written in place"])
def test_the_file_replaced_by_another_ledgers_is_refused(warm, tmp_path, how):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    other = ledger_at(tmp_path / "other", signing_key=Ed25519PrivateKey.generate())  # another machine's ledger
    for k in range(2):
        other.add(ids(k), received="2026-11-01")
    for name in ("ledger.jsonl", "head.json"):
        if how == "renamed over":
            shutil.copy(other.path / name, warm.path / f".{name}.new")
            os.replace(warm.path / f".{name}.new", warm.path / name)
        else:
            (warm.path / name).write_bytes((other.path / name).read_bytes())
    refused_as_fresh(warm, "not with the given key")


def test_an_identical_copy_under_a_new_inode_is_read_again_and_accepted(warm):
    path = warm.path / "ledger.jsonl"
    reads = warm.reader.full_reads
    shutil.copy(path, warm.path / ".copy")
    os.replace(warm.path / ".copy", path)
    assert [r.id for r in warm.requests()] == ["r-0001", "r-0002", "r-0003", "r-0004"]
    assert warm.reader.full_reads == reads + 1  # a new file: nothing remembered of the old one is trusted


def test_signature_verifications_per_add_do_not_grow_with_the_ledger(tmp_path, monkeypatch):
    from hf_unlearn import keys
    from hf_unlearn.deletion import chain, evidence

    counted = {"n": 0}
    original = keys.signature_ok

    def signature_ok(*a):
        counted["n"] += 1
        return original(*a)

    for module in (chain, evidence):
        monkeypatch.setattr(module, "signature_ok", signature_ok)
    ledger = ledger_at(tmp_path / "ledger")
    per_add = []
    for k in range(10):
        counted["n"] = 0
        ledger.add(ids(k), received="2026-11-01")
        per_add.append(counted["n"])
    # the first add on a fresh object checks everything there is (nothing, here); every later one the same few
    # signatures: the new record, the head at each of its reads, and the new acknowledgement and bundle
    assert len(set(per_add[2:])) == 1 and per_add[-1] <= 12, per_add
    counted["n"] = 0
    fresh = ledger_at(ledger.path)
    fresh.add(ids(11), received="2026-11-01")
    assert counted["n"] > 3 * 10  # a fresh object verifies the whole ledger once (and the receipts once)


def test_a_remembered_walk_serves_only_the_records_it_walked(warm):
    from hf_unlearn.deletion.chain import check_chain
    from hf_unlearn.deletion.records import read_head

    records = warm._read()[0]
    walk = warm.check(records).walk
    assert warm.reader.walk_for(records, walk.anchor) is walk
    assert warm.reader.walk_for([dict(r) for r in records], walk.anchor) is None  # equal, but not the ones read
    assert warm.reader.walk_for(records, "0" * 16) is None  # another anchor
    forged = [*records[:-1], {**records[-1], "sha256": "f" * 64}]  # another last record: all of it is checked
    result = check_chain(forged, read_head(warm.path), warm.signing_key.public_key(), resume=walk)
    assert result.problem is not None and "record 5 (request) is not signed" in result.problem


def test_a_receipt_rewritten_since_it_was_read_is_read_again(warm):
    from hf_unlearn.deletion.receipts import write_bundle

    saved = {name: (warm.path / name).read_bytes() for name in ("ledger.jsonl", "head.json")}
    other = ledger_at(warm.path)  # another process adds record 6, and `requests bundle` redoes r-0001's bundle
    other.add(ids(5), received="2026-11-01")
    write_bundle(other, warm.path / "receipts" / "r-0001.ack.json")  # under the head of record 6
    for path in (warm.path / "receipts").glob("r-0005.*"):  # an insider removes the newest evidence he knows of
        path.unlink()
    for name, data in saved.items():  # and rolls the ledger back
        (warm.path / name).write_bytes(data)
    refused_as_fresh(warm, "older than the service's own evidence")
