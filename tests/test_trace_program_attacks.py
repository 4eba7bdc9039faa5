"""Attacks on the closed training program (issue #31): a careless user or an attacker changes the run in ways the
replay does not see. Each attack must end in a refusal (up front or at compute time, naming what changed) or in a
VERIFIED whose oracle equals a plain ``Trainer`` run with the same callbacks; never a VERIFIED against an oracle that
is not the counterfactual of the run that trained."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Trainer, TrainerCallback

from hf_unlearn.errors import UnlearnError

from .test_trace_common import delete, get_trace_data, record
from .test_trace_fidelity import independent_counterfactual

AT = 3  # every attack acts from optimizer step 3
KW = dict(gradient_accumulation_steps=1, max_steps=6)


def _model(tok, dropout: float = 0.0):
    from hf_unlearn.models import build_tiny_model

    return build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2, seed=0, dropout=dropout)


def _local(cls):
    """``cls`` as a class a replay cannot import (as if defined in the user's script): watched, not recorded."""
    return type(f"Local{cls.__name__}", (cls,), {})


def _record(tmp_path, callbacks, model=None, dropout: float = 0.0, **kw):
    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=model if model is not None else _model(tok, dropout), every=2,
           **{**KW, **kw}, trainer_kwargs={"callbacks": callbacks})
    return tok, data, tmp_path / "rec" / "trace"


def _outcome(tmp_path, run, step: int = 0):
    """Delete one row served at ``step`` (redact, replay, oracle, verify): ("refused", message) or
    ("verified" | "not verified", report)."""
    from hf_unlearn.trace import open_run

    ids = open_run(run).ids_at_steps([step])[:1]
    try:
        _, report = delete(run, ids, tmp_path / f"del{step}")
    except UnlearnError as e:
        return "refused", str(e), ids
    return ("verified" if report["verified"] else "not verified"), report, ids


def _assert_refused(tmp_path, run, match: str, step: int = 0):
    kind, what, _ = _outcome(tmp_path, run, step)
    assert kind == "refused", (kind, what if kind == "refused" else (what["verified"], what["provenance"]["problems"]))
    assert match in what and "\n" not in what, what


def _assert_verified_and_counterfactual(tmp_path, tok, data, run, callbacks, dropout: float = 0.0, step: int = 0):
    """VERIFIED, and the oracle equals a plain Trainer with the same callbacks (the deleted row's labels -100)."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    kind, report, ids = _outcome(tmp_path, run, step)
    assert kind == "verified", (kind, report if kind == "refused" else report["provenance"]["problems"])
    oracle = load_checkpoint(open_run(tmp_path / f"del{step}" / "oracle").final_checkpoint())
    plain = independent_counterfactual(tok, data, _model(tok, dropout), run, ids, tmp_path / "plain",
                                       callbacks=callbacks, **KW)
    differ = [n for n, t in oracle["model"].items() if not torch.equal(t, plain[n])]
    assert not differ, differ[:3]


# ---- 1. an edit through .data that touches one element (misses any sample of the values) ---------------------
class NudgeOneElement(TrainerCallback):
    """Adds 0.5 to element 1 of the first parameter through ``.data`` (no version bump) at the end of step 3."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == AT + 1:
            next(model.parameters()).data.view(-1)[1] += 0.5


@pytest.mark.parametrize("pose", ["watched", pytest.param("transformers_module", marks=pytest.mark.slow),
                                  pytest.param("observer_flag", marks=pytest.mark.slow)])
def test_a_one_element_edit_through_data_is_caught(tmp_path, pose):
    """A watched callback, or one posing as an observer (``__module__ = "transformers.x"`` or
    ``_trace_observer = True``): the exact per-tensor checksums catch the edit; an early deletion is refused."""
    cls = _local(NudgeOneElement)
    if pose == "transformers_module":
        cls.__module__ = "transformers.trainer_callback"
    elif pose == "observer_flag":
        cls._trace_observer = True
    _, _, run = _record(tmp_path, [cls()])
    _assert_refused(tmp_path, run, "changed outside its record at optimizer step")


def test_an_observer_pose_is_not_an_observer():
    """Only callbacks whose event code lives in transformers (or this library) are observers."""
    from transformers import PrinterCallback

    from hf_unlearn.trace.guards import is_observer

    for attr in ({"__module__": "transformers.foo"}, {"_trace_observer": True}):
        cls = type("Poser", (NudgeOneElement,), dict(attr))
        assert not is_observer(cls())
    assert is_observer(PrinterCallback())
    mine = type("Mine", (PrinterCallback,), {"on_log": lambda self, *a, **k: None, "__module__": "transformers.x"})
    assert not is_observer(mine())


# ---- 2. code outside the callbacks: a gradient hook, a forward hook that edits the weights -----------------------
def test_a_parameter_gradient_hook_is_refused(tmp_path):
    """``register_hook`` on a parameter before training, scaling its gradient only from the 4th backward on: the
    replay does not run it; hooks are part of the program controls, so every replay stops at its first step."""
    tok, data = get_trace_data()
    model = _model(tok)
    calls = {"n": 0}

    def hook(grad):
        calls["n"] += 1
        return grad * 10 if calls["n"] > AT else grad

    next(model.parameters()).register_hook(hook)
    _, _, run = _record(tmp_path, [], model=model)
    assert calls["n"] > AT
    _assert_refused(tmp_path, run, "hook")


class AddForwardHookAt3(TrainerCallback):
    """Registers, at step 3, a forward pre-hook on the first layer that edits its weights through ``.data``."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step == AT:
            layer = model.model.layers[0].mlp.up_proj

            def edit(module, inputs):
                module.weight.data.view(-1)[3] *= 0.5

            layer.register_forward_pre_hook(edit)


@pytest.mark.slow
def test_a_forward_hook_added_mid_run_is_refused(tmp_path):
    _, _, run = _record(tmp_path, [_local(AddForwardHookAt3)()])
    _assert_refused(tmp_path, run, "changed outside its record at optimizer step 3")


# ---- 3. code that reads state a replay must set identically ------------------------------------------------------
class ShrinkByEpoch(TrainerCallback):
    """Importable, JSON attributes: recorded. Decides from ``state.epoch`` (which replays set as the recording's)."""

    def __init__(self):
        self.threshold = 0.4

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if (state.epoch or 0) >= self.threshold:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.99)


class ShrinkByLogs(ShrinkByEpoch):
    """Decides from ``state.log_history`` (the losses: replays do not reproduce it)."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if len(state.log_history) >= 1:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.99)


def test_a_recorded_callback_reading_state_a_replay_does_not_set_is_refused(tmp_path):
    _, _, run = _record(tmp_path, [ShrinkByLogs()], logging_steps=2)
    _assert_refused(tmp_path, run, "state.log_history")


@pytest.mark.slow
def test_a_recorded_callback_reading_the_epoch_replays_exactly(tmp_path):
    """state.epoch is in the plan: a callback that decides from it is replayed as it ran (VERIFIED, and the oracle
    equals a plain Trainer with the same callback)."""
    tok, data, run = _record(tmp_path, [ShrinkByEpoch()])
    _assert_verified_and_counterfactual(tmp_path, tok, data, run, [ShrinkByEpoch()])


class EpochScaledLoss(Trainer):
    """A user's trainer whose loss grows with ``self.state.epoch`` (a curriculum); the replay runs this class."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        scale = 1.0 + 20.0 * max(0.0, (self.state.epoch or 0.0) - 0.5)  # from step 3 on: past the self-check
        return (out[0] * scale, out[1]) if return_outputs else out * scale


@pytest.mark.slow
def test_a_compute_loss_reading_the_epoch_replays_exactly(tmp_path):
    """An early deletion is VERIFIED and a full replay reproduces the recorded final state bit for bit (before
    state.epoch was in the plan, the replay saw None from step 3 on: the deletion was VERIFIED against another
    model)."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import trace_recording

    from .test_trace_common import replays_the_recording, train_args

    tok, data = get_trace_data()
    trace_recording(EpochScaledLoss)(model=_model(tok), args=train_args(tmp_path / "rec", **KW),
                                     train_dataset=data.select(range(24)), data_collator=QACollator.from_tokenizer(tok),
                                     trace_checkpoint_steps=2).train()
    run = tmp_path / "rec" / "trace"
    kind, report, _ = _outcome(tmp_path, run, 0)
    assert kind == "verified", report
    assert replays_the_recording(run)


# ---- 4. the window between a crash and a resume ------------------------------------------------------------------
class ShrinkEveryStep(TrainerCallback):
    def on_step_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.95)


class _StopAfter5(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == 5


StopAfter5 = _local(_StopAfter5)  # stands for a crash (checkpoint-4 survives); watched, so not a replayed callback


def _resumable(tmp_path, retention: str = "geometric"):
    """A factory of recording trainers over one output folder (checkpoint-4 saved), to crash and resume."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer

    from .test_trace_common import train_args

    tok, data = get_trace_data()
    data = data.select(range(24))
    kw = dict(**KW, save_strategy="steps", save_steps=4)

    def trainer(callbacks):
        return TraceRecordingTrainer(model=_model(tok), args=train_args(tmp_path / "part", **kw), train_dataset=data,
                                     data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=2,
                                     trace_checkpoint_retention=retention, callbacks=callbacks)

    return trainer


@pytest.mark.slow
def test_a_resume_with_other_callbacks_is_refused(tmp_path):
    """Recorded with a replayed callback, crashed after step 4, resumed without it: the resume is refused (a replay
    would run the resumed process's callbacks over the whole run)."""
    trainer = _resumable(tmp_path)
    trainer([ShrinkEveryStep(), StopAfter5()]).train()
    with pytest.raises(UnlearnError, match="callbacks"):
        trainer([]).train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-4"))


# ---- 5. other levers: the scheduler object, param-group settings, global torch state, substeps, the plan ------------
class RaiseSchedulerBase(TrainerCallback):
    """Changes the learning rate through the scheduler (its base_lrs), not the param groups, at step 3."""

    def on_step_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        if state.global_step == AT and lr_scheduler is not None:
            lr_scheduler.base_lrs = [lr * 5 for lr in lr_scheduler.base_lrs]


@pytest.mark.slow
def test_a_scheduler_change_is_in_the_recorded_lrs(tmp_path):
    """The plan records the learning rates the scheduler set: a watched callback that changes them through the
    scheduler replays exactly (VERIFIED, equal to a plain Trainer with the same callback)."""
    cb = _local(RaiseSchedulerBase)
    tok, data, run = _record(tmp_path, [cb()])
    _assert_verified_and_counterfactual(tmp_path, tok, data, run, [cb()])


class GroupSetting(TrainerCallback):
    """Changes one param-group setting (not the lr) at the start of step 3."""

    key, value = "weight_decay", 0.5

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step == AT:
            for g in optimizer.param_groups:
                g[self.key] = self.value


@pytest.mark.slow  # caught before the exact checksums too (param-group settings are controls)
@pytest.mark.parametrize("key,value", [("weight_decay", 0.5), ("betas", (0.5, 0.9))])
def test_a_param_group_setting_change_is_refused(tmp_path, key, value):
    cls = type("LocalGroupSetting", (GroupSetting,), {"key": key, "value": value})
    _, _, run = _record(tmp_path, [cls()])
    _assert_refused(tmp_path, run, f"{key}")


class Threads(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == AT:
            torch.set_num_threads(1 if torch.get_num_threads() > 1 else 2)


def test_a_global_torch_setting_changed_mid_run_is_refused(tmp_path):
    """torch's thread count (CPU matmul results depend on it at realistic sizes) changed by a callback at step 3."""
    threads = torch.get_num_threads()
    try:
        _, _, run = _record(tmp_path, [_local(Threads)()])
    finally:
        torch.set_num_threads(threads)
    _assert_refused(tmp_path, run, "threads")


class Reseed(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == AT:
            torch.manual_seed(123)


@pytest.mark.slow
def test_reseeding_the_global_rng_mid_run_does_not_change_the_replay(tmp_path):
    """The replay seeds every microbatch from the plan: a torch.manual_seed at step 3 changes nothing (dropout on)."""
    cb = _local(Reseed)
    tok, data, run = _record(tmp_path, [cb()], dropout=0.1)
    _assert_verified_and_counterfactual(tmp_path, tok, data, run, [cb()], dropout=0.1)


class NudgeGradOnSubstep(TrainerCallback):
    """Between the microbatches of step 3 (on_substep_end), one gradient element through ``.data``."""

    def on_substep_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == AT:
            p = next(model.parameters())
            if p.grad is not None:
                p.grad.data.view(-1)[1] += 1.0


def test_a_gradient_edit_between_microbatches_is_refused(tmp_path):
    _, _, run = _record(tmp_path, [_local(NudgeGradOnSubstep)()], gradient_accumulation_steps=2)
    _assert_refused(tmp_path, run, "changed outside its record at optimizer step 3")


class Scale(TrainerCallback):
    def __init__(self, factor: float = 10.0):
        self.factor = factor

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step == AT:
            for g in optimizer.param_groups:
                g["lr"] *= self.factor


@pytest.mark.slow
def test_a_recorded_callbacks_attributes_edited_in_the_plan_are_refused(tmp_path):
    """The recorded callback's attributes live in the keyed plan: editing them (factor 10 -> 1) without the key
    fails the segment MACs before any compute."""
    from hf_unlearn.trace import ReplayTrainer, open_run
    from hf_unlearn.trace.plan import PLAN_FILE, CompactPlanWriter, read_plan
    from hf_unlearn.trace.run import write_sidecar

    _, _, run = _record(tmp_path, [Scale()])
    plan = read_plan(run)
    first = next(e for e in plan if "callbacks" in e.extra)
    assert first.extra["callbacks"] == [{"factor": 10.0}]
    first.extra["callbacks"] = [{"factor": 1.0}]
    header = json.loads((run / "header.json").read_text())
    CompactPlanWriter(run / PLAN_FILE, b"not the run key", header["run_id"], plan).close()
    write_sidecar(run / PLAN_FILE)
    with pytest.raises(UnlearnError, match="do not match their keyed MAC"):
        ReplayTrainer(open_run(run, strict=True), start="full")


@pytest.mark.slow
@pytest.mark.parametrize("retention", ["even", "geometric"])
def test_a_resume_from_an_edited_checkpoint_is_refused(tmp_path, retention):
    """Crashed after step 5, one weight of the Trainer's checkpoint-4 edited, resumed from it: refused before the
    trace continues. When the trace holds its own checkpoint at step 4 (retention "even") the resumed state is not
    it; when it does not (geometric retention thinned it), the state is not the one the guards' fingerprint of step
    3 digested (the first process wrote it into the plan with step 4's first entry, and the resume keeps it)."""
    from safetensors.torch import load_file, save_file

    trainer = _resumable(tmp_path, retention)
    trainer([StopAfter5()]).train()
    weights = tmp_path / "part" / "checkpoint-4" / "model.safetensors"
    state = load_file(weights)
    name = sorted(state)[0]
    state[name].view(-1)[1] += 0.5
    save_file(state, weights, metadata={"format": "pt"})
    resume = str(tmp_path / "part" / "checkpoint-4")
    match = "is not the recorded checkpoint" if retention == "even" else "is not the recorded state after optimizer step 3"
    with pytest.raises(UnlearnError, match=match):
        trainer([]).train(resume_from_checkpoint=resume)


def test_exact_checksums_see_one_element_and_a_swap_on_both_paths():
    """The CPU path (xxh3 of the bytes) and the accelerator path (weighted row and column sums of the bits, run here
    on the CPU) change with any one element and with a swap of two elements, for every dtype the state holds."""
    from hf_unlearn.trace.guards import device_checksum, tensor_checksums

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        x = (torch.randn(3 * 4096 + 7) > 0).to(dtype) if dtype is torch.bool else torch.randn(3 * 4096 + 7).to(dtype)
        edits = []
        one = x.clone()
        one.view(-1)[4097] = ~one[4097] if dtype is torch.bool else one[4097] + 1
        edits.append(one)
        i, j = 5, 4096 * 2 + 9  # different rows and columns of the (n / 4096, 4096) view
        while torch.equal(x[i], x[j]):
            j += 1
        swap = x.clone()
        swap[[i, j]] = x[[j, i]]
        edits.append(swap)
        tail = x.clone()
        tail[-1] = ~tail[-1] if dtype is torch.bool else tail[-1] + 1
        edits.append(tail)
        base, dev = tensor_checksums([("x", x)])["x"], int(device_checksum(x))
        for edited in edits:
            assert tensor_checksums([("x", edited)])["x"] != base, dtype
            assert int(device_checksum(edited)) != dev, dtype
    assert int(device_checksum(torch.tensor(3.0))) != int(device_checksum(torch.tensor(3.5)))


def test_a_model_class_patched_in_the_recording_process_only_is_refused(tmp_path):
    """``LlamaMLP.forward`` replaced by a wrapper (a kernel library or a user's monkeypatch) in the recording process
    (its self-check, in the same process, reproduces); the deletion runs where the patch is gone: the sealed code
    digests name the class before any compute (before they were sealed, the replay's controls, which function each
    module class runs, differed from the recording's at step 0, and the replay stopped)."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaMLP.forward

    def patched(self, x):
        return original(self, x) * 1.01

    modeling_llama.LlamaMLP.forward = patched
    try:
        _, _, run = _record(tmp_path, [], gradient_accumulation_steps=2)
    finally:
        modeling_llama.LlamaMLP.forward = original
    _assert_refused(tmp_path, run, "this process runs other code than the recorded run did: class "
                                   "transformers.models.llama.modeling_llama.LlamaMLP")


def test_a_torch_builtin_rebound_in_the_deleting_process_only_is_refused(tmp_path, monkeypatch):
    """Attack: a ``sitecustomize`` of the deleting process only rebinds ``torch._C._nn.pad`` (the builtin
    ``torch.nn.functional.pad`` calls, with which transformers' loss shifts the labels) to drop a row's labels only
    when another row of the microbatch has none, which a deletion's dummy makes: the probe's steps (no deletion) were
    equal, the sealed code held no ``torch._C`` namespace, and a step-3 deletion was VERIFIED with all 21 tensors off
    the counterfactual. torch's C namespaces are sealed with the code now: refused before any compute, naming it."""
    import torch

    _, _, run = _record(tmp_path, [], gradient_accumulation_steps=2)
    original = torch._C._nn.pad

    def pad(input, *args, **kwargs):
        return original(input, *args, **kwargs)

    monkeypatch.setattr(torch._C._nn, "pad", pad)
    _assert_refused(tmp_path, run, "this process runs other code than the recorded run did: module torch._C._nn")
