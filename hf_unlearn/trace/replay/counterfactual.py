"""The counterfactual microbatches: each recorded microbatch rebuilt from the store with the deleted slots as
weight-0 dummies of the recorded length (a packed row's deleted documents as dummy tokens), collated, with the
recorded loss normaliser; and the check that the dummies got exactly zero gradient."""

from __future__ import annotations

import torch

from ...errors import UnlearnError
from ..dummies import DummyInfluenceError, dummy_influence_message, dummy_positions
from ..hashing import batch_digest
from ..packing import with_dummies, with_labels_ignored
from ..plan import PlanEntry
from ..recorder import keyed_batch_digest
from ..recorder.slots import retokened
from ..trainers import recorded_trainer

IGNORE_INDEX = -100


class CounterfactualBatches:
    """The replay's microbatches as the deletion leaves them (mixed into :class:`ReplayTrainer`)."""

    def _hit(self, e: PlanEntry) -> bool:
        """Whether the deletion changes microbatch ``e`` (a deleted row, or a packed row holding a deleted document)."""
        return any(s in self.forget_tag_set or s in self._spans for s in e.slots)

    def _weighted(self, s) -> bool:
        return s is not None and s not in self.forget_tag_set and s not in self._emptied

    def _masks_deleted(self) -> bool:
        """Whether this replay trains the deleted rows themselves, their tokens kept and their labels ignored (the
        counterfactual as defined), rather than dummies: the oracle, which reads the run's original store. The
        replay, whose store no longer holds them, trains dummies of their lengths; replay == oracle then also proves
        that the loss gives the deleted rows' tokens no weight (a loss scaled by what a microbatch's inputs hold
        would differ). In a packed run the deleted documents keep their tokens with their labels ignored."""
        return self.mode == "oracle" and not self.filter_rows

    def _masked_row(self, row: dict) -> dict | None:
        """The deleted ``row`` as the counterfactual trains it: every token kept, no weight (labels ignored, loss
        masks zeroed: :meth:`_trace_masked_row`); None where the collator would still give it weight (the dummy is
        used then)."""
        masked = self._trace_masked_row(row)
        if masked is None or self._trace_dummy_has_weight(self.data_collator, masked):
            return None
        return masked

    def _rows(self, e: PlanEntry, keep_dummies: bool, rank: int = 0,
              marked: list | None = None) -> tuple[list[dict], list[int]]:
        """The microbatch's rows for process ``rank``, deleted slots as dummies (the oracle: the deleted rows
        themselves without weight where it can, :meth:`_masks_deleted`). ``marked``, a list, receives the same
        rows with another token in every deleted slot's place (deleted before included), which locates them in the
        collated batch (:func:`~hf_unlearn.trace.dummies.dummy_positions`) without reading the store again."""
        lo, hi = e.rank_slots(rank, self.accelerator.num_processes)
        slots = e.slots[lo:hi]
        masking = keep_dummies and self._masks_deleted()
        kept = [s for s in slots if s is not None and (s not in self.forget_tag_set or masking)]
        # one Arrow read per microbatch, as the training DataLoader does (a read per row cost replays ~9% per step)
        columns = self.store[[self._tag_index[s] for s in kept]] if kept else {}
        names = [k for k in columns if k != self.id_column]
        fetched = iter(zip(*(columns[k] for k in names)))
        feats, dummy_pos = [], []
        self._labels_after = False  # a deleted row whose labels only the collator sets: ignored once collated
        marker = self.dummy_token_id + 1
        for s, n in zip(slots, e.lens[lo:hi]):
            if s is None or s in self.forget_tag_set:
                original = dict(zip(names, next(fetched))) if s is not None and masking else None
                if keep_dummies:
                    dummy_pos.append(len(feats))
                    masked = self._masked_row(original) if original is not None else None
                    if masked is None and original is not None and marked is not None and self._labels_collated():
                        masked, self._labels_after = dict(original), True  # labelled by the collator: see _collate
                    if masked is not None and self._trace_row_length(original) == n:
                        feats.append(masked)
                        self._masked_slots.add((e.mb, s))
                        if marked is not None:
                            marked.append(retokened(masked, marker))
                        continue
                    feats.append(self._trace_dummy_row(self._template, n, self.dummy_token_id))
                    if s is not None and self.mode == "oracle" and marked is not None:  # trained here, not masked
                        self._dummy_slots.add((e.mb, s))
                    if marked is not None:
                        marked.append(self._trace_dummy_row(self._template, n, marker))
                continue
            row = dict(zip(names, next(fetched)))
            if self._trace_row_length(row) != n:
                raise UnlearnError(f"store row for slot tag {s} has {self._trace_row_length(row)} tokens, the plan recorded "
                                   f"{n}: the store is not the one the run read")
            if marked is not None:  # a copy: a collator may assign into its features
                marked.append(with_dummies(row, self._dummy_spans[s], marker) if s in self._dummy_spans else dict(row))
            if s in self._spans and masking:  # the oracle: the deleted documents kept, their labels ignored
                row = with_labels_ignored(row, self._spans[s])
                self._masked_slots.update((e.mb, s, k) for k in range(len(self._spans[s])))
            elif s in self._spans:  # a packed row: its deleted documents become dummies of the same length
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
            owner = f"{recorded_trainer(self.run.header)[0].__qualname__}.compute_loss"
            if self.compute_loss_func is not None:
                owner = f"compute_loss_func {getattr(self.compute_loss_func, '__qualname__', self.compute_loss_func)}"
            raise DummyInfluenceError(f"{self.run.path}: " + dummy_influence_message(owner, e.step, e.mb, loss,
                                                                                     float(watch.largest)))

    def _labels_collated(self) -> bool:
        """Whether the rows are language-model rows whose labels the collator builds (not DPO pairs, whose weight is
        their completion mask): a deleted row can then go into the oracle whole, its labels ignored once collated."""
        return "input_ids" in self._template

    def _collate_located(self, feats: list[dict], dummy_pos: list[int], marked: list | None):
        """The collated microbatch and where its deleted slots' tokens sit in it (``marked``: :meth:`_rows`'s; None
        without it), found with one collation of ``marked``; the oracle's deleted rows that only the collator labels
        (:meth:`_rows`) get their labels ignored there."""
        if marked is None:
            return self._collate(feats, dummy_pos), None
        batch = self.data_collator(feats)
        where = dummy_positions(batch, self.data_collator(marked))
        if getattr(self, "_labels_after", False):
            labels = batch.get("labels")
            if not torch.is_tensor(labels) or labels.shape != where.shape:
                raise UnlearnError("the collator gives no labels of the tokens' shape, so a deleted row cannot be given "
                                   "weight 0 in the oracle; replay with the collator the run was recorded with")
            batch["labels"] = labels.masked_fill(where.to(labels.device), IGNORE_INDEX)
        return self._checked(batch, feats, dummy_pos), where

    def _collate(self, feats: list[dict], dummy_pos: list[int]) -> dict:
        return self._checked(self.data_collator(feats), feats, dummy_pos)

    def _checked(self, batch: dict, feats: list[dict], dummy_pos: list[int]) -> dict:
        """``batch``, refused where the collator gave a dummy slot a label."""
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

    def _batch_digests(self, e: PlanEntry, world: int) -> list[str]:
        return [keyed_batch_digest(self.run.key, batch_digest(self._collate(*self._rows(e, True, rank=r))))
                for r in range(world)]
