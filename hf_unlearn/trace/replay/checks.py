"""What a replay checks at construction, before any compute: the processes, the store's rows the plan needs
(their lengths, a packed row's fragments) and that every untouched microbatch collates to the recorded batch."""

from __future__ import annotations

import dataclasses

from ...errors import UnlearnError
from ..compact import batch_mac
from ..hashing import batch_digest
from ..packing import check_redacted_row
from ..recorder import keyed_batch_digest
from ..sharding import check_replay


class BatchMismatchError(UnlearnError):
    """A microbatch the replay runs unchanged does not collate to the batch the run recorded (``step``: its optimizer
    step): the store's rows or the collator are not what trained there (a dataset that returned other rows than it
    holds, a wrong collator)."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step


class ReplayChecks:
    """The replay's refusals before compute (mixed into :class:`ReplayTrainer`)."""

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
                    raise BatchMismatchError(
                        e.step, f"microbatch {e.mb} (optimizer step {e.step}) does not collate to the batch the run recorded: "
                        "the collator, or the rows of the store, differ from the recording's; pass the collator the "
                        "run was recorded with (data_collator= / --collator)")

    def _check_batch_groups(self, world: int, key: bytes) -> None:
        """A compacted run keeps one keyed MAC per group of whole segments (trace.compact): every group the replay
        runs unchanged is rebuilt and checked (groups holding a deleted row cannot be, and are skipped)."""
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
