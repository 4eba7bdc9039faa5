"""TraceRecordingTrainer: a drop-in ``Trainer`` that records everything an exact deletion needs.

It changes no arithmetic. At construction it checks that a replay can reproduce the run and refuses what it
could not (see :meth:`TraceRecordingTrainer.trace_preflight`). During training it hooks:

* ``get_train_dataloader``: the user's collator is wrapped so it never sees the id column (any collator works,
  with int or string ids); the ids travel beside the batch;
* ``get_batch_samples`` (called once per optimizer step with the whole accumulation segment): writes the
  segment's plan entries and WAL records *before* the segment runs, with the loss normaliser
  ``num_items_in_batch`` the Trainer just computed, the learning rate the scheduler set, every process's slots
  (data parallel) and a digest of every collated batch; saves a checkpoint every ``trace_checkpoint_steps``;
* ``training_step``: each microbatch runs under ``torch.random.fork_rng`` seeded with its recorded seed, so
  dropout and NEFTune noise are reproducible microbatch by microbatch and the global RNG stream (data order) is
  untouched: a run with dropout 0 is bit-identical to a plain ``Trainer`` run.

The hooks live in :mod:`hf_unlearn.trace.recorder` (one job per module), shared with the replay engine; this module
adds what runs when ``train()`` ends: the replay engine proves the recording (its first steps, or the whole run)
and the outcome is sealed into the run. It sits above the replay engine for that reason.
"""

from __future__ import annotations

import time
import warnings

from transformers import Trainer

from ..errors import UnlearnError
from . import longest_microbatch, recorder
from .proof import AUTO_PROVE_SECONDS, prove
from .recorder import (  # noqa: F401 - the recording's public names, at the path users import them from
    GUARD_CHECKS,
    HUB_ID_OR_PATH,
    IGNORE_INDEX,
    PATH_ARGS,
    PROCESS_LOCAL_ARGS,
    SameOptimizerSettings,
    TraceWriter,
    _jsonable,
    batch_digest,
    build_optimizer,
    collator_spec,
    dropout_settings,
    dummy_has_weight,
    dummy_row,
    dynamic_rope,
    first_non_finite,
    frozen_parameters,
    keyed_batch_digest,
    microbatch_seed,
    optimizer_spec,
    peft_and_base,
    rank_seed,
    rebuild_collator,
    recorded_trainer_class,
    save_checkpoint,
    seeded,
)
from .recorder.mixin import RecordingHooks, with_recording
from .rng import rng_kept
from .run import open_run
from .self_check import self_check


class TraceRecordingMixin(RecordingHooks):
    """Records a replayable trace of the run in ``trace_dir`` (default ``output_dir/trace``); put it first among
    the bases of any ``Trainer`` subclass (:func:`trace_recording` does it for you, e.g. for ``trl.SFTTrainer``).

    The trainer class, its config class and its extra constructor arguments are recorded, so replays rebuild the
    same trainer and run its own ``compute_loss``; a class a replay could not import is refused at construction.

    Args (beyond the trainer's own):
        trace_dir: folder of the recorded run (see :mod:`hf_unlearn.trace.run` for its layout).
        trace_checkpoint_steps: the dense checkpoint spacing K: model + optimizer state is written every K
            optimizer steps (default: T // 32 with geometric retention, ceil(T / 10) with even retention, T the
            planned number of steps). Suffix replays start from the latest kept checkpoint before the first
            affected step.
        trace_checkpoint_retention: ``"geometric"`` (default): the dense checkpoints are thinned while training
            so that a deletion whose first affected step is s replays at most 2 (T - s) + K steps, with about
            log2(T / K) + 1 checkpoints kept (:mod:`hf_unlearn.trace.retention`); ``"even"``: all kept.
        trace_checkpoint_budget: bytes the kept checkpoints may take (frozen tensors counted once); geometric
            retention then keeps fewer, with a larger replay bound (logged, written to the run and printed by
            ``inspect`` and ``cost``). Refused, at the first checkpoint after step 0 (its size sets the count),
            when two checkpoints (step 0 and the end) do not fit.
        trace_frozen_source: the model folder (``from_pretrained``) the frozen weights came from: frozen tensors
            found there bit for bit are referenced, not copied into the run (checked by their hashes at every
            load; moving or editing the folder makes the run refuse to load). Default: saved once in the run.
        trace_key: the HMAC key for id tags (bytes), kept in ``trace_dir/private/hmac.key``; default: the
            library's one key (:mod:`hf_unlearn.keys`), so cards and deletion logs carry matching tags.
        id_column: the dataset column with the stable sample id (int or str; the collator never sees it).
        dummy_token_id: the token of the dummy sequence that fills deleted slots (default: the collator's pad
            token, else 0). The collator must give the dummy no label (checked at construction).
        trace_allow_hazards: record even if the run has hazards a replay cannot reproduce (a random collator,
            fp16 loss scaling, ...). They are written to the header and printed by ``inspect`` and ``verify``,
            whose verdicts then do not cover them. Default: refuse at construction.
        trace_self_check: the recorder hashes its own state (parameters and optimizer state) after the first
            optimizer step, in memory; when ``train()`` ends it replays that step from the step-0 checkpoint with
            the replay engine (model, collator and optimizer rebuilt from the trace) and compares. The outcome is
            sealed into the run (``header.json`` ``fidelity``) and a run the engine does not reproduce gets every
            replay and verdict refused (see :mod:`hf_unlearn.trace.fidelity`). An int N checks the first N steps
            (and every recorded checkpoint among them). Costs about one optimizer step, a model rebuild and two
            state hashes. ``"all"``: the whole run proven when ``train()`` ends (:func:`hf_unlearn.trace.proof.prove`:
            every step's state matched, about one training run's compute; deletions are VERIFIED only on proven
            steps). Default ``True``: ``"all"`` when training took at most
            :data:`~hf_unlearn.trace.proof.AUTO_PROVE_SECONDS`, else N = 1 (then ``hf-unlearn trace prove RUN``);
            ``False``: off.
        trace_guards: check the training program at every optimizer step (:mod:`hf_unlearn.trace.guards`): the
            learning rate each param group holds when ``optimizer.step()`` runs, the trainable set, every module's
            mode and plain attributes, and in-place edits of parameters, buffers and optimizer state; a change no
            recorded callback made marks the run (step, cause), and each step's fingerprint goes into the plan so
            replays check themselves step by step. Default: on; ``False`` leaves deletions of the run unverifiable.
        trace_parent: the recorded run (or ``forget`` output folder) whose output the model is, when it cannot be
            found from where the model was loaded (:mod:`hf_unlearn.trace.lineage`); checked: refused when that
            run's output weights are not the model's. Found or not, the starting weights' root is recorded.
    """

    _trace_machinery = True  # not the user's trainer: skipped when the recorded trainer class is looked up

    def _trace_after_train(self) -> None:
        prove_recording(self)


class TraceRecordingTrainer(TraceRecordingMixin, Trainer):
    """``transformers.Trainer`` with :class:`TraceRecordingMixin`: swap the class in a training script."""

    _trace_machinery = True


def trace_recording(trainer_cls):
    """The recording version of any ``Trainer`` subclass, TRL style: ``trace_recording(SFTTrainer)(model=...,
    args=SFTConfig(...), train_dataset=ds, processing_class=tok)`` records exactly what ``SFTTrainer`` would train.
    """
    return with_recording(trainer_cls, TraceRecordingMixin, TraceRecordingTrainer)


def prove_recording(trainer) -> None:
    """Prove the replay engine on this run (its first checkpoint interval) and seal the outcome into it. With more
    than one process (DDP, FSDP2) every process replays at the recorded world size; the main process decides
    whether it runs (and tells the others) and seals the verdict once."""
    if trainer._is_replay or not trainer._trace_started:
        return
    main = trainer.accelerator.is_main_process
    header = trainer._trace_header if main else None
    fid = header.setdefault("fidelity", {}) if main and header.get("sealed") else None
    # fid["recording"] already set: decided when sealing (a buffer changed during training)
    run = [fid is not None and not fid.get("recording") and bool(trainer.trace_self_check),
           bool(main and fid is not None and header["collator"].get("rebuildable")), _prove_all(trainer)]
    if trainer.accelerator.num_processes > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(run, src=0)
    record, failed = None, None
    if run[0] and run[2]:  # the whole run proven (hf_unlearn.trace.proof): every step's state reproduced
        try:
            with rng_kept():
                record = prove(trainer.trace_dir, data_collator=None if run[1] else trainer.data_collator,
                               progress=not trainer.args.disable_tqdm, seal=False)
        except UnlearnError as e:  # a run the engine cannot prove as a whole (a resumed recording without
            # every step's fingerprint, a random collator allowed as a hazard, ...): never a crash at the end of
            # train(); the self-check below decides, as for a longer run, and deletions name why (proof_failed)
            failed = str(e)
            warnings.warn(f"{trainer.trace_dir}: the run was not proven at the end of recording ({e}); the "
                          "first step(s) are self-checked instead", stacklevel=2)
    if record is not None:
        trainer._trace_check_ref = None
        if fid is not None:
            fid["proof"] = record
            # the steps it reproduced from step 0 (a divergence later is the proof's, fidelity.proof: a
            # deletion that passes it is never VERIFIED); one at step 0 refuses every replay, as the self-check's
            upto = (record["steps"] or [0, -1])[1] + 1
            fid["recording"] = {"checked": True, "reproduced": upto > 0,
                                "steps": [0, upto if upto else record["total_steps"]], "by": "proof",
                                "against": "the recording's per-step state fingerprints and kept checkpoints",
                                **({"why": record["diverged"]["why"]} if not upto else {}),
                                "cpu_seconds": record["cpu_seconds"], "wall_seconds": record["wall_seconds"]}
    elif run[0]:
        with rng_kept():
            result = self_check(trainer.trace_dir, data_collator=None if run[1] else trainer.data_collator,
                                reference=trainer._trace_check_ref)
        trainer._trace_check_ref = None
        if fid is not None:
            fid["recording"] = {**result, **({"proof_failed": failed} if failed else {})}
    elif fid is not None and not fid.get("recording"):
        fid["recording"] = {"checked": False, "why": "trace_self_check=False"}
    else:
        return
    if fid is not None and run[0] and (fid.get("recording") or {}).get("reproduced"):
        # the run's longest microbatch, as the engine computes it here: every deleting process must compute the same
        with rng_kept():
            longest = longest_microbatch.reference(open_run(trainer.trace_dir).kept(),
                                                   data_collator=None if run[1] else trainer.data_collator)
        if longest:
            fid[longest_microbatch.KEY] = longest
    if fid is not None:
        TraceWriter(trainer.trace_dir, trainer._trace_key).reseal_header(header)


def _prove_all(trainer) -> bool:
    """Whether the end of recording proves the whole run: ``trace_self_check="all"``, or the default (True) on a
    run whose training took at most :data:`~hf_unlearn.trace.proof.AUTO_PROVE_SECONDS` (the proof costs about
    as much again); a longer run gets the first step checked, and ``hf-unlearn trace prove`` when convenient."""
    if not trainer.trace_guards:  # no per-step fingerprints to prove against: the self-check's steps only
        return False
    if trainer.trace_self_check == "all":
        return True
    if trainer.trace_self_check is not True:
        return False
    return time.perf_counter() - getattr(trainer, "_trace_train_started", 0.0) <= AUTO_PROVE_SECONDS



# the recorder's public names but its hooks' own classes, and the public recording's
__all__ = sorted((set(recorder.__all__) - {"RecordingHooks", "RecordingHooksTrainer", "with_recording"})
                 | {"TraceRecordingMixin", "TraceRecordingTrainer", "trace_recording"})
