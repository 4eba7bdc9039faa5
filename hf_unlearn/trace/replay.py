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

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from ..errors import UnlearnError
from ..hub.mixin import UnlearningHubMixin
from .hashing import optimizer_param_names, state_hashes
from .plan import PlanEntry
from .recording import TraceRecordingTrainer, TraceWriter, rebuild_collator, seeded
from .run import TraceRun, append_deletion_log, checkpoint_dir, load_checkpoint, open_run, read_deletion_log
from .store import id_index, load_store, store_sha256
from .tags import tag

IGNORE_INDEX = -100


# ---- planning ----------------------------------------------------------------------------------------------
def forget_tags(run: TraceRun, forget_ids) -> set[str]:
    """Tags of the ids to delete; ids the plan never served are an error (listed), unless deleted before."""
    key = run.key
    tags = {i: tag(key, i) for i in dict.fromkeys(forget_ids)}
    if not tags:
        raise UnlearnError("the forget list is empty")
    in_plan = {s for e in run.plan for s in e.slots if s}
    deleted_before = {t for entry in read_deletion_log(run.path) for t in entry.get("forget_tags", [])}
    unknown = [i for i, t in tags.items() if t not in in_plan and t not in deleted_before]
    if unknown:
        raise UnlearnError(f"{len(unknown)} id(s) to forget never appear in the recorded plan of {run.path}: "
                           f"{unknown[:20]}{' ...' if len(unknown) > 20 else ''}; check the forget list")
    return set(tags.values()) & in_plan


def emptied_steps(plan: list[PlanEntry], tags: set[str]) -> list[int]:
    """Steps whose every slot is deleted (now or before): they keep their boundary but take no optimizer step."""
    weighted: dict[int, bool] = {}
    for e in plan:
        weighted[e.step] = weighted.get(e.step, False) or any(s is not None and s not in tags for s in e.slots)
    return sorted(step for step, w in weighted.items() if not w)


def replay_cost(run: TraceRun, forget_ids) -> dict:
    """Where a suffix replay starts and how much of the run it re-executes."""
    tags = forget_tags(run, forget_ids)
    affected = sorted({e.step for e in run.plan if tags & set(e.slots)})
    total = run.total_steps
    cps = sorted(run.checkpoints())
    first = affected[0] if affected else total
    start = max([c for c in cps if c <= first], default=None)
    if start is None:
        raise UnlearnError(f"{run.path} has no checkpoint at or before step {first}; cannot replay")
    return {
        "forget_ids": len(set(forget_ids)),
        "slots_deleted": sum(s in tags for e in run.plan for s in e.slots),
        "affected_steps": len(affected),
        "first_affected_step": affected[0] if affected else None,
        "start_checkpoint": start,
        "steps_to_replay": total - start,
        "total_steps": total,
        "fraction_replayed": (total - start) / total if total else 0.0,
        "segments_emptied": len(emptied_steps(run.plan, tags)),
    }


def training_args_from_header(header: dict, output_dir, **overrides) -> TrainingArguments:
    """Rebuild the run's TrainingArguments (the optimizer, clipping and loss settings the replay must share)."""
    names = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    recorded = header["training_args"]
    kwargs = {k: v for k, v in recorded.items() if k in names and not k.endswith("_token") and "hub" not in k
              and k not in ("logging_dir", "deepspeed", "fsdp_config", "accelerator_config", "report_to", "run_name",
                            "resume_from_checkpoint", "output_dir")}
    kwargs = {k: v for k, v in kwargs.items() if not (isinstance(v, str) and v.startswith("<") and v.endswith(">"))}
    kwargs.update(output_dir=str(output_dir), report_to=[], save_strategy="no", disable_tqdm=True,
                  use_cpu=recorded.get("use_cpu", not torch.cuda.is_available()))
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def model_from_run(run: TraceRun):
    """The run's model architecture with its step-0 weights (rebuilt from ``model/config.json``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(run.path / "model")
    model = AutoModelForCausalLM.from_config(config)
    return model


# ---- the engine --------------------------------------------------------------------------------------------
class ReplayTrainer(UnlearningHubMixin, TraceRecordingTrainer):
    """Re-execute a recorded plan with some slots deleted (see the module docstring).

    Args:
        run: the recorded run (a folder or an opened :class:`TraceRun`).
        store: the token store to read rows from (default: the run's own store).
        forget_ids: raw ids whose slots become weight-0 dummies.
        out_dir: where the replayed run is recorded (None: nothing is written, ``train()`` returns the state).
        start: ``"suffix"`` (latest checkpoint at or before the first affected step) or ``"full"`` (step 0).
        filter_rows: the naive ``filter`` baseline instead: deleted rows are dropped from their microbatches
            before the forward pass and the normaliser is recomputed (not trace-preserving; for comparison).
        model, args, data_collator: default to what the run's header and ``model/`` folder describe.
    """

    mode = "replay"

    def __init__(self, run, store=None, forget_ids=(), out_dir=None, start: str = "suffix", filter_rows: bool = False,
                 model=None, args=None, data_collator=None, **kwargs):
        self.run = run if isinstance(run, TraceRun) else open_run(run)
        header = self.run.header
        self.out_dir = Path(out_dir) if out_dir is not None else None
        if self.out_dir is not None and self.out_dir.exists() and any(self.out_dir.iterdir()):
            raise UnlearnError(f"{self.out_dir} exists and is not empty; choose a new output folder")
        self.forget_ids = list(dict.fromkeys(forget_ids))
        self.forget_tag_set = forget_tags(self.run, self.forget_ids) if self.forget_ids else set()
        self.start_mode = start
        self.filter_rows = filter_rows
        if model is None:
            model = model_from_run(self.run)
        if args is None:
            args = training_args_from_header(header, self.out_dir or (self.run.path / "_replay_tmp"))
        if data_collator is None:
            data_collator = rebuild_collator(header.get("collator"))
        super().__init__(model=model, args=args, data_collator=data_collator,
                         trace_dir=self.out_dir or self.run.path / "_unused", id_column=self.run.id_column,
                         dummy_token_id=header.get("dummy_token_id", 0), **kwargs)
        self.store_path = Path(store) if store is not None else self.run.store_path
        self.store = load_store(self.store_path)
        self._tag_index = {tag(self.run.key, i): n for i, n in id_index(self.store, self.id_column).items()}
        if "labels" not in self.store.column_names:
            raise UnlearnError("the store has no `labels` column: a deleted slot gets weight 0 through labels = -100, "
                               "so the run must have been recorded on rows with labels")
        self.start_step = self._start_step()
        self._check_rows()

    # ---- set-up -------------------------------------------------------------------------------------------
    def _start_step(self) -> int:
        if self.start_mode == "full":
            if 0 not in self.run.checkpoints():
                raise UnlearnError(f"{self.run.path} has no step-0 checkpoint; a full replay is impossible")
            return 0
        if self.start_mode != "suffix":
            raise UnlearnError(f"start must be 'suffix' or 'full', not {self.start_mode!r}")
        return replay_cost(self.run, self.forget_ids)["start_checkpoint"] if self.forget_ids else self.run.total_steps

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

    def _dummy_row(self, length: int) -> dict:
        if not hasattr(self, "_template"):
            self._template = self.store[0]
        template = self._template
        row = {}
        for k, v in template.items():
            if k == self.id_column:
                row[k] = type(v)()
            elif k == "input_ids":
                row[k] = [self.dummy_token_id] * length
            elif k == "attention_mask":
                row[k] = [1] * length
            elif k == "labels":
                row[k] = [IGNORE_INDEX] * length
            elif isinstance(v, list):
                row[k] = [0] * length
            else:
                row[k] = type(v)() if v is not None else None
        return row

    def _rows(self, e: PlanEntry, keep_dummies: bool) -> tuple[list[dict], list[int]]:
        feats, dummy_pos = [], []
        for j, (s, n) in enumerate(zip(e.slots, e.lens)):
            if s is None or s in self.forget_tag_set:
                if keep_dummies:
                    feats.append(self._dummy_row(n))
                    dummy_pos.append(j)
                continue
            row = self.store[self._tag_index[s]]
            if len(row["input_ids"]) != n:
                raise UnlearnError(f"store row for slot tag {s} has {len(row['input_ids'])} tokens, the plan recorded "
                                   f"{n}: the store is not the one the run read")
            feats.append(row)
        return feats, dummy_pos

    def _collate(self, feats: list[dict], dummy_pos: list[int]) -> dict:
        batch = self.data_collator(feats)
        batch.pop(self.id_column, None)
        labels = batch.get("labels")
        if dummy_pos and (labels is None or (labels[dummy_pos] != IGNORE_INDEX).any()):
            raise UnlearnError("the collator gave a dummy slot a label: deleted slots would not have weight 0")
        return batch

    def _normaliser(self, e: PlanEntry):
        if e.norm is None:
            return None
        if e.norm_dtype == "python":
            return int(e.norm) if float(e.norm).is_integer() else e.norm
        return torch.tensor(e.norm, dtype=getattr(torch, e.norm_dtype), device=self.args.device)

    # ---- the loop ------------------------------------------------------------------------------------------
    def train(self, *args, **kwargs):
        """Replay from the start checkpoint to the end of the plan; returns the final checkpoint dict."""
        run, start = self.run, self.start_step
        cps = run.checkpoints()
        if start not in cps:
            raise UnlearnError(f"{run.path} has no checkpoint at step {start}")
        ck = load_checkpoint(cps[start])
        self.model.load_state_dict(ck["model"])
        self.create_optimizer()
        model, self.optimizer = self.accelerator.prepare(self.model, self.optimizer)
        self.model_wrapped = model
        self.optimizer.load_state_dict(ck["optimizer"])
        self.accelerator.gradient_state._set_sync_gradients(True)
        writer = self._open_output(start) if self.out_dir is not None and not self.filter_rows else None
        every = run.header.get("checkpoint_steps", 1)
        model.zero_grad()
        replayed = stepped = 0
        for seg in run.segments():
            step = seg[0].step
            if step < start:
                if writer:
                    writer.append(seg)
                continue
            if writer and step % every == 0 and step != start:
                writer.save_checkpoint(step, self.model, self.optimizer)
            entries = [dataclasses.replace(e, slots=[None if s in self.forget_tag_set else s for s in e.slots])
                       for e in seg]
            if writer:
                writer.append(entries)
            replayed += 1
            stepped += self._run_segment(model, seg)
            self.state.global_step = step + 1
        final = {"model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
                 "optimizer": self.optimizer.state_dict(), "step": run.total_steps,
                 "param_names": optimizer_param_names(self.model, self.optimizer)}
        self.replay_stats = {"start_step": start, "segments_replayed": replayed, "optimizer_steps_taken": stepped,
                             "total_steps": run.total_steps}
        if writer and run.total_steps > start:
            writer.save_checkpoint(run.total_steps, self.model, self.optimizer)
            self._finish_output(writer)
        return final

    def _run_segment(self, model, seg: list[PlanEntry]) -> int:
        """Forward/backward every microbatch of a segment; step unless no slot carries weight. Returns 0/1."""
        work = []
        for e in seg:
            feats, dummy_pos = self._rows(e, keep_dummies=not self.filter_rows)
            if len(dummy_pos) < len(feats):  # at least one weighted row
                work.append((e, self._collate(feats, dummy_pos)))
        if not work:
            return 0
        if self.filter_rows:
            num_items = self._get_num_items_in_batch([b for _, b in work], self.args.device)
            self.current_gradient_accumulation_steps = len(work)
        lr = seg[0].lr
        lrs = seg[0].group_lrs or [lr] * len(self.optimizer.param_groups)
        for g, value in zip(self.optimizer.param_groups, lrs):
            g["lr"] = value
        for e, batch in work:
            if not self.filter_rows:
                num_items = self._normaliser(e)
                self.current_gradient_accumulation_steps = e.accum
            with seeded(e.seed):
                Trainer.training_step(self, model, batch, num_items)
        if self.args.max_grad_norm is not None and self.args.max_grad_norm > 0:
            self._clip_grad_norm(model)
        self.optimizer.step()
        model.zero_grad()
        return 1

    def unlearning_card_info(self) -> dict:
        """What a model card needs (the Hub code turns ``forget_ids`` into keyed tags before publishing)."""
        stats = getattr(self, "replay_stats", {})
        return {
            "method": "trace-preserving replay" + (" (oracle)" if self.mode == "oracle" else ""),
            "hyperparameters": {"start": self.start_mode, "start_step": self.start_step,
                                "checkpoint_steps": self.run.header.get("checkpoint_steps"),
                                "dummy_token_id": self.dummy_token_id, "filter_rows": self.filter_rows},
            "forget_ids": list(self.forget_ids),
            "citation": "",
            "paper": "",
            "extra": {"exact": not self.filter_rows, "parent_run": self.run.path.name, **stats,
                      **self._exact_deletion_evidence()},
        }

    def _exact_deletion_evidence(self) -> dict:
        """State-hash roots of the replayed state and, once ``trace verify`` ran, its verdict (for the model card)."""
        if self.mode == "oracle" or self.filter_rows or self.out_dir is None or self.state.global_step == 0:
            return {}
        from .hashing import state_hashes

        hashes = state_hashes(self.model, self.optimizer)  # optimizer tensors named by parameter
        opt_root = hashes.optimizer_root
        verdict_file = self.out_dir / "verification.json"
        verdict = json.loads(verdict_file.read_text()) if verdict_file.is_file() else None
        return {"exact_deletion": {
            "params_root": hashes.params_root, "optimizer_root": opt_root,
            "verified": bool(verdict and verdict["identical"]),
            "verification": (f"bit-identical to the oracle run {verdict['oracle']!r}" if verdict and verdict["identical"]
                             else "differs from the oracle" if verdict
                             else f"not verified yet: run `hf-unlearn trace verify {self.out_dir} ORACLE`"),
        }}

    # ---- output run ---------------------------------------------------------------------------------------
    def _open_output(self, start: int) -> TraceWriter:
        src, out = self.run.path, self.out_dir
        out.mkdir(parents=True, exist_ok=True)
        (out / "private").mkdir(exist_ok=True)
        if (src / "private" / "hmac.key").exists():  # a run with its own key passes it on
            shutil.copy2(src / "private" / "hmac.key", out / "private" / "hmac.key")
        shutil.copytree(src / "model", out / "model")
        for step, d in self.run.checkpoints().items():
            if step <= start:
                dst = checkpoint_dir(out, step)
                dst.mkdir(parents=True)
                for f in d.iterdir():
                    try:
                        os.link(f, dst / f.name)
                    except OSError:
                        shutil.copy2(f, dst / f.name)
        if (src / "deletion_log.jsonl").exists():
            shutil.copy2(src / "deletion_log.jsonl", out / "deletion_log.jsonl")
        header = json.loads(json.dumps(self.run.header))
        header.update(created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), sealed=False,
                      parent={"run": str(src), "start_step": start, "mode": self.mode})
        if self.mode == "oracle":
            header["dataset"]["store_sha256"] = None
        else:
            shutil.copytree(self.store_path, out / "private" / "store",
                            ignore=shutil.ignore_patterns("cache-*", "*.sha256"))
            header["dataset"].update(store_sha256=store_sha256(out / "private" / "store"), rows=len(self.store))
        writer = TraceWriter(out, self.run.key)
        writer.open(header)
        self._out_header = header
        return writer

    def _finish_output(self, writer: TraceWriter) -> None:
        header = self._out_header
        header.update(finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        writer.seal(header)
        final = self.out_dir / "checkpoints" / f"step-{self.run.total_steps:08d}" / "hashes.json"
        hashes = json.loads(final.read_text())
        append_deletion_log(self.out_dir, {
            "request": len(read_deletion_log(self.out_dir)) + 1,
            "mode": self.mode,
            "forget_tags": sorted(tag(self.run.key, i) for i in self.forget_ids),
            "start_step": self.start_step,
            "steps_replayed": self.replay_stats["segments_replayed"],
            "params_root": hashes["params_root"],
            "optimizer_root": hashes["optimizer_root"],
            "parent_run": self.run.path.name,
        })


class RedactedReplayTrainer(ReplayTrainer):
    """Honour a deletion request: replay the recorded run from the **redacted** store only.

    ``store`` must be the folder ``redact_store`` wrote (it must not contain any of ``forget_ids``); the
    run's original store is never opened. The output folder is a recorded run with the deleted slots turned
    into dummies, a deletion-log entry, and the final model + optimizer state in its last checkpoint.
    """

    mode = "replay"

    def __init__(self, run, store, forget_ids, out_dir, **kwargs):
        super().__init__(run, store=store, forget_ids=forget_ids, out_dir=out_dir, start=kwargs.pop("start", "suffix"),
                         **kwargs)
        stored = set(self.store[self.id_column])
        present = [i for i in self.forget_ids if i in stored]
        if present:
            raise UnlearnError(f"the store {store} still holds {len(present)} id(s) to forget (e.g. {present[:5]}); "
                               "redact it first (hf-unlearn trace redact)")


class OracleReplayTrainer(ReplayTrainer):
    """The trace oracle: a full replay from step 0 on the original store, deleted slots as weight-0 dummies."""

    mode = "oracle"

    def __init__(self, run, forget_ids, out_dir=None, **kwargs):
        super().__init__(run, store=kwargs.pop("store", None), forget_ids=forget_ids, out_dir=out_dir,
                         start=kwargs.pop("start", "full"), **kwargs)


def filter_counterfactual(run, forget_ids, **kwargs) -> dict:
    """The naive ``filter`` baseline: same plan, deleted rows dropped before the forward pass."""
    return ReplayTrainer(run, forget_ids=forget_ids, start="full", filter_rows=True, **kwargs).train()


def repack_counterfactual(run, forget_ids, output_dir, data_collator=None) -> dict:
    """The naive ``repack`` baseline: retrain from the step-0 state on the retained rows with fresh batching."""
    run = run if isinstance(run, TraceRun) else open_run(run)
    store = load_store(run.store_path)
    forget = set(forget_ids)
    retained = store.select([n for n, i in enumerate(store[run.id_column]) if i not in forget], keep_in_memory=True)
    model = model_from_run(run)
    model.load_state_dict(load_checkpoint(run.checkpoints()[0])["model"])
    args = training_args_from_header(run.header, output_dir, remove_unused_columns=False, logging_strategy="no")
    collate = data_collator or rebuild_collator(run.header.get("collator"))
    id_column = run.id_column

    def collator(features):
        batch = collate(features)
        batch.pop(id_column, None)
        return batch

    trainer = Trainer(model=model, args=args, train_dataset=retained, data_collator=collator)
    trainer.train()
    return {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
            "optimizer": trainer.optimizer.state_dict(), "step": trainer.state.global_step,
            "param_names": optimizer_param_names(model, trainer.optimizer)}


def save_state(state: dict, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    state_hashes(state["model"]).to_json(path.with_suffix(".hashes.json"))
