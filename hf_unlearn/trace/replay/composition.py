"""A replay runs the recorded trainer's own ``compute_loss`` and ``training_step``: the replay class composed with
the run's recorded trainer class (``SFTTrainer``, ``DPOTrainer``, a user's subclass)."""

from __future__ import annotations

import functools

from ..recorder import with_recording
from ..trainers import is_default, recorded_trainer


def replay_class(cls, header: dict):
    """``cls`` (a replay class) composed with the run's recorded trainer class, so ``compute_loss``,
    ``training_step`` and whatever else the recorded trainer overrides run in the replay; ``cls`` itself for a
    plain ``Trainer`` run."""
    if is_default(header):
        return cls
    return _composed(cls, with_recording(recorded_trainer(header)[0]))


@functools.cache
def _composed(replay_cls, traced):
    if issubclass(replay_cls, traced):
        return replay_cls
    return type(replay_cls.__name__, (replay_cls, traced), {"__module__": replay_cls.__module__,
                                                            "__qualname__": replay_cls.__qualname__,
                                                            "_trace_machinery": True})
