"""What the exact paths (one run, a pipeline, the service) share about a recorded run: whether it is a pipeline
stage, the collator its replay runs with, the processes of this launch, and a replay trainer with a progress bar.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import UnlearnError
from ..validation import is_trace_run

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)


def _launched() -> int:
    """The processes of this launch (``WORLD_SIZE``, 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def _has_run_parent(source: str) -> bool:
    """A recorded run that starts from another recorded run's output (a pipeline stage; its lineage is replayed)."""
    if not is_trace_run(source):
        return False
    try:
        header = json.loads((Path(source) / "header.json").read_text())
    except (OSError, ValueError):
        return False
    return ((header.get("lineage") or {}).get("parent") or {}).get("kind") == "run" if isinstance(header, dict) \
        else False


def _run_collator(run, reference: str | None, given):
    """The collator the replay runs with: the one given, else ``None`` (rebuilt from the trace by the replay), which
    is checked here, before any compute, to be rebuildable."""
    if given is not None:
        if not callable(given):
            raise UnlearnError(f"data_collator= must be a callable collator, not a {type(given).__name__}")
        return given
    if reference is not None:
        from ..data.collators import load_collator

        return load_collator(reference)
    spec = run.header.get("collator") or {}
    if not spec.get("rebuildable"):
        why = spec.get("why")
        raise UnlearnError(f"the run's data collator ({spec.get('class', 'unknown')}) cannot be rebuilt from the trace"
                           f"{f' ({why})' if why else ''}; pass it: --collator module:callable (data_collator= from "
                           "Python)")
    return None


def with_replay_progress(trainer_cls, desc: str, enabled: bool):
    """A replay trainer class that advances a progress bar per replayed optimizer step (segment)."""
    from tqdm.auto import tqdm

    class WithProgress(trainer_cls):
        def train(self, *args, **kwargs):
            total = sum(1 for seg in self.run.segments() if seg[0].step >= self.start_step)
            with tqdm(total=total, desc=desc, unit="step", disable=not enabled, leave=False) as self._bar:
                return super().train(*args, **kwargs)

        def _run_segment(self, model, seg):
            taken = super()._run_segment(model, seg)
            self._bar.update(1)
            return taken

    WithProgress.__name__ = trainer_cls.__name__
    return WithProgress
