"""The training program is closed (issue #31): a callback that changes training is recorded and replayed exactly, or
detected and refused with its name and step; replays check themselves against the recording's per-step
fingerprints; evidence states what it covers and a run without per-step guards is not VERIFIED."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import TrainerCallback

from hf_unlearn.errors import UnlearnError

from .test_trace_common import get_trace_data, record
from .test_trace_fidelity import independent_counterfactual

CHANGE_AT = 3  # every callback changes training at optimizer step 3


class LrTimesTen(TrainerCallback):
    """Multiplies every param group's learning rate by 10 at the start of step 3 (the scheduler resets it after)."""

    def __init__(self, step: int = CHANGE_AT, factor: float = 10.0):
        self.step, self.factor = step, factor

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step == self.step:
            for g in optimizer.param_groups:
                g["lr"] *= self.factor


class FreezeFirstLayer(TrainerCallback):
    """Freezes the first transformer layer at the start of step 3."""

    def __init__(self, step: int = CHANGE_AT):
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            for name, p in model.named_parameters():
                if ".0." in name:
                    p.requires_grad_(False)


class ShrinkWeights(TrainerCallback):
    """An EMA-style edit of the weights under no_grad, at the end of every step from step 3 (towards zero)."""

    def __init__(self, step: int = CHANGE_AT, decay: float = 0.9):
        self.step, self.decay, self.edits = step, decay, 0

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step >= self.step:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(self.decay)
            self.edits += 1  # state of its own: a suffix replay restores it with the checkpoint


class NoDropout(TrainerCallback):
    """Sets every dropout probability (nn.Dropout.p, attention dropout) to 0 at the start of step 3."""

    def __init__(self, step: int = CHANGE_AT):
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            for m in model.modules():
                if isinstance(m, torch.nn.Dropout):
                    m.p = 0.0
                for k in ("attention_dropout", "dropout"):
                    if isinstance(getattr(m, k, None), float):
                        setattr(m, k, 0.0)


CASES = {"lr_x10": LrTimesTen, "freeze": FreezeFirstLayer, "ema_edit": ShrinkWeights, "dropout_off": NoDropout}
ARCHS = ("llama", "gpt_neox", "gpt2")
FAST = {("freeze", "gpt_neox"), ("ema_edit", "gpt2"), ("dropout_off", "llama")}  # the rest: slow (time budget)
KW = dict(gradient_accumulation_steps=1, max_steps=6)


def _params(fast_only=FAST):
    return [pytest.param(c, a, marks=() if (c, a) in fast_only else pytest.mark.slow) for c in CASES for a in ARCHS]


def _model(arch: str, tok, case: str):
    from hf_unlearn.models import build_tiny_model

    return build_tiny_model(arch, tok, hidden_size=32, num_layers=2, num_heads=2, seed=0,
                            dropout=0.1 if case == "dropout_off" else 0.0)


def _record(tmp_path, arch, case, callback):
    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=_model(arch, tok, case), every=2, **KW,
           trainer_kwargs={"callbacks": [callback]})
    return tok, data, tmp_path / "rec" / "trace"


@pytest.mark.parametrize("case,arch", _params())
def test_a_state_changing_callback_is_recorded_and_replayed_exactly(tmp_path, case, arch):
    """The callback (importable, JSON attributes) is recorded and run again by replays and the oracle: an early
    deletion (step 0) and a row at step 3 after checkpoint 2 are VERIFIED, and the oracle equals a plain Trainer
    with the same callback (the deleted rows' labels -100, the recorded normalisers and seeds)."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.guards import program_changes
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_common import delete

    tok, data, run = _record(tmp_path, arch, case, CASES[case]())
    opened = open_run(run)
    assert [c["class"] for c in opened.header["trainer"]["callbacks"]] == [f"tests.test_trace_program:{CASES[case].__name__}"]
    assert program_changes(opened.plan, opened.header) == []
    for when, step in (("early", 0), ("after_checkpoint_2", CHANGE_AT)):
        ids = opened.ids_at_steps([step])[:1]
        _, report = delete(run, ids, tmp_path / when)  # redact, replay, oracle, verify (forget on GPT-NeoX: w31b)
        assert report["verified"] is True, (when, report["provenance"]["problems"])
        assert "callbacks replayed: " + CASES[case].__name__ in report["fidelity"]
        assert "per-step fingerprints matched the recording's" in report["fidelity"]
        oracle = load_checkpoint(open_run(tmp_path / when / "oracle").final_checkpoint())
        counterfactual = independent_counterfactual(tok, data, _model(arch, tok, case), run, ids,
                                                    tmp_path / when / "plain", callbacks=[CASES[case]()], **KW)
        differ = [n for n, t in oracle["model"].items() if not torch.equal(t, counterfactual[n])]
        assert not differ, (when, differ[:3])
    # the callback changed training: without it the recorded run is another model
    plain = independent_counterfactual(tok, data, _model(arch, tok, case), run, [], tmp_path / "nocb", **KW)
    final = load_checkpoint(opened.final_checkpoint())
    assert any(not torch.equal(t, plain[n]) for n, t in final["model"].items())


@pytest.mark.parametrize("case,arch", _params())
def test_a_callback_a_replay_cannot_run_is_refused_naming_it_and_the_step(tmp_path, case, arch, capsys):
    """The same callback defined where a replay cannot import it: the recording marks the run at the step it first
    changed something, naming it; forget refuses every deletion whose replay would pass that step (an early one, a
    row at step 3 after checkpoint 2, any oracle) before any compute; a row served after a later checkpoint replays."""
    from hf_unlearn import forget
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import RedactedReplayTrainer, open_run, redact_store
    from hf_unlearn.trace.guards import ProgramChangedError, program_changes

    local = type(f"Local{CASES[case].__name__}", (CASES[case],), {})  # not importable: a replay cannot rebuild it
    tok, data, run = _record(tmp_path, arch, case, local())
    opened = open_run(run)
    assert opened.header["trainer"]["callbacks"] == []
    assert opened.header["trainer"]["watched_callbacks"][0]["class"].endswith(local.__name__)
    changes = program_changes(opened.plan, opened.header)
    step = CHANGE_AT - 1 if case == "ema_edit" else CHANGE_AT  # on_step_end of step 2: in checkpoint 3 onwards
    assert changes and changes[0]["step"] == step and local.__name__ in changes[0]["by"], changes
    for when, s in (("early", 0), ("after_checkpoint_2", CHANGE_AT)):
        with pytest.raises(ProgramChangedError, match=f"step {step} by {local.__name__}") as e:
            forget(run, opened.ids_at_steps([s])[:1], tmp_path / when, oracle=True, progress=False)
        assert "\n" not in str(e.value) and not (tmp_path / when).exists()
    late = opened.ids_at_steps([5])[:1]  # served after checkpoint 4, which holds every change... unless the edits go on
    ids = write_ids(tmp_path / "late.jsonl", late)
    capsys.readouterr()
    threads = torch.get_num_threads()  # the CLI sets the free cores; the replay below must run with the recording's
    try:
        assert main(["forget", str(run), "--ids", str(ids), "--oracle", "--no-progress", "--out",
                     str(tmp_path / "cli")]) != 0
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot delete these ids" in err[0] and local.__name__ in err[0]
    redact_store(opened.store_path, late, tmp_path / "store", opened.key)
    if changes[-1]["step"] >= 4 or changes[0].get("persistent"):  # edits every step; a frozen layer, dropout p
        with pytest.raises(ProgramChangedError):  # stay in the model: no checkpoint after them helps
            RedactedReplayTrainer(run, tmp_path / "store", late, tmp_path / "replay")
    else:
        RedactedReplayTrainer(run, tmp_path / "store", late, tmp_path / "replay").train()


def test_user_code_outside_callbacks_and_a_forged_record_are_refused(tmp_path):
    """A callback posing as an observer (``__module__ = "transformers.fake"``) is not one: its edit through ``.data``
    is watched and named; removing it (or a recorded callback) from the sealed header without the run key is refused
    before any compute."""
    from hf_unlearn.trace import OracleReplayTrainer, open_run
    from hf_unlearn.trace.guards import program_changes
    from hf_unlearn.trace.run import write_sidecar

    tok, data = get_trace_data()
    model = _model("llama", tok, "")
    from hf_unlearn.models import build_tiny_model  # noqa: F401

    class Sneaky(TrainerCallback):
        pass

    def edit(self, args, state, control, **kwargs):
        if state.global_step == 4:
            with torch.no_grad():
                model.lm_head.weight.data.mul_(1.5)  # through .data: no version bump, caught by the checksums

    Sneaky.on_step_end = edit
    Sneaky.__module__ = "transformers.fake"  # poses as an observer: its code is not transformers', so it is watched
    record(tok, data.select(range(24)), tmp_path / "rec", model=model, every=2, **KW,
           trainer_kwargs={"callbacks": [Sneaky(), LrTimesTen()]})
    run = tmp_path / "rec" / "trace"
    opened = open_run(run)
    changes = program_changes(opened.plan, opened.header)
    assert [c["step"] for c in changes] == [3] and "Sneaky.on_step_end" in changes[0]["by"], changes
    assert "values of" in changes[0]["what"] and ".data" in changes[0]["what"]
    forget_ids = opened.ids_at_steps([5])[:1]
    OracleReplayTrainer  # noqa: B018
    with pytest.raises(UnlearnError, match="changed outside its record at optimizer step 3"):
        OracleReplayTrainer(run, forget_ids, out_dir=tmp_path / "o")
    header = json.loads((run / "header.json").read_text())
    # the attacker drops the recorded change (it lives in the keyed plan) and the recorded callback (keyed header)
    header["trainer"]["callbacks"] = []
    (run / "header.json").write_text(json.dumps(header))
    write_sidecar(run / "header.json")
    with pytest.raises(UnlearnError, match="controls_mac does not match the run key"):
        OracleReplayTrainer(run, forget_ids, out_dir=tmp_path / "o2")
    assert not (tmp_path / "o2").exists()


def test_tampered_fingerprints_in_the_plan_are_refused_before_compute(tmp_path):
    """Per-step fingerprints (and program changes) live in plan.bin under the run key: rewriting the plan with them
    edited, without the key, fails the segment MACs."""
    from hf_unlearn.trace import ReplayTrainer, open_run
    from hf_unlearn.trace.plan import PLAN_FILE, CompactPlanWriter, read_plan
    from hf_unlearn.trace.run import write_sidecar

    tok, data = get_trace_data()
    record(tok, data.select(range(16)), tmp_path / "rec", every=2, max_steps=4, gradient_accumulation_steps=1)
    run = tmp_path / "rec" / "trace"
    plan = read_plan(run)
    assert all("fp" in e.extra for e in plan if e.j == 0 and e.step > 0)
    plan[2].extra["fp"] = {**plan[2].extra["fp"], "s": "0" * 16}
    header = json.loads((run / "header.json").read_text())
    CompactPlanWriter(run / PLAN_FILE, b"not the run key", header["run_id"], plan).close()
    write_sidecar(run / PLAN_FILE)
    with pytest.raises(UnlearnError, match="do not match their keyed MAC"):
        ReplayTrainer(open_run(run, strict=True), start="full")


def test_a_replay_that_drops_a_recorded_callback_stops_at_the_step(tmp_path, monkeypatch):
    """The per-step fingerprints catch an engine that does not run the program: without the recorded callback the
    oracle's learning rate at step 3 differs (compared at every step, affected ones too), named."""
    from hf_unlearn.trace import OracleReplayTrainer, open_run
    from hf_unlearn.trace import replay as replay_module

    tok, data = get_trace_data()
    record(tok, data.select(range(24)), tmp_path / "rec", every=2, **KW, trainer_kwargs={"callbacks": [LrTimesTen()]})
    run = tmp_path / "rec" / "trace"
    monkeypatch.setattr(replay_module.ReplayTrainer, "_event", lambda self, event: None)
    with pytest.raises(UnlearnError, match="at optimizer step 3: the oracle's learning rates at optimizer.step"):
        OracleReplayTrainer(run, open_run(run).ids_at_steps([0])[:1], out_dir=tmp_path / "o").train()


def test_a_run_without_per_step_guards_is_not_verified(tmp_path):
    """trace_guards=False: replay and oracle agree bit for bit, but verify says what is not proven: NOT VERIFIED."""
    from hf_unlearn.trace import open_run

    from .test_trace_common import delete

    tok, data = get_trace_data()
    record(tok, data.select(range(16)), tmp_path / "rec", every=2, max_steps=4, gradient_accumulation_steps=1,
           trainer_kwargs={"trace_guards": False})
    run = tmp_path / "rec" / "trace"
    assert "guards" not in open_run(run).header["fidelity"]
    _, report = delete(run, open_run(run).ids_at_steps([2])[:1], tmp_path)
    assert report["identical"] and not report["verified"]
    assert any("ran no per-step guards" in p for p in report["provenance"]["problems"])
    assert "NO per-step guards" in report["fidelity"]


def test_forget_oracle_of_a_run_whose_guards_miss_steps_is_refused_before_any_compute(tmp_path, capsys):
    """A run the guards did not cover at every step (trace_guards=False here; a resume whose crash lost a step's
    fingerprint the same) can never be VERIFIED: `forget --oracle` ran the replay and the oracle, then said NOT
    VERIFIED and exited 1. Now it refuses before any compute, naming why and the way to accept it."""
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run

    tok, data = get_trace_data()
    record(tok, data.select(range(16)), tmp_path / "rec", every=2, max_steps=4, gradient_accumulation_steps=1,
           trainer_kwargs={"trace_guards": False})
    run = open_run(tmp_path / "rec" / "trace")
    ids = write_ids(tmp_path / "ids.jsonl", run.ids_at_steps([2])[:1])
    capsys.readouterr()
    assert main(["forget", str(run.path), "--ids", str(ids), "--out", str(tmp_path / "out"), "--oracle",
                 "--no-progress"]) == 1
    out = capsys.readouterr()
    assert "ran no per-step guards" in out.err and "refusing before any compute" in out.err, out.err
    assert "--accept-unproven" in out.err and "replayed" not in out.out and not (tmp_path / "out" / "replay").exists()
