"""Preference-style unlearning with an alternate answer per forget row: IdkDPO and IdkNLL.

Both train the model towards a second answer to each forget question, a refusal such as "I don't know.", which
IdkDPO prefers over the original answer (DPO) and IdkNLL simply fits (cross-entropy). Where that answer comes from:

* **raw QA rows** (``question``/``answer``/id, e.g. ``load_tofu("forget10")``): the row's ``alternate_column``
  (``"alternate_answer"``) if the set has that column, else a refusal from the library's list
  (``hf_unlearn/data/refusals.txt``, 60 phrasings, or your ``refusals_file=``), chosen by a hash of ``(seed, id)``:
  the same row always gets the same refusal, whatever the order, batch size or number of processes;
* **tokenised rows** (:func:`hf_unlearn.tokenize_qa` output): ``alt_input_ids``/``alt_attention_mask``/``alt_labels``
  if present, else the row's own prompt (its tokens before the first answer label) followed by the refusal's tokens
  and EOS, tokenised as ``tokenize_qa`` does with the tokenizer's default prompt format (chat template if it has one).

The trainer keeps both sequences per forget row; :class:`PreferenceCollator` pads them (a ``QACollator`` passed as
``data_collator`` is wrapped in one; any other collator must emit the ``alt_*`` keys itself). OpenUnlearning draws a new refusal at random each time a row is read; here the
choice is fixed per row, so runs are reproducible and resumable.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch

from ..data.collators import QACollator
from ..data.prompts import prompt_format
from ..data.tokenize import IGNORE_INDEX, encode_qa, has_chat_template
from ..errors import UnlearnError
from ..losses import dpo_loss, nll_loss, sequence_logprob
from .base import UnlearningConfig, UnlearningTrainer

ALT_KEYS = ("alt_input_ids", "alt_attention_mask", "alt_labels")
_PAD = {"input_ids": 0, "attention_mask": 0, "labels": IGNORE_INDEX}


# ---------------------------------------------------------------------------------------------- refusal answers


def load_refusals(path: str | os.PathLike | None = None) -> list[str]:
    """The refusal answers, one per line (``#`` comments and blank lines skipped): the shipped list by default."""
    if path is None:
        text = resources.files("hf_unlearn.data").joinpath("refusals.txt").read_text(encoding="utf-8")
        where = "hf_unlearn/data/refusals.txt"
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise UnlearnError(f"cannot read the refusals file {path}: {e.strerror}") from None
        where = os.fspath(path)
    lines = [line.strip() for line in text.splitlines()]
    refusals = [line for line in lines if line and not line.startswith("#")]
    if not refusals:
        raise UnlearnError(f"{where} holds no refusal answers (one per line; '#' starts a comment)")
    return refusals


def pick_refusal(row_id: Any, refusals: list[str], seed: int = 0) -> str:
    """The refusal for one row: a function of ``(seed, id)`` only (ids ``3600`` and ``"3600"`` may differ)."""
    key = f"{int(seed)}\0{type(row_id).__name__}\0{row_id}".encode()
    return refusals[int.from_bytes(hashlib.sha256(key).digest()[:8], "big") % len(refusals)]


# ---------------------------------------------------------------------------------------------- data


@dataclass
class PreferenceConfig(UnlearningConfig):
    """Fields shared by the methods that train towards an alternate answer (IdkDPO, IdkNLL)."""

    refusals_file: str | None = field(
        default=None,
        metadata={"help": "Text file of refusal answers, one per line; None = the list shipped with hf_unlearn."},
    )
    alternate_column: str = field(
        default="alternate_answer",
        metadata={"help": "Column of raw (or tokenised) forget rows holding each row's alternate answer; rows "
                          "without it get a refusal from refusals_file."},
    )


def _alternate_encoding(tokenizer, row: dict, text: str, args: PreferenceConfig) -> dict[str, list[int]]:
    """``input_ids``/``attention_mask``/``labels`` of the row's prompt followed by ``text`` (what ``encode_qa``
    builds for raw rows; tokenised rows keep their own prompt tokens)."""
    if "question" in row:
        return encode_qa(tokenizer, row["question"], text, args.max_length, prompt_format(args.prompt_format, tokenizer))
    labels = list(row["labels"])
    start = next((i for i, t in enumerate(labels) if t != IGNORE_INDEX), len(labels))
    prompt = list(row["input_ids"])[:start]
    answer = tokenizer(text if has_chat_template(tokenizer) else " " + text, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        answer = answer + [tokenizer.eos_token_id]
    answer = answer[:max(0, args.max_length - len(prompt))]
    if not answer:
        raise UnlearnError(f"the alternate answer is empty after truncation to max_length={args.max_length}; "
                           "raise max_length")
    ids = prompt + answer
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [IGNORE_INDEX] * len(prompt) + answer}


def with_alternate_answers(dataset, tokenizer, args: PreferenceConfig):
    """The forget set tokenised with its alternate answers as ``alt_input_ids``/``alt_attention_mask``/``alt_labels``.

    Returns ``dataset`` unchanged when it cannot be processed (no id column, raw rows without a tokenizer), so the
    base trainer's checks raise their usual errors.
    """
    columns = dataset.column_names
    raw = "input_ids" not in columns
    if args.id_column not in columns or (raw and tokenizer is None):
        return dataset
    if all(k in columns for k in ALT_KEYS):
        return dataset
    if any(k in columns for k in ALT_KEYS):
        raise UnlearnError(f"the forget set has only some of {', '.join(ALT_KEYS)}; give all three or none")
    if tokenizer is None:
        raise UnlearnError("building the alternate answers of tokenised rows needs the tokenizer: pass "
                           "processing_class=")
    if raw and ("question" not in columns or "answer" not in columns):
        return dataset
    own = args.alternate_column in columns
    refusals = None if own else load_refusals(args.refusals_file)

    def encode(row):
        text = row[args.alternate_column] if own else pick_refusal(row[args.id_column], refusals, args.seed)
        if not isinstance(text, str) or not text.strip():
            raise UnlearnError(f"forget row id {row[args.id_column]!r} has an empty alternate answer")
        try:
            out = (encode_qa(tokenizer, row["question"], row["answer"], args.max_length,
                             prompt_format(args.prompt_format, tokenizer)) if raw else {})
            alt = _alternate_encoding(tokenizer, row, text, args)
        except UnlearnError as e:
            raise UnlearnError(f"forget row id {row[args.id_column]!r}: {e}") from None
        return {**out, **{f"alt_{k}": v for k, v in alt.items()}}

    drop = [c for c in columns if c not in (args.id_column, "input_ids", "attention_mask", "labels")] if raw else []
    return dataset.map(encode, remove_columns=drop, desc="alternate answers", load_from_cache_file=False)


def alternate_batch(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The alternate-answer half of a collated batch, under the usual keys."""
    missing = [k for k in ALT_KEYS if k not in inputs]
    if missing:
        raise UnlearnError(f"the batch has no {missing[0]}: the data collator must pad the alternate answers "
                           "(use the default PreferenceCollator, or emit alt_input_ids/alt_attention_mask/alt_labels)")
    return {k[len("alt_"):]: inputs[k] for k in ALT_KEYS}


def concat_batches(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rows of ``first`` then ``second``, right-padded to a common length (one forward for both)."""
    length = max(first["input_ids"].shape[1], second["input_ids"].shape[1])

    def pad(t, value):
        return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value)

    return {k: torch.cat([pad(first[k], v), pad(second[k], v)]) for k, v in _PAD.items()}


@dataclass
class PreferenceCollator:
    """Pads the original and the alternate sequences of forget rows (with ``base``, a :class:`QACollator`);
    rows without alternates (retain rows) pass through ``base`` alone."""

    base: QACollator

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.base(features)
        if features and ALT_KEYS[0] in features[0]:
            alt = self.base([{k[len("alt_"):]: f[k] for k in ALT_KEYS} for f in features])
            batch.update({f"alt_{k}": alt[k] for k in ("input_ids", "attention_mask", "labels")})
        return batch


# ---------------------------------------------------------------------------------------------- trainers


class _PreferenceTrainer(UnlearningTrainer):
    """Adds the alternate answers to the forget set and pads them with the default collator."""

    def __init__(self, *pargs, **kwargs):
        super().__init__(*pargs, **kwargs)
        if isinstance(self.data_collator, QACollator):
            self.data_collator = PreferenceCollator(self.data_collator)

    def _prepare_dataset(self, dataset, tokenizer, args, name):
        if name == "forget" and dataset is not None and len(dataset) > 0:
            columns = dataset.column_names
            self.alternate_source = ("alt_input_ids" if "alt_input_ids" in columns else
                                     f"column {args.alternate_column!r}" if args.alternate_column in columns else
                                     args.refusals_file or "hf_unlearn/data/refusals.txt")
            dataset = with_alternate_answers(dataset, tokenizer, args)
        return UnlearningTrainer._prepare_dataset(dataset, tokenizer, args, name)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = ["input_ids", "attention_mask", "labels", self.args.id_column, *ALT_KEYS,
                                       self.args.alternate_column]

    def method_hyperparameters(self):
        hp = super().method_hyperparameters()
        hp["alternate_answers"] = self.alternate_source
        return hp


@dataclass
class IdkDPOConfig(PreferenceConfig):
    """IdkDPO: DPO with a refusal as the preferred answer and the forget answer as the rejected one."""

    beta: float = field(default=0.1, metadata={"help": "Inverse temperature of the DPO loss (OpenUnlearning: 0.1)."})

    _positive = ("beta",)


class IdkDPOTrainer(_PreferenceTrainer):
    """IdkDPO (TOFU, Maini et al., 2024; DPO, Rafailov et al., 2023): prefer "I don't know" over the forget answer.

    Forget term :func:`hf_unlearn.losses.dpo_loss` on (forget question, refusal) vs (forget question, answer)
    relative to the reference model; retain term cross-entropy by default, as in OpenUnlearning's ``DPO`` trainer.
    The original, alternate and retain rows go through one forward.
    """

    _config_class = IdkDPOConfig
    method_name = "IdkDPO"
    paper = "https://arxiv.org/abs/2401.06121"
    citation = """@article{maini2024tofu,
  title={TOFU: A Task of Fictitious Unlearning for LLMs},
  author={Maini, Pratyush and Feng, Zhili and Schwarzschild, Avi and Lipton, Zachary C. and Kolter, J. Zico},
  journal={arXiv preprint arXiv:2401.06121}, year={2024}}
@inproceedings{rafailov2023direct,
  title={Direct Preference Optimization: Your Language Model is Secretly a Reward Model},
  author={Rafailov, Rafael and Sharma, Archit and Mitchell, Eric and Ermon, Stefano and Manning, Christopher D. and Finn, Chelsea},
  booktitle={NeurIPS}, year={2023}}"""

    @classmethod
    def _needs_reference(cls, args) -> bool:
        return True

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        retain = self.retain_batch()
        pair = concat_batches(inputs, alternate_batch(inputs))  # forget answers, then their refusals
        outputs, retain_out = self.joint_forward(model, pair, retain)
        n = inputs["input_ids"].shape[0]
        policy = sequence_logprob(outputs.logits, pair["labels"])
        ref = sequence_logprob(self.reference_outputs(pair).logits, pair["labels"])
        forget = dpo_loss(policy[n:], policy[:n], ref[n:], ref[:n], self.args.beta)
        metrics = {"forget_log_ratio": (policy[:n] - ref[:n]).mean().detach(),
                   "alternate_log_ratio": (policy[n:] - ref[n:]).mean().detach()}
        loss = self.combine(forget, self.retain_term(retain, retain_out), metrics)
        return (loss, outputs) if return_outputs else loss


@dataclass
class IdkNLLConfig(PreferenceConfig):
    """IdkNLL: cross-entropy on a refusal as the answer to each forget question."""


class IdkNLLTrainer(_PreferenceTrainer):
    """IdkNLL (TOFU's "I don't know" baseline, Maini et al., 2024): fine-tune the forget questions towards a refusal.

    Forget term :func:`hf_unlearn.losses.nll_loss` on (forget question, refusal); retain term cross-entropy by
    default. The original forget answers are never trained on (no ascent), so the model is not pushed off its
    language-modelling manifold, only taught to decline.
    """

    _config_class = IdkNLLConfig
    method_name = "IdkNLL"
    paper = "https://arxiv.org/abs/2401.06121"
    citation = IdkDPOTrainer.citation.split("\n@inproceedings")[0]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        retain = self.retain_batch()
        alt = alternate_batch(inputs)
        outputs, retain_out = self.joint_forward(model, alt, retain)
        forget = nll_loss(outputs.logits, alt["labels"])
        loss = self.combine(forget, self.retain_term(retain, retain_out), {})
        return (loss, outputs) if return_outputs else loss
