"""The engine proven on the whole run (hf_unlearn.trace.proof): `trace prove`, VERIFIED only for proven steps, the
deleting environment probed, and attacks on the proof record itself.

Each VERIFIED claim is compared with an engine-free counterfactual (a plain Trainer, the deleted rows' labels masked,
the recorded normalisers; tests/test_trace_fidelity.independent_counterfactual)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import TrainerCallback

from hf_unlearn.errors import UnlearnError

from .test_trace_common import (
    config_model,
    copy_run,
    get_recorded,
    get_trace_data,
    record,
    rsqrt_other_bits,
    write_sealed_header,
)
from .test_trace_fidelity import independent_counterfactual

KW = dict(gradient_accumulation_steps=1, max_steps=6)


def _oracle_equals_counterfactual(tok, data, family, run, forget, out, callbacks=(), **kw):
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    oracle = load_checkpoint(open_run(out / "oracle").final_checkpoint())
    plain = independent_counterfactual(tok, data, config_model(family, tok), run, forget, out / "plain",
                                       callbacks=callbacks, **{**KW, **kw})
    return [n for n, t in oracle["model"].items() if not torch.equal(t, plain[n])]


# ---- a clean run: unproven until proven, then VERIFIED and equal to the counterfactual --------------------------
@pytest.mark.parametrize("family", ["llama", pytest.param("gpt_neox", marks=pytest.mark.slow)])
def test_prove_a_clean_run_at_every_step_then_deletions_verify(tmp_path, family, capsys):
    from hf_unlearn import forget
    from hf_unlearn.cli import main
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.proof import ProofError

    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=config_model(family, tok), every=2,
           trainer_kwargs={"trace_self_check": 1}, **KW)  # steps 0..0 self-checked only
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([2])[:1]
    with pytest.raises(ProofError) as e:  # before any compute: nothing written
        forget(run, ids, tmp_path / "refused", oracle=True, progress=False)
    assert "\n" not in str(e.value) and "steps 1..5" in str(e.value) and "trace prove" in str(e.value)
    assert not (tmp_path / "refused").exists()
    assert main(["trace", "prove", str(run), "--no-progress"]) == 0
    assert "proven: the engine reproduced every optimizer step 0..5" in capsys.readouterr().out
    proof = open_run(run).header["fidelity"]["proof"]
    assert proof["proven"] and proof["steps"] == [0, 5] and proof["run_id"] == open_run(run).header["run_id"]
    assert proof["engine"]["hf_unlearn"] and proof["numeric_stack"]["threads"] == torch.get_num_threads()
    receipt = forget(run, ids, tmp_path / "mid", oracle=True, progress=False)
    assert receipt.evidence["verified"] and receipt.verdict.startswith("VERIFIED")
    assert receipt.evidence["environment_probe"]["steps"][0] == 0 and not receipt.evidence["unproven_steps"]
    assert not _oracle_equals_counterfactual(tok, data, family, run, ids, tmp_path / "mid")


# ---- a hidden change no guard sees: caught by the proof at its exact step -----------------------------------------
def _clip_at_step_3():
    class ClipHarder(TrainerCallback):  # defined here: watched, not replayed; args are not a guarded control
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 3:
                args.max_grad_norm = 0.05

    return ClipHarder()


def test_a_hidden_change_is_caught_at_its_step_and_never_verified(tmp_path, capsys, monkeypatch):
    """A callback lowering args.max_grad_norm at step 3 (20/20 tensors off, yet VERIFIED before proofs), with the
    recorder's whole-program digest made blind to ``args`` (as if the change lived where no digest reads: the digests
    name causes early, the proof is the guarantee): prove names step 3; forget refuses without --accept-unproven;
    with it the receipt names the steps and is not VERIFIED, and `trace verify` prints no VERIFIED. Then the proof
    record is attacked: edited, and copied from another run."""
    from hf_unlearn.trace import digests

    whole = digests.program_state
    monkeypatch.setattr(digests, "program_state",
                        lambda model, optimizer=None, args=None, *rest, **k: whole(model, optimizer, None, *rest, **k))
    from hf_unlearn import forget
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.proof import ProofError, prove, unproven_steps

    tok, data = get_trace_data()
    data = data.select(range(24))
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer

    from .test_trace_common import train_args

    TraceRecordingTrainer(model=config_model("llama", tok), args=train_args(tmp_path / "rec", **KW),
                          train_dataset=data, data_collator=QACollator.from_tokenizer(tok), callbacks=[_clip_at_step_3()],
                          trace_checkpoint_steps=2, trace_checkpoint_retention="even", trace_self_check=1).train()
    run = tmp_path / "rec" / "trace"
    record_ = prove(run, progress=False)
    assert not record_["proven"] and record_["diverged"]["step"] == 3 and record_["steps"] == [0, 2]
    assert "optimizer step 3" in record_["diverged"]["why"]
    header = open_run(run).header
    assert unproven_steps(header, 0, 6) == [3, 4, 5]
    ids = open_run(run).ids_at_steps([0])[:1]
    with pytest.raises(ProofError, match="from optimizer step 3") as e:
        forget(run, ids, tmp_path / "refused", oracle=True, progress=False)
    assert "\n" not in str(e.value)
    receipt = forget(run, ids, tmp_path / "accepted", oracle=True, progress=False, accept_unproven=True)
    assert receipt.evidence["unproven_steps"] == [3, 4, 5] and receipt.evidence["verified"] is False
    assert receipt.ok and "VERIFIED" not in receipt.verdict and "3..5" in receipt.verdict
    saved = json.loads((tmp_path / "accepted" / "receipt.json").read_text())
    assert saved["evidence"]["unproven_steps"] == [3, 4, 5] and "not VERIFIED" in saved["guarantee"]
    capsys.readouterr()
    assert main(["trace", "verify", str(tmp_path / "accepted" / "replay"), str(tmp_path / "accepted" / "oracle")]) == 1
    out = capsys.readouterr()
    assert not any(line.startswith("VERIFIED") for line in (out.out + out.err).splitlines())
    assert "steps 3..5 of the engine unproven" in out.err
    # the CLI: non-zero without --accept-unproven, one line
    f = write_ids(tmp_path / "f.jsonl", ids)
    assert main(["forget", str(run), "--ids", str(f), "--out", str(tmp_path / "cli"), "--oracle"]) != 0
    assert not (tmp_path / "cli").exists()
    assert main(["trace", "redact", str(run), "--forget", str(f), "--out", str(tmp_path / "store")]) == 0
    replay = ["trace", "replay", str(run), "--store", str(tmp_path / "store"), "--forget", str(f)]
    assert main([*replay, "--out", str(tmp_path / "r")]) != 0 and not (tmp_path / "r").exists()
    capsys.readouterr()
    assert main([*replay, "--out", str(tmp_path / "r2"), "--accept-unproven"]) == 0
    assert "UNPROVEN (accepted): steps 3..5" in capsys.readouterr().out
    # attacks on the proof record: an edited step range (sidecar rewritten, no key) is an integrity failure
    forged = copy_run(run, tmp_path / "forged")
    h = json.loads((forged / "header.json").read_text())
    h["fidelity"]["proof"].update(proven=True, steps=[0, 5], diverged=None)
    (forged / "header.json").write_text(json.dumps(h, indent=1, sort_keys=True))
    from hf_unlearn.trace.run import write_sidecar

    write_sidecar(forged / "header.json")
    with pytest.raises(UnlearnError, match="integrity"):
        forget(forged, ids, tmp_path / "forged_out", oracle=True, progress=False)
    # another run's proof copied in, sealed with the key: still not this run's proof
    other = json.loads((get_recorded() / "header.json").read_text())["fidelity"]["proof"]
    assert other["proven"]
    copied = copy_run(run, tmp_path / "copied")
    h = json.loads((copied / "header.json").read_text())
    h["fidelity"]["proof"] = other
    write_sealed_header(copied, h)
    assert unproven_steps(open_run(copied).header, 0, 6) == [1, 2, 3, 4, 5]  # the self-check covers step 0 only
    with pytest.raises(ProofError, match="another run"):
        forget(copied, ids, tmp_path / "copied_out", oracle=True, progress=False)


# ---- resumable ---------------------------------------------------------------------------------------------------
def test_a_killed_proof_resumes_where_it_stopped(tmp_path, monkeypatch):
    """Killed right after the proof persisted a kept checkpoint it matched: the next prove starts there, and a
    forged progress file (not under the run key) is not trusted."""
    from hf_unlearn.trace import proof

    run = copy_run(get_recorded(), tmp_path / "run")  # 8 steps, checkpoints every 2
    real_save, real_run, saves, calls = proof._save_progress, proof._run_interval, [], []

    def killed(run_, state):
        real_save(run_, state)
        saves.append(state["upto"])
        if len(saves) == 2:
            raise KeyboardInterrupt  # a kill right after checkpoint 4 was persisted

    monkeypatch.setattr(proof, "_save_progress", killed)
    with pytest.raises(KeyboardInterrupt):
        proof.prove(run, progress=False)
    assert saves == [2, 4] and json.loads((run / proof.PROGRESS).read_text())["body"]["upto"] == 4
    monkeypatch.setattr(proof, "_save_progress", real_save)
    forged = json.loads((run / proof.PROGRESS).read_text())
    forged["body"]["upto"] = 8
    (tmp_path / "kept.json").write_text((run / proof.PROGRESS).read_text())
    (run / proof.PROGRESS).write_text(json.dumps(forged))
    from hf_unlearn.trace import open_run

    assert proof._load_progress(open_run(run).kept())["upto"] == 0
    (run / proof.PROGRESS).write_text((tmp_path / "kept.json").read_text())
    monkeypatch.setattr(proof, "_run_interval", lambda *a, **k: calls.append(a[1:3]) or real_run(*a, **k))
    result = proof.prove(run, progress=False, fresh_starts=True)
    assert result["proven"] and result["steps"] == [0, 7] and result["starts"] == [0, 2, 4, 6]
    assert calls == [(4, 8), (2, 3), (4, 5), (6, 7)]  # resumed at checkpoint 4; then each later start's first step
    assert not (run / proof.PROGRESS).exists()


# ---- the deleting environment ---------------------------------------------------------------------------------
def _cli(args, env_extra):
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-m", "hf_unlearn.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("env", [{"MKL_CBWR": "COMPATIBLE"}, {"ATEN_CPU_CAPABILITY": "default"}])
def test_the_environment_probe_refuses_another_numeric_environment(tmp_path, env):
    """MKL's reproducibility mode changes every matmul's bits on this CPU, and no sealed setting names it: the probe
    (step 0 re-run with no deletion) refuses before any compute, naming the variable."""
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run

    run = get_recorded()
    f = write_ids(tmp_path / "f.jsonl", open_run(run).ids_at_steps([1])[:1])
    out = _cli(["forget", str(run), "--ids", str(f), "--out", str(tmp_path / "o"), "--oracle",
                "--no-progress"], env)
    assert out.returncode != 0, out.stdout[-2000:]
    err = [line for line in out.stderr.splitlines() if line.strip()]
    name = next(iter(env))
    assert name in err[-1] and ("optimizer step 0" in err[-1] or "numeric stack" in err[-1]), err[-3:]
    assert not (tmp_path / "o").exists()
    ok = _cli(["forget", str(run), "--ids", str(f), "--out", str(tmp_path / "ok"), "--oracle",
               "--no-progress"], {})
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads((tmp_path / "ok" / "receipt.json").read_text())["evidence"]["verified"]


# ---- over-refusals --------------------------------------------------------------------------------------------
def _checkpointing_from_step_2():
    class CheckpointingFromStep2(TrainerCallback):  # defined here: watched, not replayed; the guards name its change
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2 and model is not None and not model.is_gradient_checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    return CheckpointingFromStep2()


@pytest.mark.slow
def test_a_numerically_neutral_change_is_accepted_once_proven(tmp_path):
    """Gradient checkpointing switched on at step 2 by a callback replays do not run: the guards name it (a module
    attribute), which used to refuse every deletion; the proof's replay (without it) matches the state at every step,
    so early and late deletions are VERIFIED and equal a plain Trainer with the same callback."""
    from hf_unlearn import forget
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer, open_run
    from hf_unlearn.trace.guards import program_changes

    from .test_trace_common import train_args

    tok, data = get_trace_data()
    data = data.select(range(24))
    TraceRecordingTrainer(model=config_model("qwen2", tok), args=train_args(tmp_path / "rec", **KW), train_dataset=data,
                          data_collator=QACollator.from_tokenizer(tok), callbacks=[_checkpointing_from_step_2()],
                          trace_checkpoint_steps=2, trace_checkpoint_retention="even").train()
    run = tmp_path / "rec" / "trace"
    opened = open_run(run)
    assert [c["step"] for c in program_changes(opened.plan, opened.header)][:1] == [2]  # named by the guards
    proof = opened.header["fidelity"]["proof"]
    assert proof["proven"] and proof["neutral_controls"][0] == 2, proof
    for when, step in (("early", 0), ("late", 4)):
        ids = opened.ids_at_steps([step])[:1]
        receipt = forget(run, ids, tmp_path / when, oracle=True, progress=False)
        assert receipt.evidence["verified"], receipt.evidence.get("oracle")
        assert not _oracle_equals_counterfactual(tok, data, "qwen2", run, ids, tmp_path / when,
                                                 callbacks=[_checkpointing_from_step_2()])


def _eager_at_step_3():
    class EagerAttention(TrainerCallback):  # defined here: watched; config._attn_implementation is not in to_dict()
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 3 and model is not None:
                model.set_attn_implementation("eager")

    return EagerAttention()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])  # GQA: one key/value head
def test_an_attention_switch_mid_run_is_never_verified(tmp_path, family):
    """model.set_attn_implementation("eager") at step 3 (18/20 tensors off, VERIFIED before proofs): a step-0
    deletion is refused before compute, or, accepted unproven, not VERIFIED."""
    from hf_unlearn import forget
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer, open_run
    from hf_unlearn.trace.proof import unproven_steps

    from .test_trace_common import train_args

    tok, data = get_trace_data()
    data = data.select(range(24))
    model = config_model(family, tok, attn_implementation="sdpa")
    TraceRecordingTrainer(model=model, args=train_args(tmp_path / "rec", **KW), train_dataset=data,
                          data_collator=QACollator.from_tokenizer(tok), callbacks=[_eager_at_step_3()],
                          trace_checkpoint_steps=2, trace_checkpoint_retention="even").train()
    run = tmp_path / "rec" / "trace"
    header = open_run(run).header
    assert unproven_steps(header, 0, 6), header["fidelity"]  # the proof at the end of recording found it
    ids = open_run(run).ids_at_steps([0])[:1]
    with pytest.raises(UnlearnError):
        forget(run, ids, tmp_path / "refused", oracle=True, progress=False)
    try:
        receipt = forget(run, ids, tmp_path / "accepted", oracle=True, progress=False, accept_unproven=True)
    except UnlearnError:  # refused by a guard that names the switch: also never VERIFIED
        return
    assert receipt.evidence["verified"] is not True and "VERIFIED" not in receipt.verdict.replace("NOT VERIFIED", "")


# ---- the set-up probe of compute_loss has no side effect ------------------------------------------------------
def test_the_setup_probe_does_not_count_as_a_call_of_compute_loss(tmp_path):
    """A loss that counts its calls (an edit at the 5th call): the recorder's set-up probe ran it once more, which
    moved the edit a step early; now the probe leaves the trainer's attributes as they were."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace.recording import trace_recording

    from .test_trace_common import train_args
    from .trace_trainers import CountingLoss

    Counting = trace_recording(CountingLoss)
    tok, data = get_trace_data()
    trainer = Counting(model=config_model("llama", tok), args=train_args(tmp_path, gradient_accumulation_steps=1,
                                                                         max_steps=3),
                       train_dataset=data.select(range(12)), data_collator=QACollator.from_tokenizer(tok),
                       trace_self_check=False)
    assert not hasattr(trainer, "calls") and not hasattr(trainer, "log_")
    trainer.train()
    assert trainer.calls == 3 and trainer.seen == [0, 1, 2] and trainer.log_ == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_edit_inside_the_recorded_compute_loss_is_accepted_once_proven(tmp_path, family):
    """The guards name the edit (outside the record) and used to refuse every deletion; the proof shows the engine,
    which runs the recorded trainer's compute_loss, reproduces it: a step-0 deletion is VERIFIED and equals a plain
    Trainer with the same compute_loss (engine-free counterfactual)."""
    from hf_unlearn import forget
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.guards import program_changes
    from hf_unlearn.trace.recording import trace_recording
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_common import labels_masked, recorded_normalisers_trainer, train_args
    from .trace_trainers import EditAtStep3

    tok, data = get_trace_data()
    data = data.select(range(24))
    trace_recording(EditAtStep3)(model=config_model(family, tok), args=train_args(tmp_path / "rec", **KW),
                                 train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
                                 trace_checkpoint_steps=2, trace_checkpoint_retention="even").train()
    run = tmp_path / "rec" / "trace"
    opened = open_run(run)
    assert [c["step"] for c in program_changes(opened.plan, opened.header)] == [3]  # named by the guards
    assert opened.header["fidelity"]["proof"]["proven"]
    ids = opened.ids_at_steps([0])[:1]
    receipt = forget(run, ids, tmp_path / "del", oracle=True, progress=False)
    assert receipt.evidence["verified"], receipt.evidence.get("oracle")
    model = config_model(family, tok)
    recorded_normalisers_trainer(run, base=EditAtStep3)(
        model=model, args=train_args(tmp_path / "plain", **KW), train_dataset=labels_masked(data, ids),
        data_collator=_DropIds(QACollator.from_tokenizer(tok))).train()
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())
    plain = model.state_dict()
    assert not [n for n, t in oracle["model"].items() if not torch.equal(t, plain[n])]


# ---- a fresh start is proven where it is used ------------------------------------------------------------------
def _count_steps(monkeypatch, deleting: bool = False) -> list:
    """Every optimizer step any replay trains (the engine's segment loop; ``deleting``: only replays with a
    deletion, not the proofs and probes that re-run recorded steps), appended to the returned list."""
    from hf_unlearn.trace.replay import ReplayTrainer

    steps, real = [], ReplayTrainer._run_segment

    def counted(self, model, seg):
        if self.forget_ids or not deleting:
            steps.append(seg[0].step)
        return real(self, model, seg)

    monkeypatch.setattr(ReplayTrainer, "_run_segment", counted)
    return steps


def test_prove_runs_each_step_once_and_fresh_starts_on_request(tmp_path, monkeypatch, capsys):
    """`trace prove` trains exactly the recorded steps (one replay from step 0) and proves step 0's start only;
    `--fresh-starts` adds one step from each later kept checkpoint, as before, and seals them as ``starts`` (on a run
    whose sealed proof covers every step with this engine and environment, only those steps)."""
    from hf_unlearn.cli import main
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.proof import proof_starts, prove

    run = copy_run(get_recorded(), tmp_path / "run")  # 8 steps, checkpoints 0, 2, 4, 6 kept
    steps = _count_steps(monkeypatch)
    record_ = prove(run, progress=False)
    assert steps == list(range(8)) and record_["proven"] and record_["starts"] == [0]
    assert proof_starts(open_run(run).header) == {0}
    capsys.readouterr()
    steps.clear()
    assert main(["trace", "prove", str(run), "--no-progress", "--fresh-starts"]) == 0
    assert steps == [2, 4, 6]
    assert "a replay started afresh at kept checkpoint(s) 2, 4, 6" in capsys.readouterr().out
    assert open_run(run).header["fidelity"]["proof"]["starts"] == [0, 2, 4, 6]


def test_a_deletion_proves_its_own_fresh_start_and_is_verified(tmp_path):
    """The run proven from step 0 only: a row of step 3 (its replay starts afresh at checkpoint 2, step 2 before the
    first affected one) and a row of step 2 (step 2 affected: one probe step from checkpoint 2 with no deletion) are
    VERIFIED, equal to the engine-free counterfactual, and the receipt says how the start was proven; `trace verify`
    agrees. A replay whose start was proven by nothing is not VERIFIED (a header edited to drop the record)."""
    from hf_unlearn import forget
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.proven import proof_starts, unproven_steps
    from hf_unlearn.trace.verification import verify

    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=config_model("qwen2", tok), every=2, **KW)  # GQA; proven at the end
    run = tmp_path / "rec" / "trace"
    opened = open_run(run)
    assert opened.header["fidelity"]["proof"]["proven"] and proof_starts(opened.header) == {0}
    for case, step, by in (("a", 3, "replay"), ("b", 2, "probe")):
        ids = opened.ids_at_steps([step])[:1]
        receipt = forget(run, ids, tmp_path / case, oracle=True, progress=False)
        assert receipt.evidence["cost"]["start_checkpoint"] == 2
        assert receipt.evidence["verified"] and receipt.verdict.startswith("VERIFIED"), receipt.evidence.get("oracle")
        assert receipt.evidence["start"] == {"checkpoint": 2, "proven_by": by}
        saved = json.loads((tmp_path / case / "receipt.json").read_text())
        assert saved["evidence"]["start"]["proven_by"] == by
        assert not _oracle_equals_counterfactual(tok, data, "qwen2", run, ids, tmp_path / case)
    # the replay output's own start record, removed (sealed with the key): its start is unproven, never VERIFIED
    replay = copy_run(tmp_path / "b" / "replay", tmp_path / "stripped")
    h = json.loads((replay / "header.json").read_text())
    assert h["fidelity"]["start"]["proven_by"] == "probe"
    for forged in (None, {**h["fidelity"]["start"], "run_id": "another run"},
                   {**h["fidelity"]["start"], "checkpoint": 0}):
        h["fidelity"]["start"] = forged
        write_sealed_header(replay, h)
        assert unproven_steps(open_run(replay).header, 2, 6) == [2, 3, 4, 5]
        report = verify(replay, tmp_path / "b" / "oracle")
        assert report["identical"] and not report["verified"], forged


def _dropout_off_from_step_1():
    from .test_trace_program import NoDropout

    return NoDropout(step=1)  # importable: recorded and replayed; a checkpoint does not hold the dropout it set


def test_a_callbacks_earlier_change_is_refused_where_the_fresh_start_is_used(tmp_path, monkeypatch):
    """ATTACK: a recorded callback turns dropout off at step 1 (replayed: the proof from step 0 reproduces every
    step), but a replay started afresh at checkpoint 2 or 4 runs with dropout (no checkpoint holds a module
    attribute). Unproven starts: a row of step 3 (case a) is refused at the replay's own first step, a row of step 2
    (case b) by its probe step, before any compute; neither trains a deleted row (counted) nor writes a receipt. A
    redacted replay of the Python API given no probe is stopped by its controls. With `--fresh-starts` the proof finds
    both starts and the deletion is refused before any compute."""
    from hf_unlearn import forget
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.proof import ProofError, prove

    from .test_trace_program import _model

    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=_model("llama", tok, "dropout_off"), every=2, **KW,
           trainer_kwargs={"callbacks": [_dropout_off_from_step_1()]})
    run = tmp_path / "rec" / "trace"
    opened = open_run(run)
    assert opened.header["fidelity"]["proof"]["proven"]  # the continuous run is reproduced
    steps = _count_steps(monkeypatch, deleting=True)
    for case, step in (("a", 3), ("b", 2)):
        steps.clear()
        with pytest.raises(ProofError) as e:
            forget(run, opened.ids_at_steps([step])[:1], tmp_path / case, oracle=True, progress=False)
        assert "\n" not in str(e.value) and "a replay started afresh at checkpoint 2 does not reproduce" in str(e.value)
        assert "a callback's earlier change" in str(e.value)
        assert steps == ([2] if case == "a" else []), steps  # (a): its own first step only, (b): none
        assert not (tmp_path / case / "receipt.json").exists()
        assert not (tmp_path / case / "replay").exists()
    # the Python API without the probe (no proven_start): the replay's start is unproven; here its per-step controls
    # (the dropout attribute) stop it after that step, leaving no output (a clean unproven start: never VERIFIED, above)
    from hf_unlearn.trace import RedactedReplayTrainer, redact_store

    ids = opened.ids_at_steps([2])[:1]
    redact_store(opened.store_path, ids, tmp_path / "api" / "store", opened.key)
    with pytest.raises(UnlearnError, match="optimizer step 2"):
        RedactedReplayTrainer(run, tmp_path / "api" / "store", ids, tmp_path / "api" / "replay").train()
    assert not (tmp_path / "api" / "replay" / "header.json").exists()
    record_ = prove(run, progress=False, fresh_starts=True)
    assert record_["proven"] and record_["starts"] == [0] and set(record_["start_failures"]) == {"2", "4"}
    steps.clear()
    with pytest.raises(ProofError, match="a replay started afresh at checkpoint 2 does not reproduce"):
        forget(run, opened.ids_at_steps([3])[:1], tmp_path / "after", oracle=True, progress=False)
    assert not steps and not (tmp_path / "after").exists()  # refused before any compute


def test_a_foreign_proof_claiming_fresh_starts_does_not_count(tmp_path):
    """ATTACK: another run's proof, proven with --fresh-starts, copied into this run and sealed with the key: none
    of its ``starts`` counts, and neither does a replay-start record naming another parent or checkpoint."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.proof import prove
    from hf_unlearn.trace.proven import proof_starts, proven_starts

    donor = copy_run(get_recorded(), tmp_path / "donor")
    assert prove(donor, progress=False, fresh_starts=True)["starts"] == [0, 2, 4, 6]
    tok, data = get_trace_data()
    record(tok, data.select(range(24)), tmp_path / "rec", every=2, trainer_kwargs={"trace_self_check": False}, **KW)
    run = tmp_path / "rec" / "trace"
    h = json.loads((run / "header.json").read_text())
    h["fidelity"]["proof"] = json.loads((donor / "header.json").read_text())["fidelity"]["proof"]
    write_sealed_header(run, h)
    header = open_run(run).header
    assert proof_starts(header) == set() and proven_starts(header) == set()
    parent = {"run_id": "p", "start_step": 4}
    for start in ({"checkpoint": 4, "proven_by": "probe", "run_id": "q"},
                  {"checkpoint": 2, "proven_by": "probe", "run_id": "p"},
                  {"checkpoint": 4, "proven_by": "trust me", "run_id": "p"}):
        assert proven_starts({**header, "parent": parent, "fidelity": {**h["fidelity"], "start": start}}) == set()
    assert proven_starts({**header, "parent": parent, "fidelity": {**h["fidelity"], "start": {
        "checkpoint": 4, "proven_by": "replay", "run_id": "p"}}}) == {4}


# ---- an unproven fresh start is named where unproven steps are accepted -------------------------------------------
def _partly_proven(run, diverged_at: int) -> None:
    """Seal (with the run key, as a proof would) a proof that found the engine diverge at ``diverged_at``; the
    recording's self-check covering step 0 only."""
    h = json.loads((run / "header.json").read_text())
    h["fidelity"]["recording"] = {**h["fidelity"]["recording"], "by": "self-check", "steps": [0, 1]}
    h["fidelity"]["proof"].update(proven=False, steps=[0, diverged_at - 1], starts=[0],
                                  diverged={"step": diverged_at, "why": f"optimizer step {diverged_at}: other state"})
    write_sealed_header(run, h)


def test_an_accepted_deletion_names_its_unproven_fresh_start(tmp_path, capsys):
    """ATTACK (a careless user): steps 5..7 unproven (a proof diverged at step 5) and accepted; the row deleted trains
    at step 2, so the replay starts afresh at checkpoint 2 with that step affected (its probe is not run under
    --accept-unproven). The start is unproven, so steps 2..7 are: the receipt used to list only 5..7 while `trace
    verify` counted 2..7. Now the receipt (Python API and CLI), its verdict and `trace verify` agree: steps 2..7,
    start 2, never VERIFIED. A row of step 3 (the replay's own first step proves the start) lists 5..7 only."""
    from hf_unlearn import forget
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.verification import verify

    run = copy_run(get_recorded(), tmp_path / "run")  # 8 steps, checkpoints 0, 2, 4, 6
    _partly_proven(run, 5)
    ids = open_run(run).ids_at_steps([2])[:1]
    receipt = forget(run, ids, tmp_path / "b", oracle=True, progress=False, accept_unproven=True)
    ev = receipt.evidence
    assert ev["cost"]["start_checkpoint"] == 2 and ev["start"] is None
    assert ev["unproven_steps"] == [2, 3, 4, 5, 6, 7] and ev["unproven_starts"] == [2], ev["unproven_steps"]
    assert ev["verified"] is False and "VERIFIED" not in receipt.verdict.replace("not verified", "")
    assert "2..7" in receipt.verdict and "checkpoint 2" in receipt.verdict
    assert "checkpoint 2" in receipt.guarantee and "2..7" in receipt.guarantee
    report = verify(tmp_path / "b" / "replay", tmp_path / "b" / "oracle")
    assert report["unproven_steps"] == ev["unproven_steps"] and report["unproven_starts"] == [2]
    saved = json.loads((tmp_path / "b" / "receipt.json").read_text())
    assert saved["evidence"]["unproven_starts"] == [2] and saved["evidence"]["unproven_steps"] == [2, 3, 4, 5, 6, 7]
    capsys.readouterr()
    assert main(["trace", "verify", str(tmp_path / "b" / "replay"), str(tmp_path / "b" / "oracle")]) == 1
    err = capsys.readouterr().err
    assert "steps 2..7 of the engine unproven" in err and "afresh at checkpoint 2 is not proven" in err, err
    # the CLI, without the oracle: the receipt still names the start
    f = write_ids(tmp_path / "f.jsonl", ids)
    assert main(["forget", str(run), "--ids", str(f), "--out", str(tmp_path / "cli"), "--no-progress",
                 "--accept-unproven"]) == 0  # accepted: never VERIFIED
    saved = json.loads((tmp_path / "cli" / "receipt.json").read_text())
    assert saved["evidence"]["unproven_steps"] == [2, 3, 4, 5, 6, 7] and saved["evidence"]["unproven_starts"] == [2]
    assert "checkpoint 2" in saved["guarantee"] and "VERIFIED" not in saved["guarantee"].replace("not VERIFIED", "")
    capsys.readouterr()
    assert main(["trace", "redact", str(run), "--forget", str(f), "--out", str(tmp_path / "store")]) == 0
    assert main(["trace", "replay", str(run), "--store", str(tmp_path / "store"), "--forget", str(f), "--out",
                 str(tmp_path / "r"), "--accept-unproven"]) == 0
    out = capsys.readouterr().out
    assert "UNPROVEN (accepted): steps 2..7" in out and "afresh at checkpoint 2 is not proven" in out, out
    # case (a): the replay's own first step (3 affected, 2 not) proves the start: only the proof's steps
    late = forget(run, open_run(run).ids_at_steps([3])[:1], tmp_path / "a", oracle=True, progress=False,
                  accept_unproven=True)
    assert late.evidence["start"] == {"checkpoint": 2, "proven_by": "replay"}
    assert late.evidence["unproven_steps"] == [5, 6, 7] and late.evidence["unproven_starts"] == []
    assert verify(tmp_path / "a" / "replay", tmp_path / "a" / "oracle")["unproven_steps"] == [5, 6, 7]


# ---- a resumed proof claims no continuity it did not see ----------------------------------------------------------
def _continuous_only_fault(monkeypatch, after: int):
    """An engine fault a fresh start hides: a replay that ran through kept checkpoint ``after`` (it started before
    it) carries something wrong into step ``after + 1`` (a parameter nudged before that step: live state the
    checkpoint restores for a replay started afresh there, e.g. a replayed callback's counter the engine does not
    advance as the recording's Trainer did)."""
    from hf_unlearn.trace.replay import ReplayTrainer

    real = ReplayTrainer._run_segment

    def drifted(self, model, seg):
        if seg[0].step == after + 1 and self.start_step < after:
            with torch.no_grad():
                next(p for p in self.model.parameters() if p.requires_grad).add_(1e-3)
        return real(self, model, seg)

    monkeypatch.setattr(ReplayTrainer, "_run_segment", drifted)


def test_a_proof_resumed_after_a_kill_does_not_prove_the_replays_that_run_through_its_restart(tmp_path, monkeypatch):
    """ATTACK: a proof killed after it matched kept checkpoint 4 resumes from a fresh start there, so an engine fault
    that only a replay running on through checkpoint 4 carries (it nudges the state before step 5) is never run by the
    resumed proof, which used to seal every step proven: a step-0 deletion (its oracle and replay both run through
    checkpoint 4, the same fault in both) was VERIFIED with every tensor off the engine-free counterfactual. Now the
    sealed proof names its restart and the steps from it are unproven for a replay that started before it: refused
    before any compute, naming the restart; a deletion whose replay starts at checkpoint 4 is proven there. An
    uninterrupted proof finds the fault at step 5."""
    from hf_unlearn import forget
    from hf_unlearn.trace import open_run, proof
    from hf_unlearn.trace.proven import unproven_steps

    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", every=2, trainer_kwargs={"trace_self_check": False}, **KW)
    run = tmp_path / "rec" / "trace"  # 6 steps, checkpoints 0, 2, 4
    _continuous_only_fault(monkeypatch, 4)
    whole = copy_run(run, tmp_path / "whole")
    found = proof.prove(whole, progress=False)
    assert not found["proven"] and found["diverged"]["step"] == 5, found  # seen by a proof that runs on through 4
    real_save, saves = proof._save_progress, []

    def killed(run_, state):
        real_save(run_, state)
        saves.append(state["upto"])
        if state["upto"] == 4:
            raise KeyboardInterrupt  # killed right after checkpoint 4 was persisted

    monkeypatch.setattr(proof, "_save_progress", killed)
    with pytest.raises(KeyboardInterrupt):
        proof.prove(run, progress=False)
    monkeypatch.setattr(proof, "_save_progress", real_save)
    resumed = proof.prove(run, progress=False)
    assert resumed["resumed_at"] == [4], resumed
    header = open_run(run).header
    assert unproven_steps(header, 0, 6, fresh_start=False) == [4, 5]  # a replay from step 0 runs through 4
    assert unproven_steps(header, 4, 6) == []  # one started afresh at 4 is what the resumed proof ran
    ids = open_run(run).ids_at_steps([0])[:1]
    with pytest.raises(proof.ProofError, match="resumed") as e:
        forget(run, ids, tmp_path / "refused", oracle=True, progress=False)
    assert "\n" not in str(e.value) and "checkpoint 4" in str(e.value)
    assert not (tmp_path / "refused").exists()
    accepted = forget(run, ids, tmp_path / "accepted", oracle=True, progress=False, accept_unproven=True)
    assert accepted.evidence["verified"] is False and accepted.evidence["unproven_steps"] == [4, 5]
    assert _oracle_equals_counterfactual(tok, data, "llama", run, ids, tmp_path / "accepted")  # what it would have been


def test_the_engine_classes_used_directly_are_not_verified_in_another_environment(tmp_path, monkeypatch):
    """ATTACK: `RedactedReplayTrainer` + `OracleReplayTrainer` + `verify_replay` from Python, in a process whose RMSNorm
    is computed otherwise than the recording's (``torch.rsqrt`` patched, its code entry hidden: a numeric change no code digest shows) (other bits), for a step-0 deletion (no step of the replay or the
    oracle is compared with the recording): both were equally wrong and `verify` said VERIFIED (`forget`, `trace
    replay`, `trace oracle` and pipelines refuse it with their probe). Now the oracle, given no environment probe,
    re-runs its first step with no deletion before its own compute and refuses; in the recorded environment the same
    deletion is VERIFIED and equal to the engine-free counterfactual."""
    from hf_unlearn.trace import open_run

    from .test_trace_common import delete

    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=config_model("llama", tok), every=2, **KW)  # proven when recorded
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([0])[:1]
    with monkeypatch.context() as m:
        m.setattr(torch, "rsqrt", rsqrt_other_bits(m))
        with pytest.raises(UnlearnError, match="the deleting environment does not reproduce") as e:
            delete(run, ids, tmp_path / "patched", start="full")
        assert "optimizer step 0" in str(e.value) and "\n" not in str(e.value)
        assert not (tmp_path / "patched" / "oracle" / "header.json").exists()
    _, report = delete(run, ids, tmp_path / "ok", start="full")
    assert report["verified"], report["verdict"]
    assert not _oracle_equals_counterfactual(tok, data, "llama", run, ids, tmp_path / "ok")
