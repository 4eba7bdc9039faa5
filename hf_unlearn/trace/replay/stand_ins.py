"""What a recorded callback receives in a replay as ``lr_scheduler`` and ``train_dataloader``: a replay has neither
(it writes the plan's learning rates into the optimizer and reads its microbatches from the store), and ``None``
made a callback that read them (to log a rate, or the epoch's length) fail in the recording's own proof."""

from __future__ import annotations

from ...errors import UnlearnError
from ..guards import plan_lrs


class ReplayedScheduler:
    """The learning-rate scheduler as the recorded run's callbacks saw it: ``get_last_lr()`` is the plan's rates of
    the step the Trainer's scheduler stood at (the step about to run at ``on_step_begin``, the next one at
    ``on_step_end``, after ``scheduler.step()``; after the last step, the rates recorded when training ended);
    ``step()`` is a no-op, because a replay writes the recorded rates
    into the optimizer at every step whatever a callback did to the scheduler."""

    def __init__(self, trainer):
        self._trainer = trainer
        self._first = {}
        for e in trainer.run.plan:
            self._first.setdefault(e.step, e)

    def get_last_lr(self) -> list[float]:
        trainer = self._trainer
        entry = self._first.get(trainer.state.global_step)
        groups = trainer.optimizer.param_groups
        if entry is not None:
            return plan_lrs(entry, len(groups))
        final = trainer.run.header.get("trainer", {}).get("final_lrs")  # after the last step's scheduler.step()
        return list(final) if final and len(final) == len(groups) else [g["lr"] for g in groups]

    @property
    def last_epoch(self) -> int:
        return self._trainer.state.global_step

    def step(self, *args, **kwargs) -> None:
        """The recorded rates are written at every step: nothing to advance."""

    def __getattr__(self, name):
        if name.startswith("__"):  # copy, pickle and friends probing
            raise AttributeError(name)
        raise UnlearnError(f"a recorded callback read lr_scheduler.{name}, which a replay cannot give (it has the "
                           "recorded learning rates, get_last_lr() and last_epoch, not the scheduler); read "
                           "state.global_step or the optimizer's param groups instead")


class ReplayedDataloader:
    """The training dataloader as the recorded run's callbacks saw it: its length (batches per epoch, recorded when
    training started) and batch size; iterating it, or reading its dataset (a deletion changes the store, not the
    counterfactual's dataset), is refused by name."""

    def __init__(self, length: int | None, batch_size: int):
        self._length, self.batch_size = length, batch_size

    def __len__(self) -> int:
        if self._length is None:
            raise UnlearnError("a recorded callback took len(train_dataloader), which this run did not record "
                               "(recorded with an earlier version, or an iterable dataset): record it again")
        return self._length

    def __iter__(self):
        raise UnlearnError("a recorded callback iterates train_dataloader: a replay reads its microbatches from the "
                           "plan and the store, and cannot serve the recorded loader's batches to a callback")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise UnlearnError(f"a recorded callback read train_dataloader.{name}, which a replay cannot give (only "
                           "len() and batch_size)")
