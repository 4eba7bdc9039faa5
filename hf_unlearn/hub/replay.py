"""The replay trainers that publish: the exact-deletion engine's classes with :class:`UnlearningHubMixin` above them.

The engine (:mod:`hf_unlearn.trace.replay`) sits below ``hub/`` and knows nothing of the Hub; publishing is added
here, one layer up, the way every trainer of the library gets it (the mixin before the trainer class). These are the
classes a user gets from ``hf_unlearn.RedactedReplayTrainer`` and ``hf_unlearn.trace.RedactedReplayTrainer``, so::

    replay = RedactedReplayTrainer(run, store, forget_ids, out_dir)
    replay.train()
    replay.push_to_hub("org/model-unlearned", deletion=True, trace_dir=replay.out_dir)

Everything else (arguments, checks, the replay itself, ``unlearning_card_info()``) is the engine's.
"""

from __future__ import annotations

from ..trace import replay as engine
from .mixin import UnlearningHubMixin


class ReplayTrainer(UnlearningHubMixin, engine.ReplayTrainer):
    """:class:`hf_unlearn.trace.replay.ReplayTrainer` (re-execute a recorded plan with some slots deleted) with
    ``push_to_hub`` and ``create_model_card``."""

    # the engine's card info (the mixin's is the contract's stub, and the mixin comes first for push_to_hub)
    unlearning_card_info = engine.ReplayTrainer.unlearning_card_info


class RedactedReplayTrainer(ReplayTrainer, engine.RedactedReplayTrainer):
    """:class:`hf_unlearn.trace.replay.RedactedReplayTrainer` (honour a deletion request: replay from the redacted
    store only) with ``push_to_hub`` (``deletion=True`` tags the commit, ``trace_dir`` publishes the provenance)."""


class OracleReplayTrainer(ReplayTrainer, engine.OracleReplayTrainer):
    """:class:`hf_unlearn.trace.replay.OracleReplayTrainer` (the trace oracle: a full replay with the deleted slots
    as weight-0 dummies) with ``push_to_hub`` and ``create_model_card``."""
