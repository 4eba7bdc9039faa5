"""Question/answer tokenisation for causal LMs with prompt-masked labels.

The prompt is the chat template's user turn (when the tokenizer has a template) or ``"Question: ...\\nAnswer:"``;
labels are ``-100`` on the prompt so the loss and every metric see only answer tokens. The ``id`` column is kept.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnlearnError

IGNORE_INDEX = -100
PLAIN_PROMPT = "Question: {question}\nAnswer:"


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def format_prompt(tokenizer, question: str, use_chat_template: bool | None = None) -> str:
    """The prompt text the model is trained and evaluated with (generation starts right after it)."""
    if use_chat_template is None:
        use_chat_template = has_chat_template(tokenizer)
    if use_chat_template:
        if not has_chat_template(tokenizer):
            raise UnlearnError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                "pass use_chat_template=False (plain 'Question: ... Answer:' prompts)"
            )
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
    return PLAIN_PROMPT.format(question=question)


def encode_qa(
    tokenizer,
    question: str,
    answer: str,
    max_length: int = 256,
    use_chat_template: bool | None = None,
) -> dict[str, list[int]]:
    """Token ids and labels of one QA pair; raises if truncation leaves no answer token."""
    prompt = format_prompt(tokenizer, question, use_chat_template)
    chat = use_chat_template if use_chat_template is not None else has_chat_template(tokenizer)
    # the chat template already carries BOS-like markers; plain prompts get the tokenizer's special tokens
    prompt_ids = tokenizer(prompt, add_special_tokens=not chat)["input_ids"]
    answer_text = answer if chat else " " + answer
    answer_ids = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        answer_ids = answer_ids + [tokenizer.eos_token_id]
    room = max_length - len(prompt_ids)
    if room <= 0 or not answer_ids:
        raise UnlearnError(
            f"the answer is empty after truncation to max_length={max_length} (prompt has {len(prompt_ids)} tokens); "
            "raise max_length"
        )
    answer_ids = answer_ids[:room]
    input_ids = prompt_ids + answer_ids
    return {
        "input_ids": input_ids,
        "attention_mask": [1] * len(input_ids),
        "labels": [IGNORE_INDEX] * len(prompt_ids) + answer_ids,
    }


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
