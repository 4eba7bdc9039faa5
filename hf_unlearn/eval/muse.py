"""MUSE-News evaluation (Shi et al., 2024): verbatim memorisation, knowledge memorisation, privacy leakage.

* verbmem: greedy continuation of each ``verbmem/forget`` prompt (the tokenizer's start tokens and the prompt's last
  tokens, ``max_prompt_tokens`` in all; None = the whole prompt, as OpenUnlearning keeps it); with
  ``verbmem_stop="ground_truth"`` (default) as many new tokens as the ground truth has (at most
  ``verbmem_max_new_tokens``), with ``"eos"`` (OpenUnlearning's) ``verbmem_max_new_tokens`` (128) cut only at EOS;
  ROUGE-L F1 against the ground truth;
* knowmem: ``Question: ...\\nAnswer:`` prompts on ``knowmem/forget_qa`` and ``knowmem/retain2_qa``; zero-shot (the
  answer cut at its first line break) or, with ``knowmem_examples``, few-shot as MUSE and OpenUnlearning run it (the
  in-context QA pairs first, each ``Question: q\\nAnswer: a`` and a blank line; the answer cut at the first blank
  line or ``Question``); ROUGE-L F1 (recall also reported);
* privleak: Min-k% (and LOSS, zlib, Min-k%++, gradient norm, reference-model) scores of ``privleak/forget`` vs
  ``privleak/holdout`` texts (first ``max_length`` tokens after the tokenizer's start token, as OpenUnlearning keeps
  them), AUC, and privleak against a retain-only reference's AUC
  (the reference attack needs the reference's :class:`MuseResult`, which holds its per-text losses).
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import UnlearnError
from . import metrics as M
from .result import EvalResult, fmt

KNOWMEM_PROMPT = "Question: {question}\nAnswer:"
KNOWMEM_EXAMPLE = "Question: {question}\nAnswer: {answer}\n\n"
KNOWMEM_FEW_SHOT_STOPS = ("\n\n", "\nQuestion", "Question:")
VERBMEM_STOPS = ("ground_truth", "eos")
KNOWMEM_ICL_SPLITS = {"forget": "forget_qa_icl", "retain2": "retain_qa_icl"}  # MUSE's in-context examples


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


def _reference_losses(reference) -> dict[tuple[str, int], float] | None:
    """``{(set, id): loss}`` of the reference's privleak texts (for the reference attack); None for a bare AUC."""
    if not isinstance(reference, EvalResult):
        return None
    return {(r["set"][len("privleak_"):], r["id"]): r["mia"]["loss"] for r in reference.per_item
            if str(r.get("set", "")).startswith("privleak_") and "loss" in r.get("mia", {})}


def _knowmem_examples(examples, muse_path) -> dict[str, list[dict]]:
    """In-context QA pairs per knowmem set (``forget``, ``retain2``); empty lists = zero-shot."""
    if examples is None:
        return {"forget": [], "retain2": []}
    if isinstance(examples, str):
        if examples != "muse":
            raise UnlearnError(f"knowmem_examples must be None, 'muse', a list of QA dicts or a mapping; got {examples!r}")
        return {s: _rows("knowmem", split, muse_path, None) for s, split in KNOWMEM_ICL_SPLITS.items()}
    if isinstance(examples, dict):
        unknown = set(examples) - {"forget", "retain", "retain2"}
        if unknown:
            raise UnlearnError(f"knowmem_examples names unknown sets {sorted(unknown)}; use 'forget' and 'retain'")
        per_set = {"forget": examples.get("forget", []), "retain2": examples.get("retain", examples.get("retain2", []))}
    else:
        per_set = {"forget": examples, "retain2": examples}
    out = {}
    for s, rows in per_set.items():
        rows = list(rows)
        if any(not isinstance(r, dict) or not {"question", "answer"} <= set(r) for r in rows):
            raise UnlearnError("every in-context knowmem example needs a 'question' and an 'answer'")
        out[s] = [{"question": r["question"], "answer": r["answer"]} for r in rows]
    return out


def privleak_encoding(tokenizer, text: str, max_length: int, item_id=None) -> dict[str, list[int]]:
    """Ids and labels of one privleak text as OpenUnlearning's ``preprocess_pretraining_instance`` keeps them: the
    tokenizer's start tokens (what it adds to an empty string: BOS for Llama, none for GPT-2) and then the first
    ``max_length`` text tokens; the first position is never a target."""
    ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    start = len(tokenizer("", add_special_tokens=True)["input_ids"])
    ids = ids[:start + max_length]
    if len(ids) < 2:
        raise UnlearnError(f"MUSE privleak text id {item_id} has fewer than 2 tokens")
    keep = max(start, 1)
    return {"input_ids": ids, "labels": [M.IGNORE_INDEX] * keep + ids[keep:]}


def verbmem_prompt(tokenizer, prompt: str, max_prompt_tokens: int | None) -> list[int]:
    """Ids of a verbmem prompt: ``tokenizer(prompt, add_special_tokens=True)`` whole (None, OpenUnlearning's), or cut
    to ``max_prompt_tokens`` by dropping the oldest text tokens: the start tokens (BOS) stay first."""
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if max_prompt_tokens is None or len(ids) <= max_prompt_tokens:
        return ids
    start = len(tokenizer("", add_special_tokens=True)["input_ids"])
    if max_prompt_tokens <= start:
        raise UnlearnError(f"max_prompt_tokens={max_prompt_tokens} leaves no prompt text after the start tokens")
    return ids[:start] + ids[len(ids) - (max_prompt_tokens - start):]


def cut_knowmem_answer(generation: str, few_shot: bool) -> str:
    """The answer part of a knowmem generation: up to the first line break (zero-shot), or up to the first blank
    line / ``Question`` (few-shot, OpenUnlearning's stop strings)."""
    if not few_shot:
        return generation.split("\n")[0].strip()
    cut = min((i for i in (generation.find(stop) for stop in KNOWMEM_FEW_SHOT_STOPS) if i >= 0), default=len(generation))
    return generation[:cut].strip()


def evaluate_muse_news(
    model,
    tokenizer,
    *,
    muse_path: str | os.PathLike | None = None,
    reference=None,
    batch_size: int = 4,
    max_items: int | None = None,
    max_length: int = 2048,
    max_prompt_tokens: int | None = 1024,
    verbmem_max_new_tokens: int = 128,
    knowmem_max_new_tokens: int = 32,
    knowmem_examples=None,
    mia_k: float = 0.4,
    mia_attacks=None,
    variance_floor: float = M.VARIANCE_FLOOR,
    verbmem_stop: str = "ground_truth",
    attention_mask: str = "tokens",
    progress: bool = True,
) -> MuseResult:
    """Evaluate ``model`` on MUSE-News (see the module docstring). ``reference``: the retain-only model's
    :class:`MuseResult` (or its JSON path, or its Min-k% AUC as a float) for privleak.

    ``knowmem_examples``: None (zero-shot), ``"muse"`` (MUSE's own in-context examples, ``knowmem/forget_qa_icl`` and
    ``knowmem/retain_qa_icl`` from the MUSE folder or the Hub), a list of ``{"question", "answer"}`` dicts for both
    sets, or ``{"forget": [...], "retain": [...]}``. ``mia_attacks``: a subset of ``metrics.MIA_ATTACKS`` (default
    all; ``"gradnorm"`` costs one backward per privleak text). ``max_length``: tokens of each privleak text scored
    (2048, as OpenUnlearning), counted after the start token a tokenizer adds. ``variance_floor``: the Min-k%++
    variance floor (OpenUnlearning: 1e-6). ``verbmem_stop``: ``"ground_truth"`` cuts each verbmem generation at the
    ground truth's length in tokens (a verbatim reproduction scores 1.0); ``"eos"`` generates
    ``verbmem_max_new_tokens`` and cuts only at EOS (OpenUnlearning; what the model writes past the ground truth
    counts against ROUGE-L precision). ``max_prompt_tokens``: verbmem prompt tokens kept (:func:`verbmem_prompt`;
    None = the whole prompt, OpenUnlearning's). ``attention_mask``: ``"tokens"`` or ``"not_pad"`` (``input_ids !=
    pad``, OpenUnlearning's collator), for every model pass.
    """
    from ..data.collators import check_attention_mask
    from .runner import generate_texts, gradient_norms, pad_token_id, score_sequences, tokenizer_fingerprint

    attacks = M.check_mia_attacks(mia_attacks)
    check_attention_mask(attention_mask)
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise UnlearnError(f"max_prompt_tokens must be >= 1 or None (the whole prompt), got {max_prompt_tokens}")
    if verbmem_stop not in VERBMEM_STOPS:
        raise UnlearnError(f"verbmem_stop must be one of {', '.join(VERBMEM_STOPS)}, got {verbmem_stop!r}")

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
        if len(tokenizer("", add_special_tokens=True)["input_ids"]) and not ref_meta.get("privleak_after_start_token"):
            raise UnlearnError("the MUSE reference was evaluated before privleak counted max_length after the start "
                               "token (one text token fewer with this tokenizer); evaluate the reference again")
        if ref_meta.get("variance_floor", 1e-12) != variance_floor:
            raise UnlearnError(f"the MUSE reference used variance_floor={ref_meta.get('variance_floor', 1e-12)} and this "
                               f"evaluation {variance_floor}: use the same Min-k%++ convention (the same --preset)")
        if ref_meta.get("attention_mask", "tokens") != attention_mask:
            raise UnlearnError(f"the MUSE reference used attention_mask={ref_meta.get('attention_mask', 'tokens')!r} and "
                               f"this evaluation {attention_mask!r}: use the same convention (the same --preset)")
    verbmem = _rows("verbmem", "forget", muse_path, max_items)
    knowmem = {s: _rows("knowmem", f"{s}_qa", muse_path, max_items) for s in ("forget", "retain2")}
    shots = _knowmem_examples(knowmem_examples, muse_path)
    priv = {s: _rows("privleak", s, muse_path, max_items) for s in ("forget", "holdout")}
    ref_losses = _reference_losses(reference) if "reference" in attacks else None
    missing = [(s, r["id"]) for s, rows in priv.items() for r in rows
               if ref_losses is not None and (s, r["id"]) not in ref_losses]
    if missing:  # checked before any model pass
        raise UnlearnError(f"the MUSE reference result has no privleak loss for {missing[0]}; evaluate it with the "
                           "same max_items")

    per_item: list[dict] = []
    summary: dict[str, Any] = {}

    # verbatim memorisation
    prompts, budgets = [], []
    for r in verbmem:
        prompts.append(verbmem_prompt(tokenizer, r["prompt"], max_prompt_tokens))
        gt_tokens = len(tokenizer(r["gt"], add_special_tokens=False)["input_ids"])
        budgets.append(verbmem_max_new_tokens if verbmem_stop == "eos" else min(verbmem_max_new_tokens, gt_tokens))
    gens = generate_texts(model, tokenizer, prompts, max_new_tokens=max(budgets), batch_size=batch_size,
                          desc="MUSE verbmem", progress=progress, attention_mask=attention_mask)
    scores = []
    for r, g, budget in zip(verbmem, gens, budgets):
        if verbmem_stop == "ground_truth":
            g = tokenizer.decode(tokenizer(g, add_special_tokens=False)["input_ids"][:budget])
        f1 = M.rouge_l_f1(g, r["gt"])
        scores.append(f1)
        per_item.append({"set": "verbmem", "id": r["id"], "generation": g, "rouge_l_f1": f1})
    summary["verbmem_rouge_l_f1"] = M.nanmean(scores)

    # knowledge memorisation
    qa = [(s, r) for s, rows in knowmem.items() for r in rows]
    prefix = {s: "".join(KNOWMEM_EXAMPLE.format(question=e["question"], answer=e["answer"]) for e in shots[s])
              for s in knowmem}
    gens = generate_texts(
        model, tokenizer,
        [tokenizer(prefix[s] + KNOWMEM_PROMPT.format(question=r["question"]), add_special_tokens=True)["input_ids"]
         for s, r in qa],
        max_new_tokens=knowmem_max_new_tokens, batch_size=batch_size, desc="MUSE knowmem", progress=progress,
        attention_mask=attention_mask,
    )
    by_set: dict[str, list[tuple[float, float]]] = {s: [] for s in knowmem}
    for (s, r), g in zip(qa, gens):
        g = cut_knowmem_answer(g, few_shot=bool(shots[s]))
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
    encodings = [privleak_encoding(tokenizer, r["text"], max_length, r["id"]) for _, r in texts]
    stats = score_sequences(model, encodings, pad_id=pad_token_id(tokenizer), batch_size=batch_size,
                            desc="MUSE privleak", progress=progress, variance_floor=variance_floor,
                            attention_mask=attention_mask)
    eos = tokenizer.eos_token_id
    norms = (gradient_norms(model, [{**e, "labels": M.labels_without_final_eos(e["labels"], eos)} for e in encodings],
                            desc="MUSE gradient norms", progress=progress, pad_id=pad_token_id(tokenizer),
                            attention_mask=attention_mask)
             if "gradnorm" in attacks else [None] * len(encodings))
    mia = {s: [] for s in priv}
    for (s, r), st, enc, norm in zip(texts, stats, encodings, norms):
        scored = tokenizer.decode(enc["input_ids"], skip_special_tokens=True)
        sc = M.mia_scores(st, scored, mia_k, body=M.drop_final_eos(st, enc["labels"], eos))
        if norm is not None:
            sc["gradnorm"] = norm
        if ref_losses is not None:
            sc["reference"] = M.reference_attack_score(sc["loss"], ref_losses[(s, r["id"])])
        mia[s].append(sc)
        per_item.append({"set": f"privleak_{s}", "id": r["id"], "mia": sc})
    for attack in M.MIA_ATTACKS:
        present = attack in attacks and all(attack in x for s in priv for x in mia[s])
        auc = M.mia_auc([x[attack] for x in mia["forget"]], [x[attack] for x in mia["holdout"]]) if present else None
        summary[f"mia_{attack}_auc"] = auc
        ref = 0.5 if attack == "reference" else (ref_auc or {}).get(attack)
        summary[f"privleak_{attack}"] = M.privleak(auc, ref) if auc is not None and ref is not None and ref < 1 else None
    summary["privleak"] = summary["privleak_min_k"]

    meta = {
        "benchmark": "MUSE-News",
        "model": getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__,
        "tokenizer_fingerprint": fingerprint,
        "max_length": max_length,
        "privleak_after_start_token": True,
        "variance_floor": variance_floor,
        "verbmem_stop": verbmem_stop,
        "attention_mask": attention_mask,
        "max_prompt_tokens": max_prompt_tokens,
        "verbmem_max_new_tokens": verbmem_max_new_tokens,
        "knowmem_max_new_tokens": knowmem_max_new_tokens,
        "knowmem_shots": {("retain" if k == "retain2" else k): len(v) for k, v in shots.items()},
        "mia_k": mia_k,
        "mia_attacks": list(attacks),
        "items": {"verbmem": len(verbmem), **{f"knowmem_{s}": len(v) for s, v in knowmem.items()},
                  **{f"privleak_{s}": len(v) for s, v in priv.items()}},
    }
    return MuseResult(summary=summary, per_item=per_item, meta=meta)
