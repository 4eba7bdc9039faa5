"""Padding collator for tokenised QA rows that carries sample ids through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnlearnError
from ..presets import ATTENTION_MASKS
from ..utils import import_object, load_processing_class
from .tokenize import IGNORE_INDEX


def check_attention_mask(convention: str) -> str:
    if convention not in ATTENTION_MASKS:
        raise UnlearnError(f"attention_mask must be one of {', '.join(ATTENTION_MASKS)}, got {convention!r}")
    return convention


def attention_mask(input_ids, tokens, pad_token_id: int, convention: str = "tokens"):
    """The batch's mask: ``tokens`` (1 on each row's tokens, 0 on its padding) or, with ``"not_pad"``,
    ``input_ids != pad_token_id`` as OpenUnlearning's collator builds it."""
    if check_attention_mask(convention) == "not_pad":
        return (input_ids != pad_token_id).to(tokens.dtype)
    return tokens


@dataclass
class QACollator:
    """Pad ``input_ids``/``attention_mask``/``labels`` to the longest row (or ``pad_to_multiple_of``).

    The id column, when present, comes out as an int64 tensor (or a list for string ids) under the same
    key; trainers that need it pop it before the forward pass. Padding is on the right by default so that
    training is unaffected by padding; evaluation that generates pads on the left. ``attention_mask``: ``"tokens"``
    (the rows' own masks, padded with 0) or ``"not_pad"`` (``input_ids != pad_token_id``, OpenUnlearning's;
    :data:`ATTENTION_MASKS`).
    """

    pad_token_id: int
    padding_side: str = "right"
    pad_to_multiple_of: int | None = None
    id_column: str = "id"
    attention_mask: str = "tokens"

    def __post_init__(self):
        check_attention_mask(self.attention_mask)

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
        if self.attention_mask == "not_pad":
            batch["attention_mask"] = (batch["input_ids"] != self.pad_token_id).long()
        if self.id_column in features[0]:
            ids = [f[self.id_column] for f in features]
            batch[self.id_column] = torch.tensor(ids, dtype=torch.long) if isinstance(ids[0], int) else ids
        return batch


class IdCarryingCollator:
    """Collate rows with the user's collator while carrying their sample ids beside the batch.

    The id column is removed from every row before ``collator`` sees it (as ``remove_unused_columns`` does for a
    plain ``Trainer``), so any collator works unchanged with int or string ids; the ids come back as a plain
    list under ``id_column`` for the trainer to pop before the forward pass.
    """

    def __init__(self, collator, id_column: str = "id"):
        self.collator = collator
        self.id_column = id_column

    def __call__(self, features: list[dict[str, Any]]):
        if not features:
            raise UnlearnError("cannot collate an empty batch")
        if self.id_column not in features[0]:
            raise UnlearnError(f"a training row has no {self.id_column!r} column; every row needs a stable sample id")
        ids = [f[self.id_column] for f in features]
        batch = self.collator([{k: v for k, v in f.items() if k != self.id_column} for f in features])
        batch[self.id_column] = ids
        return batch


class IdDroppingCollator:
    """``collator``'s batches without the id column, for a plain ``Trainer``, which passes every batch key to
    ``model.forward``: ids are for hf_unlearn's trainers only."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features):
        batch = self.collator(features)
        batch.pop(self.collator.id_column, None)
        return batch


# ---- rebuilding a run's collator at replay time -------------------------------------------------------------
# Arguments a collator can hold that are not JSON: a tokenizer/processor is saved next to the run and reloaded,
# a model is the replay's own model. Everything else must be JSON (checked, and the rebuilt collator is compared
# with the original on real rows before the run starts).
SAVED_ARGUMENT = "__saved__"
MODEL_ARGUMENT = "__model__"


def _is_processor(value) -> bool:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin

    return isinstance(value, (PreTrainedTokenizerBase, ProcessorMixin))


def _importable_name(obj) -> str | None:
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qual or "<" in qual or module == "__main__":
        return None
    return f"{module}:{qual}"


def collator_spec(collator, save_dir=None) -> dict:
    """How to rebuild ``collator``: an importable function, or an importable class and its constructor arguments.

    Tokenizers and processors among the arguments are saved under ``save_dir/<argument>`` (when given). The spec
    says ``rebuildable: False`` (and why) when the collator is a lambda, a local or ``__main__`` object, or holds
    an argument that is neither JSON, a tokenizer/processor nor a model: replays then need it passed explicitly.
    """
    import inspect
    import json
    import types
    from pathlib import Path

    if isinstance(collator, (types.FunctionType, types.BuiltinFunctionType)):
        name = _importable_name(collator)
        return {"class": name or repr(collator), "kind": "function", "kwargs": None, "rebuildable": name is not None,
                **({} if name else {"why": "a lambda, local or __main__ function cannot be imported by a replay"})}
    cls = type(collator)
    name = _importable_name(cls)
    spec = {"class": name or f"{cls.__module__}:{cls.__qualname__}", "kind": "class", "kwargs": None,
            "rebuildable": False}
    if name is None:
        return {**spec, "why": f"{cls.__qualname__} is defined locally or in __main__: a replay cannot import it"}
    kwargs = {}
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return {**spec, "why": f"the constructor of {cls.__qualname__} has no inspectable signature"}
    for pname, p in list(params.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if not hasattr(collator, pname):
            if p.default is p.empty:
                return {**spec, "why": f"argument {pname!r} of {cls.__qualname__} is not stored on the collator"}
            continue
        value = getattr(collator, pname)
        if _is_processor(value):
            if save_dir is not None:
                value.save_pretrained(str(Path(save_dir) / pname))
            kwargs[pname] = {SAVED_ARGUMENT: pname}
            continue
        import torch

        if isinstance(value, torch.nn.Module):
            kwargs[pname] = {MODEL_ARGUMENT: True}
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            return {**spec, "why": f"argument {pname}={type(value).__name__} of {cls.__qualname__} is not JSON"}
        kwargs[pname] = value
    return {**spec, "kwargs": kwargs, "rebuildable": True}


def rebuild_collator(spec: dict | None, save_dir=None, model=None):
    """The collator a :func:`collator_spec` describes (tokenizers reloaded from ``save_dir``)."""
    from pathlib import Path

    if not spec or not spec.get("rebuildable"):
        name = (spec or {}).get("class", "unknown")
        why = (spec or {}).get("why")
        raise UnlearnError(f"the run's data collator ({name}) cannot be rebuilt from the trace"
                           f"{f' ({why})' if why else ''}; pass the same collator to the replay "
                           "(data_collator=..., or --collator module:callable on the command line)")
    obj = import_object(spec["class"])
    if spec.get("kind") == "function" or spec["kwargs"] is None:
        return obj
    kwargs = {}
    for k, v in spec["kwargs"].items():
        if isinstance(v, dict) and SAVED_ARGUMENT in v:
            v = load_processing_class(Path(save_dir) / v[SAVED_ARGUMENT])
        elif isinstance(v, dict) and MODEL_ARGUMENT in v:
            v = model
        kwargs[k] = v
    return obj(**kwargs)


def load_collator(reference: str):
    """A collator named on the command line: ``module:name`` (the collator itself) or ``module:name()`` (a
    factory called with no arguments). The current directory is importable, as with ``python -m``."""
    import os
    import sys

    ref = reference.strip()
    call = ref.endswith("()")
    name = ref[:-2] if call else ref
    if ":" not in name:
        raise UnlearnError(f"--collator {reference!r}: expected module:callable (e.g. my_collators:collate or "
                           "my_collators:make_collator())")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj = import_object(name)
    except (ImportError, AttributeError) as e:
        raise UnlearnError(f"--collator {reference!r}: cannot import it ({e})") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: one line, cause chained
        raise UnlearnError(f"--collator {reference!r}: importing it raised {type(e).__name__}: {e}") from e
    if call:
        if not callable(obj):
            raise UnlearnError(f"--collator {reference!r}: {name} is a {type(obj).__name__}, not a factory to call")
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001 - the user's factory failed
            raise UnlearnError(f"--collator {reference!r}: calling {name}() raised {type(e).__name__}: {e}") from e
    if not callable(obj):
        raise UnlearnError(f"--collator {reference!r} is a {type(obj).__name__}, not a collator (a callable)")
    return obj
