"""Exact deletion by trace-preserving replay.

Record a run with :class:`TraceRecordingTrainer` (or ``trace_recording(SFTTrainer)``, ``trace_recording(DPOTrainer)``, any Trainer subclass); honour a deletion request with :func:`redact_store` and
:class:`RedactedReplayTrainer`; check it against :class:`OracleReplayTrainer` with :func:`verify`.
Names resolve lazily so ``import hf_unlearn.trace`` stays light.
"""

from __future__ import annotations

import importlib

_NAMES = {
    "TraceRecordingTrainer": "recording",
    "TraceRecordingMixin": "recording",
    "trace_recording": "recording",
    "ReplayTrainer": "replay",
    "RedactedReplayTrainer": "replay",
    "OracleReplayTrainer": "replay",
    "filter_counterfactual": "replay",
    "repack_counterfactual": "replay",
    "replay_cost": "replay",
    "already_deleted": "replay",
    "redact_store": "store",
    "check_store_binding": "store",
    "open_run": "run",
    "check_run": "run",
    "verify": "verification",
    "compare_states": "verification",
    "verify_replay": "verification",
    "check_provenance": "verification",
}


# The replay trainers a user imports here publish like every trainer of the library (push_to_hub, create_model_card):
# they are the engine's classes with the Hub mixin above them, defined one layer up in hf_unlearn.hub.replay. The
# engine modules never import the Hub; this table names it, as hf_unlearn's own table does, and loads it on use.
_PUBLISHING = {"ReplayTrainer", "RedactedReplayTrainer", "OracleReplayTrainer"}


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(f"module 'hf_unlearn.trace' has no attribute {name!r}")
    module = "hf_unlearn.hub.replay" if name in _PUBLISHING else f"{__name__}.{_NAMES[name]}"
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_NAMES)
