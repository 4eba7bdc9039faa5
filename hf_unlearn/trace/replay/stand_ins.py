"""What a recorded callback receives in a replay as ``lr_scheduler`` and ``train_dataloader``: a replay has neither
(it writes the plan's learning rates into the optimizer and reads its microbatches from the store), and ``None``
made a callback that read them (to log a rate, or the epoch's length) fail in the recording's own proof. What the
recording noted as training started (:func:`hf_unlearn.trace.recorder.header.callback_arguments`) is given back
exactly; anything else is refused by name, with what to read instead."""

from __future__ import annotations

from ...errors import UnlearnError
from ..guards import plan_lrs

_AGAIN = "record the run again with this version"


class ReplayedScheduler:
    """The learning-rate scheduler as the recorded run's callbacks saw it: ``get_last_lr()`` is the plan's rates of
    the step the Trainer's scheduler stood at (the step about to run at ``on_step_begin``, the next one at
    ``on_step_end``, after ``scheduler.step()``; after the last step, the rates recorded when training ended);
    ``get_lr()`` is the same for a ``LambdaLR`` (every ``lr_scheduler_type`` but the plateau one: a closed form of
    ``last_epoch``, which ``get_last_lr()`` holds); ``base_lrs`` as recorded when training started; ``optimizer`` the
    replay's own optimizer (the real one, holding the rates the replay writes); ``step()`` is a no-op, because a
    replay writes the recorded rates into the optimizer at every step whatever a callback did to the scheduler."""

    def __init__(self, trainer):
        self._trainer = trainer
        self._first = {}
        for e in trainer.run.plan:
            self._first.setdefault(e.step, e)
        self._recorded = (trainer.run.header.get("trainer", {}).get("callback_arguments") or {}).get("scheduler")

    def get_last_lr(self) -> list[float]:
        trainer = self._trainer
        entry = self._first.get(trainer.state.global_step)
        groups = trainer.optimizer.param_groups
        if entry is not None:
            return plan_lrs(entry, len(groups))
        final = trainer.run.header.get("trainer", {}).get("final_lrs")  # after the last step's scheduler.step()
        return list(final) if final and len(final) == len(groups) else [g["lr"] for g in groups]

    def get_lr(self) -> list[float]:
        recorded = self._recorded
        if recorded is None:
            raise UnlearnError("a recorded callback called lr_scheduler.get_lr(), which this run did not record "
                               f"enough to answer (recorded with an earlier version): call get_last_lr(), or {_AGAIN}")
        if not recorded.get("get_lr_is_last_lr"):
            raise UnlearnError(f"a recorded callback called lr_scheduler.get_lr() of a {recorded.get('class')}, "
                               "whose get_lr() outside step() depends on the scheduler's own state, which a replay "
                               "does not have: call get_last_lr() (the rates in use) instead")
        return self.get_last_lr()

    @property
    def base_lrs(self) -> list[float]:
        base = (self._recorded or {}).get("base_lrs")
        if base is None:
            raise UnlearnError("a recorded callback read lr_scheduler.base_lrs, which this run did not record "
                               f"(recorded with an earlier version, or a scheduler without it): {_AGAIN}, or read "
                               "args.learning_rate")
        return list(base)

    @property
    def optimizer(self):
        """The replay's torch optimizer (the Trainer built its scheduler with the unwrapped one). A ``LambdaLR`` wrote
        its rates into the param groups at its ``step()``, after ``on_optimizer_step``: at ``on_step_end`` they held
        the next step's rates, which a replay writes only when that step begins; they are written here, as the
        scheduler did (at any other event they are already these)."""
        self.write_rates()
        opt = self._trainer.optimizer
        return getattr(opt, "optimizer", opt)

    def write_rates(self) -> None:
        """Write the rates a ``LambdaLR`` holds now into the optimizer's param groups, as its ``step()`` did (the
        replay calls it before ``on_step_end``, so a callback reading the ``optimizer`` argument's groups there reads
        the next step's rates, as in the recorded run)."""
        if not (self._recorded or {}).get("get_lr_is_last_lr"):
            return
        opt = self._trainer.optimizer
        opt = getattr(opt, "optimizer", opt)
        rates = self.get_last_lr()
        if len(rates) == len(opt.param_groups):
            for group, rate in zip(opt.param_groups, rates):
                group["lr"] = rate

    @property
    def last_epoch(self) -> int:
        return self._trainer.state.global_step

    def step(self, *args, **kwargs) -> None:
        """The recorded rates are written at every step: nothing to advance."""

    def state_dict(self):
        raise UnlearnError("a recorded callback called lr_scheduler.state_dict(), which a replay cannot reproduce "
                           "(it has the recorded rates, not the scheduler's other state); read "
                           "lr_scheduler.last_epoch, get_last_lr() or base_lrs instead")

    def __getattr__(self, name):
        if name.startswith("__"):  # copy, pickle and friends probing
            raise AttributeError(name)
        raise UnlearnError(f"a recorded callback read lr_scheduler.{name}, which a replay cannot give (it has the "
                           "recorded learning rates: get_last_lr(), get_lr(), base_lrs, last_epoch and optimizer, "
                           "not the scheduler); read those, state.global_step or the optimizer's param groups "
                           "instead")


class _Sized:
    """A loader part of which the recording noted only the length (``dataset``, ``sampler``): ``len()`` is given,
    reading rows or iterating is refused by name (a deletion changes the store, not the counterfactual's schedule)."""

    def __init__(self, what: str, length: int):
        self._what, self._length = what, length

    def __len__(self) -> int:
        return self._length

    def _refuse(self, how: str):
        raise UnlearnError(f"a recorded callback {how} train_dataloader.{self._what}, which a replay cannot give (it "
                           f"reads its rows from the plan and the store; only len(train_dataloader.{self._what}) is "
                           "recorded)")

    def __iter__(self):
        self._refuse("iterates")

    def __getitem__(self, key):
        self._refuse("indexes")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse(f"read .{name} of")


class ReplayedDataloader:
    """The training dataloader as the recorded run's callbacks saw it: its length (batches per epoch, recorded when
    training started), batch size and ``total_batch_size``, and the lengths of its ``dataset``, ``sampler`` and
    ``batch_sampler``; iterating it, or reading its dataset's rows (a deletion changes the store, not the
    counterfactual's dataset), is refused by name."""

    _PARTS = {"dataset": "dataset_len", "sampler": "sampler_len", "batch_sampler": "batch_sampler_len"}

    def __init__(self, length: int | None, batch_size: int, recorded: dict | None = None):
        self._length, self.batch_size, self._recorded = length, batch_size, recorded

    def __len__(self) -> int:
        if self._length is None:
            raise UnlearnError("a recorded callback took len(train_dataloader), which this run did not record "
                               "(recorded with an earlier version, or an iterable dataset): record it again")
        return self._length

    def __iter__(self):
        raise UnlearnError("a recorded callback iterates train_dataloader: a replay reads its microbatches from the "
                           "plan and the store, and cannot serve the recorded loader's batches to a callback")

    def _noted(self, name: str, key: str):
        value = (self._recorded or {}).get(key)
        if value is None:
            raise UnlearnError(f"a recorded callback read train_dataloader.{name}, which this run did not record "
                               f"(recorded with an earlier version, or a loader without it): {_AGAIN}, or use "
                               "len(train_dataloader) and batch_size")
        return value

    @property
    def total_batch_size(self) -> int:
        return self._noted("total_batch_size", "total_batch_size")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._PARTS:
            return _Sized(name, self._noted(f"{name} (its length)", self._PARTS[name]))
        raise UnlearnError(f"a recorded callback read train_dataloader.{name}, which a replay cannot give (only "
                           "len(), batch_size, total_batch_size and the lengths of dataset, sampler and "
                           "batch_sampler)")
