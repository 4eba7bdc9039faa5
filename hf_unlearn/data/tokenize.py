"""Question/answer tokenisation for causal LMs with prompt-masked labels.

The prompt is the chat template's user turn (when the tokenizer has a template) or ``"Question: ...\\nAnswer:"``, or
any :class:`~hf_unlearn.data.prompts.PromptFormat` (OpenUnlearning's per model family);
labels are ``-100`` on the prompt so the loss and every metric see only answer tokens. The ``id`` column is kept.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnlearnError
from .prompts import IGNORE_INDEX, PromptFormat, has_chat_template, prompt_format

__all__ = ["IGNORE_INDEX", "PLAIN_PROMPT", "PromptFormat", "encode_qa", "format_prompt", "has_chat_template", "tokenize_qa"]

PLAIN_PROMPT = "Question: {question}\nAnswer:"


def format_prompt(tokenizer, question: str, use_chat_template=None) -> str:
    """The prompt text the model is trained and evaluated with (generation starts right after it).

    ``use_chat_template``: None (the tokenizer's template when it has one), a bool, or a
    :class:`~hf_unlearn.data.prompts.PromptFormat`."""
    return prompt_format(use_chat_template, tokenizer).prompt_text(tokenizer, question)


def encode_qa(
    tokenizer,
    question: str,
    answer: str,
    max_length: int = 256,
    use_chat_template=None,
) -> dict[str, list[int]]:
    """Token ids and labels of one QA pair; raises if truncation leaves no answer token.

    ``use_chat_template``: None (the tokenizer's template when it has one), a bool, or a
    :class:`~hf_unlearn.data.prompts.PromptFormat` (e.g. ``PromptFormat.open_unlearning(tokenizer)``)."""
    return prompt_format(use_chat_template, tokenizer).encode(tokenizer, question, answer, max_length)


def tokenize_qa(
    dataset,
    tokenizer,
    max_length: int = 256,
    question_key: str = "question",
    answer_key: str = "answer",
    id_column: str = "id",
    use_chat_template: bool | None = None,
    keep_columns: tuple[str, ...] = (),
):
    """Tokenise a QA ``datasets.Dataset`` into ``input_ids``/``attention_mask``/``labels`` plus the id column.

    Args:
        use_chat_template: None = use the tokenizer's chat template when it has one.
        keep_columns: extra text columns to keep (e.g. ``perturbed_answer`` for evaluation).
    """
    missing = [c for c in (question_key, answer_key, id_column) if c not in dataset.column_names]
    if missing:
        hint = " (add stable ids with dataset.add_column('id', ...))" if id_column in missing else ""
        raise UnlearnError(f"dataset has no column {missing[0]!r}; it has {dataset.column_names}{hint}")

    def _encode(row: dict[str, Any]) -> dict[str, Any]:
        try:
            return encode_qa(tokenizer, row[question_key], row[answer_key], max_length, use_chat_template)
        except UnlearnError as e:
            raise UnlearnError(f"row id {row[id_column]!r}: {e}") from None

    drop = [c for c in dataset.column_names if c not in (id_column, *keep_columns)]
    return dataset.map(_encode, remove_columns=drop, desc="tokenizing", load_from_cache_file=False)
