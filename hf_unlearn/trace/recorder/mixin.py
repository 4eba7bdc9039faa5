"""RecordingHooks: the ``transformers.Trainer`` hooks a recording overrides, each handing its work to one module of
this package (preflight, slots, segments, the checkpoint keeper, the self-check's reference, the header, the
guards' wiring, opening and sealing); :func:`with_recording` builds the classes. The public classes
(:mod:`hf_unlearn.trace.recording`) add the end-of-training proof, which runs the replay engine built on these."""

from __future__ import annotations

import functools
import math
import os
import time
from collections import deque
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback

from ...data.collators import IdCarryingCollator
from ...errors import UnlearnError
from ...utils import WeightsFollowUmask
from ..base_source import release_live
from ..environment_reads import watching
from ..fidelity import prepare_cuda_determinism
from ..file_reads import watching as files_read
from ..packing import PACKED_IDS, SUPPORTED, pack_with_documents
from ..plan import has_plan
from ..preference import check_trainer_class, preference_mixins
from ..retention import MODES, is_due
from ..rng import seeded
from ..seeds import microbatch_seed, rank_seed
from ..trainers import bound_arguments
from ..writer import TraceWriter
from . import header, keeper, launch, optimizers, preflight, probe, program, sealing, segments, selfcheck, slots
from .header import non_finite_hazard
from .opening import start
from .slots import dummy_has_weight, dummy_row, masked_row
from .uploads import refuse_uploading_the_trace, tracker_uploading_output

RECORDING_MODULE = "hf_unlearn.trace.recording"  # where the classes trace_recording() builds say they live


class _TraceCallback(TrainerCallback):
    _trace_observer = True  # the library's own: not part of the user's program

    def __init__(self, trainer):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        # state.epoch is fractional after a resume mid-epoch (1.5 is still epoch 1) and exact at epoch ends
        self.trainer._trace_epoch = int(math.floor((state.epoch or 0) + 1e-9))

    def on_optimizer_step(self, args, state, control, **kwargs):
        # the optimizer step ran: a crash from here on (logging, saving, evaluation, a callback) leaves a completed step
        writer = self.trainer._trace_writer
        if writer is not None:
            writer.mark_completed(state.global_step)
            sealing.code_at_first_step(self.trainer)  # the code its steps ran, kept if the launch is killed later

    def on_train_end(self, args, state, control, **kwargs):
        sealing.finish(self.trainer)


class RecordingHooks(WeightsFollowUmask):
    """The ``transformers.Trainer`` hooks of a recording, shared by the recording and the replays (a replay writes
    a trace of its own). The arguments are documented on :class:`hf_unlearn.trace.recording.TraceRecordingMixin`,
    the public mixin, which adds the self-check or proof when ``train()`` ends (it runs the replay engine, which
    sits above these hooks)."""

    _is_replay = False
    _trace_machinery = True  # not the user's trainer: skipped when the recorded trainer class is looked up

    def __init__(self, *args, trace_dir: str | os.PathLike | None = None, trace_checkpoint_steps: int | None = None,
                 trace_key: bytes | None = None, id_column: str = "id", dummy_token_id: int | None = None,
                 trace_allow_hazards: bool = False, trace_self_check: bool | int | str = True,
                 trace_checkpoint_retention: str = "geometric",
                 trace_checkpoint_budget: int | None = None, trace_frozen_source: str | os.PathLike | None = None,
                 trace_guards: bool = True, trace_parent: str | os.PathLike | None = None, **kwargs):
        check_trainer_class(type(self))  # trainers that generate their data; DPO without its pair dummies
        if trace_checkpoint_retention not in MODES:
            raise UnlearnError(f"trace_checkpoint_retention must be one of {MODES}, not {trace_checkpoint_retention!r}")
        for name, value in (("trace_checkpoint_steps", trace_checkpoint_steps),
                            ("trace_checkpoint_budget", trace_checkpoint_budget),
                            ("trace_self_check", None if isinstance(trace_self_check, bool) or trace_self_check == "all"
                             else trace_self_check)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UnlearnError(f"{name} must be a positive int (or None for the default), not {value!r}")
        self._trace_arguments = {} if self._is_replay else bound_arguments(super().__init__, args, kwargs)
        given = self._trace_arguments.get("args")
        if given is not None and getattr(given, "push_to_hub", False):  # before the Trainer creates the Hub repo
            refuse_uploading_the_trace(given, trace_dir, "push_to_hub=True")
        raw = self._trace_arguments.get("train_dataset")
        raw_ids = list(raw[id_column]) if id_column in getattr(raw, "column_names", ()) else None
        # before the Trainer moves the model: cuBLAS reads its workspace setting when it first runs (replays too)
        prepare_cuda_determinism(self._trace_arguments.get("args", kwargs.get("args")))
        self._trace_id_column = id_column  # SFTTrainer prepares (and packs) its dataset inside its constructor
        super().__init__(*args, **kwargs)
        tracker = None if self._is_replay else tracker_uploading_output(self.callback_handler.callbacks)
        if tracker:
            refuse_uploading_the_trace(self.args, trace_dir, tracker)
        self.trace_self_check = trace_self_check
        self.trace_guards = trace_guards
        self._trace_guard = None  # the live program guard while recording (hf_unlearn.trace.guards)
        self._trace_program_callbacks: list = []  # the user's callbacks a replay runs again, in order
        self._trace_check_ref: dict | None = None  # the state hashes the self-check must reproduce (in memory)
        self.trace_dir = Path(trace_dir) if trace_dir is not None else Path(self.args.output_dir) / "trace"
        self.trace_checkpoint_steps = trace_checkpoint_steps
        self.trace_checkpoint_retention = trace_checkpoint_retention
        self.trace_checkpoint_budget = trace_checkpoint_budget
        self.trace_frozen_source = trace_frozen_source
        self.trace_parent = trace_parent
        self.id_column = id_column
        self.dummy_token_id = dummy_token_id if dummy_token_id is not None else slots.default_dummy_token(self)
        self.trace_allow_hazards = trace_allow_hazards
        self._trace_key_arg = trace_key
        self._trace_writer: TraceWriter | None = None
        self._trace_started = False
        self._trace_seeds: deque = deque()
        self._trace_epoch = 0
        self._trace_mb = 0
        self._trace_saved: set[int] = set()
        self._trace_header: dict = {}
        self._trace_lens: dict = {}
        self._trace_groups = None
        self._trace_resume = None
        self._trace_non_finite: str | None = None  # the first NaN/inf loss or state while recording
        self._trace_optimizer_source = optimizers.optimizer_source(self)
        # first, so a user callback that fails right after an optimizer step cannot hide that the step completed
        self.callback_handler.callbacks.insert(0, _TraceCallback(self))
        if not self._is_replay:
            self.callback_handler.call_event = functools.partial(program.guarded_call_event, self)
        self._trace_dropped, self._trace_trainer, self._trace_probed = [], {}, False
        if not self._is_replay:
            self._trace_trainer = preflight.recorded_trainer(self)
            self._trace_dropped = slots.dropped_rows(self, raw_ids)
            self._trace_check_parallelism()
            if self.train_dataset is not None:
                self.trace_preflight()

    # ---- what a replay can reproduce, checked up front ----------------------------------------------------
    def trace_preflight(self) -> tuple:
        """Check that a replay can reproduce this run; return ``(served rows, hazards, notes)``.

        Errors (an unusable dataset, a collator that gives a deleted slot weight, an optimizer or adapter a replay
        cannot rebuild) raise :class:`UnlearnError`; hazards (the replay would run but differ) raise too unless
        ``trace_allow_hazards``. Run at construction, again when training starts (:mod:`.preflight`).
        """
        return preflight.preflight(self)

    def _trace_check_parallelism(self) -> None:
        """Only single-process, DDP-style data parallel and FSDP2 runs are replayable; refuse the rest here."""
        launch.check_parallelism(self)

    def _trace_served(self, dataset):
        """The rows the dataloader serves: unused columns removed as ``Trainer`` does, the id column kept."""
        if not self.args.remove_unused_columns:
            return dataset
        self._set_signature_columns_if_needed()
        cols = self._signature_columns
        added = [c for c in (self.id_column, PACKED_IDS) if c not in cols]
        cols.extend(added)
        try:
            return super()._remove_unused_columns(dataset, description="training")
        finally:
            for c in added:
                cols.remove(c)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name, *rest, **kw):
        """SFTTrainer's dataset preparation; when it packs the training rows (bfd / bfd_split), with the document
        map a deletion needs (:func:`hf_unlearn.trace.packing.pack_with_documents`)."""
        prepare = super()._prepare_dataset
        if self._is_replay or not packing or dataset_name != "train" or args.packing_strategy not in SUPPORTED:
            return prepare(dataset, processing_class, args, packing, formatting_func, dataset_name, *rest, **kw)
        return pack_with_documents(lambda *a: prepare(*a, *rest, **kw), dataset, processing_class, args,
                                   formatting_func, dataset_name, self._trace_id_column)

    def _remove_unused_columns(self, dataset, description=None):
        if not self._is_replay and str(description).lower() == "training":
            return self._trace_served(dataset)
        return super()._remove_unused_columns(dataset, description=description)

    # ---- what a slot's row and its dummy are (hf_unlearn.trace.preference overrides these for DPO's pairs) -----
    _trace_token_column = "input_ids"

    def _trace_row_lengths(self, served) -> list[int]:
        return [len(x) for x in served["input_ids"]]

    def _trace_row_length(self, row: dict) -> int:
        return len(row["input_ids"])

    def _trace_dummy_row(self, template: dict, length: int, token: int) -> dict:
        return dummy_row(template, length, token, self.id_column)

    def _trace_dummy_has_weight(self, collator, row: dict) -> bool:
        return dummy_has_weight(collator, row)

    def _trace_masked_row(self, row: dict) -> dict | None:
        """``row`` with no weight and its tokens kept (labels ignored, completion and assistant masks zeroed), as the
        counterfactual trains a deleted row; None for a row with none of those columns (its weight is the
        collator's)."""
        return masked_row(row)

    def _trace_dummies_only_run(self, entry) -> bool:
        """Whether a replay runs a microbatch of dummies only: yes with a recorded loss normaliser (its loss and
        gradient are exactly 0), and without one where the recording's probe found the loss of such a microbatch
        finite (a sum divided by at least 1: the plain run steps on its zero gradients); not where it is a
        per-microbatch mean, which over no token is NaN (DPO's per-pair mean keeps the dummies' slots: it runs)."""
        return entry.norm is not None or self.run.header["trainer"].get("dummies_only_loss") == "finite"

    def _check_dummy_has_no_influence(self, row: dict) -> str | None:
        """The dummy-weight probe of a custom ``compute_loss`` (:func:`.probe.check_dummy_has_no_influence`; DPO's
        pairs have their own); a hazard it found, where hazards are allowed."""
        return probe.check_dummy_has_no_influence(self, row)

    def _trace_start_weights(self, header: dict) -> None:
        """Called when the header's ``lineage`` was just computed from the weights training starts from (DPO: an
        adapter-disabled reference's root is theirs)."""

    def _trace_replay_arguments(self, run, given: dict) -> dict:
        """Constructor arguments a replay of ``run`` adds for the recorded trainer (DPO: its reference model)."""
        return {}

    def _trace_changed_during_training(self) -> str | None:
        """Why something a replay rebuilds from the run's record changed while training (DPO: the reference), or
        None; checked when training ends and sealed into the run as not reproducible."""
        return None

    # ---- training ----------------------------------------------------------------------------------------
    def push_to_hub(self, *args, **kwargs):
        if not self._is_replay:
            refuse_uploading_the_trace(self.args, self.trace_dir, "push_to_hub()")
        return super().push_to_hub(*args, **kwargs)

    def _push_from_checkpoint(self, checkpoint_folder):
        if not self._is_replay:  # push_to_hub=True set on the arguments after construction
            refuse_uploading_the_trace(self.args, self.trace_dir, "push_to_hub=True")
        return super()._push_from_checkpoint(checkpoint_folder)

    def get_train_dataloader(self):
        collator = self.data_collator
        self.data_collator = IdCarryingCollator(collator, self.id_column)
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = collator

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        self._trace_resume = resume_from_checkpoint
        self._trace_writer = None
        self._trace_started = False
        if resume_from_checkpoint and self.is_fsdp_enabled and not self._is_replay:
            raise UnlearnError("resuming an FSDP2 recording is not supported (its processes would disagree on the "
                               "checkpoints already written); record the run again into a new trace_dir")
        if not resume_from_checkpoint and has_plan(self.trace_dir):
            raise UnlearnError(f"{self.trace_dir} already holds a recorded run; pass a new trace_dir "
                               "(or resume_from_checkpoint)")
        self.accelerator.wait_for_everyone()  # every process checked before the main one writes
        self._trace_train_started = time.perf_counter()
        with watching() as self._trace_environment_reads, files_read(  # what the run's own code reads (sealed)
                (self.trace_dir, self.args.output_dir), lambda: self.state.global_step) as self._trace_file_reads:
            output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        try:
            self._trace_after_train()
            self.accelerator.wait_for_everyone()  # train() returns on every process once the header is sealed
        finally:  # the live tensors are the user's from now on (merge_and_unload edits them in place)
            release_live()
        return output

    def _trace_after_train(self) -> None:
        """Extension point: what runs once ``train()`` has sealed the run (the public recording mixin proves it;
        a replay, checked step by step as it runs, needs nothing more)."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batch_samples:
            return batch_samples, num_items
        if not self._trace_started:
            start(self)
        step = self.state.global_step
        if self._trace_guard is not None:
            lr0, group_lrs = segments.lr_record(self)
            self._trace_guard.between_steps(step, group_lrs or [lr0] * len(self.optimizer.param_groups))
        if (self._trace_writer is not None or keeper.shard_peer(self)) and step not in self._trace_saved and is_due(
                step, self._trace_total, self._trace_every, self.trace_checkpoint_retention):
            keeper.checkpoint(self, step)
        if (self._trace_writer is not None or selfcheck.peer(self)) and step == selfcheck.steps(self):
            selfcheck.keep_reference(self, step)  # every process of a multi-process run: each replays the self-check
        per_rank = segments.collect(self, batch_samples)
        rank, n_mb = self.accelerator.process_index, len(per_rank[0][0])
        base = self._trace_header_seed
        self._trace_seeds.clear()
        self._trace_seeds.extend(rank_seed(microbatch_seed(base, step, j), rank) for j in range(n_mb))
        if self._trace_writer is not None:
            self._trace_writer.append(segments.entries(self, step, per_rank, num_items))
        return batch_samples, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self._trace_seeds:
            return super().training_step(model, inputs, num_items_in_batch)
        with seeded(self._trace_seeds.popleft()):
            loss = super().training_step(model, inputs, num_items_in_batch)
        if not self._is_replay and self._trace_non_finite is None and torch.is_tensor(loss) \
                and not bool(torch.isfinite(loss).all()):  # Trainer itself syncs on the loss each microbatch
            non_finite_hazard(self, f"the loss was not finite ({float(loss.detach().float().mean())}) at optimizer "
                                    f"step {self.state.global_step}")
        return loss

    def _finalize_training(self, *args, **kwargs):
        # Seal before the Trainer may load the best checkpoint (load_best_model_at_end): the trace's final
        # checkpoint is the state after the last recorded step. (The callback's on_train_end is the fallback.)
        sealing.finish(self)
        return super()._finalize_training(*args, **kwargs)

    def _trace_header_dict(self, served, fingerprint: str, hazards: list[str], notes: list[str]) -> dict:
        """The run's header (:func:`.header.build`; ``PreferenceTraceMixin`` adds DPO's reference model)."""
        return header.build(self, served, fingerprint, hazards, notes)


class RecordingHooksTrainer(RecordingHooks, Trainer):
    """``transformers.Trainer`` with the recording hooks (the replays' base; users record with
    :class:`hf_unlearn.trace.recording.TraceRecordingTrainer`)."""

    _trace_machinery = True


@functools.cache
def with_recording(trainer_cls, mixin=RecordingHooks, plain=RecordingHooksTrainer):
    """``trainer_cls`` with ``mixin`` (a :class:`RecordingHooks`) put first among its bases, TRL style, and the DPO
    mixins a preference trainer needs before it; ``plain`` for ``Trainer`` itself; a class that already records is
    returned as it is."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise UnlearnError(f"trace_recording() takes a transformers.Trainer subclass, not {trainer_cls!r}")
    if issubclass(trainer_cls, RecordingHooks):
        return trainer_cls
    extra = preference_mixins(trainer_cls)  # refuses trainers that generate their own data
    if trainer_cls is Trainer:
        return plain
    return type(f"TraceRecording{trainer_cls.__name__}", (*extra, mixin, trainer_cls),
                {"__module__": RECORDING_MODULE, "__doc__": f"{trainer_cls.__qualname__} recording a replayable trace.",
                 "_trace_machinery": True})
