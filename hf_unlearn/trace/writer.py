"""The run's writer: plan frames, WAL records and manifest slots appended ahead of each segment, checkpoints bound to
the run by the checkpoint index, and the seal (sidecars and the keyed controls seal). Recordings and replays write
their runs with it; a proof seals its record with it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from ..errors import UnlearnError
from ..utils import atomic_write_text
from .checkpoints import (
    INDEX_FORMAT,
    INDEX_NAME,
    CheckpointIndex,
    FrozenTensors,
    _entry,
    list_checkpoints,
    run_uses_plain_names,
)
from .compact import read_compact
from .plan import (
    COMPACT_FILE,
    LEGACY_PLAN_FILE,
    PLAN_FILE,
    CompactPlanWriter,
    PlanEntry,
    has_plan,
    read_compact_plan,
    read_plan,
)
from .run import PROGRESS_FILE, SEALED_FILES, controls_seal, save_checkpoint, write_sidecar
from .tags import record_digest
from .wal import FLAG_ACCUM_END, FLAG_DUMMY, RECORD_SIZE, WalRecord, manifest_bytes


class TraceWriter:
    """Appends plan frames, WAL records and manifest slots; saves checkpoints (each bound to the run by the
    checkpoint index, frozen tensors saved once); seals the run with sidecars and the keyed controls seal."""

    def __init__(self, run_dir: Path, key: bytes):
        self.run = Path(run_dir)
        self.key = key
        self._plan = self._wal = self._manifest = None
        self.index: CheckpointIndex | None = None
        self.carried: dict = {}  # on resume: the guard's record of the step before it (see open)
        self.frozen = FrozenTensors(self.run)

    def open(self, header: dict, resume_step: int | None = None) -> None:
        """Start the files; on resume keep only entries of steps before ``resume_step`` (a run recorded with a
        ``plan.jsonl`` continues in ``plan.bin``, its kept entries keyed afresh)."""
        self.run.mkdir(parents=True, exist_ok=True)
        if (self.run / COMPACT_FILE).exists():
            if resume_step is not None:
                raise UnlearnError(f"{self.run} is a compacted sealed run ({COMPACT_FILE}): it cannot be resumed; "
                                   "record into a new trace_dir")
            (self.run / COMPACT_FILE).unlink()
        header.pop("provenance", None)  # append-only files from here on (a replay copies its parent's header)
        if resume_step is not None:  # its checkpoints keep the run's hash rule (one recorded before the plain rule)
            self.frozen.plain = run_uses_plain_names(self.run)
        for name in SEALED_FILES + (LEGACY_PLAN_FILE, COMPACT_FILE, "deletion_log.jsonl"):
            side = self.run / f"{name}.sha256"
            if side.exists():
                side.unlink()
        wal_f, man_f = self.run / "wal.bin", self.run / "manifest.bin"
        kept = []
        if resume_step is not None and has_plan(self.run):
            plan = read_plan(self.run)
            kept = [e for e in plan if e.step < resume_step]
            # the resume step's first entry holds the guards' fingerprint and program changes of the step before it
            # (hf_unlearn.trace.guards.recorded_fingerprints), which the resumed process never saw: carried over
            first = next((e for e in plan if e.step == resume_step and e.j == 0), None)
            self.carried = {k: first.extra[k] for k in ("fp", "changed") if first is not None and k in first.extra}
            if first is None and (self.run / "header.json").exists():  # the first process finished (stopped early):
                # its last step's record is the sealed header's final entry, which this process's seal replaces
                final = ((json.loads((self.run / "header.json").read_text()).get("fidelity") or {}).get("guards")
                         or {}).get("final") or {}
                if final.get("step") == resume_step - 1:
                    self.carried = {k: final[k] for k in ("fp", "changed") if k in final}
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
        if header.get("provenance"):  # a compacted run: its last block MAC
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

