"""One call from a deletion request to published proof: ``hf_unlearn.forget(model_or_run, ids, ...)``.

(The module is ``forgetting``, not ``forget``: a submodule named ``forget`` would replace the function
``hf_unlearn.deletion.forget`` on the package as soon as it was imported.)

* A **recorded run** (the ``trace_dir`` of a ``TraceRecordingTrainer``) gets an exact deletion: the replay cost, a
  redacted store without the rows, a suffix replay from it, optionally the trace oracle with a bit-for-bit check.
* A **model** (local folder, GGUF file or Hub id) gets an approximate method from the method registry (MASC by
  default, any ``hf_unlearn.methods.registry`` name), evaluated before and after on the forget rows and on a sample
  of the retained rows.

Either way the output folder holds the model (``model/``: safetensors, tokenizer when known, model card with the
state-hash roots) and ``receipt.json``: what was deleted as keyed tags (never raw ids), how, the evidence, the state
hashes, and, with ``repo=``, the published commit and tag and the outcome of downloading it again and re-checking
every tensor's hash. Bad input is refused before any compute; a failed call leaves no output folder behind.

This module holds the call itself; its rooms, each of one concern: :mod:`~hf_unlearn.deletion.config` (the options
and names), :mod:`~hf_unlearn.deletion.checks` (every refusal before compute: the plan),
:mod:`~hf_unlearn.deletion.exact`, :mod:`~hf_unlearn.deletion.approximate` and :mod:`~hf_unlearn.deletion.pipeline`
(the runs), :mod:`~hf_unlearn.deletion.publishing` (the Hub), :mod:`~hf_unlearn.deletion.forget_receipt` (the
receipt and its summary), :mod:`~hf_unlearn.deletion.runs` (what the exact paths share). Every public name they had
here is re-exported.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import fields

from ..errors import UnlearnError
from ..runtime import init_processes
from ..validation import output_folder
from .approximate import _approximate
from .checks import _before_compute, _validate, check_request, load_rows
from .config import (
    COMMON_METHOD_ARGS,
    DEFAULT_APPROXIMATE,
    EXACT,
    RECEIPT_FILE,
    RECEIPT_FORMAT,
    ForgetConfig,
    parse_method_args,
)
from .exact import _exact, _exact_peer
from .forget_receipt import ForgetReceipt, _check_earlier_receipt, _write_receipt, load_receipt
from .pipeline import run_pipeline
from .publishing import OWN_COUNTS, OWN_SETTINGS, PROVENANCE_FILES, _publish
from .runs import _launched, with_replay_progress

__all__ = ["COMMON_METHOD_ARGS", "DEFAULT_APPROXIMATE", "EXACT", "OWN_COUNTS", "OWN_SETTINGS", "PROVENANCE_FILES",
           "RECEIPT_FILE", "RECEIPT_FORMAT", "ForgetConfig", "ForgetReceipt", "check_request", "forget", "load_receipt",
           "load_rows", "parse_method_args", "with_replay_progress"]


def forget(model_or_run, ids, output_dir: str | os.PathLike | None = None, *, config: ForgetConfig | None = None,
           tokenizer=None, data_collator=None, log: Callable[[str], None] | None = None,
           **options) -> ForgetReceipt:
    """Honour a deletion request end to end and return its receipt (also written to ``OUTPUT_DIR/receipt.json``).

    Args:
        model_or_run: a recorded run folder (exact deletion) or a model: local folder, ``.gguf`` file or Hub id.
        ids: the ids to forget: a list, or a file (typed JSON Lines ``ids.jsonl``, a JSON list, or one per line).
        output_dir: where the model, the evidence and the receipt go (new or empty).
        config: a :class:`ForgetConfig`; or give its fields as keyword arguments (``method="npo"``, ``repo=...``).
        tokenizer: saved with an exact deletion's model (a recorded run does not hold one); approximate methods load
            the model's own.
        data_collator: exact deletion only: the run's collator, when the trace cannot rebuild it (the standard
            ``transformers`` collators and ``QACollator`` are rebuilt; a run recorded with another one says so).
        log: where progress lines go (default ``print``).

    A run recorded by N processes (DDP or FSDP2) is deleted under a launch of N processes (``torchrun
    --nproc_per_node N -m hf_unlearn.cli forget ...``): every process replays its share, the main process writes the
    store, the model (one ``save_pretrained`` folder) and the receipt and returns it; the others return None.
    """
    if config is None:
        known = {f.name for f in fields(ForgetConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise UnlearnError(f"forget() got unknown option(s) {unknown}; the options are {sorted(known)}")
        if output_dir is None:
            raise UnlearnError("forget() needs output_dir= (a new or empty folder)")
        config = ForgetConfig(output_dir=os.fspath(output_dir), **options)
    elif options or output_dir is not None:
        raise UnlearnError("pass either config= or keyword options (and output_dir), not both")
    log = log or (lambda msg: print(msg, flush=True))
    plan = _validate(model_or_run, ids, config, data_collator)  # every check that costs no compute, before any
    if _launched() > 1:  # a run recorded by N processes, under its launch: the others replay, the main one writes
        plan["processes"] = init_processes(announce=False)
        plan["processes"].wait_for_everyone()  # every process validated before the main one writes
    _before_compute(plan, config)  # every process: the deleting environment is each process's
    if plan.get("processes") is not None and not plan["processes"].is_main_process:
        _exact_peer(plan, config)
        return None
    started = time.perf_counter()
    publish_error = None
    import torch

    # a deletion trains (an approximate method, a replay) whatever the caller's grad mode: a notebook's
    # torch.set_grad_enabled(False) left over from an evaluation made it crash in its first backward
    with output_folder(config.output_dir, marker=RECEIPT_FILE, overwrite=config.overwrite,
                       marker_check=_check_earlier_receipt) as out, \
            _library_progress(config.progress), torch.inference_mode(False), torch.enable_grad():
        if plan.get("pipeline"):
            receipt = run_pipeline(plan, config, out, tokenizer, log)
        elif plan["mode"] == EXACT:
            receipt = _exact(plan, config, out, tokenizer, log)
        else:
            receipt = _approximate(plan, config, out, log)
        if config.repo:
            try:
                receipt.published = _publish(receipt, plan, config, out, log)
            except Exception as e:  # the deletion is done and kept: the receipt says the publish failed, and how to retry
                publish_error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                receipt.published = {"repo": config.repo, "error": publish_error, "verify_ok": False}
        receipt.timings["total_s"] = time.perf_counter() - started
        _write_receipt(receipt, plan["ids"], out)
    if publish_error is not None:
        raise UnlearnError(f"the deletion is done and saved in {out} (receipt.json), but publishing to {config.repo} "
                           f"failed: {publish_error}; retry with `hf-unlearn hub push {out / 'model'} --repo "
                           f"{config.repo} --deletion`")
    return receipt


@contextlib.contextmanager
def _library_progress(enabled: bool):
    """The libraries' own bars (Hub transfers, datasets' "Saving the dataset", transformers' "Writing model shards")
    only when progress is wanted; their earlier setting is restored afterwards."""
    if enabled:
        yield
        return
    import datasets
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    before = (are_progress_bars_disabled(), datasets.is_progress_bar_enabled(), hf_logging.is_progress_bar_enabled())
    disable_progress_bars()
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not before[0]:
            enable_progress_bars()
        if before[1]:
            datasets.enable_progress_bars()
        if before[2]:
            hf_logging.enable_progress_bar()
