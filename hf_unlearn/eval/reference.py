"""The retain-only reference model TOFU's forget quality compares against: the base model fine-tuned on the retain
split alone (never on the forget set) with one simple recipe, then evaluated like any other model."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import UnlearnError
from ..utils import weights_follow_umask


@dataclass
class ReferenceRecipe:
    """TOFU's fine-tuning recipe, scaled down for small machines: AdamW, linear warm-up then decay."""

    epochs: float = 5.0
    learning_rate: float = 1e-5
    batch_size: int = 8
    gradient_accumulation_steps: int = 4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.2
    max_length: int = 256
    max_train_rows: int | None = None
    seed: int = 0


def train_retain_reference(model, tokenizer, *, forget_split: str = "forget10", output_dir: str | os.PathLike,
                           tofu_path=None, recipe: ReferenceRecipe | None = None, use_chat_template: bool | None = None,
                           train_ids=None, forget_ids=None, prompt_format=None, attention_mask: str = "tokens",
                           progress: bool = True):
    """Fine-tune ``model`` in place on ``retainNN`` (the complement of ``forget_split``) and save it to
    ``output_dir``; returns the model. ``recipe.max_train_rows`` takes a seeded subset for quick runs.

    ``train_ids`` (rows of ``full``) replaces ``retainNN`` for experiments on a TOFU subset (e.g. 18 of 20 authors);
    it may not contain any of ``forget_ids``, or the reference would not be retain-only. ``prompt_format``: as for
    :func:`~hf_unlearn.eval.tofu.evaluate_tofu` (train the reference with the format it is evaluated with);
    ``attention_mask``: the collator's (:class:`~hf_unlearn.data.collators.QACollator`), likewise.
    """
    from transformers import Trainer, TrainingArguments

    from ..data import QACollator, load_tofu, tokenize_qa
    from .tofu import FORGET_SPLITS, resolve_prompt_format

    recipe = recipe or ReferenceRecipe()
    if forget_split not in FORGET_SPLITS:
        raise UnlearnError(f"unknown forget split {forget_split!r}; choose one of {', '.join(FORGET_SPLITS)}")
    chat = resolve_prompt_format(tokenizer, use_chat_template, prompt_format)
    if train_ids is None:
        retain = load_tofu(f"retain{100 - int(forget_split[-2:])}", tofu_path)
        if forget_ids is not None and set(forget_ids) & set(retain["id"]):
            raise UnlearnError(f"forget_ids overlap retain{100 - int(forget_split[-2:])}; pass train_ids (the rows the "
                               "reference may see)")
    else:
        train_ids = [int(i) for i in train_ids]
        leaked = sorted(set(train_ids) & set(int(i) for i in forget_ids or ()))
        if leaked:
            raise UnlearnError(f"train_ids contain forget ids {leaked[:5]}; a retain-only reference must never see them")
        full = load_tofu("full", tofu_path)
        bad = [i for i in train_ids if not 0 <= i < len(full)]
        if bad:
            raise UnlearnError(f"train_ids {bad[:5]} are not rows of TOFU full (0..{len(full) - 1})")
        retain = full.select(train_ids)
    if recipe.max_train_rows is not None:
        if recipe.max_train_rows < 1:
            raise UnlearnError(f"max_train_rows must be >= 1, got {recipe.max_train_rows}")
        retain = retain.shuffle(seed=recipe.seed).select(range(min(recipe.max_train_rows, len(retain))))
    train = tokenize_qa(retain, tokenizer, max_length=recipe.max_length, use_chat_template=chat)
    args = TrainingArguments(
        output_dir=os.fspath(output_dir),
        num_train_epochs=recipe.epochs,
        learning_rate=recipe.learning_rate,
        per_device_train_batch_size=recipe.batch_size,
        gradient_accumulation_steps=recipe.gradient_accumulation_steps,
        weight_decay=recipe.weight_decay,
        warmup_steps=recipe.warmup_ratio,  # a float in [0, 1) is a fraction of the total steps
        lr_scheduler_type="linear",
        seed=recipe.seed,
        save_strategy="no",
        report_to=[],
        logging_steps=10,
        disable_tqdm=not progress,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=QACollator.from_tokenizer(tokenizer, attention_mask=attention_mask))
    trainer.train()
    model.save_pretrained(output_dir)
    weights_follow_umask(output_dir)
    tokenizer.save_pretrained(output_dir)
    model.eval()
    return model
