"""TraceRecordingTrainer: a drop-in ``Trainer`` that records everything an exact deletion needs.

It changes no arithmetic. At construction it checks that a replay can reproduce the run and refuses what it
could not (see :meth:`TraceRecordingTrainer.trace_preflight`). During training it hooks:

* ``get_train_dataloader``: the user's collator is wrapped so it never sees the id column (any collator works,
  with int or string ids); the ids travel beside the batch;
* ``get_batch_samples`` (called once per optimizer step with the whole accumulation segment): writes the
  segment's plan entries and WAL records *before* the segment runs, with the loss normaliser
  ``num_items_in_batch`` the Trainer just computed, the learning rate the scheduler set, every process's slots
  (data parallel) and a digest of every collated batch; saves a checkpoint every ``trace_checkpoint_steps``;
* ``training_step``: each microbatch runs under ``torch.random.fork_rng`` seeded with its recorded seed, so
  dropout and NEFTune noise are reproducible microbatch by microbatch and the global RNG stream (data order) is
  untouched: a run with dropout 0 is bit-identical to a plain ``Trainer`` run.

The package holds one job per module: :mod:`.mixin` (the hooks), :mod:`.preflight`, :mod:`.launch` and
:mod:`.probe` (what is refused up front), :mod:`.slots` (ids and dummy rows), :mod:`.segments` (plan entries),
:mod:`.keeper` (checkpoints and retention), :mod:`.selfcheck`, :mod:`.header`, :mod:`.program` (the guards'
wiring), :mod:`.optimizers`, :mod:`.opening` and :mod:`.sealing`; the run's files are written by
:class:`hf_unlearn.trace.writer.TraceWriter`.
"""

from ...data.collators import collator_spec, rebuild_collator
from ..hashing import batch_digest
from ..model_info import dropout_settings, dynamic_rope, first_non_finite, frozen_parameters, peft_and_base
from ..rng import seeded
from ..run import save_checkpoint
from ..seeds import microbatch_seed, rank_seed
from ..trainers import recorded_trainer_class
from ..writer import TraceWriter
from .header import HUB_ID_OR_PATH, PATH_ARGS
from .launch import PROCESS_LOCAL_ARGS
from .mixin import TraceRecordingMixin, TraceRecordingTrainer, trace_recording
from .optimizers import SameOptimizerSettings, build_optimizer, optimizer_spec
from .optimizers import jsonable as _jsonable  # noqa: F401 - replay.py imports it from here
from .program import GUARD_CHECKS
from .segments import keyed_batch_digest
from .slots import IGNORE_INDEX, dummy_has_weight, dummy_row

__all__ = [
    "GUARD_CHECKS", "HUB_ID_OR_PATH", "IGNORE_INDEX", "PATH_ARGS", "PROCESS_LOCAL_ARGS", "SameOptimizerSettings",
    "TraceRecordingMixin", "TraceRecordingTrainer", "TraceWriter", "batch_digest", "build_optimizer", "collator_spec",
    "dropout_settings", "dummy_has_weight", "dummy_row", "dynamic_rope", "first_non_finite", "frozen_parameters",
    "keyed_batch_digest", "microbatch_seed", "optimizer_spec", "peft_and_base", "rank_seed", "rebuild_collator",
    "recorded_trainer_class", "save_checkpoint", "seeded", "trace_recording",
]
