"""Batched model passes shared by the benchmarks: teacher-forced scoring and greedy generation.

Scoring pads on the right (only label positions count), generation pads on the left (so every prompt ends where
generation starts). Both sort by length to keep padding small, show a tqdm progress bar, and return results in
input order. They run on whatever device the model is on. ``attention_mask``: how the padded batch's mask is built,
``"tokens"`` (each row's tokens) or ``"not_pad"`` (``input_ids != pad``, OpenUnlearning's collator;
:data:`hf_unlearn.presets.ATTENTION_MASKS`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from ..data.collators import attention_mask as batch_mask
from ..data.collators import check_attention_mask
from ..errors import UnlearnError
from .metrics import IGNORE_INDEX, VARIANCE_FLOOR, TokenStats, token_statistics


def _device(model):
    return next(model.parameters()).device


def _length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    if batch_size < 1:
        raise UnlearnError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def pad_token_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise UnlearnError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has neither a pad nor an EOS token; set "
            "tokenizer.pad_token (or load it with hf_unlearn.load_tokenizer)"
        )
    return pad


def score_sequences(
    model,
    encodings: Sequence[dict],
    *,
    pad_id: int,
    batch_size: int = 16,
    desc: str = "scoring",
    progress: bool = True,
    variance_floor: float = VARIANCE_FLOOR,
    attention_mask: str = "tokens",
) -> list[TokenStats]:
    """Teacher-forced :class:`TokenStats` for each ``{"input_ids", "labels"}`` encoding (labels -100 = not scored);
    ``variance_floor``: see :func:`~hf_unlearn.eval.metrics.token_statistics`."""
    import torch
    from tqdm.auto import tqdm

    check_attention_mask(attention_mask)
    device = _device(model)
    results: list[TokenStats | None] = [None] * len(encodings)
    batches = _length_batches([len(e["input_ids"]) for e in encodings], batch_size)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for idx in tqdm(batches, desc=desc, disable=not progress, leave=False):
                length = max(len(encodings[i]["input_ids"]) for i in idx)
                ids = torch.full((len(idx), length), pad_id, dtype=torch.long)
                labels = torch.full((len(idx), length), IGNORE_INDEX, dtype=torch.long)
                mask = torch.zeros((len(idx), length), dtype=torch.long)
                for row, i in enumerate(idx):
                    n = len(encodings[i]["input_ids"])
                    ids[row, :n] = torch.tensor(encodings[i]["input_ids"])
                    labels[row, :n] = torch.tensor(encodings[i]["labels"])
                    mask[row, :n] = 1
                mask = batch_mask(ids, mask, pad_id, attention_mask)
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
                labels = labels.to(device)
                for row, i in enumerate(idx):  # row by row: the full-vocabulary temporaries stay one sequence big
                    results[i] = token_statistics(logits[row:row + 1], labels[row:row + 1],
                                                  variance_floor=variance_floor)[0]
    finally:
        model.train(was_training)
    return results  # type: ignore[return-value]


def gradient_norms(
    model,
    encodings: Sequence[dict],
    *,
    p: float = 2.0,
    desc: str = "gradient norms",
    progress: bool = True,
    pad_id: int | None = None,
    attention_mask: str = "tokens",
) -> list[float]:
    """The gradient-norm membership score of each ``{"input_ids", "labels"}`` encoding (Wang et al., 2024).

    Per sequence: the gradient of its mean answer NLL w.r.t. every floating-point parameter tensor, and the mean over
    tensors of each gradient's ``p``-norm (OpenUnlearning's ``mia_gradnorm``; a large gradient means the model has
    not fitted the sequence). One forward and backward per sequence, in eval mode (OpenUnlearning runs train mode, so
    its scores carry dropout noise); ``torch.autograd.grad`` leaves the parameters' ``.grad`` and ``requires_grad``
    as they were, so it is safe during training (the evaluation callback). ``attention_mask="not_pad"`` (needs
    ``pad_id``) masks the sequence's pad ids as OpenUnlearning's collator does.
    """
    import torch
    from tqdm.auto import tqdm

    from ..losses import nll_loss

    if check_attention_mask(attention_mask) == "not_pad" and pad_id is None:
        raise UnlearnError("gradient_norms(attention_mask='not_pad') needs pad_id")
    device = _device(model)
    params = [t for t in model.parameters() if t.is_floating_point()]
    if not params:
        raise UnlearnError("the gradient-norm attack needs floating-point parameters; the model has none")
    flags = [t.requires_grad for t in params]
    was_training = model.training
    model.eval()
    norms: list[float] = []
    try:
        for t in params:
            t.requires_grad_(True)
        with torch.enable_grad():
            for enc in tqdm(encodings, desc=desc, disable=not progress, leave=False):
                ids = torch.tensor([enc["input_ids"]], device=device)
                labels = torch.tensor([enc["labels"]], device=device)
                mask = batch_mask(ids, torch.ones_like(ids), pad_id, attention_mask)
                loss = nll_loss(model(input_ids=ids, attention_mask=mask).logits, labels)
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                per_tensor = [torch.linalg.vector_norm(g.float(), ord=p) for g in grads if g is not None]
                norms.append(float(torch.stack(per_tensor).mean()))
    finally:
        for t, flag in zip(params, flags):
            t.requires_grad_(flag)
        model.train(was_training)
    return norms


def generate_texts(
    model,
    tokenizer,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int = 200,
    batch_size: int = 16,
    desc: str = "generating",
    progress: bool = True,
    attention_mask: str = "tokens",
) -> list[str]:
    """Greedy continuations of tokenised ``prompts`` (left-padded batches), decoded without special tokens."""
    import torch
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    check_attention_mask(attention_mask)
    device = _device(model)
    pad = pad_token_id(tokenizer)
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id
    )
    out: list[str | None] = [None] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for idx in tqdm(_length_batches([len(p) for p in prompts], batch_size), desc=desc,
                            disable=not progress, leave=False):
                length = max(len(prompts[i]) for i in idx)
                ids = torch.full((len(idx), length), pad, dtype=torch.long)
                mask = torch.zeros((len(idx), length), dtype=torch.long)
                for row, i in enumerate(idx):
                    n = len(prompts[i])
                    ids[row, length - n:] = torch.tensor(prompts[i])
                    mask[row, length - n:] = 1
                mask = batch_mask(ids, mask, pad, attention_mask)
                gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
                new = gen[:, length:].cpu()
                for row, i in enumerate(idx):
                    out[i] = tokenizer.decode(new[row], skip_special_tokens=True).strip()
    finally:
        model.train(was_training)
    return out  # type: ignore[return-value]


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary and special tokens: results from different tokenizers must not be compared."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())}
    payload = json.dumps([vocab, special], ensure_ascii=False).encode("utf-8")
    return hashlib.sha256(payload).hexdigest()[:16]
