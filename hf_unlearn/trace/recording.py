"""TraceRecordingTrainer: a drop-in ``Trainer`` that records everything an exact deletion needs.

It hooks two methods and changes no arithmetic:

* ``get_batch_samples`` (called once per optimizer step with the whole accumulation segment) writes the
  segment's plan entries and WAL records *before* the segment runs, with the loss normaliser
  ``num_items_in_batch`` the Trainer just computed and the learning rate the scheduler set, pops the id column
  so the model never sees it, and saves a model + optimizer checkpoint every ``trace_checkpoint_steps``.
* ``training_step`` runs each microbatch under ``torch.random.fork_rng`` seeded with the microbatch's recorded
  seed: dropout is reproducible microbatch by microbatch, and the global RNG stream (data order) is untouched,
  so a run with dropout 0 is bit-identical to a plain ``Trainer`` run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import platform
import shutil
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from transformers import Trainer, TrainerCallback

from ..errors import UnlearnError
from ..utils import atomic_write_text
from .hashing import optimizer_param_names, state_hashes
from .plan import PlanEntry
from .run import FORMAT, SEALED_FILES, checkpoint_dir, write_sidecar
from .tags import ids_digest, recording_key, tag
from .wal import FLAG_ACCUM_END, FLAG_DUMMY, WalRecord, manifest_bytes


def microbatch_seed(base: int, step: int, j: int) -> int:
    """The seed of microbatch ``j`` of optimizer step ``step`` (63 bits, independent of resumes)."""
    d = hashlib.sha256(f"{base}:{step}:{j}".encode()).digest()
    return int.from_bytes(d[:8], "little") & ((1 << 63) - 1)


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


def collator_spec(collator) -> dict:
    """How to rebuild the collator at replay time: an importable function, or a dataclass with JSON kwargs."""
    import types

    if dataclasses.is_dataclass(collator) and not isinstance(collator, type):
        cls = type(collator)
        kwargs = {f.name: getattr(collator, f.name) for f in dataclasses.fields(collator) if f.init}
        try:
            json.dumps(kwargs)
        except (TypeError, ValueError):
            kwargs = None
        return {"class": f"{cls.__module__}:{cls.__qualname__}", "kwargs": kwargs, "rebuildable": kwargs is not None}
    if isinstance(collator, types.FunctionType):
        name = f"{collator.__module__}:{collator.__qualname__}"
        return {"class": name, "kwargs": None, "rebuildable": "<" not in name}
    cls = type(collator)
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "kwargs": None, "rebuildable": False}


def rebuild_collator(spec: dict | None):
    if not spec or not spec.get("rebuildable"):
        name = (spec or {}).get("class", "unknown")
        raise UnlearnError(f"the run's data collator ({name}) cannot be rebuilt from the trace; "
                           "pass the same data_collator= to the replay")
    module, qual = spec["class"].split(":")
    obj = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj(**spec["kwargs"]) if spec["kwargs"] is not None else obj


def _collator_is_random(collator, rows: list[dict]) -> bool:
    """Collate the same rows under two seeds; a difference means the collator draws random numbers."""
    outs = []
    for s in (1, 2):
        with seeded(s):
            outs.append(collator([dict(r) for r in rows]))
    a, b = outs
    for k in a:
        x, y = a[k], b.get(k)
        if torch.is_tensor(x) and (not torch.is_tensor(y) or x.shape != y.shape or not torch.equal(x, y)):
            return True
    return False


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for mod in ("torch", "transformers", "datasets", "accelerate", "numpy"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except ImportError:
            pass
    from .. import __version__

    out["hf_unlearn"] = __version__
    return out


class TraceWriter:
    """Appends plan lines, WAL records and manifest slots; saves checkpoints; seals the run with sidecars."""

    def __init__(self, run_dir: Path, key: bytes):
        self.run = Path(run_dir)
        self.key = key
        self._plan = self._wal = self._manifest = None

    def open(self, header: dict, resume_step: int | None = None) -> None:
        """Start the files; on resume keep only entries of steps before ``resume_step``."""
        from .plan import read_plan
        from .wal import RECORD_SIZE

        self.run.mkdir(parents=True, exist_ok=True)
        for name in SEALED_FILES + ("deletion_log.jsonl",):
            side = self.run / f"{name}.sha256"
            if side.exists():
                side.unlink()
        plan_f, wal_f, man_f = (self.run / n for n in ("plan.jsonl", "wal.bin", "manifest.bin"))
        if resume_step is not None and plan_f.exists():
            kept = [e for e in read_plan(plan_f) if e.step < resume_step]
            atomic_write_text(plan_f, "".join(e.to_line() for e in kept))
            with open(wal_f, "r+b") as f:
                f.truncate(len(kept) * RECORD_SIZE)
            with open(man_f, "r+b") as f:
                f.truncate(8 * sum(len(e.slots) for e in kept))
            for d in (self.run / "checkpoints").glob("step-*"):
                if int(d.name.split("-")[1]) > resume_step:
                    shutil.rmtree(d)
        else:
            for f in (plan_f, wal_f, man_f):
                f.write_bytes(b"")
        self.write_header(header)
        self._plan, self._wal, self._manifest = open(plan_f, "a"), open(wal_f, "ab"), open(man_f, "ab")

    def write_header(self, header: dict) -> None:
        atomic_write_text(self.run / "header.json", json.dumps(header, indent=1, sort_keys=True))

    def append(self, entries: list[PlanEntry]) -> None:
        """Write one segment ahead of running it (plan line, WAL record, manifest slots per microbatch)."""
        for e in entries:
            flags = (FLAG_ACCUM_END if e.end else 0) | (FLAG_DUMMY if None in e.slots else 0)
            rec = WalRecord(ids_digest(self.key, e.slots), e.seed, float(np.float32(e.lr)), e.step, len(e.slots), flags)
            self._plan.write(e.to_line())
            self._manifest.write(manifest_bytes(e.slots))
            self._wal.write(rec.pack())
        for f in (self._plan, self._manifest, self._wal):
            f.flush()

    def save_checkpoint(self, step: int, model, optimizer) -> Path:
        d = checkpoint_dir(self.run, step)
        d.mkdir(parents=True, exist_ok=True)
        sd = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
        osd = optimizer.state_dict()
        names = optimizer_param_names(model, optimizer)
        tmp = d / "state.pt.tmp"
        torch.save({"step": step, "model": sd, "optimizer": osd, "param_names": names}, tmp)
        os.replace(tmp, d / "state.pt")
        write_sidecar(d / "state.pt")
        state_hashes(model, optimizer).to_json(d / "hashes.json")
        return d

    def close(self) -> None:
        for f in (self._plan, self._wal, self._manifest):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()
        self._plan = self._wal = self._manifest = None

    def seal(self, header: dict) -> None:
        self.close()
        header["sealed"] = True
        self.write_header(header)
        for name in SEALED_FILES:
            write_sidecar(self.run / name)
        if (self.run / "deletion_log.jsonl").exists():
            write_sidecar(self.run / "deletion_log.jsonl")


class _TraceCallback(TrainerCallback):
    def __init__(self, trainer):
        self.trainer = trainer

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.trainer._trace_epoch = int(round(state.epoch or 0))

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._trace_finish()


class TraceRecordingTrainer(Trainer):
    """``Trainer`` that records a replayable trace of the run in ``trace_dir`` (default ``output_dir/trace``).

    Args (beyond ``Trainer``'s):
        trace_dir: folder of the recorded run (see :mod:`hf_unlearn.trace.run` for its layout).
        trace_checkpoint_steps: save model + optimizer state every N optimizer steps (default: about 10
            checkpoints over the run). Suffix replays start from the latest checkpoint before the first
            affected step, so more checkpoints mean cheaper late deletions.
        trace_key: the HMAC key for id tags (bytes), kept in ``trace_dir/private/hmac.key``; default: the
            library's one key (:mod:`hf_unlearn.hub.keys`), so cards and deletion logs carry matching tags.
        id_column: the dataset column with the stable sample id (kept through ``remove_unused_columns``).
        dummy_token_id: the token of the dummy sequence that fills deleted slots (default 0).
    """

    def __init__(self, *args, trace_dir: str | os.PathLike | None = None, trace_checkpoint_steps: int | None = None,
                 trace_key: bytes | None = None, id_column: str = "id", dummy_token_id: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.trace_dir = Path(trace_dir) if trace_dir is not None else Path(self.args.output_dir) / "trace"
        self.trace_checkpoint_steps = trace_checkpoint_steps
        self.id_column = id_column
        self.dummy_token_id = dummy_token_id
        self._trace_key_arg = trace_key
        self._trace_writer: TraceWriter | None = None
        self._trace_seeds: deque = deque()
        self._trace_epoch = 0
        self._trace_mb = 0
        self._trace_saved: set[int] = set()
        self._trace_header: dict = {}
        self._trace_lens: dict = {}
        self._trace_resume = None
        self.add_callback(_TraceCallback(self))

    # ---- columns: keep the id through remove_unused_columns -------------------------------------------------
    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self.id_column not in self._signature_columns:
            self._signature_columns.append(self.id_column)

    # ---- recording hooks ---------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        self._trace_resume = resume_from_checkpoint
        self._trace_writer = None
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial,
                             ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batch_samples:
            return batch_samples, num_items
        if self._trace_writer is None:
            self._trace_start()
        step = self.state.global_step
        if step % self._trace_every == 0 and step not in self._trace_saved:
            self._trace_writer.save_checkpoint(step, self.model, self.optimizer)
            self._trace_saved.add(step)
        ids = []
        self._trace_seeds.clear()
        for batch in batch_samples:
            if self.id_column not in batch:
                raise UnlearnError(f"the batch has no {self.id_column!r} column: TraceRecordingTrainer needs the "
                                   "collator to carry sample ids (hf_unlearn.QACollator does)")
            raw = batch.pop(self.id_column)
            ids.append(raw.tolist() if torch.is_tensor(raw) else list(raw))
        self._trace_writer.append(self._segment_entries(step, ids, num_items))
        return batch_samples, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self._trace_seeds:
            return super().training_step(model, inputs, num_items_in_batch)
        with seeded(self._trace_seeds.popleft()):
            return super().training_step(model, inputs, num_items_in_batch)

    def _finalize_training(self, *args, **kwargs):
        # Seal before the Trainer may load the best checkpoint (load_best_model_at_end): the trace's final
        # checkpoint is the state after the last recorded step. (The callback's on_train_end is the fallback.)
        self._trace_finish()
        return super()._finalize_training(*args, **kwargs)

    # ---- internals --------------------------------------------------------------------------------------
    def _lr_record(self) -> tuple[float, list[float] | None]:
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        return lrs[0], (lrs if len(set(lrs)) > 1 else None)

    def _segment_entries(self, step: int, ids: list[list], num_items, slots: list[list] | None = None,
                         lens: list[list[int]] | None = None, seeds: list[int] | None = None,
                         lr: tuple | None = None) -> list[PlanEntry]:
        lr0, group_lrs = lr if lr is not None else self._lr_record()
        if torch.is_tensor(num_items):
            norm, norm_dtype = float(num_items.item()), str(num_items.dtype).removeprefix("torch.")
        elif num_items is None:
            norm, norm_dtype = None, None
        else:
            norm, norm_dtype = float(num_items), "python"
        entries = []
        for j, mb_ids in enumerate(ids):
            seed = seeds[j] if seeds is not None else microbatch_seed(self._trace_header["seed_base"], step, j)
            self._trace_seeds.append(seed)
            entries.append(PlanEntry(
                mb=self._trace_mb, step=step, j=j, end=j == len(ids) - 1, seed=seed, lr=lr0, norm=norm,
                norm_dtype=norm_dtype, accum=len(ids),
                slots=slots[j] if slots is not None else [tag(self._trace_key, i) for i in mb_ids],
                lens=lens[j] if lens is not None else [self._trace_lens[i] for i in mb_ids],
                epoch=self._trace_epoch, group_lrs=group_lrs,
            ))
            self._trace_mb += 1
        return entries

    def _trace_start(self) -> None:
        """Called at the first segment of ``train()``: write the header and the store, open the log files."""
        from .store import save_store

        if self.args.world_size > 1:
            raise UnlearnError("TraceRecordingTrainer records single-process runs; launch with one process")
        run = self.trace_dir
        resume_step = self.state.global_step if self._trace_resume else None
        if resume_step is None and (run / "plan.jsonl").exists() and (run / "plan.jsonl").stat().st_size:
            raise UnlearnError(f"{run} already holds a recorded run; pass a new trace_dir (or resume_from_checkpoint)")
        self._trace_key = recording_key(run, self._trace_key_arg)
        max_steps = max(self.state.max_steps, 1)
        self._trace_every = self.trace_checkpoint_steps or max(1, -(-max_steps // 10))
        dataset = self.train_dataset
        try:
            import datasets
        except ImportError:  # pragma: no cover
            datasets = None
        if datasets is None or not isinstance(dataset, datasets.Dataset):
            raise UnlearnError("TraceRecordingTrainer needs train_dataset to be a datasets.Dataset of token rows "
                               "with an id column (the token store is saved from it)")
        served = self._remove_unused_columns(dataset, description="training")
        if self.id_column not in served.column_names:
            raise UnlearnError(f"train_dataset has no {self.id_column!r} column; add stable sample ids "
                               "(hf_unlearn.tokenize_qa keeps TOFU's `id`)")
        store = run / "private" / "store"
        if not store.exists():
            fingerprint = save_store(served, store)
        else:
            from .store import store_sha256

            fingerprint = store_sha256(store)
        from .store import id_index

        index = id_index(served, self.id_column)
        lengths = [len(x) for x in served["input_ids"]]
        self._trace_lens = {i: lengths[n] for i, n in index.items()}
        header = self._trace_header_dict(served, fingerprint)
        header["seed_base"] = self.args.seed
        from ..hub.keys import key_fingerprint

        header["key_fingerprint"] = key_fingerprint(self._trace_key)
        self._trace_header = header
        if self.model.config is not None:
            self.model.config.save_pretrained(run / "model")
        self._trace_writer = TraceWriter(run, self._trace_key)
        self._trace_writer.open(header, resume_step=resume_step)
        self._trace_saved = {int(d.name.split("-")[1]) for d in (run / "checkpoints").glob("step-*")}
        self._trace_mb = 0
        if resume_step:
            from .plan import read_plan

            self._trace_mb = len(read_plan(run / "plan.jsonl"))

    def _trace_finish(self) -> None:
        if self._trace_writer is None:
            return
        step = self.state.global_step
        if step not in self._trace_saved:
            self._trace_writer.save_checkpoint(step, self.model, self.optimizer)
            self._trace_saved.add(step)
        self._trace_header.update(optimizer_steps=step, microbatches=self._trace_mb, finished=time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        self._trace_writer.seal(self._trace_header)
        self._trace_writer = None

    def _trace_header_dict(self, served, fingerprint: str) -> dict:
        args = self.args
        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model, "config", None)
        dropout = {k: v for k, v in (config.to_dict() if config is not None else {}).items()
                   if "dropout" in k and isinstance(v, (int, float))}
        opt = self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer
        hazards, notes = [], []
        collator = self.data_collator
        spec = collator_spec(collator)
        rows = [served[i] for i in range(min(2, len(served)))]
        if rows and _collator_is_random(collator, rows):
            hazards.append(f"the data collator ({spec['class']}) is random (its output changes with the RNG seed): "
                           "replays re-collate stored rows and cannot reproduce its draws")
        if args.dataloader_num_workers > 0:
            (hazards if hazards else notes).append(
                f"dataloader_num_workers={args.dataloader_num_workers}: workers have their own RNG streams"
                + (", so random collation differs run to run" if hazards else " (harmless: the collator is deterministic)"))
        if served.format.get("type") == "custom":
            hazards.append("train_dataset has an on-the-fly transform (set_transform/with_transform): the store holds "
                           "the untransformed rows")
        if not self.model_accepts_loss_kwargs and self.compute_loss_func is None:
            hazards.append("the model does not accept num_items_in_batch: the loss is a per-microbatch mean, so "
                           "deleting a row re-weights the other rows of its microbatch")
        if any(v > 0 for v in dropout.values()) or args.neftune_noise_alpha:
            notes.append("random layers (dropout/NEFTune) are active: reproduced by per-microbatch reseeding")
        if args.fp16:
            hazards.append("fp16 with dynamic loss scaling: the grad scaler's state is not checkpointed, so replays "
                           "may scale (and skip) steps differently; use bf16 or fp32")
        if torch.cuda.is_available() and not torch.are_deterministic_algorithms_enabled():
            hazards.append("CUDA without torch.use_deterministic_algorithms(True): kernels may not be bit-reproducible")
        if not spec["rebuildable"]:
            notes.append(f"the data collator ({spec['class']}) cannot be rebuilt from the trace: pass it to replays")
        if args.max_grad_norm and args.max_grad_norm > 0:
            notes.append("gradient clipping is replayed on the replay's own gradients (part of the counterfactual)")
        return {
            "format": FORMAT,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "sealed": False,
            "model": {"class": type(model).__name__, "module": type(model).__module__,
                      "num_parameters": sum(p.numel() for p in model.parameters()),
                      "config": config.to_dict() if config is not None else None},
            "optimizer": {"class": type(opt).__name__,
                          "defaults": {k: _jsonable(v) for k, v in opt.defaults.items()},
                          "param_groups": [{"params": len(g["params"]), **{k: _jsonable(v) for k, v in g.items()
                                                                           if k != "params"}}
                                           for g in opt.param_groups]},
            "training_args": {k: _jsonable(v) for k, v in args.to_dict().items()},
            "versions": _versions(),
            "determinism": {"seed": args.seed, "data_seed": args.data_seed, "full_determinism": args.full_determinism,
                            "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                            "cudnn_deterministic": torch.backends.cudnn.deterministic,
                            "cudnn_benchmark": torch.backends.cudnn.benchmark,
                            "dataloader_num_workers": args.dataloader_num_workers, "device": str(args.device),
                            "dropout": dropout, "per_microbatch_reseeding": True},
            "hazards": hazards,
            "notes": notes,
            "dataset": {"fingerprint": getattr(self.train_dataset, "_fingerprint", None), "rows": len(served),
                        "columns": served.column_names, "id_column": self.id_column, "store_sha256": fingerprint},
            "collator": spec,
            "dummy_token_id": self.dummy_token_id,
            "checkpoint_steps": self._trace_every,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "max_grad_norm": args.max_grad_norm,
            "world_size": args.world_size,
        }
