"""The end of a recording: the guards closed, the final checkpoint and retention, the final header fields (steps,
kept model, output root, buffers or settings changed while training, the guards' last fingerprint) and the seal."""

from __future__ import annotations

import time
from pathlib import Path

from ..environment_reads import process_reads, sealed, sealed_globals
from ..fidelity import changed_buffers
from ..file_reads import sealed as sealed_files
from ..lineage import final_is_output, live_output_root
from ..processes import gathered, world_size
from ..program_code import code_changed, code_record
from ..stack import numeric_stack, stack_change
from . import keeper, selfcheck
from .program import GUARD_CHECKS
from .segments import epoch_text


def finish(trainer) -> None:
    logs = every_process_reads(trainer)  # a collective: every process of a launch, before any returns
    same, trainer._trace_same_settings = getattr(trainer, "_trace_same_settings", None), None
    if same is not None:
        same.close()
    processes, trainer._trace_processes = getattr(trainer, "_trace_processes", None), None
    if processes is not None:
        processes.close()
    if trainer._trace_writer is None:
        if keeper.shard_peer(trainer) and trainer.state.global_step not in trainer._trace_saved:
            keeper.checkpoint(trainer, trainer.state.global_step, final=True)
        wanted, step = selfcheck.steps(trainer), trainer.state.global_step
        if selfcheck.peer(trainer) and wanted and 0 < step <= wanted and trainer._trace_check_ref is None:
            selfcheck.keep_reference(trainer, step)  # as the main process does below, at the same point
        if getattr(trainer, "_trace_peer_digest", None) is not None:
            trainer._trace_peer_digest.close()
            trainer._trace_peer_digest = None
        return
    step = trainer.state.global_step
    guard, trainer._trace_guard = trainer._trace_guard, None
    if guard is not None:  # after the last step: its fingerprint, and a change since (in the final checkpoint)
        guard.between_steps(step, [])
        guard.close()
    fresh = step not in trainer._trace_saved  # the final checkpoint is written now, from the state as it ends
    if fresh:
        keeper.checkpoint(trainer, step, final=True)
    else:
        keeper.thin(trainer, step, final=True)
    wanted = selfcheck.steps(trainer)
    if wanted and 0 < step <= wanted and trainer._trace_check_ref is None:
        selfcheck.keep_reference(trainer, step)  # a run no longer than the self-check: up to its final checkpoint
    trainer._trace_header.update(optimizer_steps=step, microbatches=trainer._trace_mb, finished=time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if not trainer._is_replay:
        scheduler = getattr(trainer, "lr_scheduler", None)
        if scheduler is not None and hasattr(scheduler, "get_last_lr"):  # the rates after the last step's step():
            trainer._trace_header["trainer"]["final_lrs"] = [float(x) for x in scheduler.get_last_lr()]  # callbacks
        changed = stack_change(trainer._trace_header.get("numeric_stack"), numeric_stack(trainer.args.device))
        if changed:
            trainer._trace_header["hazards"].append(
                f"the numeric stack changed while training ({changed}): replays run with the one recorded when "
                "training started (set threads and deterministic settings before train())")
    kept = kept_model(trainer)
    if kept:
        trainer._trace_header["kept_model"] = kept
    if not trainer._is_replay and trainer._trace_header.get("lineage") and not kept:
        trainer._trace_header["lineage"]["output_root"] = (
            keeper.final_params_root(trainer, step)
            if trainer.is_fsdp_enabled or (fresh and final_is_output(trainer._trace_header))
            else output_root_now(trainer))
    trainer._trace_start_hashes = None  # they hold the starting tensors
    if trainer._trace_writer is not None:
        trainer._trace_writer.frozen.start = None
    if not trainer._is_replay:
        changed = changed_buffers(trainer.accelerator.unwrap_model(trainer.model), trainer.trace_dir)
        why = (f"the model's non-persistent buffer {changed[0]} changed during training (checkpoints do not carry "
               "it, so replays cannot follow it)") if changed else (trainer._trace_changed_during_training()
                                                              or code_changed(guard.code if guard else None))
        if why:
            trainer._trace_header["fidelity"] = {"recording": {
                "checked": True, "reproduced": False, "steps": [0, step], "why": why}}
    if guard is not None and step > 0:
        trainer._trace_header.setdefault("fidelity", {})["guards"] = {
            "final": {"step": step - 1, **guard.flush(step - 1), "ep": epoch_text(trainer.state.epoch)},
            "checks": GUARD_CHECKS, **(code_record(guard.code, getattr(trainer, "_trace_earlier_code", {}),
                                                   getattr(trainer, "_trace_code_from", 0)) if guard.code else {})}
    if guard is not None:
        guard.warn_changes(trainer.trace_dir)
    reads = getattr(trainer, "_trace_environment_reads", None)
    if not trainer._is_replay and reads is not None:  # every deleting process is compared with them
        key = trainer._trace_writer.key
        trainer._trace_header.setdefault("fidelity", {}).update(
            # a resumed run: what the steps before the resume read stays (checked against this process when it resumed)
            environment_reads={**sealed(key, reads), **(getattr(trainer, "_trace_earlier_reads", None) or {})},
            file_reads={**sealed_files(key, getattr(trainer, "_trace_file_reads", None) or {}),
                        **(getattr(trainer, "_trace_earlier_files", None) or {})},
            program_globals=sealed_globals(key, getattr(trainer, "_trace_program_globals", None) or {}))
        by_process = process_reads(key, logs, getattr(trainer, "_trace_earlier_process_reads", None)) if logs else {}
        if by_process:  # the processes whose code read otherwise than process 0's: each compared with its own
            trainer._trace_header["fidelity"]["process_environment_reads"] = by_process
    trainer._trace_writer.seal(trainer._trace_header)
    trainer._trace_writer = None


def code_at_first_step(trainer) -> None:
    """Once the launch's first optimizer step has run: its code seal written into the run's header (not sealed yet),
    so a launch killed afterwards leaves the code its steps ran for a resume to compare with
    (:func:`~hf_unlearn.trace.program_code.resumed_code_checked`); :func:`finish` writes it again with the seal."""
    guard, writer = trainer._trace_guard, trainer._trace_writer
    if guard is None or writer is None or not guard.code or getattr(trainer, "_trace_code_written", True):
        return
    trainer._trace_code_written = True
    trainer._trace_header.setdefault("fidelity", {}).setdefault("guards", {}).update(
        code_record(guard.code, trainer._trace_earlier_code, trainer._trace_code_from))
    writer.write_header(trainer._trace_header)


def every_process_reads(trainer) -> list[dict] | None:
    """Every process's environment reads of a multi-process recording, in rank order (None: one process, or a
    replay): what process 1's code alone read is sealed too, and compared in the deleting launch's process 1."""
    reads = getattr(trainer, "_trace_environment_reads", None)
    if trainer._is_replay or reads is None or world_size() == 1 or getattr(trainer, "_trace_reads_gathered", False):
        return None  # (finish runs again from on_train_end: on every process, so none gathers twice)
    trainer._trace_reads_gathered = True
    return gathered(reads)


def output_root_now(trainer) -> str:
    """The output root of a run that just finished (:func:`~hf_unlearn.trace.lineage.live_output_root`), the frozen
    base's hashes taken from the lineage's start hashes when the frozen store was saved at step 0: in the same
    ``get_batch_samples`` call as the lineage hashed the starting weights, with only the recorder's own code (which
    writes no weight) between, so the bytes the store holds are the ones the start hashed."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    frozen = trainer._trace_writer.frozen
    start = getattr(trainer, "_trace_start_hashes", None) if frozen.saved_step == 0 else None
    return live_output_root(model, trainer._trace_header, start, frozen.unchanged_stamps(model) if start else None)


def kept_model(trainer) -> dict | None:
    """With ``load_best_model_at_end`` the user keeps the best checkpoint's model, not the last step's: its step."""
    state = trainer.state
    if trainer._is_replay or not trainer.args.load_best_model_at_end or not state.best_model_checkpoint:
        return None
    best = state.best_global_step
    if best is None:
        best = int(Path(state.best_model_checkpoint).name.rsplit("-", 1)[-1])
    return {"step": int(best), "recorded_steps": state.global_step, "metric": trainer.args.metric_for_best_model,
            "why": "load_best_model_at_end: the Trainer loaded the best checkpoint, so the kept model is the state "
                   f"after {best} of {state.global_step} optimizer steps; deletions replay up to it"}

