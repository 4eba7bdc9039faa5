"""Replay of a recorded plan: the redacted replay, the trace oracle, and the naive ``filter`` baseline.

One engine serves all of them, so "replay == oracle" tests the redaction, not two implementations:

* every microbatch runs under its recorded seed, the recorded learning rate is written into the optimizer's
  param groups, and the recorded loss normaliser is passed as ``num_items_in_batch``;
* a deleted slot is filled by a fixed dummy sequence of the recorded length (``dummy_token_id`` everywhere,
  full attention mask, every label ``-100``): its loss and gradient are exactly zero and the microbatch keeps
  its shape; a microbatch of dummies only runs as well, and a step whose every slot is deleted steps the optimizer
  on zero gradients, as the plain run with those rows' labels masked does;
* the arithmetic is ``Trainer.training_step``, ``Trainer._clip_grad_norm`` and the optimizer's own ``step``,
  exactly as in the recorded run, so replaying an unaffected prefix reproduces the recorded checkpoints bit
  for bit, and a suffix replay from a checkpoint equals a full replay.

The redacted replay reads only the redacted store; the oracle reads the original store and fills the deleted
slots with the same dummies. A replay's output folder is itself a recorded run (plan, WAL, checkpoints, store),
so a later request can suffix-replay from it.

This module holds :class:`ReplayTrainer`'s ``Trainer`` hooks (construction, ``create_optimizer``, ``train``, the
segment loop) and the request classes; each other concern is a room of its own: ``cost`` (where a replay starts and
what it costs), ``arguments`` (the TrainingArguments), ``model`` (a given model checked), ``start`` (the start state),
``checks`` (the refusals before compute), ``counterfactual`` (the microbatches with dummies), ``program`` (callbacks,
fingerprints and checkpoints matched on the way), ``stand_ins`` (the scheduler and loader a recorded callback is handed), ``output`` (the output run), ``card`` (card info), ``composition``
(the recorded trainer class composed in) and ``baselines`` (the naive repack baseline). Publishing is not the
engine's: :mod:`hf_unlearn.hub.replay` puts the Hub mixin above these classes.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from pathlib import Path

from ...data.collators import rebuild_collator
from ...errors import UnlearnError
from .. import module_tree
from ..dummies import watch_dummy_gradient
from ..environment_reads import note_frameworks, recorded_reads, unrecorded, watching
from ..fidelity import check_device, refusal, restore_layout
from ..file_reads import unrecorded as unrecorded_files
from ..file_reads import watching as files_read
from ..guards import plan_lrs, program_controls, state_digest, step_fingerprint
from ..issued import believed
from ..packing import deleted_spans, document_ids, emptied_rows, is_packed, load_map
from ..plan import PlanEntry
from ..processes import agreed, rank
from ..program_code import code_checked
from ..recorder import RecordingHooksTrainer, build_optimizer, rank_seed, seeded
from ..request import _check_types, forget_tags, never_trained_tags  # noqa: F401  (they lived here)
from ..rows import check_rows
from ..run import TraceRun, capture_state, full_model_state, load_checkpoint, open_run
from ..run_model import model_from_run  # noqa: F401  (it lived here)
from ..sharding import load_optimizer_state, with_process_causes
from ..stack import check_stack, pinned_stack
from ..store import check_store_binding, id_index, load_store
from ..tags import tag
from .arguments import NOT_REPLAYED, REPLAY_ARGS, _check_args, training_args_from_header, without_evaluation  # noqa: F401
from .baselines import PACKED_BASELINE, PAIRS_BASELINE, repack_counterfactual, save_state  # noqa: F401
from .card import ReplayCard
from .checks import ReplayChecks
from .composition import replay_class
from .cost import already_deleted, describe_cost, emptied_steps, replay_cost  # noqa: F401
from .counterfactual import IGNORE_INDEX, CounterfactualBatches  # noqa: F401
from .model import _check_model
from .output import OutputRun
from .program import RecordedProgram, step_ranges
from .start import ReplayStart


# ---- the engine --------------------------------------------------------------------------------------------
class ReplayTrainer(ReplayStart, ReplayChecks, CounterfactualBatches, RecordedProgram, OutputRun, ReplayCard,
                    RecordingHooksTrainer):
    """Re-execute a recorded plan with some slots deleted (see the module docstring).

    Everything is checked at construction, before any compute: the run's integrity, the store's binding to the
    run, the start checkpoint against its hashes, the number of processes, the model, arguments and collator
    (every untouched microbatch of the replayed range must collate to the batch the run recorded).

    Args:
        run: the recorded run (a folder or an opened :class:`TraceRun`).
        store: the token store to read rows from (default: the run's own store).
        forget_ids: raw ids whose slots become weight-0 dummies.
        out_dir: where the replayed run is recorded (None: nothing is written, ``train()`` returns the state).
        start: ``"suffix"`` (latest checkpoint at or before the first affected step) or ``"full"`` (step 0).
        filter_rows: the naive ``filter`` baseline instead: deleted rows are dropped from their microbatches
            before the forward pass and the normaliser is recomputed (not trace-preserving; for comparison).
        model, args, data_collator: default to what the run's header, ``model/`` and ``collator/`` describe;
            when given they are checked against the recording.
        proven_start: ``start_proof`` of :func:`hf_unlearn.trace.proof.before_deletion` when it proved this
            replay's fresh start by a probe step (``{"checkpoint", "proven_by": "probe"}``; it needs the run's
            original store, which a redacted replay never opens).
        environment_probe: ``environment_probe`` of :func:`hf_unlearn.trace.proof.before_deletion` (the deleting
            environment probed there). An oracle given none, none of whose steps is compared with the recording (a
            deleted row in its first step), probes it itself: one step with no deletion, before its own compute.
    """

    mode = "replay"
    _fidelity_reference: dict = {}  # step -> hashes the replay must reach (set by the recording's self-check only)
    store_policy = "any"  # RedactedReplayTrainer: a redaction of the run's store; the oracle: the run's own store
    _is_replay = True
    _trace_machinery = True
    _keep_final = True  # train() returns the final state (a proof's or probe's replay does not need it)

    def __new__(cls, run=None, *args, **kwargs):
        # the replay runs the recorded trainer's own compute_loss: compose this class with the run's trainer class
        opened = run if isinstance(run, TraceRun) else open_run(kwargs.get("run", run))
        obj = super().__new__(replay_class(cls, opened.header))
        obj._opened_run = opened
        return obj

    def __init__(self, run, store=None, forget_ids=(), out_dir=None, start: str = "suffix", filter_rows: bool = False,
                 model=None, args=None, data_collator=None, stop_step: int | None = None, _self_check: bool = False,
                 start_weights: dict | None = None, start_parent: dict | None = None, proven_start: dict | None = None,
                 environment_probe: dict | None = None, **kwargs):
        self._start_weights, self._start_parent = start_weights, start_parent
        self.run = self.__dict__.pop("_opened_run", None) or (run if isinstance(run, TraceRun) else open_run(run))
        # what a probe before this replay proved, believed only as issued in this process for this run (trace.issued)
        self._proven_start = believed("start", self.run, proven_start, "proven_start",
                                      "hf_unlearn.trace.proof.prove_fresh_start(RUN, ids)")
        self._environment_probe = believed("environment", self.run, environment_probe, "environment_probe",
                                           "hf_unlearn.trace.proof.probe_environment(RUN)")
        header = self.run.header
        self._self_check = _self_check
        why = None if _self_check else refusal(header)
        if why:
            raise UnlearnError(f"{self.run.path}: {why}; exact deletion cannot be proven on this run, refusing before "
                               "any compute (record it again with the cause fixed)")
        self.run = self.run.kept() if stop_step is None else self.run.cut(stop_step)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        if self.out_dir is not None and self.out_dir.exists() and any(self.out_dir.iterdir()):
            raise UnlearnError(f"{self.out_dir} exists and is not empty; choose a new output folder")
        created = self.out_dir is not None and not self.out_dir.exists()
        self._out_created = created
        try:
            with pinned_stack(header):  # the model and optimizer built as the recording built them (default dtype)
                self._setup(header, store, forget_ids, start, filter_rows, model, args, data_collator, **kwargs)
        except BaseException:
            # a refused replay leaves nothing behind (Trainer creates output_dir); the other processes of a launch
            # may remove it at the same moment, which must not replace the refusal with a FileNotFoundError
            with contextlib.suppress(OSError):
                if created and self.out_dir.is_dir() and not any(self.out_dir.iterdir()):
                    self.out_dir.rmdir()
            if getattr(self, "_scratch", None) is not None:
                shutil.rmtree(self._scratch, ignore_errors=True)
            raise

    def _setup(self, header, store, forget_ids, start, filter_rows, model, args, data_collator, **kwargs) -> None:
        if filter_rows and is_packed(header):
            raise UnlearnError(PACKED_BASELINE.format(name="filter"))
        self.forget_ids = list(dict.fromkeys(forget_ids))
        self.forget_tag_set = forget_tags(self.run, self.forget_ids) if self.forget_ids else set()
        self.start_mode = start
        self.filter_rows = filter_rows
        if model is None:
            model = model_from_run(self.run, weights_follow=True)  # train() loads the start checkpoint (strict)
            restore_layout(model, self.run.path, header)
        else:
            _check_model(model, header)
            restore_layout(model, self.run.path, header, given=True)
        self._scratch = None
        if args is None:
            if self.out_dir is None:  # nothing is written, but Trainer wants an output_dir: not inside the run
                import tempfile

                self._scratch = Path(tempfile.mkdtemp(prefix="hf_unlearn_replay_"))
            args = training_args_from_header(header, self.out_dir or self._scratch)
        else:
            _check_args(args, header)
            args = without_evaluation(args)
        if data_collator is None:
            data_collator = rebuild_collator(header.get("collator"), self.run.path / "collator", model=model)
        self.store_path = Path(store) if store is not None else self.run.store_path
        all_tags = {tag(self.run.key, i) for i in self.forget_ids}
        self.store_kind = check_store_binding(self.store_path, header["dataset"].get("store_sha256"), self.run.key,
                                              all_tags)
        if self.store_kind == "redacted" and self.store_policy == "original":
            raise UnlearnError("the oracle reads the run's original store (the counterfactual of the recorded rows), "
                               f"not the redacted store {self.store_path}")
        self.store = load_store(self.store_path)
        # SFTTrainer builds its own padding-free collator and refuses another: the rebuilt one is set after it
        padding_free = bool(getattr(args, "padding_free", False)) or bool(getattr(args, "packing", False))
        super().__init__(model=model, args=args, data_collator=None if padding_free else data_collator,
                         trace_dir=self.out_dir or self._scratch or self.run.path / "_unused", id_column=self.run.id_column,
                         dummy_token_id=header.get("dummy_token_id", 0),
                         **self._recorded_trainer_arguments(), **self._trace_replay_arguments(self.run, kwargs), **kwargs)
        self.data_collator = data_collator
        self._check_processes()
        check_device(header, self.args.device)
        check_stack(header, self.args.device)  # versions and CPU dispatch: refused here; threads: set by train()
        # the code this process runs is the recording's (a proof's or probe's replay: its caller checked it)
        self._code = None if self._self_check else code_checked(self.run)
        if self.store_policy == "redacted" and self.forget_ids:
            stored = set(document_ids(self.store, self.id_column))
            present = [i for i in self.forget_ids if i in stored]
            if present:
                raise UnlearnError(f"the store {self.store_path} still holds {len(present)} id(s) to forget (e.g. "
                                   f"{present[:5]}); redact it first (hf-unlearn trace redact) and replay from the "
                                   "redacted store")
        self._tag_index = {tag(self.run.key, i): n for i, n in id_index(self.store, self.id_column).items()}
        self._template = {k: v for k, v in self.store[0].items() if k != self.id_column}
        self._masked_slots = set()  # the oracle's deleted slots trained as the rows themselves without weight
        self._dummy_slots = set()  # and those it trained as dummies (packed documents, a collator that labels tokens)
        self._spans, self._emptied = {}, set()  # packed rows: deleted fragments; rows left without weight
        self._dummy_spans = {}  # packed rows: every fragment that is a dummy (deleted now or before)
        if is_packed(header):
            self._packing_map = load_map(self.run)
            self._spans = deleted_spans(self._packing_map, self.forget_tag_set)
            self._dummy_spans = {row: hit for row, frags in self._packing_map.items()
                                 if (hit := [k for k, (d, _, _) in enumerate(frags) if d is None or d in self.forget_tag_set])}
            self._emptied = emptied_rows(self._packing_map, self.forget_tag_set)
            self._check_packed_rows()
        if self._trace_dummy_has_weight(self.data_collator, self._trace_dummy_row(self._template, 4, self.dummy_token_id)):
            raise UnlearnError("the collator gives a deleted slot's dummy row a label: deleted slots would not have "
                               "weight 0 (pass the collator the run was recorded with)")
        self.start_step = self._start_step()
        self._check_rows()
        cps = self.run.checkpoints()
        self._recorded_checkpoints = cps
        if self.start_step not in cps:
            raise UnlearnError(f"{self.run.path} has no checkpoint at step {self.start_step}")
        # Hashed on every load, even when a probe of this process verified the same checkpoint a moment ago: a file's
        # identity (device, inode, size, mtime, ctime) does not bind its bytes (NFS serves cached attributes, a write
        # through a shared mmap updates the times lazily, timestamps are coarser than a write), and the only binding,
        # the tensors that were hashed, would have to stay in memory from the probe to the replay and the oracle.
        loaded = []  # FSDP2: this process's optimizer shards, a file only it reads: a refusal must stop every process
        agreed(lambda: loaded.append(load_checkpoint(cps[self.start_step], verify=True, rank=self.args.process_index
                                                     if self.run.header.get("sharding") else None)))
        self._start_state = loaded[0]
        if self._start_weights is not None:
            self._start_from_parent()
        held = self.model.state_dict()
        for name, t in full_model_state(self._start_state).items():
            if name in held and held[name].dtype != t.dtype:
                raise UnlearnError(f"the replay model holds {name} as {held[name].dtype}, checkpoint step "
                                   f"{self.start_step} as {t.dtype}: the model's dtype layout is not the recorded one")
        affected = [e.step for e in self.run.plan if self._hit(e)]
        self.first_affected_step = min(affected) if affected else self.run.total_steps
        if self._start_weights is not None:  # another start: no recorded state after step 0 holds any more
            self.first_affected_step = 0
        self._setup_program()
        self._setup_start_proof()
        if not self.filter_rows:
            self._check_batches()
            check_rows(self)  # the kept rows of the microbatches a deletion touches (hf_unlearn.trace.rows)
        self.accelerator.wait_for_everyone()  # every process checked the output folder before the main one writes

    def create_optimizer(self, model=None):
        spec = self.run.header["optimizer"]
        if spec.get("source") == "custom":
            self.optimizer = build_optimizer(spec["rebuild"], self.model, self._start_state["param_names"])
            return self.optimizer
        return super().create_optimizer(model)

    # ---- the loop ------------------------------------------------------------------------------------------
    def train(self, *args, **kwargs):
        """Replay from the start checkpoint to the end of the plan; returns the final checkpoint dict. It runs with
        the recorded thread count and deterministic settings (:mod:`hf_unlearn.trace.stack`)."""
        self._probe_own_environment()
        own = (self.run.path, self.out_dir, self.args.output_dir)  # what the engine writes, not the program's input
        with pinned_stack(self.run.header), watching() as reads, files_read(own) as files:
            note_frameworks(reads)  # compared with the recording's reads during its steps (unrecorded, below)
            out = self._replay()
        fidelity = self.run.header.get("fidelity") or {}
        recorded = recorded_reads(fidelity, rank())  # this process's rank's
        differ = unrecorded(self.run.key, recorded, reads) if recorded is not None else []
        other = unrecorded_files(self.run.key, fidelity["file_reads"], files) if "file_reads" in fidelity else []
        if other:  # the code the replay ran read other input than the recording's
            raise UnlearnError(f"the replay of {self.run.path} ran code that read the file {other[0]}"
                               f"{f' (and {len(other) - 1} more)' if len(other) > 1 else ''}: it may have acted "
                               "otherwise than while recording, so this replay is not the recorded program's; restore "
                               "the file as it was when the run was recorded, or record the run again")
        if differ:  # the code the replay ran acted on another environment than the recording's
            raise UnlearnError(f"the replay of {self.run.path} ran code that read the environment variable "
                               f"{differ[0]}{f' (and {len(differ) - 1} more)' if len(differ) > 1 else ''}: it may "
                               "have acted otherwise than while recording, so this replay is not the recorded "
                               "program's; run the deletion with the recording's environment")
        return out

    def _probe_own_environment(self) -> None:
        """An oracle given no environment probe (the engine's classes used directly: forget, trace oracle and
        pipelines probe before it) none of whose steps is compared with the recording (a deleted row in its first
        step): its first step re-run with no deletion from the same checkpoint and compared with the recording's
        fingerprint, before its own compute. Without it, a process that computes otherwise than the recording (a
        replaced activation, another MKL mode) makes the replay and the oracle equally wrong, and bit-identical."""
        if (self.mode != "oracle" or self._environment_probe is not None or self._self_check or self.filter_rows
                or self.start_step < self.first_affected_step or self.start_step not in self._recorded_fps):
            return
        probe = ReplayTrainer(self.run, forget_ids=(), out_dir=None, start="full", stop_step=self.start_step + 1,
                              data_collator=self.data_collator, _self_check=True)
        probe._keep_final = False
        try:
            probe.train()
        except UnlearnError as e:
            raise type(e)(f"the deleting environment does not reproduce the recorded run {self.run.path}: optimizer "
                          f"step {self.start_step}, re-run from its kept checkpoint with no deletion before the oracle "
                          f"(none of its steps is compared with the recording), ends otherwise: {e}; refusing before "
                          "the oracle's compute (run the deletion where the run was recorded, with its environment; "
                          "hf_unlearn.trace.proof.probe_environment(RUN) probes it, passed as environment_probe=)"
                          ) from None

    def _replay(self):
        run, start = self.run, self.start_step
        ck = self._start_state
        self.model.load_state_dict(full_model_state(ck))
        self.create_optimizer()
        model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        self.model_wrapped = model
        load_optimizer_state(self.optimizer, ck["optimizer"])  # its parameters' shards under FSDP2
        self.accelerator.gradient_state._set_sync_gradients(True)
        self._enable_activation_checkpointing()
        neftune = None
        if self.neftune_noise_alpha is not None:
            from transformers.integrations.neftune import activate_neftune

            neftune = activate_neftune(self.model, self.neftune_noise_alpha, self.accelerator)
        main = self.accelerator.is_main_process
        writer = self._open_output(start) if self.out_dir is not None and not self.filter_rows and main else None
        saves = set(run.checkpoints())  # the output keeps the checkpoints its parent kept
        if writer and self._start_weights is not None:
            writer.save_checkpoint(start, self.model, self.optimizer)
        model.train()
        model.zero_grad()
        replayed = stepped = 0
        self.checkpoints_matched = []
        self._gathered_hashes = {}
        try:
            for seg in run.segments():
                step = seg[0].step
                if step < start:
                    if writer:
                        writer.append(seg)
                    continue
                saved = self._save_state(writer, step) if step in saves and step != start else None
                agreed(self._check_fidelity, step, saved)  # every process, one verdict (trace.processes)
                if writer:
                    writer.append([self._output_entry(e) for e in seg])
                replayed += 1
                self.state.global_step = step  # as in the recording while it ran this step (a loss may read it)
                stepped += self._run_segment(model, seg)
                self.state.global_step = step + 1
                try:
                    agreed(self._check_step_fingerprint, step)
                except UnlearnError as e:  # on every process (agreed): a step before the first affected one doubles
                    if step < self.first_affected_step and self.accelerator.num_processes > 1:  # as the probe: name
                        with_process_causes(e, (run.header.get("numeric_stack") or {}).get("environment"))  # causes
                    raise
            saved = self._save_state(writer, run.total_steps) if run.total_steps > start else None
            agreed(self._check_fidelity, run.total_steps, saved)
        except BaseException:
            if writer:
                self._discard_output(writer)
            raise
        finally:
            if neftune is not None:
                from transformers.integrations.neftune import deactivate_neftune

                deactivate_neftune(self.model, neftune, self.accelerator)
        final = capture_state(self.model, self.optimizer, run.total_steps, clone=True) if self._keep_final else None
        self.replay_stats = {"start_step": start, "segments_replayed": replayed, "optimizer_steps_taken": stepped,
                             "total_steps": run.total_steps, "nothing_to_replay": replayed == 0,
                             "checkpoints_matched": list(self.checkpoints_matched),
                             "fingerprints_matched": step_ranges(self._fps_matched),
                             "start_proof": self._start_proof,
                             **({"deleted_rows_trained_masked": len(self._masked_slots),
                                 "deleted_rows_trained_as_dummies": len(self._dummy_slots)} if self.mode == "oracle"
                                else {})}
        if writer:
            self._finish_output(writer)
        self.accelerator.wait_for_everyone()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        return final


    def _run_segment(self, model, seg: list[PlanEntry]) -> int:
        """Forward/backward every microbatch of a segment, then the optimizer step. Returns 0/1 (1: stepped).

        A microbatch of dummies only runs too, and a step whose every slot is deleted still steps on zero
        gradients: the plain run with those rows' labels masked calls ``compute_loss`` on them (a loss or callback
        that counts its calls counts them) and steps AdamW on zero gradients (its moments decay, weight decay acts,
        its step count grows). Skipped only by the ``filter`` baseline (its rows are gone) and where the loss has no
        recorded normaliser and the recording's probe found its value over a microbatch of dummies not finite
        (:meth:`_trace_dummies_only_run`: a mean over no token is NaN); decided from the plan and the sealed header,
        so every process runs the same microbatches and their all-reduces stay matched.
        """
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        work = []
        for e in seg:
            if not any(self._weighted(s) for s in e.slots) and (self.filter_rows or not self._trace_dummies_only_run(e)):
                continue
            marked = [] if self._holds_dummy(e) else None
            feats, dummy_pos = self._rows(e, keep_dummies=not self.filter_rows, rank=rank, marked=marked)
            batch, mask = self._collate_located(feats, dummy_pos, marked)
            mask = None if mask is None else mask.to(self.args.device)
            work.append((e, batch, mask))
        step = seg[0].step
        self.state.global_step = step
        self.state.epoch = self._epochs.get(step, self.state.epoch)  # as the recording's Trainer held it
        if not work:  # no optimizer step: the recorded callbacks still see the step begin and end
            self._event("on_step_begin")
            self.state.global_step = step + 1
            self.state.epoch = self._epochs.get(step + 1, self.state.epoch)
            self._event("on_step_end")
            self._step_fps[step] = {"none": "no optimizer step (every slot deleted)"}
            return 0
        if self.filter_rows:
            num_items = self._get_num_items_in_batch([b for _, b, _ in work], self.args.device)
            self.current_gradient_accumulation_steps = len(work)
        lr = seg[0].lr
        lrs = seg[0].group_lrs or [lr] * len(self.optimizer.param_groups)
        for g, value in zip(self.optimizer.param_groups, lrs):
            g["lr"] = value
        for g, settings in zip(self.optimizer.param_groups, seg[0].extra.get("groups", [])):
            g.update({k: (tuple(v) if isinstance(g.get(k), tuple) else v) for k, v in settings.items()})
        self._event("on_step_begin")
        for i, (e, batch, mask) in enumerate(work):
            if not self.filter_rows:
                num_items = self._normaliser(e)
                self.current_gradient_accumulation_steps = e.accum
            sync = i == len(work) - 1 or world == 1
            context = contextlib.nullcontext if sync else functools.partial(self.accelerator.no_sync, model=model)
            with context(), seeded(rank_seed(e.seed, rank)), watch_dummy_gradient(self.model, mask) as watch:
                loss = self.training_step(model, batch, num_items)  # the recorded trainer's own step and compute_loss
            if watch is not None:
                self._check_dummy_gradient(e, watch, loss)
            if i < len(work) - 1:
                self._event("on_substep_end")
        if self.args.max_grad_norm is not None and self.args.max_grad_norm > 0:
            self._clip_grad_norm(model)
        self._event("on_pre_optimizer_step")
        with module_tree.held(self.model):  # one walk of the module tree for the checks before the step
            controls = program_controls(self.model, self.optimizer)
            grads = self._gradient_digest(step)
        self.optimizer.step()
        with module_tree.held(self.model):  # and one after it
            self._step_fps[step] = step_fingerprint(controls, state_digest(self.model, self.optimizer, self._fp_scope),
                                                    plan_lrs(seg[0], len(self.optimizer.param_groups)),
                                                    self._fp_scope)
        if grads is not None:
            self._step_fps[step]["g"] = grads
        self._event("on_optimizer_step")
        model.zero_grad()
        self.state.global_step = step + 1
        self.state.epoch = self._epochs.get(step + 1, self.state.epoch)
        self._event("on_step_end")
        return 1


class RedactedReplayTrainer(ReplayTrainer):
    """Honour a deletion request: replay the recorded run from the **redacted** store only.

    ``store`` must be the folder ``redact_store`` wrote from this run's store for exactly ``forget_ids`` (its
    receipt is checked under the run's key, and the store against the receipt's fingerprint); the run's original
    store is never opened. The output folder is a recorded run with the deleted slots turned into dummies, a
    deletion-log entry, and the final model + optimizer state in its last checkpoint.
    """

    mode = "replay"
    store_policy = "redacted"

    def __init__(self, run, store, forget_ids, out_dir, **kwargs):
        super().__init__(run, store=store, forget_ids=forget_ids, out_dir=out_dir, start=kwargs.pop("start", "suffix"),
                         **kwargs)


class OracleReplayTrainer(ReplayTrainer):
    """The trace oracle: a full replay from step 0 on the original store, each deleted row trained as the
    counterfactual has it, its tokens kept and its weight zero (dummies where that cannot be: see
    :meth:`~hf_unlearn.trace.replay.counterfactual.CounterfactualBatches._masks_deleted`)."""

    mode = "oracle"
    store_policy = "original"

    def __init__(self, run, forget_ids, out_dir=None, **kwargs):
        super().__init__(run, store=kwargs.pop("store", None), forget_ids=forget_ids, out_dir=out_dir,
                         start=kwargs.pop("start", "full"), **kwargs)


def filter_counterfactual(run, forget_ids, **kwargs) -> dict:
    """The naive ``filter`` baseline: same plan, deleted rows dropped before the forward pass."""
    return ReplayTrainer(run, forget_ids=forget_ids, start="full", filter_rows=True, **kwargs).train()
