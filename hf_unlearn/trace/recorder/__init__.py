"""The recording engine: the ``Trainer`` hooks that record everything an exact deletion needs, one job per module.

:mod:`.mixin` (the hooks: :class:`RecordingHooks`), :mod:`.preflight`, :mod:`.launch` and :mod:`.probe` (what is
refused up front), :mod:`.slots` (ids and dummy rows), :mod:`.segments` (plan entries), :mod:`.keeper`
(checkpoints and retention), :mod:`.selfcheck` (the self-check's reference), :mod:`.header`, :mod:`.program` (the
guards' wiring), :mod:`.optimizers`, :mod:`.opening` and :mod:`.sealing`; the run's files are written by
:class:`hf_unlearn.trace.writer.TraceWriter`. The replay engine builds on these hooks; the public classes
(:mod:`hf_unlearn.trace.recording`) sit above it, because a recording proves itself with the replay engine when
``train()`` ends.
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
from .mixin import RecordingHooks, RecordingHooksTrainer, with_recording
from .optimizers import SameOptimizerSettings, build_optimizer, optimizer_spec
from .optimizers import jsonable as _jsonable  # noqa: F401 - the replay imports it from here
from .program import GUARD_CHECKS
from .segments import keyed_batch_digest
from .slots import IGNORE_INDEX, dummy_has_weight, dummy_row

__all__ = [
    "GUARD_CHECKS", "HUB_ID_OR_PATH", "IGNORE_INDEX", "PATH_ARGS", "PROCESS_LOCAL_ARGS", "SameOptimizerSettings",
    "RecordingHooks", "RecordingHooksTrainer", "TraceWriter", "batch_digest", "build_optimizer", "collator_spec",
    "dropout_settings", "dummy_has_weight", "dummy_row", "dynamic_rope", "first_non_finite", "frozen_parameters",
    "keyed_batch_digest", "microbatch_seed", "optimizer_spec", "peft_and_base", "rank_seed", "rebuild_collator",
    "recorded_trainer_class", "save_checkpoint", "seeded", "with_recording",
]
