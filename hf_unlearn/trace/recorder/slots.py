"""What fills a plan slot: a sample's id, the dummy row a deleted slot gets (weight exactly 0), the rows the trainer's
own dataset preparation dropped, and the dummy token."""

from __future__ import annotations

import warnings

import torch

from ...errors import UnlearnError
from ..packing import document_ids
from ..trainers import recorded_trainer_class

IGNORE_INDEX = -100


def plain_id(value):
    """A sample id as a plain int or str (tensors and numpy scalars from custom datasets included)."""
    if hasattr(value, "item") and not isinstance(value, str):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UnlearnError(f"sample id {value!r} has type {type(value).__name__}; ids must be ints or strings")
    return value


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


WEIGHT_MASKS = ("completion_mask", "assistant_masks")  # TRL's per-token loss masks (1: trained on)


def masked_row(row: dict) -> dict | None:
    """``row`` as the counterfactual trains a deleted row: its tokens kept, every label ignored and every loss mask
    zeroed; None when the row carries neither (its weight is decided by the collator alone)."""
    out, touched = dict(row), False
    if isinstance(row.get("labels"), list):
        out["labels"], touched = [IGNORE_INDEX] * len(row["labels"]), True
    for k in WEIGHT_MASKS:
        if isinstance(row.get(k), list):
            out[k], touched = [0] * len(row[k]), True
    return out if touched else None


TOKEN_COLUMNS = ("input_ids", "prompt_ids", "chosen_ids", "rejected_ids")  # a row's token ids (LM rows, pairs)


def retokened(row: dict, marker: int) -> dict:
    """``row`` with every token id replaced by another (``marker``, or ``marker + 1`` where the token is ``marker``):
    collated beside the original, it locates the row's tokens in the batch
    (:func:`~hf_unlearn.trace.dummies.dummy_positions`)."""
    return {**row, **{k: [marker if t != marker else marker + 1 for t in row[k]]
                      for k in TOKEN_COLUMNS if isinstance(row.get(k), list)}}


def dummy_has_weight(collator, row: dict) -> bool:
    """True unless the collator gives the dummy row labels that are all ignored (weight exactly 0)."""
    labels = collator([dict(row)]).get("labels")
    return labels is None or bool((torch.as_tensor(labels) != IGNORE_INDEX).any())


def dropped_rows(trainer, raw_ids: list | None) -> list:
    """Ids of the rows the trainer's own dataset preparation dropped (e.g. SFTTrainer's fully masked rows after
    truncation): never trained on, recorded in the header so a request for them is answered, not lost."""
    dataset = trainer.train_dataset
    if raw_ids is None or dataset is None or dataset is trainer._trace_arguments.get("train_dataset"):
        return []
    columns = getattr(dataset, "column_names", None) or []
    if trainer.id_column not in columns:
        raise UnlearnError(f"{type(trainer).__qualname__}'s dataset preparation dropped the {trainer.id_column!r} "
                           "column: every training row needs its stable sample id")
    kept = set(document_ids(dataset, trainer.id_column))
    dropped = [i for i in raw_ids if i not in kept]
    if dropped:
        warnings.warn(f"{recorded_trainer_class(type(trainer)).__qualname__}'s dataset preparation dropped "
                      f"{len(dropped)} row(s) (e.g. ids {dropped[:5]}): they are never trained on; the run "
                      "records them, and a deletion request for them is answered 'never trained on'",
                      stacklevel=3)
    return dropped


def default_dummy_token(trainer) -> int:
    """The pad token, except under a collator that masks attention where ``input_ids`` is the pad token
    (``QACollator(attention_mask="not_pad")``): there a dummy of pad tokens would be a row attending to nothing,
    which sends the whole microbatch through another attention path (other bits for every row with grouped-query
    SDPA), so a token beside it is used (its labels are ignored all the same)."""
    collator = trainer.data_collator
    for owner in (collator, getattr(collator, "tokenizer", None), trainer.processing_class):
        pad = getattr(owner, "pad_token_id", None)
        if isinstance(pad, int):
            if getattr(collator, "attention_mask", None) == "not_pad":
                return pad - 1 if pad > 0 else pad + 1
            return pad
    return 0

