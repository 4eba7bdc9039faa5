"""Code set on the objects a replay builds afresh (the accelerator, accelerate's optimizer wrapper, the torch
optimizer, torch's global optimizer hooks, a torch mode around ``train()``): a replay never runs it. Set before
training it never showed as a change, and code acting only on a deletion's rows (a loss below a floor no recorded
microbatch reached) passed the proof: a VERIFIED deletion with every tensor off the counterfactual. Each is now a
program change at step 0, named when recording and refusing every deletion before compute."""

from __future__ import annotations

import contextlib

import pytest
from torch.overrides import TorchFunctionMode

from .test_trace_common import config_model, get_trace_data, train_args
from .test_trace_neutral_attacks import _forget_outcome

KW = dict(gradient_accumulation_steps=1, max_steps=4)
FLOOR = 0.0  # no loss is below it: the code never acts on the recorded rows (nor on a deletion's, here)


def _patch_backward(trainer):
    original = trainer.accelerator.backward

    def backward(loss, **kwargs):
        return original(loss * 2.0 if float(loss.detach()) < FLOOR else loss, **kwargs)

    trainer.accelerator.backward = backward
    return contextlib.nullcontext()


def _patch_optimizer_step(trainer):
    trainer.create_optimizer()
    original = trainer.optimizer.step

    def step(*args, **kwargs):
        return original(*args, **kwargs)

    trainer.optimizer.step = step
    return contextlib.nullcontext()


def _global_optimizer_hook(trainer):
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    return _removed(register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: None))


@contextlib.contextmanager
def _removed(handle):
    try:
        yield
    finally:
        handle.remove()


class LabelMode(TorchFunctionMode):
    """A mode that would act on a cross-entropy over no labelled token only (never in the recorded run)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _mode_around_train(trainer):
    return LabelMode()


CASES = {"accelerator.backward": (_patch_backward, "accelerator.backward = tests.test_trace_unreplayed_code"),
         "optimizer step": (_patch_optimizer_step, "optimizer.step = tests.test_trace_unreplayed_code"),
         "global optimizer hook": (_global_optimizer_hook, "a global optimizer hook tests.test_trace_unreplayed_code"),
         "torch mode": (_mode_around_train, "a torch mode active around train(), tests.test_trace_unreplayed_code.")}


@pytest.mark.parametrize("case", [c if c == "accelerator.backward" else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES])
def test_code_a_replay_does_not_build_is_named_when_recording_and_refuses_deletions(tmp_path, case):
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer, open_run

    setup, named = CASES[case]
    tok, data = get_trace_data()
    data = data.select(range(16))
    trainer = TraceRecordingTrainer(model=config_model("llama", tok), args=train_args(tmp_path / "rec", **KW),
                                    train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
                                    trace_checkpoint_steps=2, trace_checkpoint_retention="even")
    with pytest.warns(UserWarning, match="changed outside its record at optimizer step 0") as caught:
        with setup(trainer):
            trainer.train()
    assert any(named in str(w.message) for w in caught), [str(w.message)[:300] for w in caught]
    run = tmp_path / "rec" / "trace"
    kind, what = _forget_outcome(run, open_run(run).ids_at_steps([2])[:1], tmp_path / "del")
    assert kind == "refused" and named in what, (kind, what)
    assert not (tmp_path / "del").exists()


def test_a_frameworks_method_on_an_instance_is_digested_by_its_code_and_a_disguised_one_is_the_programs():
    """A step wrapper torch sets on accelerate's optimizer wrapper holds per-process objects in its closure: digested
    whole, each process of an FSDP2 launch read otherwise and every such run was refused as changed on some processes
    only. A framework's method is digested by its code (and the code it wraps) now; a wrapper of the program's own made
    with ``functools.wraps`` (which copies ``__module__``) is still the program's, digested whole and named."""
    import functools

    from accelerate.optimizer import AcceleratedOptimizer

    from hf_unlearn.trace.digests import Digester, _module_of, _patched_text

    def framework_wrapper(state):
        @functools.wraps(AcceleratedOptimizer.step)
        def step(*args, **kwargs):
            return state, AcceleratedOptimizer.step(*args, **kwargs)
        return step

    here = {"__name__": "torch.optim.fake_framework"}  # the wrapper's code, as if torch's
    exec(compile("import functools\n" + "def make(inner, state):\n"
                 "    @functools.wraps(inner)\n    def step(*a, **k):\n        return state, inner(*a, **k)\n"
                 "    return step\n", "/venv/lib/python3.11/site-packages/torch/optim/fake_framework.py", "exec"), here)
    one, two = here["make"](AcceleratedOptimizer.step, {"rank": 0}), here["make"](AcceleratedOptimizer.step, {"rank": 1})
    assert _patched_text(Digester(), one) == _patched_text(Digester(), two)
    disguised = framework_wrapper({"rank": 0})
    assert disguised.__module__ == "accelerate.optimizer" and _module_of(disguised) == __name__
    assert _patched_text(Digester(), disguised) != _patched_text(Digester(), framework_wrapper({"rank": 1}))
