"""Padding collator for tokenised QA rows that carries sample ids through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnlearnError
from .tokenize import IGNORE_INDEX


@dataclass
class QACollator:
    """Pad ``input_ids``/``attention_mask``/``labels`` to the longest row (or ``pad_to_multiple_of``).

    The id column, when present, comes out as an int64 tensor (or a list for string ids) under the same
    key; trainers that need it pop it before the forward pass. Padding is on the right by default so that
    training is unaffected by padding; evaluation that generates pads on the left.
    """

    pad_token_id: int
    padding_side: str = "right"
    pad_to_multiple_of: int | None = None
    id_column: str = "id"

    @classmethod
    def from_tokenizer(cls, tokenizer, **kwargs) -> QACollator:
        if tokenizer.pad_token_id is None:
            raise UnlearnError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no pad token; "
                "set tokenizer.pad_token = tokenizer.eos_token (or load it with hf_unlearn.load_tokenizer)"
            )
        return cls(pad_token_id=tokenizer.pad_token_id, **kwargs)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        if not features:
            raise UnlearnError("cannot collate an empty batch")
        length = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch: dict[str, Any] = {}
        pads = {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX}
        for key, pad in pads.items():
            if key not in features[0]:
                continue
            rows = []
            for f in features:
                seq = list(f[key])
                fill = [pad] * (length - len(seq))
                rows.append(seq + fill if self.padding_side == "right" else fill + seq)
            batch[key] = torch.tensor(rows, dtype=torch.long)
        if self.id_column in features[0]:
            ids = [f[self.id_column] for f in features]
            batch[self.id_column] = torch.tensor(ids, dtype=torch.long) if isinstance(ids[0], int) else ids
        return batch
