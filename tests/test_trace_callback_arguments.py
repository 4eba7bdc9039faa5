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


class DecayByWhatTheArgumentsHold(TrainerCallback):
    """Extra decay from everything else a replay's stand-ins give back: the ``optimizer`` argument's rate (at
    ``on_step_end`` the one the scheduler's ``step()`` just wrote), the scheduler's ``get_lr()``, ``base_lrs``
    and ``optimizer`` (its param groups' rate), the loader's ``total_batch_size`` and the lengths of its dataset,
    sampler and batch sampler; each with its own weight, after each optimizer step and at each step's end."""

    def _decay(self, model, lr_scheduler, train_dataloader, scale, optimizer):
        values = [optimizer.param_groups[0]["lr"],  # read first: at on_step_end, the rate the scheduler just wrote
                  lr_scheduler.get_lr()[0], lr_scheduler.base_lrs[0], lr_scheduler.optimizer.param_groups[0]["lr"],
                  1e-4 * train_dataloader.total_batch_size, 1e-5 * len(train_dataloader.dataset),
                  1e-6 * len(train_dataloader.sampler), 1e-7 * len(train_dataloader.batch_sampler)]
        factor = scale * sum(v * 3.0 ** -i for i, v in enumerate(values))
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad and p.dim() > 1:
                    p.mul_(1 - factor)

    def on_optimizer_step(self, args, state, control, model=None, lr_scheduler=None, train_dataloader=None,
                          optimizer=None, **kw):
        self._decay(model, lr_scheduler, train_dataloader, 0.01, optimizer)

    def on_step_end(self, args, state, control, model=None, lr_scheduler=None, train_dataloader=None, optimizer=None,
                    **kw):
        self._decay(model, lr_scheduler, train_dataloader, 0.001, optimizer)


class IteratesTheLoader(TrainerCallback):
    """Reads the loader's first batch at every step: a replay cannot serve it."""

    def on_step_begin(self, args, state, control, train_dataloader=None, **kwargs):
        next(iter(train_dataloader))


@pytest.mark.parametrize("callback", [DecayByTheSchedulersRate, DecayByWhatTheArgumentsHold,
                                      pytest.param(DecayInTheEpochsFirstHalf, marks=pytest.mark.slow)])
def test_a_callback_reading_the_scheduler_or_the_dataloader_replays_as_the_counterfactual(tmp_path, callback):
    """Attack (an ordinary program): a recorded callback reading ``lr_scheduler.get_last_lr()`` or
    ``len(train_dataloader)``. Replays handed it ``None``: the recording's own proof raised when ``train()`` ended
    and every deletion was refused for good. Now a replay hands it the recorded rates (the step the Trainer's
    scheduler stood at, before and after its ``step()``) and the recorded loader length: proven, and a step-3
    deletion is VERIFIED and equal to the plain ``Trainer`` with the same callback (GQA Llama). The same for the
    scheduler's ``get_lr()``, ``base_lrs`` and ``optimizer`` and the loader's ``total_batch_size`` and dataset,
    sampler and batch-sampler lengths (refused by replays before: the recording's proof failed and every deletion
    was refused as unproven)."""
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
    run = open_run(tmp_path / "rec" / "trace")
    assert not run.header["fidelity"].get("proof", {}).get("proven")
    from hf_unlearn.trace.proven import unproven_statement

    # a deletion's refusal names the cause too (it said "prove the run once", which fails the same way)
    assert "a recorded callback iterates train_dataloader" in unproven_statement(run.header, run.path, 0, 2)


def test_what_the_stand_ins_cannot_give_is_named_with_what_to_read_instead():
    """What a replay cannot answer exactly is refused in one line naming the attribute and what to read instead:
    the scheduler's ``state_dict()`` (its other state is not recorded), ``get_lr()`` of a scheduler that is not a
    ``LambdaLR`` (it depends on the scheduler's own state), the dataset's rows; a run recorded before these were
    noted names them and says to record it again (its rates and loader length still answer)."""
    from types import SimpleNamespace

    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace.replay.stand_ins import ReplayedDataloader, ReplayedScheduler

    def trainer(arguments):
        header = {"trainer": {"final_lrs": [0.5], **({"callback_arguments": arguments} if arguments else {})}}
        return SimpleNamespace(run=SimpleNamespace(plan=[], header=header), state=SimpleNamespace(global_step=3),
                               optimizer=torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))

    recorded = {"scheduler": {"class": "StepLR", "base_lrs": [0.1], "get_lr_is_last_lr": False},
                "dataloader": {"dataset_len": 24, "sampler_len": 24, "batch_sampler_len": 6, "total_batch_size": 4}}
    scheduler, old = ReplayedScheduler(trainer(recorded)), ReplayedScheduler(trainer(None))
    loader, old_loader = ReplayedDataloader(6, 4, recorded["dataloader"]), ReplayedDataloader(6, 4, {})
    assert scheduler.base_lrs == [0.1] and old.get_last_lr() == [0.5] and len(old_loader) == 6
    assert (len(loader.dataset), len(loader.sampler), len(loader.batch_sampler), loader.total_batch_size) == (24, 24,
                                                                                                            6, 4)
    for call, match in [
        (scheduler.state_dict, r"lr_scheduler\.state_dict\(\), which a replay cannot reproduce .*read "
                               r"lr_scheduler\.last_epoch, get_last_lr\(\) or base_lrs instead"),
        (scheduler.get_lr, r"get_lr\(\) of a StepLR, .*call get_last_lr\(\)"),
        (lambda: scheduler.lr_lambdas, r"read lr_scheduler\.lr_lambdas, .*get_last_lr\(\), get_lr\(\), base_lrs"),
        (lambda: loader.dataset[0], r"indexes train_dataloader\.dataset, .*only len\(train_dataloader\.dataset\)"),
        (lambda: loader.dataset.column_names, r"read \.column_names of train_dataloader\.dataset"),
        (lambda: old.base_lrs, r"lr_scheduler\.base_lrs, which this run did not record .*record the run again"),
        (old.get_lr, r"get_lr\(\), which this run did not record .*call get_last_lr\(\)"),
        (lambda: old_loader.total_batch_size, r"train_dataloader\.total_batch_size, which this run did not record"),
        (lambda: old_loader.sampler, r"train_dataloader\.sampler \(its length\), which this run did not record"),
    ]:
        with pytest.raises(UnlearnError, match=match) as e:
            call()
        assert "\n" not in str(e.value)
