"""Shared tiny setup for the tests of hf_unlearn.methods (not a test module).

A tiny Llama with a small BPE vocabulary fine-tuned until it has memorised a few TOFU rows; built once per test
session (cached here) and copied for each test, so every test starts from the same memorised model.
"""

from __future__ import annotations

import copy
import tempfile

from .conftest import TOFU_DIR

N_ROWS = 12  # rows 0..11 of TOFU full: one author
FORGET_IDS = list(range(8, 12))
MAX_LENGTH = 96
_CACHE: dict = {}


def tiny_data():
    """``(tokenizer, forget, retain)``: tokenised rows with ids; forget = rows 8..11, retain = rows 0..7."""
    if "data" not in _CACHE:
        from hf_unlearn.data import load_tofu, tokenize_qa
        from hf_unlearn.models import build_tiny_tokenizer

        rows = load_tofu("full", TOFU_DIR).select(range(N_ROWS))
        tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
        data = tokenize_qa(rows, tok, max_length=MAX_LENGTH)
        forget = data.filter(lambda r: r["id"] in FORGET_IDS)
        retain = data.filter(lambda r: r["id"] not in FORGET_IDS)
        _CACHE["data"] = (tok, forget, retain, rows)
    return _CACHE["data"][:3]


def raw_rows():
    tiny_data()
    return _CACHE["data"][3]


def memorised_model():
    """A fresh copy of a tiny Llama fine-tuned to memorise all ``N_ROWS`` rows (answer loss well below 0.5)."""
    if "model" not in _CACHE:
        import torch
        from transformers import Trainer, TrainingArguments

        from hf_unlearn.data import QACollator
        from hf_unlearn.demo import _DropIds
        from hf_unlearn.models import build_tiny_model

        tok, forget, retain = tiny_data()
        from datasets import concatenate_datasets

        data = concatenate_datasets([retain, forget])
        torch.manual_seed(0)
        model = build_tiny_model("llama", tok, hidden_size=64, num_layers=2, num_heads=4, seed=0)
        args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="hfu-memorise-"), max_steps=60, per_device_train_batch_size=12,
                                 learning_rate=1e-2, warmup_steps=5, weight_decay=0.0, save_strategy="no",
                                 report_to=[], logging_strategy="no", use_cpu=True, disable_tqdm=True,
                                 remove_unused_columns=False, seed=0)
        Trainer(model=model, args=args, train_dataset=data,
                data_collator=_DropIds(QACollator.from_tokenizer(tok))).train()
        model.eval()
        _CACHE["model"] = model
    return copy.deepcopy(_CACHE["model"])


def save_memorised_model(path):
    """Save the memorised model and its tokenizer to ``path`` (for CLI tests); returns ``path``."""
    memorised_model().save_pretrained(path)
    tiny_data()[0].save_pretrained(path)
    return path


def answer_loss(model, dataset) -> float:
    from hf_unlearn.demo import mean_answer_loss

    return mean_answer_loss(model, tiny_data()[0], dataset)
