"""The start of a recording (the first segment of ``train()``): preflight again, the token store, the header, the
lineage of the starting weights, the model files, the writer opened (or resumed), the guards started; a process
other than the main one only takes part in the collectives."""

from __future__ import annotations

import json
import warnings

from ...errors import UnlearnError
from ...keys import key_fingerprint
from ...utils import owner_only, private_dir
from ..digests import replayed_classes, replayed_globals
from ..environment_reads import differences, globals_differences, note_frameworks
from ..fidelity import save_buffers
from ..file_reads import differences as file_differences
from ..files import model_file_digests
from ..guards import ProgramGuard
from ..lineage import record_lineage, weights_root
from ..model_info import rebuilt_attributes
from ..packing import PACKED_IDS, save_store_info
from ..plan import read_plan
from ..program_code import resumed_code_checked
from ..retention import default_every
from ..sharding import ShardPeerDigest
from ..stack import stack_change
from ..store import id_index, save_store, store_sha256
from ..tags import launch_key, recording_key
from ..trainers import RESUMABLE_ARGS, arithmetic_differences, restored_by_optimizer
from ..writer import TraceWriter
from . import keeper, program
from .header import describe_packing, save_model_files
from .optimizers import SameOptimizerSettings
from .program import GUARD_CHECKS


def start(trainer) -> None:
    """Called at the first segment of ``train()``: the main process writes the header and the store."""
    trainer._trace_started = True
    if getattr(trainer, "_trace_environment_reads", None) is not None:
        note_frameworks(trainer._trace_environment_reads)  # from the first step on, the frameworks' reads too
    trainer._trace_header_seed = trainer.args.seed
    trainer._trace_groups = None
    resume_step = trainer.state.global_step if trainer._trace_resume else None
    main = trainer.accelerator.is_main_process
    # the key, read or created once by the main process and found by every other (a collective): each process proves
    # the run with it when train() ends
    key = launch_key(trainer.trace_dir, trainer._trace_key_arg) if not trainer._is_replay else None
    previous = {}
    if main and resume_step and (trainer.trace_dir / "header.json").exists():
        previous = json.loads((trainer.trace_dir / "header.json").read_text())
    # first, on every process (a collective): the code the steps before the stop ran must be every process's now
    trainer._trace_earlier_code, trainer._trace_code_from = resumed_code_checked(
        trainer.trace_dir, previous if main else None, resume_step) if resume_step else ({}, 0)
    trainer._trace_code_written = False
    if trainer.accelerator.num_processes > 1 and not trainer._is_replay:
        trainer._trace_same_settings = SameOptimizerSettings(trainer.optimizer, lambda: trainer.state.global_step)
    if not trainer.accelerator.is_main_process:
        if trainer.is_fsdp_enabled:  # a shard peer: it writes its shards of each checkpoint the main one indexes
            trainer._trace_total = max(trainer.state.max_steps, 1)
            trainer._trace_every = trainer.trace_checkpoint_steps or default_every(
                trainer._trace_total, trainer.trace_checkpoint_retention)
            trainer._trace_saved = set()
            if trainer.trace_guards:
                trainer._trace_peer_digest = ShardPeerDigest(trainer.accelerator.unwrap_model(trainer.model),
                                                             trainer.optimizer)
            if not trainer._is_replay:  # the main process's lineage gathers each starting tensor: take part
                weights_root(trainer.accelerator.unwrap_model(trainer.model).state_dict())
        if trainer.trace_guards:  # the whole program is compared between processes at every step
            program.sort_callbacks(trainer)
            program.processes_start(trainer)
        return
    served, hazards, notes = trainer.trace_preflight()
    run = trainer.trace_dir
    trainer._trace_key = key if key is not None else recording_key(run, trainer._trace_key_arg)
    max_steps = max(trainer.state.max_steps, 1)
    trainer._trace_total = max_steps
    trainer._trace_every = trainer.trace_checkpoint_steps or default_every(max_steps,
                                                                           trainer.trace_checkpoint_retention)
    trainer._trace_factor = 2
    store = private_dir(run) / "store"  # raw ids and token ids of every row: owner-only whatever the umask
    fingerprint = store_sha256(store) if store.exists() else save_store(served, store)
    if PACKED_IDS in served.column_names:
        save_store_info(store, trainer.dummy_token_id)
    owner_only(store.parent)
    index = id_index(served, trainer.id_column)
    lengths = trainer._trace_row_lengths(served)
    trainer._trace_lens = {i: lengths[n] for i, n in index.items()}
    header = trainer._trace_header_dict(served, fingerprint, hazards, notes)
    changed = stack_change(previous.get("numeric_stack"), header["numeric_stack"])
    if changed:  # the steps before the resume ran on another stack than the one every replay uses
        header["hazards"].append(f"the run was resumed at step {resume_step} with another numeric stack than its "
                                 f"earlier steps ({changed}): replays run every step with the resumed one")
    describe_packing(trainer, served, header)
    header["run_id"] = previous.get("run_id", header["run_id"])
    header["origin_run_id"] = header["run_id"]
    header["key_fingerprint"] = key_fingerprint(trainer._trace_key)
    header["trainer"].update(program.sort_callbacks(trainer))
    loader = trainer.callback_handler.train_dataloader  # what a recorded callback's len(train_dataloader) gave
    if loader is not None and hasattr(loader, "__len__"):
        header["trainer"]["dataloader_len"] = len(loader)
    # what the modules of the code replays run again fixed when imported, as training starts (as a replay rebuilding
    # that code finds them): sealed with the run (sealing.finish)
    trainer._trace_program_globals = replayed_globals(replayed_classes(
        trainer._trace_program_callbacks, type(trainer), trainer.data_collator))
    earlier = previous.get("fidelity") or {}
    trainer._trace_earlier_reads = earlier.get("environment_reads") or {}
    trainer._trace_earlier_files = earlier.get("file_reads") or {}
    trainer._trace_earlier_process_reads = earlier.get("process_environment_reads") or {}
    if resume_step:  # the steps before it ran with what the first process's code read: so must the ones after
        differ = differences(trainer._trace_key, trainer._trace_earlier_reads, frameworks=True) + globals_differences(
            trainer._trace_key, earlier.get("program_globals") or {}, trainer._trace_program_globals) + [
            why for _, why in file_differences(trainer._trace_key, trainer._trace_earlier_files)]
        if differ:
            raise UnlearnError(f"{run} cannot be resumed in this process: what the run's code read before it was "
                               f"stopped differs here: {differ[0]}"
                               f"{f' (and {len(differ) - 1} more)' if len(differ) > 1 else ''}; resume with the "
                               "environment it was recorded in")
    if resume_step and previous.get("training_args"):  # a replay runs one set of arguments over the whole run
        restored = restored_by_optimizer(trainer.optimizer, previous["training_args"], header["training_args"])
        if restored:  # the run trains on with the earlier values (the checkpoint's param groups): so does a replay
            given = ", ".join(f"{k}={header['training_args'][k]!r}" for k in sorted(restored))
            kept = ", ".join(f"{k}={previous['training_args'][k]!r}" for k in sorted(restored))
            header["training_args"].update({k: previous["training_args"][k] for k in restored})
            warnings.warn(f"{run} is resumed with {given}, which does not act: transformers restores the optimizer's "
                          f"param groups from the checkpoint, so the run goes on with {kept}, as recorded; to change "
                          "them, start a new run", stacklevel=2)
        differ = arithmetic_differences(previous["training_args"], header["training_args"], header,
                                        RESUMABLE_ARGS | restored)
        if differ:
            raise UnlearnError(f"{run} is resumed with other TrainingArguments than its steps before {resume_step} "
                               f"ran: {'; '.join(differ)}; a replay runs one set of arguments over the whole run, so "
                               "its earlier steps would run with the new ones (a clipping threshold that never acted "
                               "on the recorded rows can act on a deletion's); resume with the recorded arguments")
    before = (previous.get("trainer") or {}).get("callbacks")
    if before is not None and before != header["trainer"]["callbacks"]:  # a replay runs one set over the run
        names = [[c["class"].rsplit(":", 1)[-1] for c in cbs] for cbs in (before, header["trainer"]["callbacks"])]
        raise UnlearnError(f"{run} was recorded with the replayed callbacks {names[0] or 'none'} and is resumed "
                           f"with {names[1] or 'none'}: a replay runs one set of callbacks over the whole run; "
                           "resume with the same callbacks (same classes, same order)")
    trainer._trace_start_hashes = None
    if not trainer._is_replay:  # the model it starts from: a recorded run's output, or an external base
        header["lineage"] = previous.get("lineage")
        if not header["lineage"]:
            trainer._trace_start_hashes = {}  # the starting weights' hashes (sealing.output_root_now)
            header["lineage"] = record_lineage(trainer.accelerator.unwrap_model(trainer.model), run,
                                               trainer.trace_parent, hashes_out=trainer._trace_start_hashes)
            trainer._trace_start_weights(header)
    trainer._trace_header = header
    if resume_step:
        keeper.check_resumed_state(trainer, resume_step)
    save_model_files(trainer, run)
    header["model"]["files"] = model_file_digests(run)  # sealed: an edited config is named, not blamed on the probe
    model = trainer.accelerator.unwrap_model(trainer.model)
    header["model"]["layout"] = save_buffers(model, run, rebuilt_attributes(model))
    trainer._trace_writer = TraceWriter(run, trainer._trace_key)
    trainer._trace_writer.frozen.source = trainer.trace_frozen_source
    trainer._trace_writer.frozen.start = trainer._trace_start_hashes  # the frozen store takes their hashes
    if trainer.trace_guards:  # said from the start, so a run that crashes still says its steps were guarded
        header.setdefault("fidelity", {})["guards"] = {"checks": GUARD_CHECKS}
    trainer._trace_writer.open(header, resume_step=resume_step)
    trainer._trace_saved = set(trainer._trace_writer.index.entries)  # bound to the run; a save cut short is redone
    trainer._trace_mb = 0
    if resume_step:
        trainer._trace_mb = len(read_plan(run))
    trainer._trace_cb_states = None
    if trainer.trace_guards:
        watched = {id(cb): spec for cb, spec in trainer._trace_watched}
        trainer._trace_guard = ProgramGuard(trainer.accelerator.unwrap_model(trainer.model), trainer.optimizer, watched,
                                         context=lambda: program.context(trainer))
        trainer._trace_guard.start()
        if resume_step:  # the step before it, as the first process recorded it
            trainer._trace_guard.resume(resume_step, trainer._trace_writer.carried, trainer._trace_resume)
    program.processes_start(trainer)

