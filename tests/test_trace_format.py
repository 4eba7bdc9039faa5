"""Pure functions of the trace format: WAL records, tags, plan segments, forget lists (no model)."""

from __future__ import annotations

import struct
import zlib

import pytest


def test_wal_record_layout_and_crc(tmp_path):
    from hf_unlearn.trace.wal import WalRecord, read_wal

    rec = WalRecord(digest=2**64 - 1, seed=7, lr=0.5, step=3, length=4, flags=1)
    raw = rec.pack()
    assert len(raw) == 32 and raw[:28] == struct.pack("<QQfIHH", 2**64 - 1, 7, 0.5, 3, 4, 1)
    assert struct.unpack("<I", raw[28:])[0] == zlib.crc32(raw[:28])
    bad = bytearray(raw)
    bad[9] ^= 0x80
    (tmp_path / "wal.bin").write_bytes(raw + bytes(bad) + raw[:5])
    scan = read_wal(tmp_path / "wal.bin")
    assert scan.records[0] == rec and scan.bad_crc == [1] and scan.tail_bytes == 5


def test_tags_are_keyed_and_typed():
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace.tags import ids_digest, tag

    k1, k2 = b"a" * 32, b"b" * 32
    assert len(tag(k1, 1)) == 16 and tag(k1, 1) == tag(k1, 1)
    assert tag(k1, 1) != tag(k1, "1") and tag(k1, 1) != tag(k2, 1)
    t = [tag(k1, 1), tag(k1, 2)]
    assert ids_digest(k1, t) != ids_digest(k1, t[::-1]) != ids_digest(k1, [t[0], None])
    with pytest.raises(UnlearnError, match="ints or strings"):
        tag(k1, 1.5)


def test_segments_and_emptied_steps():
    from hf_unlearn.trace.plan import PlanEntry, segments
    from hf_unlearn.trace.replay import emptied_steps

    def e(mb, step, j, end, slots):
        return PlanEntry(mb, step, j, end, 0, 0.1, 4.0, "float32", 2, slots, [3] * len(slots))

    plan = [e(0, 0, 0, False, ["a", "b"]), e(1, 0, 1, True, ["c", None]), e(2, 1, 0, False, ["d", None]),
            e(3, 1, 1, True, [None, "e"])]
    assert [[x.mb for x in s] for s in segments(plan)] == [[0, 1], [2, 3]]
    assert emptied_steps(plan, {"d", "e"}) == [1] and emptied_steps(plan, {"a"}) == []
    assert PlanEntry.from_dict(__import__("json").loads(plan[1].to_line())) == plan[1]


def test_forget_file_parsing(tmp_path):
    from hf_unlearn.commands.trace import read_forget_file
    from hf_unlearn.errors import UnlearnError

    f = tmp_path / "ids.txt"
    f.write_text("# header\n12\n\n  7  # inline\nabc-1\n")
    assert read_forget_file(f) == [12, 7, "abc-1"]
    f.write_text("# nothing\n")
    with pytest.raises(UnlearnError, match="holds no ids"):
        read_forget_file(f)
    with pytest.raises(UnlearnError, match="cannot read"):
        read_forget_file(tmp_path / "missing.txt")


def test_collator_spec_round_trip():
    from transformers import default_data_collator

    from hf_unlearn.data import QACollator
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace.recording import collator_spec, rebuild_collator

    qa = QACollator(pad_token_id=3, pad_to_multiple_of=8)
    assert rebuild_collator(collator_spec(qa)) == qa
    assert rebuild_collator(collator_spec(default_data_collator)) is default_data_collator
    with pytest.raises(UnlearnError, match="pass the same collator to the replay"):
        rebuild_collator(collator_spec(lambda f: f))


def test_header_keys_are_the_ones_the_hub_provenance_check_knows(tmp_path):
    """hub.provenance scans every header key outside HEADER_KEYS for forget ids (numbers included): a recording's and
    a replay's headers must only hold known keys, or their own settings would be scanned as ids."""
    import json

    from hf_unlearn.trace.run import HEADER_KEYS

    from .test_trace_common import delete, get_recorded, ids_at_step

    run = get_recorded()
    recorded = json.loads((run / "header.json").read_text())
    _, report = delete(run, ids_at_step(run, 7)[:1], tmp_path)
    replayed = json.loads((tmp_path / "replay" / "header.json").read_text())
    oracle = json.loads((tmp_path / "oracle" / "header.json").read_text())
    for header in (recorded, replayed, oracle):
        assert set(header) <= HEADER_KEYS, set(header) - HEADER_KEYS
    assert "parent" in replayed and report["verified"]
