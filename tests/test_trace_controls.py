"""Keyed controls and the compact plan (issue #22 item 4, issue #24 item 4).

A forger without the run key rewrites a control consistently in plan.bin and wal.bin (CRCs recomputed, sidecars
rewritten): every entry point refuses the run before any compute, naming the segment. A run recorded in the older
plan.jsonl format still replays, and every report says its controls are unkeyed.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from .test_trace_common import copy_run, get_recorded, ids_at_step, to_legacy_format


def _cli(*args):
    from hf_unlearn.cli import main

    return main([str(a) for a in args])


def _rewrite(run, entries, macs) -> None:
    """What a forger without the key can do: re-encode plan.bin (keeping the MACs it cannot recompute) and
    wal.bin (keeping the keyed id digests), with valid CRCs and fresh sidecars."""
    from hf_unlearn.trace.plan import MAGIC, decode_segment, encode_segment, frame, segments
    from hf_unlearn.trace.run import write_sidecar
    from hf_unlearn.trace.wal import FLAG_ACCUM_END, FLAG_DUMMY, WalRecord, read_wal

    digests = [r.digest for r in read_wal(run / "wal.bin").records]
    data, previous = MAGIC, None
    for k, seg in enumerate(segments(entries)):
        body = encode_segment(seg, previous)
        previous = decode_segment(body, b"", previous)
        data += frame(body, macs[min(k, len(macs) - 1)])
    (run / "plan.bin").write_bytes(data)
    (run / "wal.bin").write_bytes(b"".join(
        WalRecord(d, e.seed, float(np.float32(e.lr)), e.step, len(e.slots),
                  (FLAG_ACCUM_END if e.end else 0) | (FLAG_DUMMY if None in e.slots else 0)).pack()
        for d, e in zip(digests, entries)))
    for name in ("plan.bin", "wal.bin", "header.json"):
        write_sidecar(run / name)


def _seed(plan):
    plan[5].seed += 1
    return 2


def _lr(plan):
    for e in plan[6:8]:
        e.lr *= 2
    return 3


def _step(plan):
    for e in plan[14:16]:
        e.step = 9
    return 9


def _flags(plan):  # split step 0's segment in two: the accumulation-end flag of its first microbatch set
    plan[0].end, plan[1].j = True, 0
    return 0


def _normaliser(plan):
    for e in plan[4:6]:
        e.norm += 1
    return 2


def _lengths(plan):
    plan[9].lens[0] += 1
    return 4


@pytest.mark.parametrize("forge", [_seed, _lr, _step, _flags, _normaliser, _lengths],
                         ids=["seed", "lr", "step", "flags", "normaliser", "lengths"])
def test_forged_control_is_refused_everywhere_before_compute(tmp_path, capsys, forge):
    from hf_unlearn import forget
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, check_run
    from hf_unlearn.trace.plan import read_compact_plan, read_plan
    from hf_unlearn.trace.tags import run_key

    recorded = get_recorded()
    forget_ids = ids_at_step(recorded, 7)[:1]
    run = copy_run(recorded, tmp_path / "run")
    plan = read_plan(run)
    macs = [s.mac for s in read_compact_plan(run / "plan.bin").segments]
    step = forge(plan)
    _rewrite(run, plan, macs)
    assert read_plan(run) == plan  # the forgery reads back as the forger meant it

    rep, _, _ = check_run(run, key=run_key(run))
    named = rf"controls of optimizer step {step} \(plan entries \d+-\d+, plan\.bin segment \d+\)"
    assert rep.errors and all("sidecar" not in e and "CRC" not in e for e in rep.errors), rep.errors
    assert any(__import__("re").search(named, e) for e in rep.errors), rep.errors
    assert rep.summary["controls"] == "keyed, FAILED"
    assert _cli("trace", "inspect", run) == 1
    out = capsys.readouterr().out
    assert "do not match their keyed MAC" in out and "integrity: FAILED" in out
    with pytest.raises(UnlearnError, match=named):
        RedactedReplayTrainer(run, run / "private" / "store", forget_ids, tmp_path / "replay")
    with pytest.raises(UnlearnError, match=named):
        OracleReplayTrainer(run, forget_ids, out_dir=tmp_path / "oracle")
    with pytest.raises(UnlearnError, match=named):
        forget(run, forget_ids, tmp_path / "out", oracle=True, progress=False, log=lambda m: None)
    assert not any((tmp_path / d).exists() for d in ("replay", "oracle", "out"))


def test_forged_header_or_cut_plan_fails_the_keyed_seal(tmp_path):
    from hf_unlearn.trace import check_run
    from hf_unlearn.trace.plan import read_compact_plan, read_plan
    from hf_unlearn.trace.run import write_sidecar
    from hf_unlearn.trace.tags import run_key

    recorded = get_recorded()
    run = copy_run(recorded, tmp_path / "args")
    header = json.loads((run / "header.json").read_text())
    header["training_args"]["max_grad_norm"] = header["max_grad_norm"] = 100.0
    (run / "header.json").write_text(json.dumps(header))
    write_sidecar(run / "header.json")
    rep, _, _ = check_run(run, key=run_key(run))
    assert any("header.json's controls_mac does not match the run key" in e for e in rep.errors), rep.errors

    cut = copy_run(recorded, tmp_path / "cut")  # the last segment dropped from plan, WAL and manifest alike
    plan = read_plan(cut)[:-2]
    _rewrite(cut, plan, [s.mac for s in read_compact_plan(cut / "plan.bin").segments])
    (cut / "manifest.bin").write_bytes((cut / "manifest.bin").read_bytes()[:8 * sum(len(e.slots) for e in plan)])
    header = json.loads((cut / "header.json").read_text())
    header.update(optimizer_steps=7, microbatches=14)
    (cut / "header.json").write_text(json.dumps(header))
    for name in ("header.json", "manifest.bin"):
        write_sidecar(cut / name)
    rep, _, _ = check_run(cut, key=run_key(cut))
    assert rep.errors == ["header.json's controls_mac does not match the run key: the header's training arguments, "
                          "optimizer, model, dataset, step counts, hazards or fidelity evidence were changed, or the "
                          "plan was cut, after the run was sealed"]

    faked = copy_run(recorded, tmp_path / "fidelity")  # the engine's self-check outcome is covered too
    header = json.loads((faked / "header.json").read_text())
    assert header["fidelity"]["recording"]["checked"]  # the seal was recomputed after the self-check wrote it
    header["fidelity"]["recording"]["steps"] = [0, 99]
    (faked / "header.json").write_text(json.dumps(header))
    write_sidecar(faked / "header.json")
    assert check_run(faked, key=run_key(faked))[0].summary["controls"] == "keyed, FAILED"


def test_a_run_rewritten_in_the_unkeyed_format_is_refused(tmp_path):
    """The downgrade: plan.bin turned back into a plan.jsonl (no MACs to forge) with the seal removed. Without the
    key the WAL keeps its keyed record digests, which an older run's ids-only check refuses, naming the entry."""
    from hf_unlearn.trace import check_run
    from hf_unlearn.trace.plan import read_plan
    from hf_unlearn.trace.run import write_sidecar
    from hf_unlearn.trace.tags import run_key

    run = copy_run(get_recorded(), tmp_path / "run")
    plan = read_plan(run)
    (run / "plan.jsonl").write_text("".join(e.to_line() for e in plan))
    (run / "plan.bin").unlink()
    (run / "plan.bin.sha256").unlink()
    header = json.loads((run / "header.json").read_text())
    del header["controls_mac"]
    (run / "header.json").write_text(json.dumps(header))
    for name in ("plan.jsonl", "header.json"):
        write_sidecar(run / name)
    rep, _, _ = check_run(run, key=run_key(run))
    assert rep.errors[0].startswith("plan entry 0 and wal.bin record 0 (optimizer step 0) disagree: ids digest")
    assert len(rep.errors) == 16


def test_forged_seed_in_a_legacy_run_is_only_noted(tmp_path):
    """What 'unkeyed' means: the same forgery in a plan.jsonl run (today's format) passes the integrity check."""
    from hf_unlearn.trace import check_run
    from hf_unlearn.trace.plan import read_plan
    from hf_unlearn.trace.run import write_sidecar
    from hf_unlearn.trace.tags import run_key
    from hf_unlearn.trace.wal import WalRecord, read_wal

    run = to_legacy_format(copy_run(get_recorded(), tmp_path / "run"))
    plan = read_plan(run)
    plan[5].seed += 1
    (run / "plan.jsonl").write_text("".join(e.to_line() for e in plan))
    recs = read_wal(run / "wal.bin").records
    recs[5] = WalRecord(recs[5].digest, plan[5].seed, recs[5].lr, recs[5].step, recs[5].length, recs[5].flags)
    (run / "wal.bin").write_bytes(b"".join(r.pack() for r in recs))
    for name in ("plan.jsonl", "wal.bin"):
        write_sidecar(run / name)
    rep, _, _ = check_run(run, key=run_key(run))
    assert rep.ok and rep.summary["controls"] == "unkeyed"
    assert any("controls are unkeyed" in n for n in rep.notes)


def test_legacy_plan_jsonl_run_still_replays_and_says_unkeyed(tmp_path, capsys):
    from hf_unlearn import forget
    from hf_unlearn.trace import open_run

    run = to_legacy_format(copy_run(get_recorded(), tmp_path / "run"))
    assert not (run / "plan.bin").exists() and (run / "plan.jsonl").exists()
    with pytest.warns(UserWarning, match="controls are unkeyed"):
        opened = open_run(run)
    assert opened.report.ok and len(opened.plan) == 16
    assert _cli("trace", "inspect", run) == 0
    out = capsys.readouterr().out
    assert "controls: unkeyed (plan.jsonl" in out and "integrity: OK" in out
    ids = ids_at_step(run, 6)[:2]
    receipt = forget(run, ids, tmp_path / "out", oracle=True, progress=False, log=lambda m: None)
    assert receipt.evidence["verified"] is True
    assert receipt.evidence["controls"]["status"] == "unkeyed"
    assert any("controls are unkeyed" in n for n in receipt.evidence["controls"]["notes"])
    from hf_unlearn.trace import verify

    prov = verify(tmp_path / "out" / "replay", tmp_path / "out" / "oracle")["provenance"]
    assert prov["controls"] == {"replay": "keyed", "oracle": "keyed"}  # the outputs are written in the keyed format
    assert any("parent run whose controls are unkeyed" in n for n in prov["notes"])
    assert (tmp_path / "out" / "replay" / "plan.bin").exists()


def _random_plan(n_segments: int, accum: int = 2, slots: int = 4, seed: int = 0):
    from hf_unlearn.trace.plan import PlanEntry

    rng = random.Random(seed)
    plan, mb = [], 0
    for step in range(n_segments):
        lr, norm = 1e-3 * (1 - step / n_segments), float(rng.randrange(50, 900))
        for j in range(accum):
            tags = [None if rng.random() < 0.05 else rng.randbytes(8).hex() for _ in range(slots)]
            plan.append(PlanEntry(mb=mb, step=step, j=j, end=j == accum - 1, seed=rng.getrandbits(63), lr=lr,
                                  norm=norm, norm_dtype="int64", accum=accum, slots=tags,
                                  lens=[rng.randrange(8, 512) for _ in tags], epoch=step * 3 // n_segments,
                                  batch=[rng.randbytes(8).hex()], extra={"groups": [{"momentum": 0.9}]} if j == 0 and
                                  step % 7 == 0 else {}))
            mb += 1
    return plan


def _write(run, plan, key=b"k" * 32):
    from hf_unlearn.trace.recording import TraceWriter

    w = TraceWriter(run, key)
    w.open({"run_id": "r1", "format": "x"})
    for seg in __import__("hf_unlearn.trace.plan", fromlist=["segments"]).segments(plan):
        w.append(seg)
    w.close()


def test_compact_plan_round_trips_and_reports_a_torn_or_damaged_frame(tmp_path):
    from hf_unlearn.trace.plan import read_compact_plan, read_plan

    plan = _random_plan(40)
    run = tmp_path / "run"
    _write(run, plan)
    assert read_plan(run) == plan
    data = (run / "plan.bin").read_bytes()
    assert len(data) < 40 * len(plan)  # against ~360 B per microbatch as JSON lines
    (run / "plan.bin").write_bytes(data[:-5])  # a crash mid-append
    scan = read_compact_plan(run / "plan.bin")
    assert len(scan.segments) == 39 and scan.tail_bytes and scan.damaged_at is None
    assert read_plan(run) == plan[:78]
    bad = bytearray(data)
    bad[len(data) // 2] ^= 1
    (run / "plan.bin").write_bytes(bytes(bad))
    scan = read_compact_plan(run / "plan.bin")
    assert scan.damaged_at is not None and "CRC32" in scan.damage and len(scan.segments) < 40


def test_hub_provenance_publishes_plan_bin_checked_and_scanned(tmp_path):
    """The allowlist takes plan.bin after checking its frames, and scans its free texts for the forget ids."""
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.hub.leaks import IdScanner
    from hf_unlearn.hub.provenance import select_provenance
    from hf_unlearn.trace.plan import read_compact_plan, read_plan
    from hf_unlearn.trace.run import write_sidecar

    run = copy_run(get_recorded(), tmp_path / "run")
    scanner = IdScanner([3600, "author-x"])
    keep, skipped, hits = select_provenance(run, scanner)
    assert {"plan.bin", "plan.bin.sha256", "wal.bin", "manifest.bin"} <= set(keep) and hits == []
    plan = read_plan(run)
    macs = [s.mac for s in read_compact_plan(run / "plan.bin").segments]
    plan[0].extra = {"groups": [{"note": "rows of author-x"}]}
    _rewrite(run, plan, macs)
    _, _, hits = select_provenance(run, scanner)
    assert hits and all("provenance/plan.bin:segment 0.extra" in h.field for h in hits), hits
    (run / "plan.bin").write_bytes((run / "plan.bin").read_bytes()[:-3])
    write_sidecar(run / "plan.bin")
    with pytest.raises(UnlearnError, match="refusing to publish provenance/plan.bin: a torn last segment"):
        select_provenance(run, scanner)
