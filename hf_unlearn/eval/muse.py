"""MUSE-News evaluation (Shi et al., 2024): verbatim memorisation, knowledge memorisation, privacy leakage.

* verbmem: greedy continuation of each ``verbmem/forget`` prompt (its last ``max_prompt_tokens`` tokens), as many new
  tokens as the ground truth has (at most ``verbmem_max_new_tokens``); ROUGE-L F1 against the ground truth;
* knowmem: zero-shot ``Question: ...\\nAnswer:`` prompts on ``knowmem/forget_qa`` and ``knowmem/retain2_qa``, the
  answer cut at its first line break; ROUGE-L F1 (recall also reported);
* privleak: Min-k% (and LOSS, zlib, Min-k%++) scores of ``privleak/forget`` vs ``privleak/holdout`` texts (first
  ``max_length`` tokens), AUC, and privleak against a retain-only reference's AUC.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import UnlearnError
from . import metrics as M
from .result import EvalResult, fmt

KNOWMEM_PROMPT = "Question: {question}\nAnswer:"


class MuseResult(EvalResult):
    """MUSE-News result; ``summary`` keys ``verbmem_rouge_l_f1``, ``knowmem_{forget,retain}_rouge_l_{f1,recall}``,
    ``mia_{attack}_auc``, ``privleak`` (Min-k%; None without a reference) and ``privleak_{attack}``."""

    kind = "muse_news"

    def headline(self) -> dict[str, Any]:
        keys = ("verbmem_rouge_l_f1", "knowmem_forget_rouge_l_f1", "knowmem_retain_rouge_l_f1", "mia_min_k_auc",
                "privleak")
        return {k: self.summary.get(k) for k in keys}

    def to_markdown(self) -> str:
        lines = [f"## MUSE-News evaluation ({self.meta.get('model', 'model')})", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {fmt(v)} |" for k, v in self.summary.items()]
        return "\n".join(lines) + "\n"


def _rows(subset: str, split: str, path, max_items: int | None) -> list[dict]:
    from ..data.muse import load_muse_news

    rows = load_muse_news(subset, split, path).to_list()
    return rows[:max_items] if max_items else rows


def _load_reference_auc(reference) -> dict[str, float] | None:
    if reference is None:
        return None
    if isinstance(reference, (int, float)):
        return {"min_k": float(reference)}
    if isinstance(reference, EvalResult):
        return {a: reference.summary[f"mia_{a}_auc"] for a in M.MIA_ATTACKS
                if reference.summary.get(f"mia_{a}_auc") is not None}
    raise UnlearnError(f"reference must be a MuseResult, its JSON path or a Min-k% AUC, got {type(reference).__name__}")


def evaluate_muse_news(
    model,
    tokenizer,
    *,
    muse_path: str | os.PathLike | None = None,
    reference=None,
    batch_size: int = 4,
    max_items: int | None = None,
    max_length: int = 1024,
    max_prompt_tokens: int = 1024,
    verbmem_max_new_tokens: int = 128,
    knowmem_max_new_tokens: int = 32,
    mia_k: float = 0.4,
    progress: bool = True,
) -> MuseResult:
    """Evaluate ``model`` on MUSE-News (see the module docstring). ``reference``: the retain-only model's
    :class:`MuseResult` (or its JSON path, or its Min-k% AUC as a float) for privleak."""
    from .runner import generate_texts, pad_token_id, score_sequences, tokenizer_fingerprint

    if isinstance(reference, (str, os.PathLike)):
        reference = MuseResult.from_json(reference)
    ref_auc = _load_reference_auc(reference)
    ref_meta = reference.meta if isinstance(reference, EvalResult) else None
    fingerprint = tokenizer_fingerprint(tokenizer)
    if ref_meta is not None:
        if ref_meta.get("tokenizer_fingerprint") != fingerprint:
            raise UnlearnError("the MUSE reference was evaluated with another tokenizer; privleak needs the same one")
        if ref_meta.get("max_length") != max_length or ref_meta.get("mia_k") != mia_k:
            raise UnlearnError(
                f"the MUSE reference used max_length={ref_meta.get('max_length')}, mia_k={ref_meta.get('mia_k')}; "
                f"this evaluation uses {max_length}, {mia_k}: use the same settings"
            )
    verbmem = _rows("verbmem", "forget", muse_path, max_items)
    knowmem = {s: _rows("knowmem", f"{s}_qa", muse_path, max_items) for s in ("forget", "retain2")}
    priv = {s: _rows("privleak", s, muse_path, max_items) for s in ("forget", "holdout")}

    per_item: list[dict] = []
    summary: dict[str, Any] = {}

    # verbatim memorisation
    prompts, budgets = [], []
    for r in verbmem:
        ids = tokenizer(r["prompt"], add_special_tokens=True)["input_ids"][-max_prompt_tokens:]
        prompts.append(ids)
        budgets.append(min(verbmem_max_new_tokens, len(tokenizer(r["gt"], add_special_tokens=False)["input_ids"])))
    gens = generate_texts(model, tokenizer, prompts, max_new_tokens=max(budgets), batch_size=batch_size,
                          desc="MUSE verbmem", progress=progress)
    scores = []
    for r, g, budget in zip(verbmem, gens, budgets):
        g = tokenizer.decode(tokenizer(g, add_special_tokens=False)["input_ids"][:budget])
        f1 = M.rouge_l_f1(g, r["gt"])
        scores.append(f1)
        per_item.append({"set": "verbmem", "id": r["id"], "generation": g, "rouge_l_f1": f1})
    summary["verbmem_rouge_l_f1"] = M.nanmean(scores)

    # knowledge memorisation
    qa = [(s, r) for s, rows in knowmem.items() for r in rows]
    gens = generate_texts(
        model, tokenizer,
        [tokenizer(KNOWMEM_PROMPT.format(question=r["question"]), add_special_tokens=True)["input_ids"] for _, r in qa],
        max_new_tokens=knowmem_max_new_tokens, batch_size=batch_size, desc="MUSE knowmem", progress=progress,
    )
    by_set: dict[str, list[tuple[float, float]]] = {s: [] for s in knowmem}
    for (s, r), g in zip(qa, gens):
        g = g.split("\n")[0].strip()
        recall, _, f1 = M.rouge_l(g, r["answer"])
        by_set[s].append((f1, recall))
        per_item.append({"set": f"knowmem_{s}", "id": r["id"], "question": r["question"], "answer": r["answer"],
                         "generation": g, "rouge_l_f1": f1, "rouge_l_recall": recall})
    for s, vals in by_set.items():
        name = "retain" if s == "retain2" else s
        summary[f"knowmem_{name}_rouge_l_f1"] = M.nanmean([v[0] for v in vals])
        summary[f"knowmem_{name}_rouge_l_recall"] = M.nanmean([v[1] for v in vals])

    # privacy leakage
    texts = [(s, r) for s, rows in priv.items() for r in rows]
    encodings = []
    for _, r in texts:
        ids = tokenizer(r["text"], add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]
        if len(ids) < 2:
            raise UnlearnError(f"MUSE privleak text id {r['id']} has fewer than 2 tokens")
        encodings.append({"input_ids": ids, "labels": [M.IGNORE_INDEX] + ids[1:]})
    stats = score_sequences(model, encodings, pad_id=pad_token_id(tokenizer), batch_size=batch_size,
                            desc="MUSE privleak", progress=progress)
    mia = {s: [] for s in priv}
    for (s, r), st, enc in zip(texts, stats, encodings):
        scored = tokenizer.decode(enc["input_ids"], skip_special_tokens=True)
        sc = M.mia_scores(st, scored, mia_k)
        mia[s].append(sc)
        per_item.append({"set": f"privleak_{s}", "id": r["id"], "mia": sc})
    for attack in M.MIA_ATTACKS:
        auc = M.mia_auc([x[attack] for x in mia["forget"]], [x[attack] for x in mia["holdout"]])
        summary[f"mia_{attack}_auc"] = auc
        ref = (ref_auc or {}).get(attack)
        summary[f"privleak_{attack}"] = M.privleak(auc, ref) if ref is not None and ref < 1 else None
    summary["privleak"] = summary["privleak_min_k"]

    meta = {
        "benchmark": "MUSE-News",
        "model": getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__,
        "tokenizer_fingerprint": fingerprint,
        "max_length": max_length,
        "max_prompt_tokens": max_prompt_tokens,
        "verbmem_max_new_tokens": verbmem_max_new_tokens,
        "knowmem_max_new_tokens": knowmem_max_new_tokens,
        "mia_k": mia_k,
        "items": {"verbmem": len(verbmem), **{f"knowmem_{s}": len(v) for s, v in knowmem.items()},
                  **{f"privleak_{s}": len(v) for s, v in priv.items()}},
    }
    return MuseResult(summary=summary, per_item=per_item, meta=meta)
