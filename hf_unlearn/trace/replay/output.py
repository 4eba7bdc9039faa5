"""A replay's output folder is itself a recorded run (plan, WAL, checkpoints, store, deletion log, seal), so a
later request can suffix-replay from it; a replay stopped part way leaves none."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import uuid
from pathlib import Path

from ...utils import owner_only, private_dir
from ..checkpoints import link_checkpoints, run_uses_plain_names
from ..compact import compact_run
from ..fidelity import fidelity_statement
from ..guards import callback_attributes
from ..packing import is_packed, write_map
from ..plan import PlanEntry
from ..preference import replaced_reference
from ..recorder import TraceWriter
from ..reference import PRIVATE_SOURCE, REFERENCE_DIR
from ..rows import output_rows
from ..run import append_deletion_log, checkpoint_dir, read_deletion_log
from ..shards import save as save_shards
from ..store import store_sha256
from ..tags import tag
from ..trainers import PROCESSING_CLASS_DIR


class OutputRun:
    """The replayed run written as a run (mixed into :class:`ReplayTrainer`)."""

    def _open_output(self, start: int) -> TraceWriter:
        src, out = self.run.path, self.out_dir
        out.mkdir(parents=True, exist_ok=True)
        private_dir(out)  # the key, the local paths and the store, owner-only whatever the umask (owner_only below)
        if (src / "private" / "hmac.key").exists():  # a run with its own key passes it on
            shutil.copy2(src / "private" / "hmac.key", out / "private" / "hmac.key")
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
            header["dataset"]["packing"].update(write_map(out, entries))
        if header.get("lineage"):  # the recording's output root is not this replay's
            header["lineage"].pop("output_root", None)
        if self._start_weights is not None:  # a new start: its own step-0 checkpoint (written by _replay)
            header["lineage"] = {"start_root": self._start_root,
                                 "parent": {"kind": "run", **(self._start_parent or {})},
                                 "recorded": self.run.header.get("lineage")}
        writer = TraceWriter(out, self.run.key)
        writer.open(header)
        if self._start_weights is None:  # else the frozen base changed too: saved with the new step-0 checkpoint
            link_checkpoints(src, writer, [s for s in self.run.checkpoints() if s <= start], self.model,
                             self._start_state.get("frozen", []))
        self._out_header = header
        return writer

    def _output_entry(self, e: PlanEntry) -> PlanEntry:
        """The plan entry the output run records: deleted slots become dummies, their batch digests change."""
        changed = self._hit(e)
        if e.j == 0 and e.extra.get("rows"):  # the rows as this replay trained on them (hf_unlearn.trace.rows)
            e = dataclasses.replace(e, extra={**e.extra, "rows": output_rows(self, e)})
        if e.j == 0 and e.step > self.start_step:  # this replay's own fingerprint of the step before, its callbacks
            extra = {k: v for k, v in e.extra.items() if k not in ("fp", "changed", "callbacks")}
            # only where the recording's guards covered the step: a gap (a crash before a resume) stays a gap, so
            # verify does not read this replay's own fingerprints as the recording's evidence
            if self._step_fps.get(e.step - 1) is not None and e.step - 1 in self._recorded_fps:
                extra["fp"] = self._step_fps[e.step - 1]
            if self._program_callbacks:
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

    def _save_state(self, writer: TraceWriter | None, step: int) -> Path | None:
        """The output run's checkpoint at ``step`` (the main process writes it). A sharded run's is written by every
        process, its shards (:mod:`hf_unlearn.trace.shards`): the others keep its hashes for :meth:`_check_fidelity`."""
        if not self.run.header.get("sharding"):
            return writer.save_checkpoint(step, self.model, self.optimizer) if writer else None
        if writer:
            return writer.save_checkpoint(step, self.model, self.optimizer)
        out = self.out_dir if self.out_dir is not None and not self.filter_rows else None  # as the main one's writer
        self._gathered_hashes[step] = save_shards(out, step, self.model, self.optimizer,
                                                  run_uses_plain_names(self.run.path))[1]
        return None

    def _discard_output(self, writer: TraceWriter) -> None:
        """A replay stopped part way leaves no half-written output run."""
        writer.close()
        if self._out_created:
            shutil.rmtree(self.out_dir, ignore_errors=True)
        else:
            for p in self.out_dir.iterdir():
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink()

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
        header["fidelity"].pop("start", None)  # the parent's own start is not this replay's
        if self._start_proof:  # how this replay's fresh start was proven (hf_unlearn.trace.proven.replay_start)
            header["fidelity"]["start"] = {**self._start_proof, "run_id": self.run.header.get("run_id")}
        last = self.run.total_steps - 1
        # the last step's fingerprint is this replay's; a replay that ran nothing (it starts at the run's end: every
        # id gone, or trained only after a kept model's step) keeps the recording's, which its plan cut at the kept
        # step no longer holds (the recording wrote it with the next step's first entry)
        final = self._step_fps.get(last) if last in self._step_fps else \
            self._recorded_fps.get(last) if self.start_step > last else None
        if header["fidelity"].get("guards") and last in self._recorded_fps and final is not None:
            header["fidelity"]["guards"] = {**header["fidelity"]["guards"], "final": {"step": last, "fp": final}}
        entry["fidelity"] = fidelity_statement(header)
        if stats["nothing_to_replay"]:
            entry["note"] = ("nothing to replay: no slot of the requested ids is left in the plan (deleted by an "
                             "earlier request); the state is the parent's final state")
        append_deletion_log(self.out_dir, entry)
        writer.seal(header)
        if self.run.compact:  # the output of a compacted run is compacted the same way
            first = next((e.mb for e in self.run.plan if e.step >= self.start_step), len(self.run.plan))
            compact_run(self.out_dir, {(a, b): mac for a, b, mac in self.run.batch_groups()
                                       if mac is not None and b <= first})
