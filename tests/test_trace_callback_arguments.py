"""A recorded callback reads what the Trainer hands every event (``lr_scheduler``, ``train_dataloader``): a replay
has neither, and handing ``None`` made ordinary callbacks fail in the recording's own proof."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from .test_trace_common import config_model, delete, get_trace_data, record

KW = dict(gradient_accumulation_steps=1, max_steps=6)


class DecayByTheSchedulersRate(TrainerCallback):
    """Extra decoupled weight decay scaled by the scheduler's current rate (``lr_scheduler.get_last_lr()``), after
    each optimizer step and, scaled down, at each step's end (the scheduler has stepped by then)."""

    def __init__(self, wd: float = 0.1):
        self.wd = wd

    def _decay(self, model, factor):
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad and p.dim() > 1:
                    p.mul_(1 - factor * self.wd)

    def on_optimizer_step(self, args, state, control, model=None, lr_scheduler=None, **kwargs):
        self._decay(model, lr_scheduler.get_last_lr()[0])

    def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **kwargs):
        self._decay(model, 0.1 * lr_scheduler.get_last_lr()[0])


class DecayInTheEpochsFirstHalf(TrainerCallback):
    """Extra decay during the first half of the epoch, its length from ``len(train_dataloader)``."""

    def __init__(self, wd: float = 0.1):
        self.wd = wd

    def on_optimizer_step(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        if state.global_step < len(train_dataloader) // 2:
            with torch.no_grad():
                for p in model.parameters():
                    if p.requires_grad and p.dim() > 1:
                        p.mul_(1 - 1e-3 * self.wd)


class IteratesTheLoader(TrainerCallback):
    """Reads the loader's first batch at every step: a replay cannot serve it."""

    def on_step_begin(self, args, state, control, train_dataloader=None, **kwargs):
        next(iter(train_dataloader))


@pytest.mark.parametrize("callback", [DecayByTheSchedulersRate,
                                      pytest.param(DecayInTheEpochsFirstHalf, marks=pytest.mark.slow)])
def test_a_callback_reading_the_scheduler_or_the_dataloader_replays_as_the_counterfactual(tmp_path, callback):
    """Attack (an ordinary program): a recorded callback reading ``lr_scheduler.get_last_lr()`` or
    ``len(train_dataloader)``. Replays handed it ``None``: the recording's own proof raised when ``train()`` ended
    and every deletion was refused for good. Now a replay hands it the recorded rates (the step the Trainer's
    scheduler stood at, before and after its ``step()``) and the recorded loader length: proven, and a step-3
    deletion is VERIFIED and equal to the plain ``Trainer`` with the same callback (GQA Llama)."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.verification import load_state

    from .test_trace_fidelity import independent_counterfactual

    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=config_model("llama", tok), trainer_kwargs={"callbacks": [callback()]},
           **KW)
    run = open_run(tmp_path / "rec" / "trace")
    assert run.header["fidelity"]["proof"]["proven"] and run.header["trainer"]["dataloader_len"] == 6
    forget = run.ids_at_steps([3])[:1]
    assert delete(run.path, forget, tmp_path / "del")[1]["verified"]
    plain = independent_counterfactual(tok, data, config_model("llama", tok), run.path, forget, tmp_path / "plain",
                                       callbacks=[callback()], **KW)
    oracle = load_state(tmp_path / "del" / "oracle")["model"]
    assert not [n for n, t in oracle.items() if not torch.equal(t, plain[n])]


@pytest.mark.slow  # a recording whose proof fails (~6 s)
def test_a_callback_iterating_the_dataloader_is_named_not_a_traceback(tmp_path):
    """A recorded callback that iterates ``train_dataloader``: no replay can serve the recorded loader's batches.
    The end-of-recording proof names it in one line (it raised ``TypeError`` on ``None`` before) and the run is left
    unproven."""
    from hf_unlearn.trace import open_run

    tok, data = get_trace_data()
    with pytest.warns(UserWarning, match="not proven .*a recorded callback iterates train_dataloader"):
        record(tok, data.select(range(8)), tmp_path / "rec", trainer_kwargs={"callbacks": [IteratesTheLoader()]},
               gradient_accumulation_steps=1, max_steps=2)
    assert not open_run(tmp_path / "rec" / "trace").header["fidelity"].get("proof", {}).get("proven")
