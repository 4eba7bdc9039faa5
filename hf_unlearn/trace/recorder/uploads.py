"""What the Trainer's own uploads may carry: never the trace. ``push_to_hub`` and the experiment trackers that log
the output folder as assets upload the whole ``output_dir``; the default trace lives inside it, with the run's store
of training rows and ids, and a Hub repo (or a tracker's storage) keeps what it is given where no deletion reaches."""

from __future__ import annotations

import os
from pathlib import Path

from ...errors import UnlearnError


def refuse_uploading_the_trace(args, trace_dir, when: str) -> None:
    """The Trainer's own Hub uploads (``push_to_hub=True`` at every save, ``trainer.push_to_hub()``) and trackers
    logging it as assets send the whole output folder: with the trace inside it, the run's store (every training row
    and its id) and every trace checkpoint would go to a Hub repo (or a tracker's storage), whose history no deletion
    reaches. Refused before anything is created."""
    if args is None:
        return
    output = Path(args.output_dir).expanduser().resolve()
    trace = Path(trace_dir).expanduser().resolve() if trace_dir is not None else output / "trace"
    if trace != output and output not in trace.parents:
        return
    where = "the Hub" if "push_to_hub" in when else "the tracker's storage"
    raise UnlearnError(f"{when} would upload {output} to {where} with the run's trace in it ({trace}: every training "
                       "row and its id, and every trace checkpoint), which keeps what it is given where no deletion "
                       "reaches; pass trace_dir= a folder outside output_dir (e.g. "
                       f"{output.parent / (output.name + '-trace')}), or publish with `hf-unlearn hub push`")


_TRUE = {"1", "ON", "YES", "TRUE"}
# transformers' experiment trackers that upload the whole output folder, and the setting that makes them (by class
# name along the callback's MRO: their packages need not be installed for this module to load)
_TRACKERS_UPLOADING_OUTPUT = {
    "CometCallback": ("COMET_LOG_ASSETS", lambda cb: os.getenv("COMET_LOG_ASSETS", "").upper() in _TRUE),
    "DagsHubCallback": ("HF_DAGSHUB_LOG_ARTIFACTS",
                        lambda cb: os.getenv("HF_DAGSHUB_LOG_ARTIFACTS", "").upper() in _TRUE),
    "DVCLiveCallback": ("HF_DVCLIVE_LOG_MODEL=all", lambda cb: getattr(cb, "_log_model", None) == "all"),
}


def tracker_uploading_output(callbacks) -> str | None:
    """The first callback set to upload the whole output folder (a tracker's asset logging), named, or None."""
    for cb in callbacks:
        for cls in type(cb).__mro__:
            setting, uploads = _TRACKERS_UPLOADING_OUTPUT.get(cls.__name__, (None, None))
            if uploads is not None and uploads(cb):
                return f"{type(cb).__name__} with {setting}"
    return None
