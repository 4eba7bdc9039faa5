"""Replay of a recorded plan: the redacted replay, the trace oracle, and the naive ``filter`` baseline.

One engine serves all of them, so "replay == oracle" tests the redaction, not two implementations:

* every microbatch runs under its recorded seed, the recorded learning rate is written into the optimizer's
  param groups, and the recorded loss normaliser is passed as ``num_items_in_batch``;
* a deleted slot is filled by a fixed dummy sequence of the recorded length (``dummy_token_id`` everywhere,
  full attention mask, every label ``-100``): its loss and gradient are exactly zero and the microbatch keeps
  its shape; a microbatch of dummies only is skipped, and a segment with no weighted slot keeps its boundary
  but takes no optimizer step (moments and step counter untouched);
* the arithmetic is ``Trainer.training_step``, ``Trainer._clip_grad_norm`` and the optimizer's own ``step``,
  exactly as in the recorded run, so replaying an unaffected prefix reproduces the recorded checkpoints bit
  for bit, and a suffix replay from a checkpoint equals a full replay.

The redacted replay reads only the redacted store; the oracle reads the original store and fills the deleted
slots with the same dummies. A replay's output folder is itself a recorded run (plan, WAL, checkpoints, store),
so a later request can suffix-replay from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import shutil
import time
import uuid
from pathlib import Path

import torch
from transformers import PrinterCallback, Trainer, TrainingArguments

from ..errors import UnlearnError
from ..hub.mixin import UnlearningHubMixin
from .dummies import DummyInfluenceError, dummy_influence_message, dummy_positions, watch_dummy_gradient
from .fidelity import (
    check_against_checkpoint,
    check_against_state,
    check_device,
    fidelity_statement,
    refusal,
    restore_layout,
)
from .guards import VOLATILE_CONFIG
from .hashing import batch_digest
from .packing import (
    check_redacted_row,
    deleted_spans,
    document_ids,
    emptied_rows,
    is_packed,
    load_map,
    with_dummies,
)
from .plan import PlanEntry
from .processes import agreed
from .recording import (
    TraceRecordingTrainer,
    TraceWriter,
    _jsonable,
    build_optimizer,
    keyed_batch_digest,
    rank_seed,
    seeded,
)
from .request import _check_types, forget_tags, never_trained_tags  # noqa: F401  (they lived here)
from .run import (
    TraceRun,
    append_deletion_log,
    capture_state,
    checkpoint_dir,
    full_model_state,
    load_checkpoint,
    open_run,
    read_deletion_log,
)
from .sharding import check_replay, load_optimizer_state, replay_arguments
from .stack import check_stack, pinned_stack
from .store import check_store_binding, id_index, load_store, store_sha256
from .tags import tag

IGNORE_INDEX = -100

# TrainingArguments that change a replay's arithmetic: a replay given its own args must agree on all of them.
REPLAY_ARGS = ("neftune_noise_alpha", "max_grad_norm", "optim", "optim_args", "weight_decay", "adam_beta1",
               "adam_beta2", "adam_epsilon", "learning_rate", "label_smoothing_factor", "bf16", "fp16", "tf32",
               "average_tokens_across_devices", "gradient_checkpointing", "gradient_checkpointing_kwargs",
               "torch_compile", "use_liger_kernel", "seed")
# what a recorded run did besides training that a replay does not do (it would need an eval set, or write checkpoints)
NOT_REPLAYED = {"eval_strategy": "no", "save_strategy": "no", "load_best_model_at_end": False, "eval_on_start": False,
                "do_eval": False}
# the naive baselines drop or re-batch whole store rows; a packed row holds several documents
PACKED_BASELINE = ("the {name} baseline drops whole rows, and a packed run's rows hold several documents, so it is not "
                   "defined for packing=True runs; compare the replay with the oracle (trace oracle, trace verify)")
PAIRS_BASELINE = ("the repack baseline retrains with Trainer's own loss, which is not DPO's (pairs, a reference model): "
                  "it is not defined for DPO runs; compare the replay with the oracle (trace oracle without --baselines)")
# config keys that say where a model came from, not what it computes
_VOLATILE_CONFIG = VOLATILE_CONFIG


# ---- planning ----------------------------------------------------------------------------------------------
def already_deleted(run: TraceRun, forget_ids) -> list:
    """The ids among ``forget_ids`` that are absent from the store: an earlier request deleted them (the run's
    deletion log has their tags) or the trainer dropped them before training (:func:`never_trained_tags`)."""
    logged = {t for entry in read_deletion_log(run.path) for t in entry.get("forget_tags", [])}
    logged |= never_trained_tags(run)
    key = run.key
    return [i for i in dict.fromkeys(forget_ids) if tag(key, i) in logged]


def emptied_steps(plan: list[PlanEntry], tags: set[str]) -> list[int]:
    """Steps whose every slot is deleted (now or before): they keep their boundary but take no optimizer step."""
    weighted: dict[int, bool] = {}
    for e in plan:
        weighted[e.step] = weighted.get(e.step, False) or any(s is not None and s not in tags for s in e.slots)
    return sorted(step for step, w in weighted.items() if not w)


def replay_cost(run: TraceRun, forget_ids) -> dict:
    """Where a suffix replay starts and how much of the run it re-executes (0 steps: nothing left to replay).

    ``minimum_steps`` is the physical limit of a trace-preserving deletion (``T - s``, ``s`` the first affected
    step); ``steps_to_replay / minimum_steps`` is what the kept checkpoints cost on top of it, and ``bound_steps``
    the most the run's retention rule allows (``factor * (T - s) + K``; None for runs without one). In a
    multi-epoch run the ids' first occurrence (its epoch) sets the start; every later occurrence is replayed too.
    """
    run = (run if isinstance(run, TraceRun) else open_run(run, check_checkpoints=False)).kept()
    tags = forget_tags(run, forget_ids)
    hit_rows, gone = set(), tags
    if is_packed(run.header):  # the packed rows that hold a fragment of a deleted document
        doc_map = load_map(run)
        spans = deleted_spans(doc_map, tags)
        hit_rows, gone = set(spans), emptied_rows(doc_map, tags)
    hits = [e for e in run.plan if (tags | hit_rows) & set(e.slots)]
    affected = sorted({e.step for e in hits})
    total = run.total_steps
    cps = sorted(run.checkpoints())
    first = affected[0] if affected else total
    start = max([c for c in cps if c <= first], default=None)
    if start is None:
        raise UnlearnError(f"{run.path} has no checkpoint at or before step {first}; cannot replay")
    n_ids = len(set(forget_ids))
    dropped = never_trained_tags(run)
    never = sum(tag(run.key, i) in dropped for i in set(forget_ids))
    retention = run.header.get("checkpoint_retention") or {}
    minimum = total - first
    bound = None
    if retention.get("mode") == "geometric" and affected:
        bound = retention.get("factor", 2) * minimum + retention.get("every", 0)
    epochs = sorted({e.epoch for e in hits if e.epoch is not None})
    return {
        "forget_ids": n_ids,
        "already_deleted": n_ids - len(tags) - never,
        "never_trained": never,
        "slots_deleted": sum(s in tags for e in run.plan for s in e.slots),
        **({"packed_rows_touched": sum(s in hit_rows for e in run.plan for s in e.slots)} if hit_rows else {}),
        "affected_steps": len(affected),
        "first_affected_step": affected[0] if affected else None,
        "start_checkpoint": start,
        "steps_to_replay": total - start,
        "minimum_steps": minimum,
        "ratio_to_minimum": (total - start) / minimum if minimum else None,
        "bound_steps": bound,
        "epochs": epochs,
        "first_epoch": epochs[0] if epochs else None,
        "total_steps": total,
        "fraction_replayed": (total - start) / total if total else 0.0,
        "segments_emptied": len(emptied_steps(run.plan, gone)),
        "world_size": run.header.get("world_size", 1),
        **({"kept_step": total} if run.served_plan else {}),
    }


def describe_cost(cost: dict) -> list[str]:
    """The cost estimate as the lines ``trace cost`` and ``forget`` print before any compute."""
    if cost["first_affected_step"] is None:
        return [f"nothing to replay: the {cost['forget_ids']} id(s) were deleted by an earlier request"]
    ratio = cost["ratio_to_minimum"]
    lines = [f"suffix replay from checkpoint step {cost['start_checkpoint']}: {cost['steps_to_replay']} of "
             f"{cost['total_steps']} steps ({100 * cost['fraction_replayed']:.1f}% of the run); the minimum is "
             f"{cost['minimum_steps']} steps (T - s, first affected step s = {cost['first_affected_step']}), ratio "
             + (f"{ratio:.2f}" if ratio is not None else "n/a")
             + (f" (the run's retention bound: at most {cost['bound_steps']:g} steps)" if cost["bound_steps"] else "")]
    if cost.get("packed_rows_touched"):
        lines.append(f"packing: the documents sit in {cost['packed_rows_touched']} packed row slot(s), which stay; "
                     "their fragments become dummy tokens of the same length (the other documents are unchanged)")
    if len(cost["epochs"]) > 1:
        lines.append(f"the ids occur in epochs {cost['epochs']}: their first occurrence (epoch {cost['first_epoch']}, "
                     f"step {cost['first_affected_step']}) sets the start; the later ones are replayed with it")
    return lines


def training_args_from_header(header: dict, output_dir, **overrides) -> TrainingArguments:
    """Rebuild the run's config (TrainingArguments, or its recorded subclass such as SFTConfig): the optimizer,
    clipping and loss settings the replay must share; fields that only prepare data are set as
    :data:`~hf_unlearn.trace.trainers.CONSTRUCTION_ONLY` says (the store holds the prepared rows)."""
    from .trainers import CONSTRUCTION_ONLY, config_fields, recorded_trainer

    config_cls = recorded_trainer(header)[1]
    names = config_fields(config_cls)
    recorded = header["training_args"]
    kwargs = {k: v for k, v in recorded.items() if k in names and not k.endswith("_token") and "hub" not in k
              and k not in ("logging_dir", "deepspeed", "fsdp_config", "accelerator_config", "report_to", "run_name",
                            "resume_from_checkpoint", "output_dir", "fsdp", "parallelism_config")}
    kwargs = {k: v for k, v in kwargs.items() if not (isinstance(v, str) and v.startswith("<") and v.endswith(">"))}
    kwargs.update(output_dir=str(output_dir), report_to=[], disable_tqdm=True,
                  use_cpu=recorded.get("use_cpu", not torch.cuda.is_available()), **NOT_REPLAYED)
    if config_cls is not TrainingArguments:
        kwargs.update({k: v for k, v in CONSTRUCTION_ONLY.items() if k in names})
    kwargs.update(replay_arguments(header))  # an FSDP2 run: its recorded fsdp_config (hf_unlearn.trace.sharding)
    kwargs.update(overrides)
    return config_cls(**kwargs)


def without_evaluation(args: TrainingArguments) -> TrainingArguments:
    """``args`` with evaluation, checkpoint saving and best-model loading off (a replay only re-executes the plan;
    evaluating does not change the trace, and the kept model's step is a recorded control)."""
    if all(getattr(args, k) == v for k, v in NOT_REPLAYED.items()):
        return args
    return dataclasses.replace(args, **NOT_REPLAYED)


def _check_args(args: TrainingArguments, header: dict) -> None:
    from .trainers import CONSTRUCTION_ONLY, config_fields, recorded_trainer

    recorded, given = header["training_args"], args.to_dict()
    # the config subclass's own fields (SFTConfig: loss_type, padding_free, ...) count like REPLAY_ARGS
    own = sorted(config_fields(recorded_trainer(header)[1]) - config_fields(TrainingArguments) - set(CONSTRUCTION_ONLY))
    diff = [f"{k} ({_jsonable(given.get(k))!r} vs recorded {recorded.get(k)!r})" for k in (*REPLAY_ARGS, *own)
            if k in recorded and _jsonable(given.get(k)) != recorded.get(k)]
    if diff:
        raise UnlearnError(f"the replay's TrainingArguments differ from the recorded run's in {', '.join(diff)}: a "
                           "replay must run the recorded arithmetic (omit args= to rebuild them from the trace)")


def model_from_run(run: TraceRun, weights_follow: bool = False):
    """The run's model (its class, dtype, attention implementation and PEFT adapter) with fresh weights.

    ``weights_follow``: the caller loads a whole checkpoint into it (strictly) and restores the recorded layout, so
    when the run recorded its non-persistent buffers (every tensor is then overwritten) the random initialisation
    is skipped (seconds of CPU at 135M parameters; the weights are tied as ``init_weights`` would have).
    """
    import contextlib

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from ..utils import import_object

    info = run.header["model"]
    config = AutoConfig.from_pretrained(run.path / "model")
    try:
        cls = import_object(f"{info['module']}:{info['class']}")
    except (ImportError, AttributeError):
        cls = AutoModelForCausalLM
    kwargs = {"dtype": getattr(torch, info.get("dtype") or "float32")}
    if info.get("attn_implementation"):
        kwargs["attn_implementation"] = info["attn_implementation"]
    skip_init = weights_follow and (info.get("layout") or {}).get("buffers") is not None
    with no_init_weights() if skip_init else contextlib.nullcontext():
        model = (cls.from_config if cls is AutoModelForCausalLM else cls._from_config)(config, **kwargs)
    if skip_init:
        model.tie_weights()  # no_init_weights skips init_weights, which ties
    if info.get("peft"):
        from peft import PeftConfig, get_peft_model

        adapter = PeftConfig.from_pretrained(str(run.path / "model" / "adapter"))
        model = get_peft_model(model, adapter, adapter_name=info["peft"]["adapter_name"])
    if info.get("frozen_parameters") is not None:  # the same parameters frozen as in the recorded run
        frozen = set(info["frozen_parameters"])
        for name, p in model.named_parameters(remove_duplicate=False):
            p.requires_grad_(name not in frozen)
    return model


def _check_model(model, header: dict) -> None:
    """A model passed to a replay must be the recorded architecture (class, config, dtype, attention, adapter)."""
    from .recording import peft_and_base

    info = header["model"]
    peft, base = peft_and_base(model)
    problems = []
    if type(base).__name__ != info["class"]:
        problems.append(f"class {type(base).__name__} (recorded {info['class']})")
    if bool(peft) != bool(info.get("peft")):
        problems.append("a PEFT adapter" + (" it does not have" if info.get("peft") else " the run did not have"))
    dtype = str(next(base.parameters()).dtype).removeprefix("torch.")
    if info.get("dtype") and dtype != info["dtype"]:
        problems.append(f"dtype {dtype} (recorded {info['dtype']})")
    attn = getattr(base.config, "_attn_implementation", None)
    if info.get("attn_implementation") and attn != info["attn_implementation"]:
        problems.append(f"attention {attn} (recorded {info['attn_implementation']})")
    given, recorded = base.config.to_dict(), info.get("config") or {}
    keys = [k for k in sorted(set(given) | set(recorded)) if k not in _VOLATILE_CONFIG and given.get(k) != recorded.get(k)]
    if keys:
        problems.append("config " + ", ".join(f"{k}={given.get(k)!r} (recorded {recorded.get(k)!r})" for k in keys[:4]))
    from .recording import frozen_parameters

    if info.get("frozen_parameters") is not None and frozen_parameters(model) != info["frozen_parameters"]:
        problems.append("other frozen parameters (requires_grad) than the recorded run's")
    if problems:
        raise UnlearnError("the model passed to the replay is not the recorded one: " + "; ".join(problems)
                           + " (omit model= to rebuild it from the trace)")


# ---- the engine --------------------------------------------------------------------------------------------
class ReplayTrainer(UnlearningHubMixin, TraceRecordingTrainer):
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
    """

    mode = "replay"
    _fidelity_reference: dict = {}  # step -> hashes the replay must reach (set by the recording's self-check only)
    store_policy = "any"  # RedactedReplayTrainer: a redaction of the run's store; the oracle: the run's own store
    _is_replay = True
    _trace_machinery = True

    def __new__(cls, run=None, *args, **kwargs):
        # the replay runs the recorded trainer's own compute_loss: compose this class with the run's trainer class
        opened = run if isinstance(run, TraceRun) else open_run(kwargs.get("run", run))
        obj = super().__new__(replay_class(cls, opened.header))
        obj._opened_run = opened
        return obj

    def __init__(self, run, store=None, forget_ids=(), out_dir=None, start: str = "suffix", filter_rows: bool = False,
                 model=None, args=None, data_collator=None, stop_step: int | None = None, _self_check: bool = False,
                 start_weights: dict | None = None, start_parent: dict | None = None, **kwargs):
        self._start_weights, self._start_parent = start_weights, start_parent
        self.run = self.__dict__.pop("_opened_run", None) or (run if isinstance(run, TraceRun) else open_run(run))
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
            from ..data.collators import rebuild_collator

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
        if self.store_policy == "redacted" and self.forget_ids:
            stored = set(document_ids(self.store, self.id_column))
            present = [i for i in self.forget_ids if i in stored]
            if present:
                raise UnlearnError(f"the store {self.store_path} still holds {len(present)} id(s) to forget (e.g. "
                                   f"{present[:5]}); redact it first (hf-unlearn trace redact) and replay from the "
                                   "redacted store")
        self._tag_index = {tag(self.run.key, i): n for i, n in id_index(self.store, self.id_column).items()}
        self._template = {k: v for k, v in self.store[0].items() if k != self.id_column}
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
        self._start_state = load_checkpoint(cps[self.start_step], verify=True,  # FSDP2: this process's optimizer shards
                                            rank=self.args.process_index if self.run.header.get("sharding") else None)
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
        if not self.filter_rows:
            self._check_batches()
            from .rows import check_rows

            check_rows(self)  # the kept rows of the microbatches a deletion touches (hf_unlearn.trace.rows)
        self.accelerator.wait_for_everyone()  # every process checked the output folder before the main one writes

    # ---- set-up -------------------------------------------------------------------------------------------
    def _start_from_parent(self) -> None:
        """A pipeline stage whose parent changed: its step-0 state with the base weights replaced by the new parent's
        output (``start_weights``, plain names; adapter tensors and the optimizer's step-0 state stay as recorded).
        Every tensor must be there with the recorded shape and dtype."""
        from .base_source import base_key
        from .lineage import ADAPTER, weights_root

        if self.start_step != 0:
            raise UnlearnError("a replay from a new parent's weights starts at step 0 (start='full')")
        given, model = self._start_weights, dict(self._start_state["model"])
        for name, t in model.items():
            if ADAPTER.search(name):
                continue
            new = given.get(base_key(name))
            if new is None or tuple(new.shape) != tuple(t.shape) or new.dtype != t.dtype:
                what = "lacks it" if new is None else f"holds {tuple(new.shape)} {new.dtype}"
                raise UnlearnError(f"{self.run.path}: the new parent's output cannot be this stage's start: its "
                                   f"{base_key(name)} {what}, the stage started from {tuple(t.shape)} {t.dtype}")
            model[name] = new.detach().to("cpu").clone()
        self._start_state = {**self._start_state, "model": model, "frozen": []}
        full = full_model_state(self._start_state)
        self._start_root = weights_root(full)
        expected = (self._start_parent or {}).get("start_root") or (self._start_parent or {}).get("output_root")
        if expected is not None and expected != self._start_root:
            raise UnlearnError(f"{self.run.path}: the start weights (root {self._start_root[:16]}...) are not the new "
                               f"parent's output (root {expected[:16]}...)")

    def _setup_program(self) -> None:
        """The program a replay runs besides the plan (hf_unlearn.trace.guards): refused up front when the run
        changed outside its record at or after the start; the recorded callbacks rebuilt with their attributes at
        the start step; the recording's per-step fingerprints to compare with."""
        from .guards import ProgramChangedError, program_refusal, rebuild_callback, recorded_fingerprints

        full = self.run.served_plan or self.run.plan
        if not self._self_check and not self.filter_rows:  # the self-check finds it by its fingerprints instead
            why = program_refusal(self.run, self.start_step)
            if why:
                raise ProgramChangedError(f"{self.run.path}: {why}; refusing before any compute")
        self._recorded_fps = recorded_fingerprints(full, self.run.header)
        from .proof import neutral_controls

        self._neutral_controls = neutral_controls(self.run.header)  # proven steps whose controls differ, not the state
        # state.epoch during step s (the recording's, when its guards recorded it) and after the last step
        def epoch(text):
            return None if text is None else float.fromhex(text)

        self._epochs = {e.step: epoch(e.extra["ep"]) for e in full if e.j == 0 and "ep" in e.extra}
        final = ((self.run.header.get("fidelity") or {}).get("guards") or {}).get("final") or {}
        if "ep" in final:
            self._epochs[final["step"] + 1] = epoch(final["ep"])
        planned = (self.run.header.get("checkpoint_retention") or {}).get("planned_steps")
        self.state.max_steps = planned or self.run.total_steps  # as the recording's TrainerState held it
        self._step_fps: dict[int, dict] = {}
        self._fps_matched = {"state": [], "controls": []}
        specs = (self.run.header.get("trainer") or {}).get("callbacks") or []
        states = None
        for e in self.run.plan:
            if e.j == 0 and e.step <= self.start_step and "callbacks" in e.extra:
                states = e.extra["callbacks"]
        if specs and (states is None or len(states) != len(specs)):
            raise UnlearnError(f"{self.run.path} records {len(specs)} callback(s) a replay runs again but not their "
                               f"attributes at step {self.start_step}: the plan is not the one the recording wrote")
        self._program_callbacks = [rebuild_callback(spec, st) for spec, st in zip(specs, states or [])]
        self._out_cb_states = states

    def _event(self, event: str) -> None:
        """Run a recorded callback event as the recording's Trainer did at this point of the step."""
        if self._program_callbacks:
            from .guards import run_event

            run_event(self._program_callbacks, event, self.args, self.state, self.control, model=self.model,
                      processing_class=self.processing_class, optimizer=self.optimizer, lr_scheduler=None,
                      train_dataloader=None, eval_dataloader=None)

    def _recorded_trainer_arguments(self) -> dict:
        """What the run's own trainer class takes beyond model/args/collator: its recorded arguments, the store as
        its (already prepared) train_dataset and the saved tokenizer. Nothing for a plain ``Trainer`` run."""
        from .trainers import PROCESSING_CLASS_DIR, is_default, load_processing_class

        header = self.run.header
        if is_default(header):
            return {}
        out = {**header["trainer"].get("kwargs", {}), "train_dataset": self.store}
        if (self.run.path / PROCESSING_CLASS_DIR).is_dir():
            out["processing_class"] = load_processing_class(self.run.path / PROCESSING_CLASS_DIR)
        return out

    def _check_processes(self) -> None:
        self._trace_check_parallelism()
        recorded, world = self.run.header.get("world_size", 1), self.accelerator.num_processes
        if recorded != world:
            launch = "python (one process)" if recorded == 1 else f"accelerate launch --num_processes {recorded}"
            raise UnlearnError(f"the run was recorded with {recorded} process(es) and this replay has {world}: a replay "
                               f"must run at the recorded world size (run it with {launch}); other world sizes, FSDP1 "
                               "and DeepSpeed are not supported")
        check_replay(self.run.header, self)  # FSDP2: the recorded sharding (hf_unlearn.trace.sharding)
        if self.filter_rows and world > 1:
            raise UnlearnError("the naive filter baseline runs in one process only")
        if world > 1:  # every process deletes the same ids from the same start (each replays its own slots)
            from accelerate.utils import gather_object

            everyone = gather_object([(sorted(self.forget_tag_set), self.start_mode, self.store_kind)])
            if any(theirs != everyone[0] for theirs in everyone[1:]):
                raise UnlearnError("the processes of this replay were given different ids to forget, start or store: "
                                   "every process must replay the same request (give them the same --forget file)")

    def _start_step(self) -> int:
        if self.start_mode == "full":
            if 0 not in self.run.checkpoints():
                raise UnlearnError(f"{self.run.path} has no step-0 checkpoint; a full replay is impossible")
            return 0
        if self.start_mode != "suffix":
            raise UnlearnError(f"start must be 'suffix' or 'full', not {self.start_mode!r}")
        if self.forget_ids:
            return replay_cost(self.run, self.forget_ids)["start_checkpoint"]
        cps = [c for c in self.run.checkpoints() if c <= self.run.total_steps]
        return max(cps) if cps else self.run.total_steps

    def _check_rows(self) -> None:
        """Every retained slot of the replayed suffix must be in the store, with its recorded length."""
        missing = []
        for e in self.run.plan:
            if e.step < self.start_step:
                continue
            for s in e.slots:
                if s is None or s in self.forget_tag_set:
                    continue
                if s not in self._tag_index:
                    missing.append(f"step {e.step} microbatch {e.mb} slot tag {s}")
        if missing:
            raise UnlearnError(f"the store {self.store_path} is missing {len(missing)} retained row(s) the plan needs "
                               f"(e.g. {missing[0]}); it must be the run's store minus the deleted rows only")

    def _hit(self, e: PlanEntry) -> bool:
        """Whether the deletion changes microbatch ``e`` (a deleted row, or a packed row holding a deleted document)."""
        return any(s in self.forget_tag_set or s in self._spans for s in e.slots)

    def _weighted(self, s) -> bool:
        return s is not None and s not in self.forget_tag_set and s not in self._emptied

    def _check_packed_rows(self) -> None:
        """A packed row holding a deleted document: in a redacted store, only dummies where that document was (its
        fragments as the sealed map records them); in the original store, the map's fragments."""
        redacted = self.store_kind == "redacted"
        rows = sorted(self._spans)
        for s in rows:
            if s not in self._tag_index:
                continue  # reported by _check_rows when the replay needs it
            row = self.store[self._tag_index[s]]
            frags = self._packing_map[s]
            check_redacted_row(row, self._spans[s] if redacted else [], frags, self.dummy_token_id,
                               f"packed row {s} of the store {self.store_path}")

    def _check_batches(self) -> None:
        """Every microbatch the replay runs unchanged must collate to the batch the run recorded (before compute)."""
        world, key = self.accelerator.num_processes, self.run.key
        if self.run.compact:
            return self._check_batch_groups(world, key)
        for e in self.run.plan:
            if e.step < self.start_step or not e.batch or self._hit(e):
                continue
            for r in range(world):
                feats, dummy_pos = self._rows(e, keep_dummies=True, rank=r)
                digest = keyed_batch_digest(key, batch_digest(self._collate(feats, dummy_pos)))
                if digest != e.batch[r]:
                    raise UnlearnError(
                        f"microbatch {e.mb} (optimizer step {e.step}) does not collate to the batch the run recorded: "
                        "the collator, or the rows of the store, differ from the recording's; pass the collator the "
                        "run was recorded with (data_collator= / --collator)")

    def _batch_digests(self, e: PlanEntry, world: int) -> list[str]:
        return [keyed_batch_digest(self.run.key, batch_digest(self._collate(*self._rows(e, True, rank=r))))
                for r in range(world)]

    def _check_batch_groups(self, world: int, key: bytes) -> None:
        """A compacted run keeps one keyed MAC per group of whole segments (trace.compact): every group the replay
        runs unchanged is rebuilt and checked (groups holding a deleted row cannot be, and are skipped)."""
        from .compact import batch_mac

        plan, self._rebuilt_batches = self.run.plan, {}
        for a, b, mac in self.run.batch_groups():
            group = plan[a:b]
            if mac is None or len(group) != b - a or group[0].step < self.start_step or \
                    any(self._hit(e) for e in group):
                continue
            rebuilt = [dataclasses.replace(e, batch=self._batch_digests(e, world)) for e in group]
            if batch_mac(key, rebuilt) != mac:
                raise UnlearnError(
                    f"microbatches {a}-{b - 1} (optimizer steps {group[0].step}-{group[-1].step}) do not collate to the "
                    "batches the run recorded: the collator, or the rows of the store, differ from the recording's; "
                    "pass the collator the run was recorded with (data_collator= / --collator)")
            self._rebuilt_batches.update((e.mb, e.batch) for e in rebuilt)

    def _rows(self, e: PlanEntry, keep_dummies: bool, rank: int = 0,
              marked: list | None = None) -> tuple[list[dict], list[int]]:
        """The microbatch's rows for process ``rank``, deleted slots as dummies. ``marked``, a list, receives the same
        rows with another token in every dummy's place (deleted before included), which locates the dummies in the
        collated batch (:func:`~hf_unlearn.trace.dummies.dummy_positions`) without reading the store again."""
        lo, hi = e.rank_slots(rank, self.accelerator.num_processes)
        slots = e.slots[lo:hi]
        kept = [s for s in slots if s is not None and s not in self.forget_tag_set]
        # one Arrow read per microbatch, as the training DataLoader does (a read per row cost replays ~9% per step)
        columns = self.store[[self._tag_index[s] for s in kept]] if kept else {}
        names = [k for k in columns if k != self.id_column]
        fetched = iter(zip(*(columns[k] for k in names)))
        feats, dummy_pos = [], []
        marker = self.dummy_token_id + 1
        for s, n in zip(slots, e.lens[lo:hi]):
            if s is None or s in self.forget_tag_set:
                if keep_dummies:
                    dummy_pos.append(len(feats))
                    feats.append(self._trace_dummy_row(self._template, n, self.dummy_token_id))
                    if marked is not None:
                        marked.append(self._trace_dummy_row(self._template, n, marker))
                continue
            row = dict(zip(names, next(fetched)))
            if self._trace_row_length(row) != n:
                raise UnlearnError(f"store row for slot tag {s} has {self._trace_row_length(row)} tokens, the plan recorded "
                                   f"{n}: the store is not the one the run read")
            if marked is not None:  # a copy: a collator may assign into its features
                marked.append(with_dummies(row, self._dummy_spans[s], marker) if s in self._dummy_spans else dict(row))
            if s in self._spans:  # a packed row: its deleted documents become dummies of the same length
                row = with_dummies(row, self._spans[s], self.dummy_token_id)
            feats.append(row)
        return feats, dummy_pos

    def _holds_dummy(self, e: PlanEntry) -> bool:
        """Whether some process's part of microbatch ``e`` holds a dummy (from the plan: every process agrees)."""
        return not self.filter_rows and any(s is None or s in self.forget_tag_set or s in self._dummy_spans
                                            for s in e.slots)

    def _check_dummy_gradient(self, e: PlanEntry, watch, loss) -> None:
        """Stop at the first microbatch whose dummies got a non-zero gradient (all processes agree on the verdict)."""
        flag = watch.flag
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag.to(torch.float32), reduction="sum") > 0
        if bool(flag):
            from .trainers import recorded_trainer

            owner = f"{recorded_trainer(self.run.header)[0].__qualname__}.compute_loss"
            if self.compute_loss_func is not None:
                owner = f"compute_loss_func {getattr(self.compute_loss_func, '__qualname__', self.compute_loss_func)}"
            raise DummyInfluenceError(f"{self.run.path}: " + dummy_influence_message(owner, e.step, e.mb, loss,
                                                                                     float(watch.largest)))

    def _collate(self, feats: list[dict], dummy_pos: list[int]) -> dict:
        batch = self.data_collator(feats)
        labels = batch.get("labels")
        if dummy_pos and labels is not None and torch.is_tensor(labels) and labels.dim() >= 1 \
                and labels.shape[0] == len(feats) and (labels[dummy_pos] != IGNORE_INDEX).any():
            raise UnlearnError("the collator gave a dummy slot a label: deleted slots would not have weight 0")
        return batch

    def _normaliser(self, e: PlanEntry):
        if e.norm is None:
            return None
        if e.norm_dtype == "python":
            return int(e.norm) if float(e.norm).is_integer() else e.norm
        return torch.tensor(e.norm, dtype=getattr(torch, e.norm_dtype), device=self.args.device)

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
        with pinned_stack(self.run.header):
            return self._replay()

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
                agreed(self._check_step_fingerprint, step)
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
        final = capture_state(self.model, self.optimizer, run.total_steps, clone=True)
        self.replay_stats = {"start_step": start, "segments_replayed": replayed, "optimizer_steps_taken": stepped,
                             "total_steps": run.total_steps, "nothing_to_replay": replayed == 0,
                             "checkpoints_matched": list(self.checkpoints_matched),
                             "fingerprints_matched": step_ranges(self._fps_matched)}
        if writer:
            self._finish_output(writer)
        self.accelerator.wait_for_everyone()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        return final

    def _save_state(self, writer: TraceWriter | None, step: int) -> Path | None:
        """The output run's checkpoint at ``step`` (the main process writes it). A sharded run's is written by every
        process, its shards (:mod:`hf_unlearn.trace.shards`): the others keep its hashes for :meth:`_check_fidelity`."""
        if not self.run.header.get("sharding"):
            return writer.save_checkpoint(step, self.model, self.optimizer) if writer else None
        if writer:
            return writer.save_checkpoint(step, self.model, self.optimizer)
        from .shards import save

        out = self.out_dir if self.out_dir is not None and not self.filter_rows else None  # as the main one's writer
        self._gathered_hashes[step] = save(out, step, self.model, self.optimizer)[1]
        return None

    def _enable_activation_checkpointing(self) -> None:
        """As ``Trainer.train`` does: the recorded run's backward recomputed its activations (SFTConfig's default)."""
        args = self.args
        if not getattr(args, "activation_checkpointing", getattr(args, "gradient_checkpointing", False)):
            return
        gc_kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
                         or {})
        every_n_layers, offload = gc_kwargs.pop("every_n_layers", 1), gc_kwargs.pop("offload", False)
        if hasattr(self.model, "activation_checkpointing_enable"):
            self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=gc_kwargs or None,
                                                       every_n_layers=every_n_layers, offload=offload)
        else:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs or None)

    def _check_step_fingerprint(self, step: int) -> None:
        """Compare this replay's fingerprint of ``step`` with the recording's: the controls at every step (a deletion
        does not change them), the state before the first affected step."""
        from .guards import compare_fingerprint

        recorded, actual = self._recorded_fps.get(step), self._step_fps.get(step)
        if self.filter_rows or recorded is None or actual is None or "c" not in actual or "c" not in recorded:
            return
        state = step < self.first_affected_step
        if step in self._neutral_controls and recorded.get("c") != actual.get("c"):  # proven: a neutral difference
            recorded = {**recorded, "c": actual["c"], "lr": actual.get("lr")}
        compare_fingerprint(step, recorded, actual, state, who=f"the {self.mode}")
        self._fps_matched["controls"].append(step)
        if state:
            self._fps_matched["state"].append(step)

    def _check_fidelity(self, step: int, saved: Path | None) -> None:
        """At a recorded checkpoint before the first affected step, the state must be the recorded one (else stop)."""
        recorded = self._recorded_checkpoints.get(step)
        reference = self._fidelity_reference.get(step)  # the recorder's in-memory state hashes (its self-check)
        if (recorded is None and reference is None) or step == self.start_step or step > self.first_affected_step:
            return
        if saved is not None:
            actual = json.loads((saved / "hashes.json").read_text())
        elif step in self._gathered_hashes:  # a sharded run's, gathered by _save_state
            actual = self._gathered_hashes.pop(step)
        else:
            from .hashing import checkpoint_hashes

            actual = checkpoint_hashes(capture_state(self.model, self.optimizer, step))
        if reference is not None:
            check_against_state(self.run.path, step, reference, actual, who=f"the {self.mode}",
                                where=f"step {step} (the recording's own state, hashed in memory as it trained)")
        if recorded is not None:
            check_against_checkpoint(self.run.path, step, recorded, actual, who=f"the {self.mode}")
            self.checkpoints_matched.append(step)

    def _discard_output(self, writer: TraceWriter) -> None:
        """A replay stopped part way leaves no half-written output run."""
        writer.close()
        if self._out_created:
            shutil.rmtree(self.out_dir, ignore_errors=True)
        else:
            for p in self.out_dir.iterdir():
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()

    def _output_entry(self, e: PlanEntry) -> PlanEntry:
        """The plan entry the output run records: deleted slots become dummies, their batch digests change."""
        changed = self._hit(e)
        if e.j == 0 and e.extra.get("rows"):  # the rows as this replay trained on them (hf_unlearn.trace.rows)
            from .rows import output_rows

            e = dataclasses.replace(e, extra={**e.extra, "rows": output_rows(self, e)})
        if e.j == 0 and e.step > self.start_step:  # this replay's own fingerprint of the step before, its callbacks
            extra = {k: v for k, v in e.extra.items() if k not in ("fp", "changed", "callbacks")}
            # only where the recording's guards covered the step: a gap (a crash before a resume) stays a gap, so
            # verify does not read this replay's own fingerprints as the recording's evidence
            if self._step_fps.get(e.step - 1) is not None and e.step - 1 in self._recorded_fps:
                extra["fp"] = self._step_fps[e.step - 1]
            if self._program_callbacks:
                from .guards import callback_attributes

                states = [callback_attributes(cb) for cb in self._program_callbacks]
                if states != self._out_cb_states:
                    extra["callbacks"] = self._out_cb_states = states
            e = dataclasses.replace(e, extra=extra)
        if not changed and (e.batch or not self.run.compact):
            return e
        batch = e.batch
        if not changed:  # a compacted parent has batch MACs, not digests: the output records the digests again
            batch = getattr(self, "_rebuilt_batches", {}).get(e.mb) or self._batch_digests(
                e, self.accelerator.num_processes)
        elif batch or self.run.compact:
            batch = self._batch_digests(e, len(batch) if batch else self.accelerator.num_processes)
        return dataclasses.replace(e, slots=[None if s in self.forget_tag_set else s for s in e.slots], batch=batch)

    def _run_segment(self, model, seg: list[PlanEntry]) -> int:
        """Forward/backward every microbatch of a segment; step unless no slot carries weight. Returns 0/1.

        A microbatch is skipped only if no process has a weighted row in it (decided from the plan, so every
        process skips the same ones and their gradient all-reduces stay matched).
        """
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        work = []
        for e in seg:
            if not any(self._weighted(s) for s in e.slots):
                continue
            marked = [] if self._holds_dummy(e) else None
            feats, dummy_pos = self._rows(e, keep_dummies=not self.filter_rows, rank=rank, marked=marked)
            batch = self._collate(feats, dummy_pos)
            mask = None if marked is None else dummy_positions(batch, self.data_collator(marked)).to(self.args.device)
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
        from .guards import plan_lrs, program_controls, state_digest, step_fingerprint

        controls = program_controls(self.model, self.optimizer)
        self.optimizer.step()
        self._step_fps[step] = step_fingerprint(controls, state_digest(self.model, self.optimizer),
                                                plan_lrs(seg[0], len(self.optimizer.param_groups)))
        self._event("on_optimizer_step")
        model.zero_grad()
        self.state.global_step = step + 1
        self.state.epoch = self._epochs.get(step + 1, self.state.epoch)
        self._event("on_step_end")
        return 1

    def unlearning_card_info(self) -> dict:
        """What a model card needs (the Hub code turns ``forget_ids`` into keyed tags before publishing)."""
        from ..hub.leaks import own_numbers

        stats = getattr(self, "replay_stats", {})
        hyperparameters = {"start": self.start_mode, "start_step": self.start_step,
                           "checkpoint_steps": self.run.header.get("checkpoint_steps"),
                           "dummy_token_id": self.dummy_token_id, "filter_rows": self.filter_rows}
        counts = {"exact": not self.filter_rows, **stats}  # steps and counts of this replay: its own numbers
        return {
            "method": "trace-preserving replay" + (" (oracle)" if self.mode == "oracle" else ""),
            "hyperparameters": hyperparameters,
            "forget_ids": list(self.forget_ids),
            "citation": "",
            "paper": "",
            # the parent by its run id: a local folder name is the user's file system, never published
            "extra": {**counts, "parent_run_id": self.run.header.get("run_id"), **self._exact_deletion_evidence()},
            # a run of 500 steps is not sample id 500: declared to the Hub's forget-id scanner by exact value
            "not_ids": {**own_numbers(hyperparameters, "hyperparameters"), **own_numbers(counts, "extra")},
        }

    def _exact_deletion_evidence(self) -> dict:
        """State-hash roots of the replayed state and, once ``trace verify`` ran, its verdict (for the model card)."""
        if self.mode == "oracle" or self.filter_rows or self.out_dir is None or not hasattr(self, "replay_stats"):
            return {}
        final = checkpoint_dir(self.out_dir, self.run.total_steps) / "hashes.json"
        if not final.is_file():
            return {}
        hashes = json.loads(final.read_text())
        verdict_file = self.out_dir / "verification.json"
        verdict = json.loads(verdict_file.read_text()) if verdict_file.is_file() else None
        verified = bool(verdict and verdict.get("verified") and verdict["roots"]["a"]["params"] == hashes["params_root"])
        return {"exact_deletion": {
            "params_root": hashes["params_root"], "optimizer_root": hashes["optimizer_root"],
            "verified": verified,
            # published in the card: no local path or folder name (they are the user's, and may hold anything)
            "verification": ("bit-identical to the trace oracle" if verified
                             else "differs from the oracle" if verdict and not verdict.get("identical")
                             else "not verified: run `hf-unlearn trace verify REPLAY_DIR ORACLE_DIR` on this "
                                  "replay's output folder and a trace oracle's"),
        }}

    # ---- output run ---------------------------------------------------------------------------------------
    def _open_output(self, start: int) -> TraceWriter:
        src, out = self.run.path, self.out_dir
        out.mkdir(parents=True, exist_ok=True)
        from ..utils import owner_only, private_dir

        private_dir(out)  # the key, the local paths and the store, owner-only whatever the umask (owner_only below)
        if (src / "private" / "hmac.key").exists():  # a run with its own key passes it on
            shutil.copy2(src / "private" / "hmac.key", out / "private" / "hmac.key")
        from .reference import PRIVATE_SOURCE, REFERENCE_DIR
        from .trainers import PROCESSING_CLASS_DIR

        for folder in ("model", "collator", PROCESSING_CLASS_DIR, REFERENCE_DIR):  # a DPO run's reference goes along
            if (src / folder).exists():
                shutil.copytree(src / folder, out / folder)
        if (src / "private" / "lineage.json").exists() and self._start_weights is None:  # its parent stays the parent
            shutil.copy2(src / "private" / "lineage.json", out / "private" / "lineage.json")
        if src.joinpath(*PRIVATE_SOURCE).exists():
            shutil.copy2(src.joinpath(*PRIVATE_SOURCE), out.joinpath(*PRIVATE_SOURCE))
        if (src / "deletion_log.jsonl").exists():
            shutil.copy2(src / "deletion_log.jsonl", out / "deletion_log.jsonl")
        header = json.loads(json.dumps(self.run.header))
        from .preference import replaced_reference

        replaced_reference(self, header, out)  # DPO given ref_model= (a pipeline stage's new parent): recorded as such
        header.update(optimizer_steps=self.run.total_steps, microbatches=len(self.run.plan))
        header.update(created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), sealed=False, run_id=uuid.uuid4().hex,
                      origin_run_id=self.run.header.get("origin_run_id", self.run.header.get("run_id")),
                      parent={"run_id": self.run.header.get("run_id"), "start_step": start,  # no local path
                              "mode": self.mode, "controls": self.run.report.summary.get("controls")})
        if self.mode == "oracle":
            header["dataset"]["store_sha256"] = None
        else:
            shutil.copytree(self.store_path, out / "private" / "store",
                            ignore=shutil.ignore_patterns("cache-*", "*.sha256"))
            header["dataset"].update(store_sha256=store_sha256(out / "private" / "store"), rows=len(self.store))
        owner_only(out / "private")
        if is_packed(header):  # the output's map: the deleted documents' fragments are dummies now
            gone = {row: {k for k in hit} for row, hit in self._spans.items()}
            entries = [[row, [[None if k in gone.get(row, ()) else d, a, n] for k, (d, a, n) in enumerate(frags)]]
                       for row, frags in self._packing_map.items()]
            from .packing import write_map

            header["dataset"]["packing"].update(write_map(out, entries))
        if header.get("lineage"):  # the recording's output root is not this replay's
            header["lineage"].pop("output_root", None)
        if self._start_weights is not None:  # a new start: its own step-0 checkpoint (written by _replay)
            header["lineage"] = {"start_root": self._start_root,
                                 "parent": {"kind": "run", **(self._start_parent or {})},
                                 "recorded": self.run.header.get("lineage")}
        writer = TraceWriter(out, self.run.key)
        writer.open(header)
        from .checkpoints import link_checkpoints

        if self._start_weights is None:  # else the frozen base changed too: saved with the new step-0 checkpoint
            link_checkpoints(src, writer, [s for s in self.run.checkpoints() if s <= start], self.model,
                             self._start_state.get("frozen", []))
        self._out_header = header
        return writer

    def _finish_output(self, writer: TraceWriter) -> None:
        header = self._out_header
        header.update(finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        final = checkpoint_dir(self.out_dir, self.run.total_steps) / "hashes.json"
        hashes = json.loads(final.read_text())
        stats = self.replay_stats
        entry = {
            "request": len(read_deletion_log(self.out_dir)) + 1,
            "mode": self.mode,
            "forget_tags": sorted(tag(self.run.key, i) for i in self.forget_ids),
            "start_step": self.start_step,
            "steps_replayed": stats["segments_replayed"],
            "params_root": hashes["params_root"],
            "optimizer_root": hashes["optimizer_root"],
            "parent_run_id": self.run.header.get("run_id"),  # published: the run id, not the local folder name
        }
        header["fidelity"] = {**(header.get("fidelity") or {}), "checkpoints_matched": stats["checkpoints_matched"],
                              "fingerprints_matched": stats["fingerprints_matched"]}
        last = self.run.total_steps - 1
        if header["fidelity"].get("guards") and last in self._step_fps and last in self._recorded_fps:  # the last step's fingerprint is this replay's
            header["fidelity"]["guards"] = {**header["fidelity"]["guards"], "final": {"step": last,
                                                                                       "fp": self._step_fps[last]}}
        entry["fidelity"] = fidelity_statement(header)
        if stats["nothing_to_replay"]:
            entry["note"] = ("nothing to replay: no slot of the requested ids is left in the plan (deleted by an "
                             "earlier request); the state is the parent's final state")
        append_deletion_log(self.out_dir, entry)
        writer.seal(header)
        if self.run.compact:  # the output of a compacted run is compacted the same way
            from .compact import compact_run

            first = next((e.mb for e in self.run.plan if e.step >= self.start_step), len(self.run.plan))
            compact_run(self.out_dir, {(a, b): mac for a, b, mac in self.run.batch_groups()
                                       if mac is not None and b <= first})


def step_ranges(matched: dict) -> dict:
    """``{"state": [first, last], "controls": [first, last]}`` of the steps whose fingerprints matched (None: none)."""
    return {k: [min(v), max(v)] if v else None for k, v in matched.items()}


def replay_class(cls, header: dict):
    """``cls`` (a replay class) composed with the run's recorded trainer class, so ``compute_loss``,
    ``training_step`` and whatever else the recorded trainer overrides run in the replay; ``cls`` itself for a
    plain ``Trainer`` run."""
    from .recording import trace_recording
    from .trainers import is_default, recorded_trainer

    if is_default(header):
        return cls
    return _composed(cls, trace_recording(recorded_trainer(header)[0]))


@functools.cache
def _composed(replay_cls, traced):
    if issubclass(replay_cls, traced):
        return replay_cls
    return type(replay_cls.__name__, (replay_cls, traced), {"__module__": replay_cls.__module__,
                                                            "__qualname__": replay_cls.__qualname__,
                                                            "_trace_machinery": True})


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
    """The trace oracle: a full replay from step 0 on the original store, deleted slots as weight-0 dummies."""

    mode = "oracle"
    store_policy = "original"

    def __init__(self, run, forget_ids, out_dir=None, **kwargs):
        super().__init__(run, store=kwargs.pop("store", None), forget_ids=forget_ids, out_dir=out_dir,
                         start=kwargs.pop("start", "full"), **kwargs)


def filter_counterfactual(run, forget_ids, **kwargs) -> dict:
    """The naive ``filter`` baseline: same plan, deleted rows dropped before the forward pass."""
    return ReplayTrainer(run, forget_ids=forget_ids, start="full", filter_rows=True, **kwargs).train()


def repack_counterfactual(run, forget_ids, output_dir, data_collator=None, callbacks=None) -> dict:
    """The naive ``repack`` baseline: retrain from the step-0 state on the retained rows with fresh batching
    (``callbacks``: the Trainer's, e.g. a progress bar)."""
    from ..data.collators import rebuild_collator

    run = run if isinstance(run, TraceRun) else open_run(run)
    if is_packed(run.header):
        raise UnlearnError(PACKED_BASELINE.format(name="repack"))
    if run.header.get("reference_model"):
        raise UnlearnError(PAIRS_BASELINE)
    _check_types(run, list(forget_ids))
    store = load_store(run.store_path)
    forget = set(forget_ids)
    retained = store.select([n for n, i in enumerate(store[run.id_column]) if i not in forget], keep_in_memory=True)
    model = model_from_run(run)
    start = load_checkpoint(run.checkpoints()[0])
    model.load_state_dict(full_model_state(start))
    args = training_args_from_header(run.header, output_dir, remove_unused_columns=False, logging_strategy="no")
    collate = data_collator or rebuild_collator(run.header.get("collator"), run.path / "collator", model=model)
    id_column = run.id_column

    def collator(features):
        return collate([{k: v for k, v in f.items() if k != id_column} for f in features])

    spec = run.header["optimizer"]
    optimizers = (None, None)
    if spec.get("source") == "custom":
        optimizers = (build_optimizer(spec["rebuild"], model, start["param_names"]), None)
    trainer = Trainer(model=model, args=args, train_dataset=retained, data_collator=collator, optimizers=optimizers,
                      callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # a baseline, not a user's training: no metrics dict on stdout
    with pinned_stack(run.header):  # the run's threads: the baseline's distance is not the thread count's
        trainer.train()
    return capture_state(model, trainer.optimizer, trainer.state.global_step, clone=True)


def save_state(state: dict, path) -> None:
    from .hashing import checkpoint_hashes

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    from ..utils import atomic_write_text

    atomic_write_text(path.with_suffix(".hashes.json"), json.dumps(checkpoint_hashes(state), indent=1, sort_keys=True))
