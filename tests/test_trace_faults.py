"""Bad input and faults: each is named clearly, and replays refuse what they cannot trust."""

from __future__ import annotations

import json

import pytest

from .test_trace_common import copy_run, get_recorded, ids_at_step, to_legacy_format


def _cli(*args):
    from hf_unlearn.cli import main

    return main([str(a) for a in args])


def _forget_file(tmp_path, ids):
    f = tmp_path / "forget.txt"
    f.write_text("# ids to delete\n" + "\n".join(map(str, ids)) + "\n")
    return f


def test_unknown_ids_are_listed(tmp_path):
    recorded = get_recorded()
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import RedactedReplayTrainer, open_run, redact_store, replay_cost

    run = open_run(recorded)
    with pytest.raises(UnlearnError, match=r"2 id\(s\) to forget never appear.*\[999, 1234\]"):
        replay_cost(run, [1, 999, 1234])
    with pytest.raises(UnlearnError, match=r"id '7' is str but the run .* uses int ids"):  # "7" is not 7
        replay_cost(run, [1, "7"])
    with pytest.raises(UnlearnError, match=r"not in the store: \[12345\]"):
        redact_store(run.store_path, [1, 12345], tmp_path / "s", run.key)
    with pytest.raises(UnlearnError, match="999"):
        RedactedReplayTrainer(run, run.store_path, [999], tmp_path / "out")


def test_flipped_wal_byte_is_named_and_refused(tmp_path, capsys):
    recorded = get_recorded()
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import RedactedReplayTrainer

    run = copy_run(recorded, tmp_path / "run")
    wal = bytearray((run / "wal.bin").read_bytes())
    wal[5 * 32 + 12] ^= 0x01  # a bit of record 5's seed
    (run / "wal.bin").write_bytes(bytes(wal))
    assert _cli("trace", "inspect", run) == 1
    out = capsys.readouterr().out
    assert "wal.bin record 5 (microbatch 5, optimizer step 2) fails its CRC32 check" in out
    assert "does not match its SHA-256 sidecar" in out
    with pytest.raises(UnlearnError, match="refusing.*record 5"):
        RedactedReplayTrainer(run, run / "private" / "store", [1], tmp_path / "out")


def test_truncated_wal_tail(tmp_path):
    """Sealed run with a cut WAL: refused. Crashed (unsealed) run: recovered to the last whole segment."""
    recorded = get_recorded()
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import open_run

    sealed = copy_run(recorded, tmp_path / "sealed")
    data = (sealed / "wal.bin").read_bytes()
    (sealed / "wal.bin").write_bytes(data[:-40])  # 1 whole record and 8 bytes of another lost
    with pytest.raises(UnlearnError, match="torn record .* in a sealed run"):
        open_run(sealed)
    crashed = copy_run(recorded, tmp_path / "crashed")
    (crashed / "wal.bin").write_bytes(data[:-40])
    (crashed / "wal.bin.sha256").unlink()
    (crashed / "plan.bin.sha256").unlink()
    (crashed / "manifest.bin.sha256").unlink()
    header = json.loads((crashed / "header.json").read_text())
    header["sealed"] = False
    (crashed / "header.json").write_text(json.dumps(header))
    (crashed / "header.json.sha256").unlink()
    (crashed / "progress.json").unlink()  # as a run recorded before progress.json: no proof that step 6 ran
    with pytest.warns(UserWarning) as caught:
        run = open_run(crashed)
    messages = " ".join(str(w.message) for w in caught)
    assert "recovered to the last whole record" in messages
    # 14 whole records = 7 segments; step 6 was logged, but nothing after it proves it completed: replays stop there
    assert "optimizer step 6 was logged but never completed" in messages and "replays stop at step 6" in messages
    assert len(run.plan) == 12 and run.plan[-1].end and run.total_steps == 6
    (crashed / "progress.json").write_text(json.dumps({"completed_step": 6}))  # the recorder saw step 6's update
    with pytest.warns(UserWarning, match="stopped after optimizer step 6 completed"):
        assert open_run(crashed).total_steps == 7


def test_plan_and_wal_disagree(tmp_path, capsys):
    recorded = get_recorded()
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import write_sidecar

    run = to_legacy_format(copy_run(recorded, tmp_path / "run"))  # the keyed format: test_trace_controls.py
    lines = (run / "plan.jsonl").read_text().splitlines()
    entry = json.loads(lines[3])
    entry["lr"] *= 2
    lines[3] = json.dumps(entry, separators=(",", ":"))
    (run / "plan.jsonl").write_text("\n".join(lines) + "\n")
    write_sidecar(run / "plan.jsonl")  # a consistent sidecar: only the cross-check can catch it
    assert _cli("trace", "inspect", run) == 1
    assert "plan entry 3 and wal.bin record 3 (optimizer step 1) disagree: lr" in capsys.readouterr().out
    with pytest.raises(UnlearnError, match="disagree"):
        open_run(run)


def test_store_redacted_for_another_request(tmp_path):
    """A store missing a retained row (redacted for a larger request) is refused by its receipt, before compute."""
    recorded = get_recorded()
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import RedactedReplayTrainer, open_run, redact_store

    run = open_run(recorded)
    forget = ids_at_step(recorded, 6)[:1]
    also_gone = ids_at_step(recorded, 7)[:1]
    redact_store(run.store_path, forget + also_gone, tmp_path / "s", run.key)
    with pytest.raises(UnlearnError, match=r"redacted for another deletion request \(2 id\(s\), 1 of them"):
        RedactedReplayTrainer(run, tmp_path / "s", forget, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_replay_refuses_an_unredacted_store(tmp_path):
    recorded = get_recorded()
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import RedactedReplayTrainer

    with pytest.raises(UnlearnError, match="still holds 1 id"):
        RedactedReplayTrainer(recorded, recorded / "private" / "store", [5], tmp_path / "out")


def test_cli_workflow(tmp_path, capsys):
    """inspect, cost, redact, replay, oracle --baselines, verify: exit 0 and the distances printed."""
    recorded = get_recorded()
    forget = _forget_file(tmp_path, ids_at_step(recorded, 6)[:2])
    assert _cli("trace", "inspect", recorded) == 0
    assert "integrity: OK" in capsys.readouterr().out
    assert _cli("trace", "cost", recorded, "--forget", forget) == 0
    assert "suffix replay from checkpoint step 6: 2 of 8 steps (25.0% of the run)" in capsys.readouterr().out
    assert _cli("trace", "redact", recorded, "--forget", forget, "--out", tmp_path / "store") == 0
    assert _cli("trace", "replay", recorded, "--store", tmp_path / "store", "--forget", forget,
                "--out", tmp_path / "replay") == 0
    capsys.readouterr()
    assert _cli("trace", "oracle", recorded, "--forget", forget, "--out", tmp_path / "oracle", "--baselines") == 0
    out = capsys.readouterr().out
    # the proof and environment-probe lines come first (hf_unlearn.trace.proof), then the oracle's own
    assert "\noracle: full replay" in "\n" + out and "train_runtime" not in out  # the repack baseline prints nothing
    assert _cli("trace", "verify", tmp_path / "replay", tmp_path / "oracle") == 0
    out = capsys.readouterr().out
    assert "VERIFIED" in out and "baseline filter" in out and "baseline repack" in out
    assert _cli("trace", "verify", recorded, tmp_path / "oracle") == 1  # the original run is not the counterfactual
    assert _cli("trace", "inspect", tmp_path / "replay") == 0


def test_nothing_left_to_replay_is_sealed_and_logged(tmp_path, capsys):
    """A request for ids an earlier request deleted: redact and replay succeed, the output says so and is sealed."""
    recorded = get_recorded()
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run, redact_store, replay_cost
    from hf_unlearn.trace.replay import RedactedReplayTrainer
    from hf_unlearn.trace.run import read_deletion_log

    forget = ids_at_step(recorded, 6)[:2]
    run = open_run(recorded)
    redact_store(run.store_path, forget, tmp_path / "s1", run.key)
    RedactedReplayTrainer(run, tmp_path / "s1", forget, tmp_path / "r1").train()
    cost = replay_cost(open_run(tmp_path / "r1"), forget)
    assert cost["already_deleted"] == 2 and cost["steps_to_replay"] == 0
    ids = write_ids(tmp_path / "f.jsonl", forget)
    assert _cli("trace", "redact", tmp_path / "r1", "--forget", ids, "--out", tmp_path / "s2") == 0
    assert "2 already deleted by an earlier request" in capsys.readouterr().out
    assert _cli("trace", "replay", tmp_path / "r1", "--store", tmp_path / "s2", "--forget", ids,
                "--out", tmp_path / "r2") == 0
    assert "nothing to replay" in capsys.readouterr().out
    log = read_deletion_log(tmp_path / "r2")
    assert len(log) == 2 and log[1]["steps_replayed"] == 0 and "nothing to replay" in log[1]["note"]
    assert log[1]["params_root"] == log[0]["params_root"]
    assert _cli("trace", "inspect", tmp_path / "r2") == 0
    assert "sealed" in capsys.readouterr().out


def test_crash_mid_step(tmp_path, capsys):
    """An exception inside step 5: inspect names the step, replays stop before it, warnings are one line."""
    from transformers import TrainerCallback

    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer

    from .test_trace_common import get_trace_data, tiny, train_args

    tok, data = get_trace_data()

    class Crash(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 5:
                raise RuntimeError("power cut")

    t = TraceRecordingTrainer(model=tiny(tok), args=train_args(tmp_path), train_dataset=data, callbacks=[Crash()],
                              data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=2)
    with pytest.raises(RuntimeError, match="power cut"):
        t.train()
    run = tmp_path / "trace"
    assert _cli("trace", "inspect", run) == 0
    out = capsys.readouterr().out
    assert "WARNING: optimizer step 5 was logged but never completed" in out and "5 optimizer steps" in out
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run

    with pytest.warns(UserWarning):
        ids = write_ids(tmp_path / "f.jsonl", open_run(run).ids_at_steps([4])[:1])
    import warnings

    capsys.readouterr()
    with warnings.catch_warnings():  # as a fresh CLI process: the CLI prints each warning as one line
        warnings.simplefilter("always")
        assert _cli("trace", "cost", run, "--forget", ids) == 0
    out, err = capsys.readouterr()
    assert "1 of 5 steps" in out
    lines = [x for x in err.splitlines() if x.strip()]
    assert any("step 5 was logged but never completed" in x for x in lines)
    assert lines and all(x.startswith("hf-unlearn: warning: ") for x in lines), err  # one line each
    # a deletion from the crashed run: replay and oracle stop at the last completed step and agree bit for bit, once
    # the run is proven (train() raised before the end-of-recording proof: `trace prove` proves the steps it completed)
    from hf_unlearn.trace.proof import prove

    from .test_trace_common import delete

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert prove(run, progress=False)["proven"]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        forget = open_run(run).ids_at_steps([4])[:1]
        replay, report = delete(run, forget, tmp_path / "deletion")
    assert report["verified"] and replay.state.global_step == 5, report["provenance"]["problems"]
