"""A quick before/after check of any question/answer data: answer loss, answer probability and ROUGE-L per set.

``hf-unlearn forget`` and the demo use it on the forget rows and a sample of the retained rows, whatever the
dataset (``evaluate_tofu`` needs TOFU's perturbed answers and utility sets). The numbers are TOFU's per-item
``probability`` (``exp(-mean answer-token NLL)``) and ``rouge_l`` (recall of the greedy answer), computed with the
same runner and metric functions, so they read the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import UnlearnError

QA_METRICS = ("answer_loss", "probability", "rouge_l")


def _rouge_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("rouge_score") is not None


def rouge_missing() -> str | None:
    """The one line that says ROUGE-L is not computed here, or None: without the ``eval`` extra it would vanish
    from a receipt and a card with no word."""
    if _rouge_available():
        return None
    return "ROUGE-L not computed: rouge_score is not installed (pip install 'hf_unlearn[eval]')"


def evaluate_qa(model, tokenizer, sets: Mapping[str, Sequence[dict]], *, max_length: int = 256,
                max_new_tokens: int = 64, batch_size: int = 16, generate: bool = True,
                use_chat_template=None, attention_mask: str = "tokens", progress: bool = True) -> dict[str, dict]:
    """``{set: {"items", "answer_loss", "probability", "rouge_l"}}`` for each named list of rows.

    Rows are raw QA (``question``, ``answer``) or tokenised (``input_ids``, ``labels``; no ROUGE-L then).
    ``rouge_l`` is None when ``generate`` is off, the rows are tokenised, or rouge_score is not installed.
    ``use_chat_template``: None (the tokenizer's template when it has one), a bool or a
    :class:`~hf_unlearn.data.prompts.PromptFormat` (the format the model was trained with); ``attention_mask``: the
    mask it was trained with (``"tokens"`` / ``"not_pad"``, :data:`hf_unlearn.presets.ATTENTION_MASKS`).
    """
    from ..data.tokenize import encode_qa, has_chat_template
    from . import metrics as M
    from .runner import generate_texts, pad_token_id, score_sequences
    from .tofu import prompt_ids

    chat = has_chat_template(tokenizer) if use_chat_template is None else use_chat_template
    pad = pad_token_id(tokenizer)
    out: dict[str, dict] = {}
    for name, rows in sets.items():
        rows = list(rows)
        if not rows:
            raise UnlearnError(f"the {name} set to evaluate is empty")
        text = "question" in rows[0] and "answer" in rows[0]
        if text:
            enc = [encode_qa(tokenizer, r["question"], r["answer"], max_length, chat) for r in rows]
        elif "input_ids" in rows[0] and "labels" in rows[0]:
            enc = [{"input_ids": list(r["input_ids"]), "labels": list(r["labels"])} for r in rows]
        else:
            raise UnlearnError(f"the {name} rows have neither question/answer nor input_ids/labels columns")
        stats = score_sequences(model, enc, pad_id=pad, batch_size=batch_size, desc=f"scoring {name}",
                                progress=progress, attention_mask=attention_mask)
        nll = [s.mean_nll for s in stats]
        res = {"items": len(rows), "answer_loss": sum(nll) / len(nll),
               "probability": sum(M.probability(x) for x in nll) / len(nll), "rouge_l": None}
        if generate and text and _rouge_available():
            prompts = [prompt_ids(tokenizer, r["question"], chat) for r in rows]
            answers = generate_texts(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                     desc=f"generating {name}", progress=progress, attention_mask=attention_mask)
            res["rouge_l"] = sum(M.rouge_l_recall(a, r["answer"]) for a, r in zip(answers, rows)) / len(rows)
        out[name] = res
    return out


def format_qa_table(before: Mapping[str, dict], after: Mapping[str, dict]) -> str:
    """A markdown table: one row per set and metric, before -> after."""
    lines = ["| set | metric | before | after |", "|---|---|---|---|"]
    for name in after:
        for metric in QA_METRICS:
            b, a = before.get(name, {}).get(metric), after[name].get(metric)
            if a is None and b is None:
                continue
            lines.append(f"| {name} ({after[name]['items']} rows) | {metric} | {_fmt(b)} | {_fmt(a)} |")
    return "\n".join(lines)


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"
