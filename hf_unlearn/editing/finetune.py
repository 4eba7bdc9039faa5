"""Task matrices for users who have only data: fine-tune the base on the forget rows and on the retain rows.

Each fine-tune is a plain ``transformers.Trainer`` run (LoRA through ``peft`` by default, or full), on QA rows
tokenised with :func:`hf_unlearn.tokenize_qa` and padded by :class:`hf_unlearn.QACollator`. The output folder::

    TM/forget/             LoRA adapter (adapter_config.json + adapter_model.safetensors) or a full model
    TM/retain/             the same for the retain rows
    TM/task_matrices.json  base name and weight hash, splits, sizes, training settings, forget ids (keep it local)

is what ``qr_erase(model, "TM")`` and ``hf-unlearn edit qr-erase BASE --task-matrices TM`` read; the base hash
makes them refuse another base. The folder appears only when both fine-tunes finished (it is built under
``.TM.partial`` and renamed), so a failed run leaves no half-written task matrices.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import UnlearnError
from ..utils import weights_follow_umask
from .task_matrices import TASK_MANIFEST, TaskFolder, read_task_folder


def fine_tune_task(model, tokenizer, dataset, output_dir, *, lora: bool = True, lora_r: int = 8,
                   lora_alpha: int | None = None, target_modules: str | list[str] = "all-linear",
                   epochs: float = 3.0, learning_rate: float | None = None, batch_size: int = 8,
                   max_length: int = 128, seed: int = 0, progress: bool = True, **training_args) -> Path:
    """Fine-tune a **copy** of ``model`` on QA rows and save the adapter (or the full model) to ``output_dir``.

    ``dataset`` holds raw QA rows (``question``/``answer``/``id``) or :func:`tokenize_qa` output. Defaults are sized
    for a CPU: LoRA r=8 on every linear layer, 3 epochs, lr 1e-4 (LoRA) or 2e-5 (full), batch 8, 128 tokens.
    ``training_args`` go to ``TrainingArguments``.
    """
    from transformers import Trainer, TrainingArguments

    from ..data import QACollator, tokenize_qa
    from ..data.collators import IdDroppingCollator

    if len(dataset) == 0:
        raise UnlearnError("cannot fine-tune a task model on an empty dataset")
    if "input_ids" not in dataset.column_names:
        dataset = tokenize_qa(dataset, tokenizer, max_length=max_length)
    dataset = dataset.remove_columns([c for c in dataset.column_names
                                      if c not in ("input_ids", "attention_mask", "labels")])
    task_model = copy.deepcopy(model)
    if lora:
        from peft import LoraConfig, get_peft_model

        task_model = get_peft_model(task_model, LoraConfig(
            r=lora_r, lora_alpha=lora_alpha or 2 * lora_r, lora_dropout=0.0, target_modules=target_modules,
            task_type="CAUSAL_LM"))
    args = TrainingArguments(
        output_dir=str(Path(output_dir) / "_trainer"), num_train_epochs=epochs, per_device_train_batch_size=batch_size,
        learning_rate=learning_rate or (1e-4 if lora else 2e-5), lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, logging_steps=10, save_strategy="no", report_to=[], seed=seed,
        remove_unused_columns=False, disable_tqdm=not progress, **training_args,
    )
    trainer = Trainer(model=task_model, args=args, train_dataset=dataset,
                      data_collator=IdDroppingCollator(QACollator.from_tokenizer(tokenizer)))
    trainer.train()
    trainer.save_model(str(output_dir))
    weights_follow_umask(output_dir)
    if trainer.is_world_process_zero():
        shutil.rmtree(Path(output_dir) / "_trainer", ignore_errors=True)
        if not lora:
            tokenizer.save_pretrained(str(output_dir))
    return Path(output_dir)


def make_task_matrices(model, tokenizer, forget, retain, output_dir, *, base: str = "", lora: bool = True,
                       info: dict[str, Any] | None = None, **fine_tune_kwargs) -> TaskFolder:
    """Fine-tune ``model`` once on ``forget`` and once on ``retain`` (datasets with an ``id`` column) and write the
    task-matrix folder ``output_dir`` (see the module docstring). ``info`` adds fields to the manifest."""
    from accelerate import PartialState

    from ..trace.hashing import state_hashes
    from ..utils import atomic_write_text

    out = Path(output_dir)
    if out.exists() and any(out.iterdir()):
        raise UnlearnError(f"{out} exists and is not empty; pick a new output folder")
    for name, data in (("forget", forget), ("retain", retain)):
        if data is None or len(data) == 0:
            raise UnlearnError(f"the {name} set is empty")
        if "id" not in data.column_names:
            raise UnlearnError(f"the {name} set has no 'id' column (stable sample ids)")
    overlap = set(forget["id"]) & set(retain["id"])
    if overlap:
        raise UnlearnError(f"{len(overlap)} id(s) are in both the forget and the retain set; remove them from retain")
    state = PartialState()
    partial = out.parent / f".{out.name}.partial"
    if state.is_main_process and partial.exists():
        shutil.rmtree(partial)
    state.wait_for_everyone()
    base_root = state_hashes(model).params_root
    forget_rows, retain_rows = _tokenize_together(forget, retain, tokenizer, fine_tune_kwargs.get("max_length", 128))
    for name, data in (("forget", forget_rows), ("retain", retain_rows)):
        fine_tune_task(model, tokenizer, data, partial / name, lora=lora, **fine_tune_kwargs)
    if state.is_main_process:
        from .task_matrices import load_task_matrices

        fingerprints = {f"{name}_fingerprint": load_task_matrices(model, partial / name).fingerprint
                        for name in ("forget", "retain")}
        manifest = {
            "format": "hf_unlearn.task_matrices.v1", "kind": "lora" if lora else "full", "forget": "forget",
            "retain": "retain", "base": base, "base_params_root": base_root, "num_forget": len(forget),
            "num_retain": len(retain), "forget_ids": [_plain(i) for i in forget["id"]], **fingerprints,
            "fine_tune": {k: v for k, v in fine_tune_kwargs.items() if isinstance(v, (int, float, str, bool, list))},
            **(info or {}),
        }
        atomic_write_text(partial / TASK_MANIFEST, json.dumps(manifest, indent=1))
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(partial, out)
    state.wait_for_everyone()
    folder = read_task_folder(out)
    assert folder is not None
    return folder


def _tokenize_together(forget, retain, tokenizer, max_length: int):
    """Both sets tokenised in one ``tokenize_qa`` call (``datasets`` fingerprints the tokenizer once, not twice)."""
    from datasets import concatenate_datasets

    from ..data import tokenize_qa

    if "input_ids" in forget.column_names and "input_ids" in retain.column_names:
        return forget, retain
    columns = ["question", "answer", "id"]
    for name, data in (("forget", forget), ("retain", retain)):
        if "input_ids" in data.column_names or any(c not in data.column_names for c in columns):
            raise UnlearnError(f"the {name} set must hold raw QA rows (question, answer, id) like the other set, got "
                               f"{data.column_names}")
    both = concatenate_datasets([forget.select_columns(columns), retain.select_columns(columns)])
    rows = tokenize_qa(both, tokenizer, max_length=max_length)
    return rows.select(range(len(forget))), rows.select(range(len(forget), len(both)))


def _plain(value):
    return value.item() if hasattr(value, "item") else value
