"""Issue #41, wave 6: a recorded callback (code a replay runs again) acting on a value its module fixed when it was
imported, read from the environment, by routes the sealed program globals did not follow: a default argument, a
class attribute, a module-level helper function's own global, a lambda inside the method, a ``functools.partial``,
another module's attribute (``import cfg; cfg.CLIP``), and a runtime read through ``os.environb``. A deleting process
(a fresh CLI subprocess) with the variable set imports the module again and the callback clips from step 5 on; the
replay and the oracle both clip, so the verdict was VERIFIED off an engine-free counterfactual."""

from __future__ import annotations

import functools
import os

import pytest
from transformers import TrainerCallback

from hf_unlearn.errors import UnlearnError

from . import imported_config_attack as cfg
from .test_trace_neutral_attacks import _differs_from_counterfactual, _forget_outcome, _record

LATE = 5


def _clip(args, to=0.05):
    args.max_grad_norm = to


class ByDefault(TrainerCallback):
    """A default argument evaluated at import."""

    def on_step_begin(self, args, state, control, _on=os.environ.get("HFU_TEST_IMP_DEFAULT"),  # noqa: B008
                      **kwargs):
        if state.global_step >= LATE and _on:
            _clip(args)


class ByClassAttribute(TrainerCallback):
    """A class attribute set at import (the rebuilt callback gets its instance attributes back, not its class's)."""

    ON = os.getenv("HFU_TEST_IMP_CLASS")

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step >= LATE and self.ON:
            _clip(args)


_HELPER_ON = os.environ.get("HFU_TEST_IMP_HELPER")


def _maybe_clip(args, state):
    if state.global_step >= LATE and _HELPER_ON:
        _clip(args)


class ByHelper(TrainerCallback):
    """A module function the method calls reads the constant (the method itself reads only the function)."""

    def on_step_begin(self, args, state, control, **kwargs):
        _maybe_clip(args, state)


_NESTED_ON = os.environ.get("HFU_TEST_IMP_NESTED")


class ByLambda(TrainerCallback):
    """A lambda inside the method reads the constant (its own code object's names)."""

    def on_step_begin(self, args, state, control, **kwargs):
        wanted = lambda: state.global_step >= LATE and _NESTED_ON  # noqa: E731
        if wanted():
            _clip(args)


_PARTIAL = functools.partial(_clip, to=0.05 if os.environ.get("HFU_TEST_IMP_PARTIAL") else 1.0)


class ByPartial(TrainerCallback):
    """A ``functools.partial`` whose argument was fixed at import."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step >= LATE:
            _PARTIAL(args)


class ByModuleAttribute(TrainerCallback):
    """Another module's constant, read as ``cfg.CLIP``."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step >= LATE and cfg.CLIP:
            _clip(args)


class ByEnvironb(TrainerCallback):
    """A read while training through ``os.environb`` (the bytes environment), not ``os.environ``."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step >= LATE and os.environb.get(b"HFU_TEST_IMP_ENVIRONB"):
            _clip(args)


ATTACKS = {ByDefault: "HFU_TEST_IMP_DEFAULT", ByClassAttribute: "HFU_TEST_IMP_CLASS", ByHelper: "HFU_TEST_IMP_HELPER",
           ByLambda: "HFU_TEST_IMP_NESTED", ByPartial: "HFU_TEST_IMP_PARTIAL", ByModuleAttribute: "HFU_TEST_IMP_MODULE",
           ByEnvironb: "HFU_TEST_IMP_ENVIRONB"}


@pytest.mark.slow
@pytest.mark.parametrize("attack", list(ATTACKS), ids=lambda c: c.__name__)
def test_a_value_fixed_at_import_by_another_route_in_a_deleting_process(tmp_path, attack):
    """Recorded with the variable unset; `hf-unlearn forget` in a process where it is set is refused before any
    compute (it was VERIFIED with the trained tensors off the counterfactual); unset, it deletes exactly."""
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run

    from .conftest import run_cli

    assert not any(os.environ.get(v) for v in ATTACKS.values())
    tok, data, run = _record(tmp_path, "llama", [attack()])
    ids = open_run(run).ids_at_steps([LATE])[:1]
    write_ids(tmp_path / "ids.jsonl", ids)
    proc = run_cli("forget", run, "--ids", tmp_path / "ids.jsonl", "--out", tmp_path / "del", "--oracle",
                   "--no-progress", env={ATTACKS[attack]: "1"})
    if proc.returncode == 0 and "VERIFIED" in proc.stdout:  # the break: say how far off it is
        off = _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "del", [attack()])
        pytest.fail(f"VERIFIED with {len(off)} tensors off the counterfactual")
    assert proc.returncode != 0 and "refusing before any compute" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "del").exists()
    proc = run_cli("forget", run, "--ids", tmp_path / "ids.jsonl", "--out", tmp_path / "same", "--oracle",
                   "--no-progress")
    assert proc.returncode == 0 and "VERIFIED" in proc.stdout, proc.stderr[-2000:]
    assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "same", [attack()])


_MUTATIONS = {  # what the deleting process's import changes, done in this process instead: (object, attribute, value)
    ByDefault: lambda m: m.setattr(ByDefault.on_step_begin, "__defaults__", ("1",)),
    ByClassAttribute: lambda m: m.setattr(ByClassAttribute, "ON", "1"),
    ByHelper: lambda m: m.setattr(__import__(__name__, fromlist=["_"]), "_HELPER_ON", "1"),
    ByLambda: lambda m: m.setattr(__import__(__name__, fromlist=["_"]), "_NESTED_ON", "1"),
    ByPartial: lambda m: m.setattr(__import__(__name__, fromlist=["_"]), "_PARTIAL", functools.partial(_clip, to=0.05)),
    ByModuleAttribute: lambda m: m.setattr(cfg, "CLIP", "1"),
}


@pytest.mark.parametrize("attack", list(_MUTATIONS), ids=lambda c: c.__name__)
def test_the_sealed_globals_follow_every_route_to_a_value_fixed_at_import(attack, monkeypatch):
    """The unit behind the slow test: the value the callback acts on, as another import would set it, changes the
    entries a replay compares with the sealed ones (each route was missed before: no entry changed)."""
    from hf_unlearn.trace.digests import replayed_globals

    before = replayed_globals({"callback 0": attack})
    _MUTATIONS[attack](monkeypatch)
    after = replayed_globals({"callback 0": attack})
    assert [k for k in after if after[k] != before.get(k)], before


def test_a_read_through_environb_is_noted_as_the_variable():
    from hf_unlearn.trace.environment_reads import watching

    with watching() as log:
        os.environb.get(b"HFU_TEST_IMP_ENVIRONB")
        os.getenvb(b"HFU_TEST_IMP_ENVIRONB_B")
    assert log == {"HFU_TEST_IMP_ENVIRONB": {"value": None, "by": __name__},
                   "HFU_TEST_IMP_ENVIRONB_B": {"value": None, "by": __name__}}, log


class Counts(TrainerCallback):
    """Ordinary running state: an attribute set per instance, a class counter, a module counter, a history."""

    ON = None
    calls = 0

    def __init__(self, on=None):
        self.ON = on

    def on_step_begin(self, args, state, control, **kwargs):
        global _SEEN
        type(self).calls += 1
        _SEEN += 1
        _clip(args, to=1.0 if not self.ON else 0.05)


_SEEN = 0


def test_running_state_is_not_compared(monkeypatch):
    """What the code assigns (an instance attribute shadowing a class one, a class or module counter) changes as a
    run goes: not an entry, so a proof comparing at the run's end does not refuse an ordinary callback."""
    from hf_unlearn.trace.digests import replayed_globals

    names = {k.split(" global ", 1)[1] for k in replayed_globals({"callback 0": Counts})}
    assert names == {f"{__name__}._clip", f"{__name__}._clip default to"}, names


class SetsADefault(TrainerCallback):
    """A recorded callback that sets a variable when unset (``os.environ.setdefault``): it reads the variable, unset
    while recording, and then sets it in the training process itself."""

    def on_step_begin(self, args, state, control, **kwargs):
        os.environ.setdefault("HFU_TEST_IMP_SETDEFAULT", "offline")


@pytest.mark.slow  # the default suite's time budget (`make test-slow` runs it)
def test_a_variable_the_program_set_itself_is_its_own_state(tmp_path, monkeypatch):
    """OVER-REFUSAL: the recording read the variable unset, then the program set it; the proof that ends the
    recording replays that code in the same process, which now holds the value, so it stopped ("its value differs")
    and the run was never proven; a deletion in that process (a notebook's next cell) was refused naming the
    variable. A value the recording's own code set is sealed as the program's (a keyed digest): VERIFIED there and
    equal to the counterfactual; another value is still refused."""
    from hf_unlearn.trace import open_run

    monkeypatch.delenv("HFU_TEST_IMP_SETDEFAULT", raising=False)
    tok, data, run = _record(tmp_path, "llama", [SetsADefault()])
    assert os.environ["HFU_TEST_IMP_SETDEFAULT"] == "offline"
    ids = open_run(run).ids_at_steps([LATE])[:1]
    kind, receipt = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "verified", receipt
    assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "del", [SetsADefault()])
    monkeypatch.setenv("HFU_TEST_IMP_SETDEFAULT", "online")
    kind, what = _forget_outcome(run, ids, tmp_path / "other")
    assert kind == "refused" and "HFU_TEST_IMP_SETDEFAULT" in what, what


def test_a_numpy_view_is_found_wherever_a_watched_callback_holds_it():
    """An attribute, an item of one, a module global its code names, a closure cell; not an array of its own (a view
    of it included)."""
    import numpy as np
    import torch

    from hf_unlearn.trace.value_reads import held_view

    weight = torch.ones(3)
    _VIEWS["w"] = weight.numpy()

    class OwnArray(TrainerCallback):
        def __init__(self):
            self.buf, self.part = np.zeros(3), np.zeros(4)[1:]  # a view, of its own array
            self.raw = memoryview(bytearray(4))

    class InGlobal(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            _VIEWS["w"] *= 1

    def in_closure(v):
        class InClosure(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                v[0] = v[0]
        return InClosure()

    attribute = OwnArray()
    attribute.views = [weight.numpy()[1:]]
    assert held_view(OwnArray()) is None
    assert held_view(attribute).endswith("OwnArray.views")
    assert held_view(InGlobal()) == f"{__name__}._VIEWS"
    assert "closure v" in held_view(in_closure(weight.numpy()))


_VIEWS: dict = {}


class ClipFromStep1(TrainerCallback):
    """A recorded callback clipping from step 1 on while ``HFU_TEST_IMP_RESUME`` is set."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step >= 1 and os.environ.get("HFU_TEST_IMP_RESUME"):
            _clip(args)


@pytest.mark.slow  # the default suite's time budget (`make test-slow` runs it)
def test_a_recording_resumed_with_another_environment(tmp_path, monkeypatch):
    """ATTACK: stopped after step 4 (a callback's early stop: the first process sealed the run) with the variable
    unset, resumed (``resume_from_checkpoint``) with it set: a step-1 deletion in a process with it set would replay
    steps 1..3 clipped, which the recording did not clip. The resume is refused, naming the variable. Resumed as it was
    recorded, a step-1 deletion is VERIFIED and equal to the counterfactual (before, the resumed recording lost the
    sealed fingerprint of step 3, the first process's final entry, and every oracle deletion was refused)."""
    from hf_unlearn.trace import open_run

    from .test_trace_common import get_trace_data
    from .test_trace_neutral_attacks import stopped_at_4_then_resumed

    tok, data = get_trace_data()
    data = data.select(range(24))
    trainer = stopped_at_4_then_resumed(tmp_path, tok, data, [ClipFromStep1()])
    monkeypatch.delenv("HFU_TEST_IMP_RESUME", raising=False)
    trainer(trainer.stop_at_4).train()
    monkeypatch.setenv("HFU_TEST_IMP_RESUME", "1")
    with pytest.raises(UnlearnError, match=r"cannot be resumed in this process: what the run's code read before it was "
                                           r"stopped differs here: HFU_TEST_IMP_RESUME \(read by "):
        trainer().train(resume_from_checkpoint=str(tmp_path / "rec" / "checkpoint-4"))
    monkeypatch.delenv("HFU_TEST_IMP_RESUME")  # resumed as it was recorded: its deletions are exact
    trainer().train(resume_from_checkpoint=str(tmp_path / "rec" / "checkpoint-4"))
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([1])[:1]
    kind, what = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "verified", what
    assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "del", [ClipFromStep1()])
