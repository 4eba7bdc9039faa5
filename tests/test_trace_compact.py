"""The sealed compact provenance (issue #24 item 4): ``hf-unlearn trace compact`` replaces a sealed run's plan.bin,
wal.bin and manifest.bin by one provenance.bin that decodes to the same records for every reader; the run inspects
clean, replays, and replay == oracle is VERIFIED; a forger without the run key who edits it (a byte, a seed claim,
the tag table, the order, a cut) and rewrites its SHA-256 and sidecars is refused before any compute.

One recorded run (16 rows, 3 epochs: the sampler's permutation claim is real from the second epoch on) is compacted
once per module; the tamper tests work on copies.
"""

from __future__ import annotations

import functools
import json
import lzma
import shutil
import tempfile
from pathlib import Path

import pytest

from .test_trace_common import copy_run, get_trace_data, ids_at_step, record, to_legacy_format


def _cli(*args):
    from hf_unlearn.cli import main

    return main([str(a) for a in args])


@functools.cache
def _recorded() -> Path:
    """16 rows, batches of 4, accumulation 2, 3 epochs (6 optimizer steps), checkpoints every 2 steps."""
    import atexit

    tok, data = get_trace_data()
    out = Path(tempfile.mkdtemp(prefix="trace_compact_"))
    atexit.register(shutil.rmtree, out, True)
    record(tok, data.select(range(16)), out, num_train_epochs=3, seed=5)
    return out / "trace"


@pytest.fixture(scope="module")
def compacted(tmp_path_factory):
    """A copy of the run, compacted with the CLI (what a user runs)."""
    run = copy_run(_recorded(), tmp_path_factory.mktemp("compact") / "run")
    assert _cli("trace", "compact", run) == 0
    return run


def test_compact_run_decodes_to_the_recorded_records_and_inspects_clean(compacted, capsys):
    from hf_unlearn.trace.compact import read_compact
    from hf_unlearn.trace.plan import read_plan
    from hf_unlearn.trace.run import check_run
    from hf_unlearn.trace.tags import run_key
    from hf_unlearn.trace.wal import read_manifest, read_wal

    original = _recorded()
    assert not any((compacted / n).exists() for n in ("plan.bin", "wal.bin", "manifest.bin"))
    header = json.loads((compacted / "header.json").read_text())
    info = header["provenance"]
    # Trainer serves every epoch in accelerate's SeedableRandomSampler order: stored as seeds, checked by drawing them
    meta = read_compact(compacted / "provenance.bin").meta
    assert meta["order"] == {"rule": "seedable_sampler", "rows": 16, "epoch_seeds": [5, 6, 7]}
    assert (info["order"], info["seeds"], info["lens"]) == ("seedable_sampler", "microbatch_seed", "per_row")
    assert info["bytes"] < sum(info["replaced_bytes"].values()) / 2  # a tiny run: the fixed part (~0.5 KB) dominates
    # every reader gets the records the append-only files held (batch digests: folded into the batch MACs)
    plan = read_plan(original)
    assert read_plan(compacted) == [dataclass_without_batch(e) for e in plan]
    key = run_key(compacted)
    wal = read_wal(original / "wal.bin").records
    assert read_compact(compacted / "provenance.bin", key).records == wal  # the key holder's WAL is the recorded one
    assert [(r.seed, r.step, r.flags) for r in read_wal(compacted / "wal.bin").records] == \
        [(r.seed, r.step, r.flags) for r in wal]
    assert read_manifest(compacted / "manifest.bin") == read_manifest(original / "manifest.bin")
    rep, _, checked = check_run(compacted, key=key)
    assert rep.ok and rep.summary["controls"] == "keyed" and len(checked) == len(plan), rep.errors
    assert _cli("trace", "inspect", compacted, "--deep") == 0
    out = capsys.readouterr().out
    assert "controls: keyed (provenance.bin" in out and "integrity: OK" in out and "WARNING" not in out
    assert _cli("trace", "compact", compacted) == 0  # a second call changes nothing
    assert json.loads((compacted / "header.json").read_text())["provenance"] == info


def dataclass_without_batch(e):
    import dataclasses

    return dataclasses.replace(e, batch=None)


def test_compacted_run_forgets_exactly_and_its_outputs_are_compacted(compacted, tmp_path):
    from hf_unlearn import forget
    from hf_unlearn.hub.leaks import IdScanner
    from hf_unlearn.hub.provenance import select_provenance
    from hf_unlearn.trace import verify
    from hf_unlearn.trace.compact import read_compact

    ids = ids_at_step(compacted, 3)[:2]
    receipt = forget(compacted, ids, tmp_path / "out", oracle=True, progress=False, log=lambda m: None)
    assert receipt.evidence["verified"] is True and receipt.evidence["controls"]["status"] == "keyed"
    report = verify(tmp_path / "out" / "replay", tmp_path / "out" / "oracle")
    assert report["identical"] and report["provenance"]["controls"] == {"replay": "keyed", "oracle": "keyed"}
    for name in ("replay", "oracle"):
        out = tmp_path / "out" / name
        assert (out / "provenance.bin").exists() and not (out / "wal.bin").exists()
        assert _cli("trace", "inspect", out) == 0
    # the replay's unreplayed prefix keeps its parent's batch MACs, the replayed steps record theirs again
    assert read_compact(tmp_path / "out" / "replay" / "provenance.bin").meta["batch_groups"] == "all"
    # the Hub allowlist takes the compacted file after decoding it, and finds no raw id in it
    keep, _, hits = select_provenance(tmp_path / "out" / "replay", IdScanner(ids))
    assert {"provenance.bin", "provenance.bin.sha256", "header.json"} <= set(keep)
    assert not [h for h in hits if "provenance.bin" in h.field], hits


def _forge(run: Path, edit) -> None:
    """What a forger without the run key can do: re-encode provenance.bin with ``edit(meta, cols)`` applied (the MACs
    kept: it cannot recompute them), then rewrite the header's SHA-256 entry and every sidecar."""
    from hf_unlearn.trace.compact_format import _COLUMNS, MAGIC, _sections

    f = run / "provenance.bin"
    meta, cols = _sections(lzma.decompress(f.read_bytes()[len(MAGIC):]))
    edit(meta, cols)
    raw = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    body = b"".join(len(p).to_bytes(8, "little") + p for p in [raw] + [cols[c] for c in _COLUMNS])
    f.write_bytes(MAGIC + lzma.compress(body, format=lzma.FORMAT_XZ))
    _rehash(run)


def _rehash(run: Path) -> None:
    from hf_unlearn.trace.run import file_sha256, write_sidecar

    header = json.loads((run / "header.json").read_text())
    header["provenance"]["sha256"] = file_sha256(run / "provenance.bin")
    (run / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True))
    for name in ("provenance.bin", "header.json"):
        write_sidecar(run / name)


def _seed_claim(meta, cols):
    meta["order"]["epoch_seeds"][1] += 1  # "epoch 1 was served in the order of seed 7"


def _tag_table(meta, cols):
    t = bytearray(cols["tags"])
    t[0:8], t[8:16] = t[8:16], t[0:8]  # two rows' tags swapped in the table
    cols["tags"] = bytes(t)


def _lengths(meta, cols):
    lens = bytearray(cols["lens"])
    lens[3] += 1
    cols["lens"] = bytes(lens)


def _microbatch_seeds(meta, cols):
    meta["seeds"]["base"] += 1


def _learning_rate(meta, cols):
    lr = bytearray(cols["lr"])
    lr[-1] ^= 1
    cols["lr"] = bytes(lr)


@pytest.mark.parametrize("edit", [_seed_claim, _tag_table, _lengths, _microbatch_seeds, _learning_rate],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_forged_compact_file_is_refused_before_compute(compacted, tmp_path, edit):
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import OracleReplayTrainer
    from hf_unlearn.trace.run import check_run
    from hf_unlearn.trace.tags import run_key

    run = copy_run(compacted, tmp_path / "run")
    _forge(run, edit)
    rep, _, _ = check_run(run, key=run_key(run))
    assert rep.errors and rep.summary["controls"] == "keyed, FAILED"
    assert any("do not match their keyed MAC" in e and "provenance.bin block 0" in e for e in rep.errors), rep.errors
    assert any("controls_mac does not match the run key" in e for e in rep.errors)  # the seal binds the file
    with pytest.raises(UnlearnError, match="failed its integrity check; refusing"):
        OracleReplayTrainer(run, [], out_dir=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_a_swapped_order_a_flipped_byte_or_a_cut_file_is_refused(compacted, tmp_path, capsys):
    """The order stored as indices (a run the sampler claim does not fit) with two slots swapped; then damage."""
    from hf_unlearn.trace.compact import encode
    from hf_unlearn.trace.plan import read_plan
    from hf_unlearn.trace.run import check_run, controls_seal
    from hf_unlearn.trace.tags import run_key

    run = copy_run(compacted, tmp_path / "run")
    key = run_key(run)
    header = json.loads((run / "header.json").read_text())
    plan = read_plan(_recorded())  # the key holder writes the order as indices (no sampler claim)
    (run / "provenance.bin").write_bytes(encode(plan, key, header["run_id"], seed_base=5))
    _rehash(run)
    header = json.loads((run / "header.json").read_text())
    from hf_unlearn.trace.compact import read_compact

    honest = read_compact(run / "provenance.bin")
    assert honest.meta["order"]["rule"] == "indices"
    header["controls_mac"] = controls_seal(key, honest.last_mac, header)
    (run / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True))
    _rehash(run)
    assert check_run(run, key=key)[0].ok

    def swap(meta, cols):
        width = cols["order"][0]
        o = bytearray(cols["order"])
        a, b = 1, 1 + width
        o[a:a + width], o[b:b + width] = o[b:b + width], o[a:a + width]
        cols["order"] = bytes(o)

    forged = copy_run(run, tmp_path / "swapped")
    _forge(forged, swap)
    assert _cli("trace", "inspect", forged) == 1
    out = capsys.readouterr().out
    assert "optimizer steps 0-5 (plan entries 0-11, provenance.bin block 0)" in out and "integrity: FAILED" in out
    data = (run / "provenance.bin").read_bytes()
    for name, damaged in (("flipped", data[:40] + bytes([data[40] ^ 0x10]) + data[41:]), ("cut", data[:-9])):
        bad = copy_run(run, tmp_path / name)
        (bad / "provenance.bin").write_bytes(damaged)
        rep = check_run(bad, key=key)[0]
        assert any("provenance.bin does not match its SHA-256 sidecar" in e for e in rep.errors), rep.errors
        _rehash(bad)  # sidecar and header entry rewritten too: the file itself does not decode
        rep = check_run(bad, key=key)[0]
        assert any(e.startswith("provenance.bin is refused: it ") for e in rep.errors), rep.errors
        assert any("controls_mac" in e for e in rep.errors) or len(rep.errors) == 1


def test_a_compacted_run_checks_its_batches_and_refuses_what_it_cannot_compact(compacted, tmp_path):
    from transformers import DataCollatorForSeq2Seq

    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import OracleReplayTrainer
    from hf_unlearn.trace.compact import compact_run

    tok, _ = get_trace_data()
    wrong = DataCollatorForSeq2Seq(tok, pad_to_multiple_of=64)  # pads differently: the batch MACs refuse it
    with pytest.raises(UnlearnError, match=r"microbatches \d+-\d+ \(optimizer steps \d+-\d+\) do not collate"):
        OracleReplayTrainer(compacted, [], out_dir=tmp_path / "o", data_collator=wrong)
    unsealed = copy_run(_recorded(), tmp_path / "unsealed")
    header = json.loads((unsealed / "header.json").read_text())
    header["sealed"] = False
    (unsealed / "header.json").write_text(json.dumps(header))
    with pytest.raises(UnlearnError, match="is not sealed"):
        compact_run(unsealed)
    assert (unsealed / "plan.bin").exists() and not (unsealed / "provenance.bin").exists()
    legacy = to_legacy_format(copy_run(_recorded(), tmp_path / "legacy"))  # plan.jsonl: no keyed MACs to fold
    with pytest.raises(UnlearnError, match="unkeyed controls .*stays in its recorded format"):
        compact_run(legacy)
    assert (legacy / "plan.jsonl").exists() and not (legacy / "provenance.bin").exists()
