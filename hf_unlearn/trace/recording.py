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
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import math
import os
import platform
import shutil
import time
import uuid
import warnings
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from ..data.collators import IdCarryingCollator, _importable_name, collator_spec, rebuild_collator
from ..errors import UnlearnError
from ..utils import WeightsFollowUmask, atomic_write_text
from .checkpoints import INDEX_FORMAT, CheckpointIndex, FrozenTensors
from .fidelity import device_info, prepare_cuda_determinism
from .hashing import batch_digest, optimizer_param_names
from .plan import PlanEntry
from .retention import default_every, is_due
from .run import FORMAT, PROGRESS_FILE, SEALED_FILES, controls_seal, save_checkpoint, write_sidecar
from .sharding import engine_spec, unsharded_class
from .stack import numeric_stack
from .tags import record_digest, recording_key, tag
from .wal import FLAG_ACCUM_END, FLAG_DUMMY, WalRecord, manifest_bytes

IGNORE_INDEX = -100


def _hashed_seed(text: str) -> int:
    """63 bits of SHA-256(text): a seed that depends on nothing but the text."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def microbatch_seed(base: int, step: int, j: int) -> int:
    """The seed of microbatch ``j`` of optimizer step ``step`` (63 bits, independent of resumes)."""
    return _hashed_seed(f"{base}:{step}:{j}")


def rank_seed(seed: int, rank: int) -> int:
    """The seed process ``rank`` uses for a microbatch whose recorded seed is ``seed`` (rank 0: the seed itself)."""
    return seed if rank == 0 else _hashed_seed(f"{seed}:rank{rank}")


@contextmanager
def _rng_kept():
    """Run a block (a nested Trainer seeds everything) and give the caller its Python, numpy and torch RNGs back."""
    import random

    py, npy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


@contextmanager
def seeded(seed: int):
    """Run a block under ``seed`` without disturbing the caller's RNG streams."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


# TrainingArguments fields that hold a place on the user's machine, and fields (here and in a model config) that
# hold a Hub id or a local path: a replay never reads them (training_args_from_header), and the header is published
# with the run's provenance, so the local paths are withheld
# TrainingArguments that legitimately differ between the processes of one launch
PROCESS_LOCAL_ARGS = frozenset({"local_rank", "output_dir", "logging_dir", "run_name"})
PATH_ARGS = ("output_dir", "logging_dir", "resume_from_checkpoint", "deepspeed", "fsdp_config", "accelerator_config")
HUB_ID_OR_PATH = ("chat_template_path", "_name_or_path")


def _without_local_paths(record: dict) -> dict:
    """``record`` with the local paths in :data:`PATH_ARGS` and :data:`HUB_ID_OR_PATH` withheld (see
    :func:`hf_unlearn.utils.withhold_local_path`): the header carries no folder layout of the user's machine."""
    from ..utils import LOCAL_PATH, withhold_local_path

    out = dict(record)
    for k in (*PATH_ARGS, *HUB_ID_OR_PATH):
        if isinstance(out.get(k), str) and out[k]:
            out[k] = LOCAL_PATH if k in PATH_ARGS else withhold_local_path(out[k])
    return out


def _plain_id(value):
    """A sample id as a plain int or str (tensors and numpy scalars from custom datasets included)."""
    if hasattr(value, "item") and not isinstance(value, str):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UnlearnError(f"sample id {value!r} has type {type(value).__name__}; ids must be ints or strings")
    return value


def keyed_batch_digest(key: bytes, digest: str) -> str:
    """What the plan stores for a batch: 16 hex digits of HMAC(key, its SHA-256), so published plans reveal nothing."""
    import hmac

    return hmac.new(key, b"hf_unlearn.batch\0" + digest.encode(), hashlib.sha256).hexdigest()[:16]


def dummy_row(template: dict, length: int, dummy_token_id: int, id_column: str) -> dict:
    """The fixed row that fills a deleted slot: ``length`` dummy tokens, full attention, every label ignored."""
    row = {}
    for k, v in template.items():
        if k == id_column:
            continue
        if k == "input_ids":
            row[k] = [dummy_token_id] * length
        elif k == "attention_mask":
            row[k] = [1] * length
        elif k == "labels":
            row[k] = [IGNORE_INDEX] * length
        elif k == "seq_lengths":  # a packed row's document lengths (position ids): one document
            row[k] = [length]
        elif isinstance(v, list):
            row[k] = [0] * length
        else:
            row[k] = type(v)() if v is not None else None
    return row


def dummy_has_weight(collator, row: dict) -> bool:
    """True unless the collator gives the dummy row labels that are all ignored (weight exactly 0)."""
    labels = collator([dict(row)]).get("labels")
    return labels is None or bool((torch.as_tensor(labels) != IGNORE_INDEX).any())


def _collator_is_random(collator, rows: list[dict]) -> bool:
    """Collate the same rows under two seeds; a difference means the collator draws random numbers."""
    outs = []
    for s in (1, 2):
        with seeded(s):
            outs.append(batch_digest(collator([dict(r) for r in rows])))
    return outs[0] != outs[1]


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "datasets", "accelerate", "numpy", "peft"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except ImportError:
            pass
    from ..version import __version__

    out["hf_unlearn"] = __version__
    return out


def dynamic_rope(config) -> str | None:
    """The rope type of a config whose rotary frequencies follow the sequence length (``dynamic``, ``longrope``),
    or None. Their ``inv_freq`` buffers change with the longest sequence seen so far: history no checkpoint holds."""
    found = []

    def walk(value):
        if isinstance(value, dict):
            kind = value.get("rope_type", value.get("type"))
            if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope"):
                found.append(kind)
            for v in value.values():
                walk(v)

    for name in ("rope_parameters", "rope_scaling"):
        walk(getattr(config, name, None))
    return found[0] if found else None


def first_non_finite(model) -> str | None:
    """The name of the first parameter holding a NaN or an infinity, or None."""
    from .sharding import local

    for name, p in model.named_parameters():
        if p.is_floating_point() and not bool(torch.isfinite(local(p)).all()):  # FSDP2: this process's shard
            return name
    return None


def dropout_settings(model) -> dict:
    """Every non-zero dropout probability of the model: config fields (``*dropout*``, GPT-2's ``*_pdrop``) and
    ``nn.Dropout`` modules."""
    config = getattr(model, "config", None)
    found = {}
    for k, v in (config.to_dict() if config is not None else {}).items():
        if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            found[k] = v
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found.setdefault("modules", {})[name] = module.p
    return found


# ---- optimizers a replay must rebuild ----------------------------------------------------------------------
def optimizer_spec(optimizer, model=None) -> dict:
    """How to rebuild ``optimizer``: importable class, constructor arguments, param-group sizes and names.

    With ``model``, every optimized tensor must be one of its parameters (a replay finds them by name).
    """
    import inspect

    inner = getattr(optimizer, "optimizer", optimizer)
    cls = type(inner)
    name = _importable_name(cls)
    spec = {"class": name or f"{cls.__module__}:{cls.__qualname__}", "rebuildable": False}
    if name is None:
        return {**spec, "why": f"{cls.__qualname__} is defined locally or in __main__: a replay cannot import it"}
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in inner.defaults.items() if takes_any or k in params}
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError):
        return {**spec, "why": f"the constructor arguments of {cls.__qualname__} are not JSON ({kwargs})"}
    names = None
    if model is not None:
        names = optimizer_param_names(model, inner)
        by_id = {id(p) for p in model.parameters()}
        foreign = sum(id(p) not in by_id for g in inner.param_groups for p in g["params"])
        if foreign:
            return {**spec, "why": f"{foreign} optimized tensor(s) are not parameters of the model"}
    try:  # the constructor must accept the recorded arguments and give back the same defaults
        probe = cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
        same = json.dumps(probe.defaults, sort_keys=True, default=repr) == json.dumps(inner.defaults, sort_keys=True,
                                                                                         default=repr)
    except Exception as e:  # noqa: BLE001 - any constructor failure means "not rebuildable"
        return {**spec, "why": f"{cls.__qualname__}(**recorded arguments) fails: {e}"}
    if not same:
        return {**spec, "why": f"{cls.__qualname__} rebuilt from its arguments has other defaults"}
    return {**spec, "rebuildable": True, "kwargs": kwargs, "group_sizes": [len(g["params"]) for g in inner.param_groups],
            "param_names": names}


def build_optimizer(spec: dict, model, param_names: list[str]):
    """The optimizer :func:`optimizer_spec` describes, over ``model``'s parameters in the recorded order."""
    from ..utils import import_object

    named = dict(model.named_parameters())
    missing = [n for n in param_names if n not in named]
    if missing:
        raise UnlearnError(f"the replay model has no parameter {missing[0]!r} that the run's optimizer updated")
    params = [named[n] for n in param_names]
    groups, i = [], 0
    for size in spec["group_sizes"]:
        groups.append({"params": params[i:i + size]})
        i += size
    return import_object(spec["class"])(groups, **spec["kwargs"])


class TraceWriter:
    """Appends plan frames, WAL records and manifest slots; saves checkpoints (each bound to the run by the
    checkpoint index, frozen tensors saved once); seals the run with sidecars and the keyed controls seal."""

    def __init__(self, run_dir: Path, key: bytes):
        self.run = Path(run_dir)
        self.key = key
        self._plan = self._wal = self._manifest = None
        self.index: CheckpointIndex | None = None
        self.frozen = FrozenTensors(self.run)

    def open(self, header: dict, resume_step: int | None = None) -> None:
        """Start the files; on resume keep only entries of steps before ``resume_step`` (a run recorded with a
        ``plan.jsonl`` continues in ``plan.bin``, its kept entries keyed afresh)."""
        from .plan import COMPACT_FILE, LEGACY_PLAN_FILE, PLAN_FILE, CompactPlanWriter, has_plan, read_plan
        from .wal import RECORD_SIZE

        self.run.mkdir(parents=True, exist_ok=True)
        if (self.run / COMPACT_FILE).exists():
            if resume_step is not None:
                raise UnlearnError(f"{self.run} is a compacted sealed run ({COMPACT_FILE}): it cannot be resumed; "
                                   "record into a new trace_dir")
            (self.run / COMPACT_FILE).unlink()
        header.pop("provenance", None)  # append-only files from here on (a replay copies its parent's header)
        for name in SEALED_FILES + (LEGACY_PLAN_FILE, COMPACT_FILE, "deletion_log.jsonl"):
            side = self.run / f"{name}.sha256"
            if side.exists():
                side.unlink()
        wal_f, man_f = self.run / "wal.bin", self.run / "manifest.bin"
        kept = []
        if resume_step is not None and has_plan(self.run):
            kept = [e for e in read_plan(self.run) if e.step < resume_step]
            with open(wal_f, "r+b") as f:
                f.truncate(len(kept) * RECORD_SIZE)
            with open(man_f, "r+b") as f:
                f.truncate(8 * sum(len(e.slots) for e in kept))
            for d in (self.run / "checkpoints").glob("step-*"):
                if int(d.name.split("-")[1]) > resume_step:
                    shutil.rmtree(d)
        else:
            for f in (wal_f, man_f):
                f.write_bytes(b"")
            (self.run / PROGRESS_FILE).unlink(missing_ok=True)
        self._open_index(header, resume_step)
        if resume_step is not None:
            self._drop_unbound_checkpoints()
        self.write_header(header)
        self._plan = CompactPlanWriter(self.run / PLAN_FILE, self.key, header["run_id"], kept)
        (self.run / LEGACY_PLAN_FILE).unlink(missing_ok=True)
        self._wal, self._manifest = open(wal_f, "ab"), open(man_f, "ab")

    def _drop_unbound_checkpoints(self) -> None:
        """On resume: a checkpoint folder the index does not list is a save cut short (a kill while writing it, or
        before the index took it); remove it so the resumed run writes that checkpoint again."""
        for d in (self.run / "checkpoints").glob("step-*"):
            if int(d.name.split("-")[1]) not in self.index.entries:
                shutil.rmtree(d)

    def mark_completed(self, step: int) -> None:
        """Note that optimizer step ``step`` ran (``progress.json``), so a crash report names the right step."""
        atomic_write_text(self.run / PROGRESS_FILE, json.dumps({"completed_step": step}))

    def write_header(self, header: dict) -> None:
        atomic_write_text(self.run / "header.json", json.dumps(header, indent=1, sort_keys=True))

    def reseal_header(self, header: dict) -> None:
        """Rewrite a sealed run's header (the self-check's outcome) with its sidecar and its keyed controls seal."""
        from .plan import COMPACT_FILE, PLAN_FILE, read_compact_plan

        if header.get("provenance"):  # a compacted run: its last block MAC
            from .compact import read_compact

            last = read_compact(self.run / COMPACT_FILE).last_mac
        else:
            segs = read_compact_plan(self.run / PLAN_FILE).segments
            last = segs[-1].mac if segs else None
        if last:
            header["controls_mac"] = controls_seal(self.key, last, header)
        self.write_header(header)
        write_sidecar(self.run / "header.json")

    def append(self, entries: list[PlanEntry]) -> None:
        """Write one segment ahead of running it (its plan frame, then per microbatch manifest slots and WAL record)."""
        self._plan.append(entries)
        for e in entries:
            flags = (FLAG_ACCUM_END if e.end else 0) | (FLAG_DUMMY if None in e.slots else 0)
            lr32 = float(np.float32(e.lr))
            rec = WalRecord(record_digest(self.key, e.slots, e.seed, lr32, e.step, len(e.slots), flags), e.seed, lr32,
                            e.step, len(e.slots), flags)
            self._manifest.write(manifest_bytes(e.slots))
            self._wal.write(rec.pack())
        for f in (self._plan, self._manifest, self._wal):
            f.flush()

    def _open_index(self, header: dict, resume_step: int | None) -> None:
        from .checkpoints import INDEX_NAME, _entry, list_checkpoints

        header["checkpoint_index"] = INDEX_FORMAT
        if resume_step is not None and (self.run / "checkpoints" / INDEX_NAME).exists():
            self.index = CheckpointIndex.load(self.run, header["run_id"], self.key)
            self.index.thin([s for s in self.index.entries if s <= resume_step])
            return
        self.index = CheckpointIndex(self.run, header["run_id"], self.key, header.get("checkpoint_retention"))
        if resume_step is not None:  # a run recorded before the index: bind the checkpoints it has
            for step, d in list_checkpoints(self.run).items():
                self.index.adopt(step, _entry(d))
        self.index.save()

    def save_checkpoint(self, step: int, model, optimizer, state: dict | None = None) -> Path:
        if not self.frozen.exists and (self.frozen.dir / "hashes.json").exists():
            self.frozen.adopt_matching(model)  # a resumed recording: its frozen tensors were saved before
        d = save_checkpoint(self.run, step, model, optimizer, frozen=self.frozen, state=state)
        self.index.add(step)
        return d

    def close(self) -> None:
        for f in (self._plan, self._wal, self._manifest):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()
        self._plan = self._wal = self._manifest = None

    def seal(self, header: dict) -> None:
        last = self._plan.mac
        self.close()
        header["sealed"] = True
        header["controls_mac"] = controls_seal(self.key, last, header)
        self.write_header(header)
        for name in SEALED_FILES:
            write_sidecar(self.run / name)
        if (self.run / "deletion_log.jsonl").exists():
            write_sidecar(self.run / "deletion_log.jsonl")


class SameOptimizerSettings:
    """Every process of a multi-process recording, before each optimizer step: the processes' optimizer settings
    (each param group's learning rate, betas, weight decay, ...) must be equal (an all-gather). The plan records the
    main process's, which a replay sets on every process; a process whose settings differ (a callback that changes
    the learning rate on one process only) is refused at that step, on every process, before it steps."""

    def __init__(self, optimizer, step):
        self.step = step  # () -> the optimizer step about to be taken
        inner = getattr(optimizer, "optimizer", optimizer)
        self._hook = inner.register_step_pre_hook(lambda opt, *a: self.check(opt))

    def check(self, optimizer) -> None:
        from accelerate.utils import gather_object

        mine = [{k: _jsonable(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        everyone = gather_object([mine])
        differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
        if differ:
            keys = sorted({k for r in differ for g0, g in zip(everyone[0], everyone[r]) for k in g0 if g.get(k) != g0[k]})
            raise UnlearnError(f"process(es) {differ} would take optimizer step {self.step()} with other optimizer "
                               f"settings than the main process ({', '.join(keys) or 'param groups'}): the plan records "
                               "the main process's for every process; change them the same way on every process")

    def close(self) -> None:
        self._hook.remove()


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

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._trace_finish()


class TraceRecordingMixin(WeightsFollowUmask):
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

    _is_replay = False
    _trace_machinery = True  # not the user's trainer: skipped when the recorded trainer class is looked up

    def __init__(self, *args, trace_dir: str | os.PathLike | None = None, trace_checkpoint_steps: int | None = None,
                 trace_key: bytes | None = None, id_column: str = "id", dummy_token_id: int | None = None,
                 trace_allow_hazards: bool = False, trace_self_check: bool | int | str = True,
                 trace_checkpoint_retention: str = "geometric",
                 trace_checkpoint_budget: int | None = None, trace_frozen_source: str | os.PathLike | None = None,
                 trace_guards: bool = True, trace_parent: str | os.PathLike | None = None, **kwargs):
        from .preference import check_trainer_class
        from .retention import MODES

        check_trainer_class(type(self))  # trainers that generate their data; DPO without its pair dummies
        if trace_checkpoint_retention not in MODES:
            raise UnlearnError(f"trace_checkpoint_retention must be one of {MODES}, not {trace_checkpoint_retention!r}")
        for name, value in (("trace_checkpoint_steps", trace_checkpoint_steps),
                            ("trace_checkpoint_budget", trace_checkpoint_budget),
                            ("trace_self_check", None if isinstance(trace_self_check, bool) or trace_self_check == "all"
                             else trace_self_check)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UnlearnError(f"{name} must be a positive int (or None for the default), not {value!r}")
        self._trace_arguments = {} if self._is_replay else _bound_arguments(super().__init__, args, kwargs)
        raw = self._trace_arguments.get("train_dataset")
        raw_ids = list(raw[id_column]) if id_column in getattr(raw, "column_names", ()) else None
        # before the Trainer moves the model: cuBLAS reads its workspace setting when it first runs (replays too)
        prepare_cuda_determinism(self._trace_arguments.get("args", kwargs.get("args")))
        self._trace_id_column = id_column  # SFTTrainer prepares (and packs) its dataset inside its constructor
        super().__init__(*args, **kwargs)
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
        self.dummy_token_id = dummy_token_id if dummy_token_id is not None else self._default_dummy_token()
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
        self._trace_optimizer_source = self._optimizer_source()
        # first, so a user callback that fails right after an optimizer step cannot hide that the step completed
        self.callback_handler.callbacks.insert(0, _TraceCallback(self))
        if not self._is_replay:
            self.callback_handler.call_event = self._guarded_call_event
        self._trace_dropped, self._trace_trainer, self._trace_probed = [], {}, False
        if not self._is_replay:
            self._trace_trainer = self._trace_trainer_spec()
            self._trace_dropped = self._dropped_rows(raw_ids)
            self._trace_check_parallelism()
            if self.train_dataset is not None:
                self.trace_preflight()

    # ---- what a replay can reproduce, checked up front ----------------------------------------------------
    def _trace_trainer_spec(self) -> dict:
        """The recorded trainer class, config class and extra arguments (refused here if a replay cannot rebuild
        them)."""
        from .trainers import trainer_spec

        cls = recorded_trainer_class(type(self))
        spec = trainer_spec(cls, self.args, self._trace_arguments)
        from .packing import packing_refusal

        why = packing_refusal(self.args)
        if why:
            raise UnlearnError(f"{cls.__qualname__} with packing=True cannot be recorded for exact deletion: {why}")
        return spec

    def _dropped_rows(self, raw_ids: list | None) -> list:
        """Ids of the rows the trainer's own dataset preparation dropped (e.g. SFTTrainer's fully masked rows after
        truncation): never trained on, recorded in the header so a request for them is answered, not lost."""
        dataset = self.train_dataset
        if raw_ids is None or dataset is None or dataset is self._trace_arguments.get("train_dataset"):
            return []
        columns = getattr(dataset, "column_names", None) or []
        if self.id_column not in columns:
            raise UnlearnError(f"{type(self).__qualname__}'s dataset preparation dropped the {self.id_column!r} column: "
                               "every training row needs its stable sample id")
        from .packing import document_ids

        kept = set(document_ids(dataset, self.id_column))
        dropped = [i for i in raw_ids if i not in kept]
        if dropped:
            import warnings

            warnings.warn(f"{recorded_trainer_class(type(self)).__qualname__}'s dataset preparation dropped "
                          f"{len(dropped)} row(s) (e.g. ids {dropped[:5]}): they are never trained on; the run "
                          "records them, and a deletion request for them is answered 'never trained on'",
                          stacklevel=3)
        return dropped

    def _default_dummy_token(self) -> int:
        collator = self.data_collator
        for owner in (collator, getattr(collator, "tokenizer", None), self.processing_class):
            pad = getattr(owner, "pad_token_id", None)
            if isinstance(pad, int):
                return pad
        return 0

    def _optimizer_source(self) -> str:
        custom_method = type(self).create_optimizer is not Trainer.create_optimizer
        if self.optimizer is not None or self.optimizer_cls_and_kwargs is not None or custom_method:
            return "custom"
        return "args"

    def _trace_check_parallelism(self) -> None:
        """Only single-process, DDP-style data parallel and FSDP2 runs are replayable; refuse the rest here."""
        from .sharding import SUPPORTED as supported
        from .sharding import refusal

        why = refusal(self)  # FSDP1, DeepSpeed (hf_unlearn.trace.sharding)
        if why:
            raise UnlearnError(why)
        if self.args.n_gpu > 1:
            raise UnlearnError(f"exact deletion cannot replay torch.nn.DataParallel over {self.args.n_gpu} GPUs in one "
                               f"process; {supported}")
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != self.accelerator.num_processes:
            raise UnlearnError(f"{launched} processes were launched but training runs {self.accelerator.num_processes} "
                               "(they are not connected: on CPU set TrainingArguments(use_cpu=True) so they use gloo); "
                               "they would all write the same trace")
        self._trace_check_launch_settings()
        if self.accelerator.num_processes > 1:
            self._trace_check_same_arguments()
            if not self.args.average_tokens_across_devices:
                raise UnlearnError("average_tokens_across_devices=False: each process would divide its loss by its "
                                   "own token count, and the plan records one loss normaliser per step (the sum over "
                                   "the processes): leave average_tokens_across_devices=True (the default)")
        cfg = self.accelerator.dataloader_config
        if getattr(cfg, "split_batches", False) or getattr(cfg, "dispatch_batches", False):
            raise UnlearnError(f"exact deletion does not record split_batches/dispatch_batches dataloaders; {supported}")

    def _trace_check_launch_settings(self) -> None:
        """The mixed precision and compilation accelerate runs must be what the TrainingArguments say (bf16=/fp16=,
        torch_compile=): the run records them and a replay rebuilds them, but accelerate takes
        ACCELERATE_MIXED_PRECISION and ACCELERATE_DYNAMO_BACKEND (what ``accelerate launch --mixed_precision /
        --dynamo_backend`` or a config file exports) when they say nothing."""
        args = self.args
        backend = str(getattr(getattr(self.accelerator.state, "dynamo_plugin", None), "backend", "NO")).split(".")[-1]
        if not args.torch_compile and backend.upper() != "NO":
            raise UnlearnError(f"accelerate compiles the model with {backend} (ACCELERATE_DYNAMO_BACKEND="
                               f"{os.environ.get('ACCELERATE_DYNAMO_BACKEND')!r} in the environment: accelerate launch "
                               "--dynamo_backend or a config file) but the TrainingArguments say torch_compile=False, "
                               "which is what the run records and a replay rebuilds: set torch_compile=True (and "
                               "torch_compile_backend) in the TrainingArguments or launch with --dynamo_backend no")
        said = "fp16" if args.fp16 else "bf16" if args.bf16 else "no"
        live = str(self.accelerator.mixed_precision)
        if live != said:
            raise UnlearnError(f"accelerate runs mixed precision {live!r} (ACCELERATE_MIXED_PRECISION="
                               f"{os.environ.get('ACCELERATE_MIXED_PRECISION')!r} in the environment: accelerate launch "
                               f"--mixed_precision or a config file) but the TrainingArguments say {said!r} (bf16="
                               f"{args.bf16}, fp16={args.fp16}), which is what the run records and a replay rebuilds: "
                               "set bf16=/fp16= in the TrainingArguments or launch without that mixed precision")

    def _trace_check_same_arguments(self) -> None:
        """Every process must train with the main process's TrainingArguments and model description (a collective):
        the header records the main process's (its seed makes every process's microbatch seeds, its model config,
        buffers and numeric stack are what a replay rebuilds on every process), so a process given its own (seed=rank,
        another config, a buffer edited on one process: FSDP2 leaves buffers unsynchronised, another thread count or
        matmul precision) would train what no replay reproduces."""
        from accelerate.utils import gather_object

        from .hashing import tensor_hash
        from .sharding import process_differences
        from .stack import numeric_stack

        base = peft_and_base(self.model)[1]
        config = getattr(base, "config", None)
        mine = {"TrainingArguments": {k: _jsonable(v) for k, v in self.args.to_dict().items()
                                      if k not in PROCESS_LOCAL_ARGS},
                "model config": {k: _jsonable(v) for k, v in (config.to_dict() if config is not None else {}).items()},
                "model dtype": str(next(base.parameters()).dtype),
                "frozen parameters": frozen_parameters(self.model),
                "buffers": {n: tensor_hash(n, b) for n, b in self.model.named_buffers()},
                "numeric stack": numeric_stack(self.args.device)}  # threads, kernels' switches: the header's are main's
        diff, where = process_differences(gather_object([mine]))  # (hf_unlearn.trace.sharding)
        if diff:
            raise UnlearnError(f"the processes were given different {'; '.join(diff)}: every process must train with "
                               "the same ones (the run records the main process's); build them the same way on every "
                               f"process ({'; '.join(where)})")

    def _trace_served(self, dataset):
        """The rows the dataloader serves: unused columns removed as ``Trainer`` does, the id column kept."""
        if not self.args.remove_unused_columns:
            return dataset
        from .packing import PACKED_IDS

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
        from .packing import SUPPORTED, pack_with_documents

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

    def _trace_replay_arguments(self, run, given: dict) -> dict:
        """Constructor arguments a replay of ``run`` adds for the recorded trainer (DPO: its reference model)."""
        return {}

    def _trace_changed_during_training(self) -> str | None:
        """Why something a replay rebuilds from the run's record changed while training (DPO: the reference), or
        None; checked when training ends and sealed into the run as not reproducible."""
        return None

    def trace_preflight(self) -> tuple:
        """Check that a replay can reproduce this run; return ``(served rows, hazards, notes)``.

        Errors (an unusable dataset, a collator that gives a deleted slot weight, an optimizer or adapter a replay
        cannot rebuild) raise :class:`UnlearnError`; hazards (the replay would run but differ) raise too unless
        ``trace_allow_hazards``. Run at construction, again when training starts.
        """
        try:
            import datasets
        except ImportError:  # pragma: no cover
            datasets = None
        dataset = self.train_dataset
        if datasets is None or not isinstance(dataset, datasets.Dataset):
            raise UnlearnError("TraceRecordingTrainer needs train_dataset to be a datasets.Dataset of token rows "
                               f"with an id column (got {type(dataset).__name__}); the token store is saved from it")
        served = self._trace_served(dataset)
        if self.id_column not in served.column_names:
            raise UnlearnError(f"train_dataset has no {self.id_column!r} column; add stable sample ids "
                               "(hf_unlearn.tokenize_qa keeps TOFU's `id`), or pass id_column=")
        if self._trace_token_column not in served.column_names:
            raise UnlearnError(f"train_dataset has no `{self._trace_token_column}` column: the trace stores token rows")
        id_type = served.features[self.id_column]
        if getattr(id_type, "dtype", None) not in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                                     "uint64", "string", "large_string"):
            raise UnlearnError(f"the id column {self.id_column!r} has type {id_type}; ids must be ints or strings")
        if len(served) == 0:
            raise UnlearnError("train_dataset is empty")
        from .store import id_index

        id_index(served, self.id_column)  # unique ids
        collator = self.data_collator
        hazards, notes = [], []
        args = self.args
        probe = [{k: v for k, v in served[i].items() if k != self.id_column} for i in range(min(2, len(served)))]
        try:
            random_collator = _collator_is_random(collator, probe)
        except Exception as e:  # noqa: BLE001 - a collator that fails on real rows is the user's error to see
            raise UnlearnError(f"the data collator fails on the training rows (without the id column): {e}") from None
        name = getattr(collator, "__qualname__", type(collator).__qualname__)
        if random_collator:
            hazards.append(f"the data collator ({name}) is random (its output changes with the RNG seed): replays "
                           "re-collate stored rows and cannot reproduce its draws")
        if args.dataloader_num_workers > 0:
            notes.append(f"dataloader_num_workers={args.dataloader_num_workers}: harmless, the collator is "
                         "deterministic and batches are digested in the plan")
        if served.format.get("type") == "custom":
            hazards.append("train_dataset has an on-the-fly transform (set_transform/with_transform): the store holds "
                           "the untransformed rows")
        stock_loss = recorded_trainer_class(type(self)).compute_loss is Trainer.compute_loss
        if stock_loss and not self.model_accepts_loss_kwargs and self.compute_loss_func is None:
            hazards.append("the model does not accept num_items_in_batch: the loss is a per-microbatch mean, so "
                           "deleting a row re-weights the other rows of its microbatch")
        if self.compute_loss_func is not None and not isinstance(self.compute_loss_func, str):
            name = getattr(self.compute_loss_func, "__qualname__", "custom")
            hazards.append(f"a custom loss (compute_loss_func={name}): a function argument is not recorded, so "
                           "replays and the oracle would agree with each other on a loss this run did not train on; "
                           "subclass the trainer and override compute_loss in an importable module instead")
        if args.fp16:
            hazards.append("fp16 with dynamic loss scaling: the grad scaler's state is not checkpointed, so replays "
                           "may scale (and skip) steps differently; use bf16 or fp32")
        if args.device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
            hazards.append("CUDA without torch.use_deterministic_algorithms(True): kernels may not be bit-reproducible")
        template = served[0]
        if self._trace_dummy_has_weight(collator, self._trace_dummy_row(template, 4, self.dummy_token_id)):
            raise UnlearnError(
                f"the data collator ({name}) gives the dummy row that replaces a deleted sample a label "
                f"(dummy_token_id={self.dummy_token_id}): a deleted slot would not have weight 0; add a `labels` column "
                "(-100 on ignored tokens) or pass dummy_token_id= a token the collator masks (its pad token)")
        if not self._trace_probed:
            self._trace_probed = True  # once, at construction: a forward and backward pass on two rows
            self._check_dummy_has_no_influence({k: v for k, v in template.items() if k != self.id_column})
        if self.neftune_noise_alpha is not None:
            notes.append(f"NEFTune (alpha {self.neftune_noise_alpha}) is reproduced: its noise is drawn under each "
                         "microbatch's recorded seed")
        rope = dynamic_rope(getattr(peft_and_base(self.accelerator.unwrap_model(self.model))[1], "config", None))
        if rope:
            hazards.append(f"the model's rotary embedding is {rope!r} (rope_scaling / rope_parameters): its inv_freq "
                           "buffers change with the longest sequence seen so far, which no checkpoint holds, so a "
                           "replay from a checkpoint computes other positions and a mid-run deletion never verifies; "
                           "use a static rope type (default, linear, yarn, llama3)")
        if dropout_settings(self.accelerator.unwrap_model(self.model)):
            notes.append("dropout is active: reproduced by per-microbatch reseeding")
        if args.max_grad_norm and args.max_grad_norm > 0:
            notes.append("gradient clipping is replayed on the replay's own gradients (part of the counterfactual)")
        self._check_optimizer_rebuildable()
        self._check_model_rebuildable()
        if hazards and not self.trace_allow_hazards:
            raise UnlearnError("TraceRecordingTrainer cannot record a run a replay reproduces: " + "; ".join(hazards)
                               + ". Fix this, or pass trace_allow_hazards=True to record anyway (inspect and verify "
                               "will then list what their verdicts do not cover)")
        return served, hazards, notes

    def _check_dummy_has_no_influence(self, row: dict) -> None:
        """A trainer with its own ``compute_loss`` must give a deleted slot's dummy row no weight: the loss's gradient
        with respect to the dummy's input embeddings, in a microbatch beside a real row, must be exactly zero (a term
        on every token regardless of the labels would fail). The stock loss is covered by the labels check."""
        cls = recorded_trainer_class(type(self))
        if cls.compute_loss is Trainer.compute_loss:
            return
        dummy = dummy_row(row, len(row["input_ids"]), self.dummy_token_id, self.id_column)
        batch = self._prepare_inputs(self.data_collator([dict(row), dummy]))
        model = self.model
        seen = {}

        def capture(module, args, output):  # a leaf in place of the embeddings: its gradient is the dummy's weight
            seen["embeds"] = output.detach().requires_grad_(True)
            return seen["embeds"]

        handle = model.get_input_embeddings().register_forward_hook(capture)
        training = model.training
        import copy

        saved = copy.deepcopy(getattr(self, "_metrics", None))  # SFTTrainer logs metrics in compute_loss: not ours
        own = _attributes_kept(self)  # the user's loss may count its calls: the probe is not one of them
        try:
            model.eval()  # no dropout: the probe's answer does not depend on a draw
            with seeded(0):
                loss = self.compute_loss(model, batch, num_items_in_batch=torch.tensor(1.0, device=self.args.device))
                loss.backward()
        except Exception as e:  # noqa: BLE001 - the user's loss failed on a real row and a dummy
            raise UnlearnError(f"{cls.__qualname__}.compute_loss fails on a microbatch of a training row and the dummy "
                               f"row that replaces a deleted sample: {e}") from None
        finally:
            handle.remove()
            model.zero_grad(set_to_none=True)
            model.train(training)
            if saved is not None:
                self._metrics = saved
            own.restore()
        grad, n = seen["embeds"].grad, len(row["input_ids"])
        part = None if grad is None else grad[0, n:2 * n] if grad.shape[0] == 1 else grad[1, :n]  # 1 row: padding-free
        if part is not None and bool((part != 0).any()):
            raise UnlearnError(f"{cls.__qualname__}.compute_loss gives the dummy row that replaces a deleted sample a "
                               "gradient (a term on tokens whose labels are -100?): a deleted slot would not have "
                               "weight 0, so a replay would not delete it; weight every term by the labels")

    def _check_optimizer_rebuildable(self) -> None:
        if self._trace_optimizer_source != "custom":
            return
        if self.optimizer is not None:
            spec = optimizer_spec(self.optimizer, self.accelerator.unwrap_model(self.model))
        elif self.optimizer_cls_and_kwargs is not None:
            cls, kwargs = self.optimizer_cls_and_kwargs
            try:
                spec = optimizer_spec(cls([torch.nn.Parameter(torch.zeros(1))], **kwargs))
            except Exception as e:  # noqa: BLE001
                spec = {"rebuildable": False, "why": f"{getattr(cls, '__qualname__', cls)}(**kwargs) fails: {e}"}
        else:
            return  # a subclass's create_optimizer: checked on the optimizer it creates when training starts
        if not spec["rebuildable"]:
            raise UnlearnError(f"a replay must rebuild the optimizer and cannot: {spec['why']}; use an importable "
                               "torch optimizer class (optimizers=(...) or optimizer_cls_and_kwargs=) or the "
                               "TrainingArguments `optim` options")

    def _check_model_rebuildable(self) -> None:
        model = self.accelerator.unwrap_model(self.model)
        peft, base = peft_and_base(model)
        if getattr(base, "config", None) is None or _importable_name(unsharded_class(type(base))) is None:
            raise UnlearnError(f"a replay must rebuild the model and cannot: {type(base).__qualname__} is not an "
                               "importable transformers model with a config (pass model= to replays otherwise)")
        if peft and peft.get("why"):
            raise UnlearnError(f"a replay must rebuild the PEFT model and cannot: {peft['why']}")

    # ---- training ----------------------------------------------------------------------------------------
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
        from .plan import has_plan

        if resume_from_checkpoint and self.is_fsdp_enabled and not self._is_replay:
            raise UnlearnError("resuming an FSDP2 recording is not supported (its processes would disagree on the "
                               "checkpoints already written); record the run again into a new trace_dir")
        if not resume_from_checkpoint and has_plan(self.trace_dir):
            raise UnlearnError(f"{self.trace_dir} already holds a recorded run; pass a new trace_dir "
                               "(or resume_from_checkpoint)")
        self.accelerator.wait_for_everyone()  # every process checked before the main one writes
        self._trace_train_started = time.perf_counter()
        output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                               ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        try:
            self._trace_self_check()
            self.accelerator.wait_for_everyone()  # train() returns on every process once the header is sealed
        finally:  # the live tensors are the user's from now on (merge_and_unload edits them in place)
            from .base_source import release_live

            release_live()
        return output

    def _self_check_steps(self) -> int | None:
        """N of the self-check (steps 0..N reproduced), None when it does not run (off, a replay)."""
        if self._is_replay or not self.trace_self_check or self.trace_self_check == "all":
            return None
        from .fidelity import SELF_CHECK_STEPS

        return SELF_CHECK_STEPS if self.trace_self_check is True else int(self.trace_self_check)

    def _trace_keep_reference(self, step: int) -> None:
        """Keep the state hashes after ``step`` optimizer steps for the self-check: the checkpoint's just written
        at that step, else hashed from the live state now (no file: the self-check compares in memory). With more
        than one process every process hashes the live state (each replays the self-check; under FSDP2 the hashes
        gather each tensor: a collective)."""
        from .checkpoints import capture_state, checkpoint_dir
        from .fidelity import in_memory_reference
        from .hashing import checkpoint_hashes

        if step in self._trace_saved and self.accelerator.num_processes == 1:
            hashes = json.loads((checkpoint_dir(self.trace_dir, step) / "hashes.json").read_text())
        else:
            model = self.accelerator.unwrap_model(self.model)
            hashes = checkpoint_hashes(capture_state(model, self.optimizer, step))
        self._trace_check_ref = in_memory_reference(step, hashes)

    def _trace_self_check(self) -> None:
        """Prove the replay engine on this run (its first checkpoint interval) and seal the outcome into it. With more
        than one process (DDP, FSDP2) every process replays at the recorded world size; the main process decides
        whether it runs (and tells the others) and seals the verdict once."""
        if self._is_replay or not self._trace_started:
            return
        main = self.accelerator.is_main_process
        header = self._trace_header if main else None
        fid = header.setdefault("fidelity", {}) if main and header.get("sealed") else None
        # fid["recording"] already set: decided when sealing (a buffer changed during training)
        run = [fid is not None and not fid.get("recording") and bool(self.trace_self_check),
               bool(main and fid is not None and header["collator"].get("rebuildable")), self._trace_prove_all()]
        if self.accelerator.num_processes > 1:
            import torch.distributed as dist

            dist.broadcast_object_list(run, src=0)
        record = None
        if run[0] and run[2]:  # the whole run proven (hf_unlearn.trace.proof): every step's state reproduced
            from ..errors import UnlearnError
            from .proof import prove

            try:
                with _rng_kept():
                    record = prove(self.trace_dir, data_collator=None if run[1] else self.data_collator,
                                   progress=not self.args.disable_tqdm, seal=False)
            except UnlearnError as e:  # a run the engine cannot prove as a whole (a resumed recording without
                # every step's fingerprint, a random collator allowed as a hazard, ...): never a crash at the end of
                # train(); the self-check below decides, as for a longer run, and `trace prove` says why later
                warnings.warn(f"{self.trace_dir}: the run was not proven at the end of recording ({e}); the "
                              "first step(s) are self-checked instead", stacklevel=2)
        if record is not None:
            self._trace_check_ref = None
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
            from .fidelity import self_check

            with _rng_kept():
                result = self_check(self.trace_dir, data_collator=None if run[1] else self.data_collator,
                                    reference=self._trace_check_ref)
            self._trace_check_ref = None
            if fid is not None:
                fid["recording"] = result
        elif fid is not None and not fid.get("recording"):
            fid["recording"] = {"checked": False, "why": "trace_self_check=False"}
        else:
            return
        if fid is not None:
            TraceWriter(self.trace_dir, self._trace_key).reseal_header(header)

    def _trace_prove_all(self) -> bool:
        """Whether the end of recording proves the whole run: ``trace_self_check="all"``, or the default (True) on a
        run whose training took at most :data:`~hf_unlearn.trace.proof.AUTO_PROVE_SECONDS` (the proof costs about
        as much again); a longer run gets the first step checked, and ``hf-unlearn trace prove`` when convenient."""
        if not self.trace_guards:  # no per-step fingerprints to prove against: the self-check's steps only
            return False
        if self.trace_self_check == "all":
            return True
        if self.trace_self_check is not True:
            return False
        from .proof import AUTO_PROVE_SECONDS

        return time.perf_counter() - getattr(self, "_trace_train_started", 0.0) <= AUTO_PROVE_SECONDS

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batch_samples:
            return batch_samples, num_items
        if not self._trace_started:
            self._trace_start()
        step = self.state.global_step
        if self._trace_guard is not None:
            lr0, group_lrs = self._lr_record()
            self._trace_guard.between_steps(step, group_lrs or [lr0] * len(self.optimizer.param_groups))
        if (self._trace_writer is not None or self._trace_shard_peer()) and step not in self._trace_saved and is_due(
                step, self._trace_total, self._trace_every, self.trace_checkpoint_retention):
            self._trace_checkpoint(step)
        if (self._trace_writer is not None or self._trace_peer()) and step == self._self_check_steps():
            self._trace_keep_reference(step)  # every process of a multi-process run: each replays the self-check
        from .rows import row_hashes

        ids, digests, rows = [], [], []
        for batch in batch_samples:
            if self.id_column not in batch:
                raise UnlearnError(f"the batch has no {self.id_column!r} entry: TraceRecordingTrainer's dataloader "
                                   "carries the ids; do not override get_train_dataloader without IdCarryingCollator")
            raw = batch.pop(self.id_column)
            ids.append([_plain_id(i) for i in (raw.tolist() if torch.is_tensor(raw) else raw)])
            digests.append(batch_digest(batch))
            hashes = row_hashes(batch)  # every row as the model sees it (hf_unlearn.trace.rows); none when merged
            rows.append(hashes if hashes is not None and len(hashes) == len(ids[-1]) else None)
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        if world > 1:
            from accelerate.utils import gather_object

            self._trace_rows = gather_object([rows])
            per_rank = gather_object([(ids, digests)])
            if len({len(r[0]) for r in per_rank}) != 1:
                raise UnlearnError("the processes ran different numbers of microbatches in one optimizer step; "
                                   "exact deletion needs even batches (accelerate's default)")
        else:
            per_rank, self._trace_rows = [(ids, digests)], [rows]
        base = self._trace_header_seed
        self._trace_seeds.clear()
        self._trace_seeds.extend(rank_seed(microbatch_seed(base, step, j), rank) for j in range(len(ids)))
        if self._trace_writer is not None:
            self._trace_writer.append(self._segment_entries(step, per_rank, num_items))
        return batch_samples, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self._trace_seeds:
            return super().training_step(model, inputs, num_items_in_batch)
        with seeded(self._trace_seeds.popleft()):
            loss = super().training_step(model, inputs, num_items_in_batch)
        if not self._is_replay and self._trace_non_finite is None and torch.is_tensor(loss) \
                and not bool(torch.isfinite(loss).all()):  # Trainer itself syncs on the loss each microbatch
            self._trace_non_finite_hazard(f"the loss was not finite ({float(loss.detach().float().mean())}) at "
                                          f"optimizer step {self.state.global_step}")
        return loss

    def _trace_non_finite_hazard(self, what: str) -> None:
        """A NaN or infinity while recording: a hazard of the run, named with its step (sealed into the header)."""
        import warnings

        self._trace_non_finite = what
        hazard = (f"{what}: the run trained on non-finite numbers from there on (an fp16 overflow, a learning rate "
                  "too high?); a deletion replays them, and its verdict says nothing about a usable model")
        if "hazards" in self._trace_header:  # the main process's header (sealed when training ends)
            self._trace_header["hazards"].append(hazard)
        warnings.warn(f"{self.trace_dir}: {hazard}", stacklevel=3)

    def _finalize_training(self, *args, **kwargs):
        # Seal before the Trainer may load the best checkpoint (load_best_model_at_end): the trace's final
        # checkpoint is the state after the last recorded step. (The callback's on_train_end is the fallback.)
        self._trace_finish()
        return super()._finalize_training(*args, **kwargs)

    # ---- internals --------------------------------------------------------------------------------------
    def _lr_record(self) -> tuple[float, list[float] | None]:
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        return lrs[0], (lrs if len(set(lrs)) > 1 else None)

    def _group_settings(self) -> list[dict]:
        """Param-group settings other than the learning rate (a scheduler may cycle momentum, e.g. OneCycleLR)."""
        return [{k: _jsonable(v) for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                for g in self.optimizer.param_groups]

    def _segment_entries(self, step: int, per_rank: list, num_items) -> list[PlanEntry]:
        lr0, group_lrs = self._lr_record()
        groups = self._group_settings()
        extra = {}
        if groups != self._trace_groups:
            extra = {"groups": groups}
            self._trace_groups = groups
        if self._trace_guard is not None and step > 0:
            extra.update(self._trace_guard.flush(step - 1))  # step - 1's fingerprint and program changes
        extra.update(self._trace_callback_extra(step))
        from .rows import keyed_rows

        rows = [[keyed_rows(self._trace_key, r[j]) for r in self._trace_rows] for j in range(len(per_rank[0][0]))]
        if all(None not in mb for mb in rows):  # every kept row checked by replays (hf_unlearn.trace.rows)
            extra["rows"] = ["".join(mb) for mb in rows]
        if self._trace_guard is not None:  # what callbacks and compute_loss read of state.epoch during this step
            extra["ep"] = _epoch_text(self.state.epoch)  # exact, and not a number an id scan could take for an id
        if torch.is_tensor(num_items):
            norm, norm_dtype = float(num_items.item()), str(num_items.dtype).removeprefix("torch.")
        elif num_items is None:
            norm, norm_dtype = None, None
        else:
            norm, norm_dtype = float(num_items), "python"
        world = len(per_rank)
        entries = []
        n_mb = len(per_rank[0][0])
        for j in range(n_mb):
            mb_ids = [i for ids, _ in per_rank for i in ids[j]]
            entries.append(PlanEntry(
                mb=self._trace_mb, step=step, j=j, end=j == n_mb - 1, seed=microbatch_seed(self._trace_header_seed, step, j),
                lr=lr0, norm=norm, norm_dtype=norm_dtype, accum=n_mb,
                slots=[tag(self._trace_key, i) for i in mb_ids], lens=[self._trace_lens[i] for i in mb_ids],
                epoch=self._trace_epoch, group_lrs=group_lrs,
                ranks=[len(ids[j]) for ids, _ in per_rank] if world > 1 else None,
                batch=[keyed_batch_digest(self._trace_key, digests[j]) for _, digests in per_rank],
                extra=extra if j == 0 else {},
            ))
            self._trace_mb += 1
        return entries

    def _trace_start(self) -> None:
        """Called at the first segment of ``train()``: the main process writes the header and the store."""
        self._trace_started = True
        self._trace_header_seed = self.args.seed
        self._trace_groups = None
        if self.accelerator.num_processes > 1 and not self._is_replay:
            self._trace_same_settings = SameOptimizerSettings(self.optimizer, lambda: self.state.global_step)
        if not self.accelerator.is_main_process:
            if self.is_fsdp_enabled:  # a shard peer: it writes its shards of each checkpoint the main one indexes
                self._trace_total = max(self.state.max_steps, 1)
                self._trace_every = self.trace_checkpoint_steps or default_every(self._trace_total,
                                                                                 self.trace_checkpoint_retention)
                self._trace_saved = set()
                if self.trace_guards:
                    from .sharding import ShardPeerDigest

                    self._trace_peer_digest = ShardPeerDigest(self.accelerator.unwrap_model(self.model), self.optimizer)
                if not self._is_replay:  # the main process's lineage gathers each starting tensor: take part
                    from .lineage import weights_root

                    weights_root(self.accelerator.unwrap_model(self.model).state_dict())
            if self.trace_guards:  # the whole program is compared between processes at every step
                self._trace_callbacks()
                self._trace_processes_start()
            return
        from .store import id_index, save_store, store_sha256

        served, hazards, notes = self.trace_preflight()
        run = self.trace_dir
        resume_step = self.state.global_step if self._trace_resume else None
        self._trace_key = recording_key(run, self._trace_key_arg)
        max_steps = max(self.state.max_steps, 1)
        self._trace_total = max_steps
        self._trace_every = self.trace_checkpoint_steps or default_every(max_steps, self.trace_checkpoint_retention)
        self._trace_factor = 2
        from ..utils import owner_only, private_dir

        store = private_dir(run) / "store"  # raw ids and token ids of every row: owner-only whatever the umask
        fingerprint = store_sha256(store) if store.exists() else save_store(served, store)
        from .packing import PACKED_IDS, save_store_info

        if PACKED_IDS in served.column_names:
            save_store_info(store, self.dummy_token_id)
        owner_only(store.parent)
        index = id_index(served, self.id_column)
        lengths = self._trace_row_lengths(served)
        self._trace_lens = {i: lengths[n] for i, n in index.items()}
        previous = {}
        if resume_step and (run / "header.json").exists():
            previous = json.loads((run / "header.json").read_text())
        header = self._trace_header_dict(served, fingerprint, hazards, notes)
        from .stack import stack_change

        changed = stack_change(previous.get("numeric_stack"), header["numeric_stack"])
        if changed:  # the steps before the resume ran on another stack than the one every replay uses
            header["hazards"].append(f"the run was resumed at step {resume_step} with another numeric stack than its "
                                     f"earlier steps ({changed}): replays run every step with the resumed one")
        self._trace_packing(served, header)
        header["run_id"] = previous.get("run_id", header["run_id"])
        header["origin_run_id"] = header["run_id"]
        from ..keys import key_fingerprint

        header["key_fingerprint"] = key_fingerprint(self._trace_key)
        header["trainer"].update(self._trace_callbacks())
        before = (previous.get("trainer") or {}).get("callbacks")
        if before is not None and before != header["trainer"]["callbacks"]:  # a replay runs one set over the run
            names = [[c["class"].rsplit(":", 1)[-1] for c in cbs] for cbs in (before, header["trainer"]["callbacks"])]
            raise UnlearnError(f"{run} was recorded with the replayed callbacks {names[0] or 'none'} and is resumed "
                               f"with {names[1] or 'none'}: a replay runs one set of callbacks over the whole run; "
                               "resume with the same callbacks (same classes, same order)")
        if not self._is_replay:  # the model it starts from: a recorded run's output, or an external base
            from .lineage import record_lineage

            header["lineage"] = previous.get("lineage") or record_lineage(
                self.accelerator.unwrap_model(self.model), run, self.trace_parent)
        self._trace_header = header
        if resume_step:
            self._check_resumed_state(resume_step)
        self._save_model_files(run)
        from .fidelity import save_buffers

        header["model"]["layout"] = save_buffers(self.accelerator.unwrap_model(self.model), run)
        self._trace_writer = TraceWriter(run, self._trace_key)
        self._trace_writer.frozen.source = self.trace_frozen_source
        if self.trace_guards:  # said from the start, so a run that crashes still says its steps were guarded
            header.setdefault("fidelity", {})["guards"] = {"checks": GUARD_CHECKS}
        self._trace_writer.open(header, resume_step=resume_step)
        self._trace_saved = set(self._trace_writer.index.entries)  # bound to the run; a save cut short is redone
        self._trace_mb = 0
        if resume_step:
            from .plan import read_plan

            self._trace_mb = len(read_plan(run))
        self._trace_cb_states = None
        if self.trace_guards:
            from .guards import ProgramGuard

            watched = {id(cb): spec for cb, spec in self._trace_watched}
            self._trace_guard = ProgramGuard(self.accelerator.unwrap_model(self.model), self.optimizer, watched,
                                             context=self._trace_program_context)
            self._trace_guard.start()
        self._trace_processes_start()

    def _trace_program_context(self) -> dict:
        """What the whole-program digests read besides the model and the optimizer (hf_unlearn.trace.digests)."""
        loader = getattr(self.callback_handler, "train_dataloader", None)
        datasets = {"train_dataset": self.train_dataset, "the training dataloader's dataset":
                    getattr(loader, "dataset", None)}
        if datasets["the training dataloader's dataset"] is self.train_dataset:
            datasets.pop("the training dataloader's dataset")
        return {"args": self.args, "trainer": self, "callbacks": self._trace_program_callbacks,
                "datasets": {k: v for k, v in datasets.items() if v is not None}, "collator": self.data_collator}

    def _trace_processes_start(self) -> None:
        """Every process of a multi-process recording compares its whole program with the others' at every optimizer
        step (hf_unlearn.trace.digests.ProcessComparison); the main process records a difference as a change."""
        if not self.trace_guards or self.accelerator.num_processes < 2:
            return
        from .digests import ProcessComparison

        self._trace_processes = ProcessComparison(
            self.accelerator.unwrap_model(self.model), self.optimizer, self._trace_program_context,
            guard=self._trace_guard, step=lambda: self.state.global_step)

    def _check_resumed_state(self, step: int) -> None:
        """The state a resume loaded (the Trainer's checkpoint) must be the recorded checkpoint at that step when
        the trace holds one: an edited or foreign checkpoint would continue a run the plan does not describe."""
        from .checkpoints import capture_state, checkpoint_dir
        from .hashing import checkpoint_hashes

        saved = checkpoint_dir(self.trace_dir, step) / "hashes.json"
        if not saved.is_file():
            return  # no recorded checkpoint at the resume step: the guards' missing fingerprint says so (verify)
        recorded = json.loads(saved.read_text())
        now = checkpoint_hashes(capture_state(self.accelerator.unwrap_model(self.model), self.optimizer, step))
        for part in ("params_root", "optimizer_root"):
            if now.get(part) != recorded.get(part):
                raise UnlearnError(f"the state resumed from {self._trace_resume} at step {step} is not the recorded "
                                   f"checkpoint {saved.parent} ({part.split('_')[0]} differ): the trace cannot "
                                   "continue from it; resume from the checkpoint the run saved at that step")

    def _trace_callbacks(self) -> dict:
        """Sort the callbacks (hf_unlearn.trace.guards): observers; the user's program callbacks a replay runs again
        (``callbacks`` in the header: class and events); those it cannot (``watched_callbacks``, with why)."""
        from .guards import callback_spec, is_observer

        self._trace_watched, recorded, watched = [], [], []
        for cb in self.callback_handler.callbacks:
            if is_observer(cb):
                continue
            spec = callback_spec(cb)
            self._trace_watched.append((cb, spec))
            if spec["replayable"]:
                recorded.append({"class": spec["class"], "events": spec["events"]})
            else:
                watched.append({"class": spec["class"], "why": spec["why"]})
        self._trace_program_callbacks = [cb for cb, spec in self._trace_watched if spec["replayable"]]
        return {"callbacks": recorded, "watched_callbacks": watched}

    def _trace_callback_extra(self, step: int) -> dict:
        """The recorded callbacks' attributes when they changed (a suffix replay restores them with the checkpoint)."""
        from .guards import callback_attributes

        if not self._trace_program_callbacks:
            return {}
        try:
            states = [callback_attributes(cb) for cb in self._trace_program_callbacks]
        except ValueError as e:
            if self._trace_guard is not None:
                self._trace_guard.pending.append({"step": step, "what": f"a recorded callback's attributes: {e}",
                                                  "by": "a recorded callback"})
            return {}
        if states == self._trace_cb_states:
            return {}
        self._trace_cb_states = states
        return {"callbacks": states}

    def _guarded_call_event(self, event, args, state, control, **kwargs):
        """transformers' CallbackHandler.call_event, with each watched callback's event run inside the guard."""
        handler, guard = self.callback_handler, self._trace_guard
        from .guards import StateView

        for cb in handler.callbacks:
            spec = guard.watched.get(id(cb)) if guard is not None else None
            # a recorded callback sees the state through a view that notes reads of fields replays do not set
            view = StateView(state) if spec is not None and spec["replayable"] else None

            def call(cb=cb, control=control, seen=view or state):
                return getattr(cb, event)(args, seen, control, model=handler.model,
                                          processing_class=handler.processing_class, optimizer=handler.optimizer,
                                          lr_scheduler=handler.lr_scheduler, train_dataloader=handler.train_dataloader,
                                          eval_dataloader=handler.eval_dataloader, **kwargs)
            if spec is not None and event in spec["events"]:
                result = guard.around(cb, event, call, state_view=view)
            else:
                result = call()
            if result is not None:
                control = result
        return control

    def _trace_packing(self, served, header: dict) -> None:
        """A packed run: write the public document map and describe it in the header (under the keyed seal)."""
        from .packing import PACKED_IDS, document_map, write_map

        if PACKED_IDS not in served.column_names:
            return
        docs = [d for row in served[PACKED_IDS] for d in row]
        dataset = header["dataset"]
        dataset["id_type"] = "str" if isinstance(docs[0], str) else "int"  # the documents' ids, which requests name
        dataset["packing"] = {"strategy": self.args.packing_strategy, "max_length": self.args.max_length,
                              "documents": len(set(docs)), "fragments": len(docs), "packed_rows": len(served),
                              **write_map(self.trace_dir, document_map(served, self._trace_key, self.id_column))}

    def _save_model_files(self, run: Path) -> None:
        from .trainers import DEFAULT_TRAINER, PROCESSING_CLASS_DIR

        model = self.accelerator.unwrap_model(self.model)
        peft, base = peft_and_base(model)
        for folder in ("model", PROCESSING_CLASS_DIR):
            if (run / folder).exists():
                shutil.rmtree(run / folder)
        base.config.save_pretrained(run / "model")
        if peft:
            peft["config"].save_pretrained(str(run / "model" / "adapter"))
        if self._trace_trainer["class"] != DEFAULT_TRAINER and self.processing_class is not None:
            self.processing_class.save_pretrained(str(run / PROCESSING_CLASS_DIR))  # the rebuilt trainer takes it

    def _trace_peer(self) -> bool:
        """A process other than the main one of a multi-process recording (DDP or FSDP2)."""
        return self._trace_started and not self.accelerator.is_main_process and not self._is_replay

    def _trace_shard_peer(self) -> bool:
        """A process other than the main one of a sharded (FSDP2) recording: it writes its shards of each checkpoint."""
        return self._trace_started and self.is_fsdp_enabled and not self.accelerator.is_main_process \
            and not self._is_replay

    def _trace_final_params_root(self, step: int) -> str:
        """A sharded run's output root: its final checkpoint's ``params_root`` (over the full logical tensors, as
        :func:`~hf_unlearn.trace.lineage.weights_root` computes it), read instead of gathering the model again."""
        from .checkpoints import checkpoint_dir

        return json.loads((checkpoint_dir(self.trace_dir, step) / "hashes.json").read_text())["params_root"]

    def _trace_finish(self) -> None:
        same, self._trace_same_settings = getattr(self, "_trace_same_settings", None), None
        if same is not None:
            same.close()
        processes, self._trace_processes = getattr(self, "_trace_processes", None), None
        if processes is not None:
            processes.close()
        if self._trace_writer is None:
            if self._trace_shard_peer() and self.state.global_step not in self._trace_saved:
                self._trace_checkpoint(self.state.global_step, final=True)
            wanted, step = self._self_check_steps(), self.state.global_step
            if self._trace_peer() and wanted and 0 < step <= wanted and self._trace_check_ref is None:
                self._trace_keep_reference(step)  # as the main process does below, at the same point
            if getattr(self, "_trace_peer_digest", None) is not None:
                self._trace_peer_digest.close()
                self._trace_peer_digest = None
            return
        step = self.state.global_step
        guard, self._trace_guard = self._trace_guard, None
        if guard is not None:  # after the last step: its fingerprint, and a change since (in the final checkpoint)
            guard.between_steps(step, [])
            guard.close()
        if step not in self._trace_saved:
            self._trace_checkpoint(step, final=True)
        else:
            self._trace_thin(step, final=True)
        wanted = self._self_check_steps()
        if wanted and 0 < step <= wanted and self._trace_check_ref is None:
            self._trace_keep_reference(step)  # a run no longer than the self-check: up to its final checkpoint
        self._trace_header.update(optimizer_steps=step, microbatches=self._trace_mb, finished=time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        if not self._is_replay:
            from .stack import stack_change

            changed = stack_change(self._trace_header.get("numeric_stack"), numeric_stack(self.args.device))
            if changed:
                self._trace_header["hazards"].append(
                    f"the numeric stack changed while training ({changed}): replays run with the one recorded when "
                    "training started (set threads and deterministic settings before train())")
        kept = self._kept_model()
        if kept:
            self._trace_header["kept_model"] = kept
        if not self._is_replay and self._trace_header.get("lineage") and not kept:
            from .lineage import live_output_root  # a later stage finds this run by it without loading a checkpoint

            self._trace_header["lineage"]["output_root"] = (
                self._trace_final_params_root(step) if self.is_fsdp_enabled else
                live_output_root(self.accelerator.unwrap_model(self.model), self._trace_header))
        if not self._is_replay:
            from .fidelity import changed_buffers

            changed = changed_buffers(self.accelerator.unwrap_model(self.model), self.trace_dir)
            why = (f"the model's non-persistent buffer {changed[0]} changed during training (checkpoints do not carry "
                   "it, so replays cannot follow it)") if changed else self._trace_changed_during_training()
            if why:
                self._trace_header["fidelity"] = {"recording": {
                    "checked": True, "reproduced": False, "steps": [0, step], "why": why}}
        if guard is not None and step > 0:
            self._trace_header.setdefault("fidelity", {})["guards"] = {
                "final": {"step": step - 1, **guard.flush(step - 1), "ep": _epoch_text(self.state.epoch)},
                "checks": GUARD_CHECKS}
        if guard is not None:
            guard.warn_changes(self.trace_dir)
        self._trace_writer.seal(self._trace_header)
        self._trace_writer = None

    def _trace_checkpoint(self, step: int, final: bool = False) -> None:
        model = self.accelerator.unwrap_model(self.model)
        if self._trace_writer is None:  # a shard peer: writes its shards (hf_unlearn.trace.shards), joins the hashes
            from .shards import save

            save(self.trace_dir, step, model, self.optimizer)
            self._trace_saved.add(step)
            return
        if not self._is_replay and self._trace_non_finite is None:
            bad = first_non_finite(model)
            if bad:
                self._trace_non_finite_hazard(f"parameter {bad} holds a NaN or infinity at the checkpoint after "
                                              f"{step} optimizer steps")
        self._trace_writer.save_checkpoint(step, model, self.optimizer)
        self._trace_saved.add(step)
        if step > 0 and self.trace_checkpoint_budget and self.trace_checkpoint_retention == "geometric" \
                and "max_kept" not in self._trace_header["checkpoint_retention"]:
            self._trace_fit_budget(step)  # the first checkpoint with optimizer state sets the size of each
        self._trace_thin(step, final)

    def _trace_fit_budget(self, step: int) -> None:
        """Pick the retention factor whose kept set fits ``trace_checkpoint_budget`` (sizes from ``step``'s files)."""
        import logging

        from .checkpoints import FROZEN_DIR, checkpoint_bytes, checkpoint_dir
        from .retention import describe, factor_for_budget

        each = checkpoint_bytes(checkpoint_dir(self.trace_dir, step))
        frozen_dir = self.trace_dir / "checkpoints" / FROZEN_DIR
        frozen = sum(f.stat().st_size for f in frozen_dir.iterdir()) if frozen_dir.exists() else 0
        budget = self.trace_checkpoint_budget
        fits = max(0, budget - frozen) // each
        factor = factor_for_budget(self._trace_total, self._trace_every, fits)
        if factor is None:
            raise UnlearnError(f"trace_checkpoint_budget={budget} bytes holds {fits} checkpoint(s) of {each} bytes "
                               f"(+ {frozen} bytes of frozen tensors once); a run needs at least 2 (step 0 and the "
                               f"end): raise it to at least {2 * each + frozen}, or drop it")
        self._trace_factor = factor
        retention = self._trace_header["checkpoint_retention"]
        retention.update(factor=factor, budget=budget, max_kept=int(fits))
        self._trace_writer.index.retention = retention
        if factor != 2:
            logging.getLogger(__name__).warning(
                "trace_checkpoint_budget=%d keeps at most %d checkpoints: %s (2 x (T - s) + K without the budget)",
                budget, fits, describe(retention))

    def _trace_thin(self, step: int, final: bool = False) -> None:
        """Drop the checkpoints retention no longer needs (crash-safe: see CheckpointIndex.thin)."""
        from .retention import final_keep, thin

        index, mode = self._trace_writer.index, self.trace_checkpoint_retention
        have = sorted(index.entries)
        if 0 not in have or step not in have:
            return  # a run resumed without its step-0 checkpoint: keep everything
        if final:
            keep = final_keep(step, have, self._trace_every, self._trace_factor, mode)
        else:
            keep = thin(step, have, self._trace_total, self._trace_every, self._trace_factor, mode)
            cap = self._trace_header["checkpoint_retention"].get("max_kept")
            if cap and len(keep) > cap:  # while training, the bound for an early stop gives way to the budget
                from .retention import dense_steps, geometric_keep

                planned = set(geometric_keep(self._trace_total, dense_steps(self._trace_total, self._trace_every),
                                             self._trace_every, self._trace_factor))
                extra = [c for c in keep if c not in planned and c not in (0, step)]
                keep = sorted(set(keep) - set(extra[:len(keep) - cap]))
        index.thin(keep)
        if final:
            index.retention = {**(index.retention or {}), "kept": sorted(index.entries)}
            self._trace_header["checkpoint_retention"] = index.retention
            index.save()

    def _kept_model(self) -> dict | None:
        """With ``load_best_model_at_end`` the user keeps the best checkpoint's model, not the last step's: its step."""
        state = self.state
        if self._is_replay or not self.args.load_best_model_at_end or not state.best_model_checkpoint:
            return None
        best = state.best_global_step
        if best is None:
            best = int(Path(state.best_model_checkpoint).name.rsplit("-", 1)[-1])
        return {"step": int(best), "recorded_steps": state.global_step, "metric": self.args.metric_for_best_model,
                "why": "load_best_model_at_end: the Trainer loaded the best checkpoint, so the kept model is the state "
                       f"after {best} of {state.global_step} optimizer steps; deletions replay up to it"}

    def _trace_header_dict(self, served, fingerprint: str, hazards: list[str], notes: list[str]) -> dict:
        args = self.args
        model = self.accelerator.unwrap_model(self.model)
        peft, base = peft_and_base(model)
        config = getattr(base, "config", None)
        opt = getattr(self.optimizer, "optimizer", self.optimizer)
        spec = collator_spec(self.data_collator, save_dir=self.trace_dir / "collator")
        if spec["rebuildable"]:  # prove it: rebuild from the saved files and collate real rows the same way
            rows = [{k: v for k, v in served[i].items() if k != self.id_column} for i in range(min(4, len(served)))]
            try:
                same = batch_digest(rebuild_collator(spec, self.trace_dir / "collator", model=model)(rows)) == \
                    batch_digest(self.data_collator(rows))
            except Exception as e:  # noqa: BLE001
                same, spec["why"] = False, f"rebuilding it failed: {e}"
            if not same:
                spec.update(rebuildable=False, why=spec.get("why", "rebuilt from the trace it collates differently"))
        if not spec["rebuildable"]:
            notes.append(f"the data collator ({spec['class']}) cannot be rebuilt from the trace ({spec.get('why')}): "
                         "pass it to replays (data_collator= or --collator)")
        optimizer = {"class": type(opt).__name__, "source": self._trace_optimizer_source,
                     "defaults": {k: _jsonable(v) for k, v in opt.defaults.items()},
                     "param_groups": [{"params": len(g["params"]), **{k: _jsonable(v) for k, v in g.items()
                                                                      if k != "params"}} for g in opt.param_groups]}
        if self._trace_optimizer_source == "custom":
            ospec = optimizer_spec(opt, model)
            if not ospec["rebuildable"]:
                raise UnlearnError(f"a replay must rebuild the optimizer and cannot: {ospec['why']}")
            optimizer["rebuild"] = {k: v for k, v in ospec.items() if k != "param_names"}
        return {
            "format": FORMAT,
            "run_id": uuid.uuid4().hex,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "sealed": False,
            "model": {"class": unsharded_class(type(base)).__name__, "module": unsharded_class(type(base)).__module__,
                      "dtype": str(next(base.parameters()).dtype).removeprefix("torch."),
                      "attn_implementation": getattr(config, "_attn_implementation", None),
                      "num_parameters": sum(p.numel() for p in model.parameters()),
                      "frozen_parameters": frozen_parameters(model),
                      "peft": {"adapter_name": peft["name"], "type": str(peft["config"].peft_type)} if peft else None,
                      "config": _without_local_paths(config.to_dict()) if config is not None
                      else None},
            "optimizer": optimizer,
            "training_args": _without_local_paths({k: _jsonable(v) for k, v in args.to_dict().items()}),
            "versions": _versions(),
            "numeric_stack": numeric_stack(args.device),
            "determinism": {"seed": args.seed, "data_seed": args.data_seed, "full_determinism": args.full_determinism,
                            "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                            "cudnn_deterministic": torch.backends.cudnn.deterministic,
                            "cudnn_benchmark": torch.backends.cudnn.benchmark,
                            "dataloader_num_workers": args.dataloader_num_workers, "device": str(args.device),
                            "device_info": device_info(args.device),
                            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                            "dropout": dropout_settings(model), "neftune_noise_alpha": args.neftune_noise_alpha,
                            "per_microbatch_reseeding": True},
            "hazards": hazards,
            "notes": notes,
            "dataset": {"fingerprint": getattr(self.train_dataset, "_fingerprint", None), "rows": len(served),
                        "columns": served.column_names, "id_column": self.id_column,
                        "id_type": "str" if "string" in str(served.features[self.id_column].dtype) else "int",
                        "store_sha256": fingerprint},
            "collator": spec,
            "trainer": {**self._trace_trainer, "dropped_rows": len(self._trace_dropped),
                        "dropped_tags": sorted(tag(self._trace_key, i) for i in self._trace_dropped)},
            "dummy_token_id": self.dummy_token_id,
            "checkpoint_steps": self._trace_every,
            "checkpoint_retention": {"mode": self.trace_checkpoint_retention, "every": self._trace_every,
                                     "factor": self._trace_factor, "planned_steps": self._trace_total,
                                     "budget": self.trace_checkpoint_budget},
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "max_grad_norm": args.max_grad_norm,
            "world_size": self.accelerator.num_processes,
            "distributed_type": str(self.accelerator.distributed_type).split(".")[-1],
            "sharding": engine_spec(self),  # FSDP2: the sharding a replay must run (hf_unlearn.trace.sharding)
        }


class TraceRecordingTrainer(TraceRecordingMixin, Trainer):
    """``transformers.Trainer`` with :class:`TraceRecordingMixin`: swap the class in a training script."""

    _trace_machinery = True


class _attributes_kept:
    """The trainer's attributes as they are now, to put back after a probe runs the user's ``compute_loss``: every
    attribute rebound, added or removed comes back, and plain values (numbers, strings, lists and dicts of them) are
    copied, so an in-place ``self.calls.append(...)`` is undone too. The probe leaves no trace a later step could
    read (a counter-based edit would otherwise run one step early)."""

    def __init__(self, obj):
        import copy

        self.obj, self.before = obj, dict(vars(obj))
        self.copies = {}
        for k, v in self.before.items():
            if isinstance(v, (list, dict, set)):
                try:
                    json.dumps(list(v) if isinstance(v, set) else v)
                except (TypeError, ValueError):
                    continue
                self.copies[k] = copy.deepcopy(v)

    def restore(self) -> None:
        now = vars(self.obj)
        for k in [k for k in now if k not in self.before]:
            del now[k]
        now.update(self.before)
        for k, v in self.copies.items():
            target = now[k]
            target.clear()
            target.update(v) if isinstance(target, (dict, set)) else target.extend(v)


def _bound_arguments(init, args: tuple, kwargs: dict) -> dict:
    """The trainer constructor's arguments by name (its ``**kwargs`` flattened in)."""
    import inspect

    try:
        sig = inspect.signature(init)
        bound = sig.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return dict(kwargs)
    out = {}
    for name, value in bound.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif sig.parameters[name].kind is not inspect.Parameter.VAR_POSITIONAL:
            out[name] = value
    return out


def _adds_behaviour(cls) -> bool:
    """Whether a class defines anything of its own (a method, an attribute), beyond combining its bases."""
    return any(not (k.startswith("__") and k.endswith("__")) or k == "__init__" for k in vars(cls))


GUARD_CHECKS = ("per optimizer step: param-group settings at optimizer.step(), trainable set, module modes and "
                "attributes, config, user hooks, module classes' forward, process-wide numerics, exact checksums of "
                "parameters, buffers and optimizer state (after optimizer.step()) and of the gradients (before it); "
                "the whole program digested (every TrainingArguments field, the whole config, every module "
                "attribute, the code modules run, recorded callbacks' code and globals, the optimizer's structure, "
                "the dataset's format and the collator, torch switches, numeric environment variables: "
                "hf_unlearn.trace.digests), compared between processes; a keyed digest of every row as collated")


def _epoch_text(epoch) -> str | None:
    return None if epoch is None else float(epoch).hex()


def recorded_trainer_class(cls):
    """The trainer class a replay rebuilds: ``cls`` without the trace machinery (the mixin, the classes made by
    :func:`trace_recording`, replays) and without subclasses that only combine their bases."""
    for c in cls.__mro__:
        if "_trace_machinery" in vars(c) or not _adds_behaviour(c):
            continue
        return c
    return Trainer


@functools.cache
def trace_recording(trainer_cls):
    """The recording version of any ``Trainer`` subclass, TRL style: ``trace_recording(SFTTrainer)(model=...,
    args=SFTConfig(...), train_dataset=ds, processing_class=tok)`` records exactly what ``SFTTrainer`` would train.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise UnlearnError(f"trace_recording() takes a transformers.Trainer subclass, not {trainer_cls!r}")
    if issubclass(trainer_cls, TraceRecordingMixin):
        return trainer_cls
    from .preference import preference_mixins

    extra = preference_mixins(trainer_cls)  # refuses trainers that generate their own data
    if trainer_cls is Trainer:
        return TraceRecordingTrainer
    return type(f"TraceRecording{trainer_cls.__name__}", (*extra, TraceRecordingMixin, trainer_cls),
                {"__module__": __name__, "__doc__": f"{trainer_cls.__qualname__} recording a replayable trace.",
                 "_trace_machinery": True})


def frozen_parameters(model) -> list[str]:
    """Names of the parameters that do not train (``requires_grad=False``): a replay freezes the same ones."""
    return sorted(n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)


def peft_and_base(model) -> tuple[dict | None, object]:
    """(:func:`_peft_info` of ``model``, the model under its adapter, or ``model`` itself without one)."""
    peft = _peft_info(model)
    return peft, (peft["base"] if peft else model)


def _peft_info(model) -> dict | None:
    """``{"name", "config", "base"}`` of a PEFT model (``why`` when a replay could not rebuild it), else None."""
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict) or not hasattr(model, "get_base_model"):
        return None
    names = list(peft_config)
    info = {"name": names[0], "config": peft_config[names[0]], "base": model.get_base_model()}
    if len(names) != 1:
        info["why"] = f"it has {len(names)} adapters ({names}); record runs with one adapter"
    return info
