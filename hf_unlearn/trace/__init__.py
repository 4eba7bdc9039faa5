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


def __getattr__(name):
    if name not in _NAMES:
        raise AttributeError(f"module 'hf_unlearn.trace' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)


__all__ = sorted(_NAMES)
