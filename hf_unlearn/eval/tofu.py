"""TOFU evaluation (Maini et al., 2024): forget/retain/real-authors/world-facts metrics, forget quality, MIA.

Sets evaluated (ids as in :mod:`hf_unlearn.data.tofu`):

* ``forget``: ``forgetNN_perturbed`` (the forget split with paraphrased and perturbed answers), or the rows of
  ``full`` with ``forget_ids``;
* ``retain``: ``retain_perturbed`` (= the first 400 rows of ``full``) minus any forget id, or the rows with
  ``retain_ids``;
* ``real_authors`` and ``world_facts``: their ``*_perturbed`` files (the true answer is its own paraphrase);
* ``holdout``: as many rows of ``holdout10`` as there are forget items, for membership inference only.

Membership inference (forget vs holdout answers): LOSS, zlib, Min-k%, Min-k%++ from the scoring pass, the gradient
norm (one backward per forget/holdout answer), and the reference-model attack, which needs the retain-only
reference's result (its per-item losses on the same forget and holdout items); ``mia_attacks=`` picks a subset.

For explicit ids, paraphrased/perturbed answers come from ``forget10_perturbed`` (ids 3600-3999) and
``retain_perturbed`` (ids 0-399). Items outside those ranges have no truth ratio: every other metric is computed for
them, truth-ratio summaries (and forget quality) use only the items that have one, and
``meta["truth_ratio_items"]`` says how many that was per set.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import UnlearnError
from . import metrics as M
from .result import EvalResult, fmt

FORGET_SPLITS = ("forget01", "forget05", "forget10")
UTILITY_SETS = ("retain", "real_authors", "world_facts")
QA_SETS = ("forget", *UTILITY_SETS)
HEADLINE = ("forget_quality", "model_utility", "forget_probability", "forget_rouge_l", "forget_truth_ratio",
            "privleak", "retain_probability", "retain_rouge_l", "retain_truth_ratio")


class TofuResult(EvalResult):
    """TOFU evaluation result; ``summary`` keys: ``forget_quality`` (None without a reference), ``model_utility``,
    ``{set}_{probability,rouge_l,truth_ratio,truth_ratio_symmetric,truth_ratio_one_minus}`` for every set,
    ``{forget,retain}_{extraction_strength,exact_memorization}``, ``mia_{attack}_auc`` for every attack in
    ``metrics.MIA_ATTACKS`` (None when not run), ``privleak`` (Min-k%, None without a reference) and
    ``privleak_{attack}``."""

    kind = "tofu"

    def headline(self) -> dict[str, Any]:
        return {k: self.summary.get(k) for k in HEADLINE}

    def forget_truth_ratios(self) -> list[float]:
        """Per-item forget truth ratios (items that have one), in item order."""
        return [r["truth_ratio"] for r in self.per_item if r["set"] == "forget" and r.get("truth_ratio") is not None]

    def with_reference(self, reference: TofuResult | str | os.PathLike) -> TofuResult:
        """This result with forget quality and privleak computed against a retain-only ``reference`` result.

        Lets a model be evaluated once, before the reference exists, and compared later without re-running it.
        """
        ref = _load_reference(reference)
        self.check_comparable(ref)
        records = {name: [r for r in self.per_item if r.get("set") == name] for name in (*QA_SETS, "holdout")}
        meta = copy.deepcopy(self.meta)
        summary = _summarize(records, meta, ref)
        meta["notes"] = list(dict.fromkeys(meta.get("notes", [])))  # the set notes are added again
        return TofuResult(summary=summary, per_item=self.per_item, meta=meta)

    def check_comparable(self, reference: TofuResult) -> None:
        """Raise unless ``reference`` was computed on the same forget items with the same tokenizer and prompts."""
        mine, theirs = self.meta, reference.meta
        if theirs.get("forget_split") != mine.get("forget_split"):
            raise UnlearnError(
                f"the reference was evaluated on {theirs.get('forget_split')!r} but this evaluation uses "
                f"{mine.get('forget_split')!r}; evaluate the retain-only reference on the same forget split"
            )
        if theirs.get("tokenizer_fingerprint") != mine.get("tokenizer_fingerprint"):
            raise UnlearnError(
                f"the reference was evaluated with another tokenizer (fingerprint {theirs.get('tokenizer_fingerprint')} "
                f"vs {mine.get('tokenizer_fingerprint')}); truth ratios are only comparable with the same tokenizer"
            )
        if theirs.get("chat_template") != mine.get("chat_template"):
            raise UnlearnError(
                f"the reference used chat_template={theirs.get('chat_template')} but this evaluation uses "
                f"{mine.get('chat_template')}; use the same prompt format for both"
            )
        for key, old in (("zlib_text", "answer"), ("variance_floor", 1e-12), ("es_no_match", "zero"),
                         ("attention_mask", "tokens"),
                         ("prompt_format", _default_format(mine.get("chat_template")))):  # written before the option
            if theirs.get(key, old) != mine.get(key, old):
                raise UnlearnError(f"the reference used {key}={theirs.get(key, old)!r} but this evaluation uses "
                                   f"{mine.get(key, old)!r}; evaluate both with the same conventions (the same --preset)")
        if sorted(theirs.get("forget_ids", [])) != sorted(mine.get("forget_ids", [])):
            raise UnlearnError(
                f"the reference was evaluated on {len(theirs.get('forget_ids', []))} forget items and this evaluation "
                f"on {len(mine.get('forget_ids', []))} different ones; use the same forget_ids and max_items for both"
            )

    def to_markdown(self) -> str:
        m = self.meta
        lines = [
            f"## TOFU evaluation ({m.get('forget_set') or m.get('forget_split')}, {m.get('model', 'model')})",
            "",
            "| metric | value |",
            "|---|---|",
        ]
        lines += [f"| {k} | {fmt(v)} |" for k, v in self.headline().items()]
        lines += ["", "| set | items | probability | ROUGE-L recall | truth ratio (report form) | ES | EM |",
                  "|---|---|---|---|---|---|---|"]
        s = self.summary
        for name in QA_SETS:
            lines.append(
                f"| {name} | {m.get('items', {}).get(name, 'n/a')} | {fmt(s.get(f'{name}_probability'))} | "
                f"{fmt(s.get(f'{name}_rouge_l'))} | {fmt(s.get(f'{name}_truth_ratio'))} | "
                f"{fmt(s.get(f'{name}_extraction_strength'))} | {fmt(s.get(f'{name}_exact_memorization'))} |"
            )
        lines += ["", "| MIA (forget vs holdout) | AUC | privleak % |", "|---|---|---|"]
        for attack in M.MIA_ATTACKS:
            lines.append(f"| {attack} | {fmt(s.get(f'mia_{attack}_auc'))} | {fmt(s.get(f'privleak_{attack}'))} |")
        notes = m.get("notes") or []
        if notes:
            lines += [""] + [f"- {n}" for n in notes]
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# data


def _default_format(chat) -> dict:
    """The prompt format of a result written before ``prompt_format`` was recorded (hf_unlearn's)."""
    from ..data.prompts import PromptFormat

    return PromptFormat(chat_template=chat).to_dict()


def _load(config: str, tofu_path, why: str) -> list[dict]:
    from ..data.tofu import load_tofu

    try:
        return load_tofu(config, tofu_path).to_list()
    except UnlearnError as e:
        raise UnlearnError(f"{e} ({config} is needed for {why})") from None


def _qa(row: dict, perturbed: dict | None) -> dict:
    item = {"id": int(row["id"]), "question": row["question"], "answer": row["answer"],
            "paraphrased_answer": None, "perturbed_answer": None}
    if perturbed is not None:
        item["paraphrased_answer"] = perturbed.get("paraphrased_answer", row["answer"])
        item["perturbed_answer"] = list(perturbed["perturbed_answer"])
        item["paraphrased_question"] = perturbed.get("paraphrased_question")  # for the robustness evaluation
    return item


def _by_ids(ids: Iterable[int], full: dict[int, dict], lookup: dict[int, dict], what: str) -> list[dict]:
    ids = [int(i) for i in ids]
    if not ids:
        raise UnlearnError(f"{what} is empty; pass at least one TOFU id")
    unknown = [i for i in ids if i not in full]
    if unknown:
        raise UnlearnError(f"{what} has ids that are not rows of TOFU full (0..{len(full) - 1}): {unknown[:5]}")
    return [_qa(full[i], lookup.get(i)) for i in ids]


def tofu_sets(
    forget_split: str = "forget10",
    tofu_path: str | os.PathLike | None = None,
    forget_ids: Iterable[int] | None = None,
    retain_ids: Iterable[int] | None = None,
    max_items: int | Mapping[str, int] | None = None,
) -> dict[str, list[dict]]:
    """The items of each evaluated set: ``{set: [{id, question, answer, paraphrased_answer, perturbed_answer}]}``.

    ``max_items`` caps every set at its first N items, or, as ``{set: N}``, only the sets it names (for example all
    forget items, which forget quality needs, but a sample of the utility sets).
    """
    if forget_split not in FORGET_SPLITS:
        raise UnlearnError(f"unknown forget split {forget_split!r}; choose one of {', '.join(FORGET_SPLITS)}")
    why = "truth ratio and forget quality"
    sets: dict[str, list[dict]] = {}
    if forget_ids is None and retain_ids is None:
        sets["forget"] = [_qa(r, r) for r in _load(f"{forget_split}_perturbed", tofu_path, why)]
        lookup = None
    else:
        lookup = {r["id"]: r for name in ("forget10_perturbed", "retain_perturbed") for r in _load(name, tofu_path, why)}
        full = {r["id"]: r for r in _load("full", tofu_path, "looking up forget/retain ids")}
        if forget_ids is not None:
            sets["forget"] = _by_ids(forget_ids, full, lookup, "forget_ids")
        else:
            sets["forget"] = [_qa(r, r) for r in _load(f"{forget_split}_perturbed", tofu_path, why)]
    forget_set = {it["id"] for it in sets["forget"]}
    if retain_ids is not None:
        overlap = sorted(forget_set.intersection(int(i) for i in retain_ids))
        if overlap:
            raise UnlearnError(f"retain_ids and forget_ids overlap ({overlap[:5]}); an item cannot be in both")
        sets["retain"] = _by_ids(retain_ids, full, lookup, "retain_ids")
    else:
        rows = [r for r in _load("retain_perturbed", tofu_path, "the retain truth ratio") if r["id"] not in forget_set]
        if not rows:
            raise UnlearnError("every retain_perturbed item is a forget id; pass retain_ids")
        sets["retain"] = [_qa(r, r) for r in rows]
    for name in ("real_authors", "world_facts"):
        sets[name] = [_qa(r, r) for r in _load(f"{name}_perturbed", tofu_path, "model utility")]
    holdout = _load("holdout10", tofu_path, "membership inference (forget vs holdout)")
    sets["holdout"] = [_qa(r, None) for r in holdout[: min(len(sets["forget"]), len(holdout))]]
    if max_items is not None:
        caps = dict(max_items) if isinstance(max_items, Mapping) else dict.fromkeys(sets, max_items)
        unknown = sorted(set(caps) - set(sets))
        if unknown:
            raise UnlearnError(f"max_items names unknown TOFU sets {unknown}; the sets are {', '.join(sets)}")
        bad = {k: n for k, n in caps.items() if n is not None and n < 1}
        if bad:
            raise UnlearnError(f"max_items must be >= 1, got {bad}")
        sets = {k: v[:caps[k]] if caps.get(k) is not None else v for k, v in sets.items()}
    return sets


# ----------------------------------------------------------------------------------------------------------------
# evaluation


def _load_reference(reference) -> TofuResult | None:
    if reference is None or isinstance(reference, TofuResult):
        return reference
    if isinstance(reference, EvalResult):
        return TofuResult(reference.summary, reference.per_item, reference.meta)
    if isinstance(reference, (str, os.PathLike)):
        return TofuResult.from_json(reference)
    raise UnlearnError(f"reference must be a TofuResult or the path to its JSON, got {type(reference).__name__}")


ZLIB_TEXTS = ("answer", "decoded")


def decoded_answer(tokenizer, labels) -> str:
    """The scored tokens (``labels != -100``) decoded without special tokens: the text OpenUnlearning's zlib attack
    compresses."""
    return tokenizer.decode([t for t in labels if t != M.IGNORE_INDEX], skip_special_tokens=True)


def resolve_chat_template(tokenizer, use_chat_template: bool | None) -> bool:
    return bool(resolve_prompt_format(tokenizer, use_chat_template).chat_template)


def resolve_prompt_format(tokenizer, use_chat_template: bool | None = None, prompt_format=None):
    """The :class:`~hf_unlearn.data.prompts.PromptFormat` an evaluation uses: ``prompt_format`` (None /
    ``"hf-unlearn"``, ``"open-unlearning"`` = OpenUnlearning's for the tokenizer's model family, a PromptFormat)
    with ``use_chat_template`` on top when given, resolved for ``tokenizer``."""
    from dataclasses import replace

    from ..data.prompts import prompt_format as as_format

    fmt = as_format(prompt_format, tokenizer)
    if use_chat_template is not None:
        fmt = replace(fmt, chat_template=bool(use_chat_template))
    return fmt.resolve(tokenizer)


def prompt_ids(tokenizer, question: str, chat) -> list[int]:
    """Token ids of the prompt exactly as :func:`hf_unlearn.data.tokenize.encode_qa` builds it (``chat``: a bool or a
    :class:`~hf_unlearn.data.prompts.PromptFormat`)."""
    from ..data.prompts import prompt_format as as_format

    return as_format(chat, tokenizer).prompt_ids(tokenizer, question)


def evaluate_tofu(
    model,
    tokenizer,
    *,
    forget_split: str = "forget10",
    tofu_path: str | os.PathLike | None = None,
    forget_ids: Iterable[int] | None = None,
    retain_ids: Iterable[int] | None = None,
    reference: TofuResult | str | os.PathLike | None = None,
    batch_size: int = 16,
    max_new_tokens: int = 200,
    max_items: int | Mapping[str, int] | None = None,
    use_chat_template: bool | None = None,
    max_length: int = 512,
    mia_k: float = 0.4,
    mia_attacks: Iterable[str] | None = None,
    zlib_text: str = "answer",
    variance_floor: float = M.VARIANCE_FLOOR,
    es_no_match: str = "zero",
    prompt_format=None,
    attention_mask: str = "tokens",
    progress: bool = True,
) -> TofuResult:
    """Evaluate ``model`` on TOFU; see the module docstring for the sets and :class:`TofuResult` for the keys.

    Args:
        forget_split: ``forget01``/``forget05``/``forget10``; labels the result and sizes the holdout set.
        forget_ids, retain_ids: restrict evaluation to these TOFU ids (rows of ``full``).
        reference: the retain-only reference model's result (object or JSON path) for forget quality and privleak.
            It must come from the same forget items, tokenizer and prompt format.
        max_items: cap every set at its first ``max_items`` items (quick checks, tests), or only the sets named in a
            ``{set: N}`` mapping (``forget``, ``retain``, ``real_authors``, ``world_facts``, ``holdout``).
        use_chat_template: None = the tokenizer's chat template if it has one (as training does).
        mia_k: the fraction of lowest-scoring tokens Min-k% and Min-k%++ average.
        mia_attacks: the membership-inference attacks to report (default all of ``metrics.MIA_ATTACKS``); leaving out
            ``"gradnorm"`` saves one backward pass per forget and holdout item; ``"reference"`` needs ``reference``
            (or is computed later by :meth:`TofuResult.with_reference`).
        zlib_text: what the zlib attack compresses: ``"answer"`` (the raw answer text) or ``"decoded"`` (the scored
            answer tokens decoded without special tokens, OpenUnlearning's convention).
        variance_floor: the Min-k%++ variance floor (OpenUnlearning: 1e-6; ``hf_unlearn.presets`` says why 1e-12).
        es_no_match: extraction strength of an answer none of whose suffixes is predicted: ``"zero"`` or
            ``"one_over_n"`` (OpenUnlearning's; see :func:`~hf_unlearn.eval.metrics.extraction_strength`).
        prompt_format: how questions are prompted (:class:`~hf_unlearn.data.prompts.PromptFormat`): None /
            ``"hf-unlearn"`` (the format hf_unlearn trains with), ``"open-unlearning"`` (OpenUnlearning's for the
            tokenizer's model family: system prompt, Llama-3 date string, Llama-2 ``[INST]``, ``Answer: ``), or a
            PromptFormat; ``use_chat_template`` overrides its ``chat_template``.
        attention_mask: ``"tokens"`` (every token of a sequence) or ``"not_pad"`` (``input_ids != pad``,
            OpenUnlearning's collator: a pad id inside the prompt, e.g. SmolLM2's end-of-turn, is masked), for
            scoring, gradient norms and generation.
    """
    from ..data.collators import check_attention_mask
    from ..data.tokenize import encode_qa
    from .runner import generate_texts, gradient_norms, pad_token_id, score_sequences, tokenizer_fingerprint

    attacks = M.check_mia_attacks(mia_attacks)
    if zlib_text not in ZLIB_TEXTS:
        raise UnlearnError(f"zlib_text must be one of {', '.join(ZLIB_TEXTS)}, got {zlib_text!r}")
    M.check_es_no_match(es_no_match)
    check_attention_mask(attention_mask)
    chat = resolve_prompt_format(tokenizer, use_chat_template, prompt_format)
    ref = _load_reference(reference)
    sets = tofu_sets(forget_split, tofu_path, forget_ids, retain_ids, max_items)
    meta: dict[str, Any] = {
        "benchmark": "TOFU",
        "model": getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__,
        "forget_split": forget_split,
        # what the forget set is, as the summary names it (forget_split only labels the result when ids were given)
        "forget_set": forget_split if forget_ids is None else f"{len(sets['forget'])} given forget ids",
        "forget_ids": [it["id"] for it in sets["forget"]],
        "retain_ids": [it["id"] for it in sets["retain"]],
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "chat_template": chat.chat_template,
        "prompt_format": chat.to_dict(),
        "max_new_tokens": max_new_tokens,
        "max_length": max_length,
        "mia_k": mia_k,
        "mia_attacks": list(attacks),
        "zlib_text": zlib_text,
        "variance_floor": variance_floor,
        "es_no_match": es_no_match,
        "attention_mask": attention_mask,
        "answer_scoring": "ES, EM, Min-k%, Min-k%++ and gradnorm score answers without their final EOS",
        "items": {k: len(v) for k, v in sets.items()},
        "notes": [],
    }
    if ref is not None:
        TofuResult(summary={}, meta=meta).check_comparable(ref)  # fail before spending compute

    # one flat list of teacher-forced sequences: (set, item index, kind, perturbed index)
    encodings, tags = [], []
    for name, items in sets.items():
        for i, it in enumerate(items):
            answers = [("answer", 0, it["answer"])]
            if it["perturbed_answer"] is not None and name != "holdout":
                answers.append(("paraphrased", 0, it["paraphrased_answer"]))
                answers += [("perturbed", j, a) for j, a in enumerate(it["perturbed_answer"])]
            for kind, j, text in answers:
                try:
                    encodings.append(encode_qa(tokenizer, it["question"], text, max_length, chat))
                except UnlearnError as e:
                    raise UnlearnError(f"TOFU {name} id {it['id']}: {e}") from None
                tags.append((name, i, kind, j))
    pad = pad_token_id(tokenizer)
    started = time.perf_counter()
    stats = score_sequences(model, encodings, pad_id=pad, batch_size=batch_size, desc="TOFU scoring",
                            progress=progress, variance_floor=variance_floor, attention_mask=attention_mask)

    records = {name: [dict(set=name, id=it["id"], question=it["question"], answer=it["answer"], perturbed_nlls=[])
                      for it in items] for name, items in sets.items()}
    eos = tokenizer.eos_token_id
    answers = []  # (record, encoding) of each answer, for the gradient norm
    for (name, i, kind, _j), st, enc in zip(tags, stats, encodings):
        rec = records[name][i]
        if kind == "answer":
            body = M.drop_final_eos(st, enc["labels"], eos)  # the answer without its EOS, as OpenUnlearning scores it
            rec["mean_nll"] = st.mean_nll
            rec["exact_memorization"] = M.exact_memorization(body.correct)
            rec["extraction_strength"] = M.extraction_strength(body.correct, es_no_match)
            text = rec["answer"] if zlib_text == "answer" else decoded_answer(tokenizer, enc["labels"])
            rec["mia"] = M.mia_scores(st, text, mia_k, body=body)
            if name in ("forget", "holdout"):
                answers.append((rec, {**enc, "labels": M.labels_without_final_eos(enc["labels"], eos)}))
        elif kind == "paraphrased":
            rec["paraphrased_nll"] = st.mean_nll
        else:
            rec["perturbed_nlls"].append(st.mean_nll)
    graded = time.perf_counter()
    if "gradnorm" in attacks:
        norms = gradient_norms(model, [enc for _, enc in answers], desc="TOFU gradient norms", progress=progress,
                               pad_id=pad, attention_mask=attention_mask)
        for (rec, _), norm in zip(answers, norms):
            rec["mia"]["gradnorm"] = norm

    scored = time.perf_counter()
    qa_items = [(name, i) for name in QA_SETS for i in range(len(sets[name]))]
    generations = generate_texts(
        model, tokenizer, [prompt_ids(tokenizer, sets[n][i]["question"], chat) for n, i in qa_items],
        max_new_tokens=max_new_tokens, batch_size=batch_size, desc="TOFU generation", progress=progress,
        attention_mask=attention_mask,
    )
    meta["timings"] = {"sequences_scored": len(encodings), "scoring_s": graded - started,
                       "gradnorm_s": scored - graded,
                       "prompts_generated": len(qa_items), "generation_s": time.perf_counter() - scored}
    for (name, i), text in zip(qa_items, generations):
        rec = records[name][i]
        rec["generation"] = text
        rec["rouge_l_recall"] = M.rouge_l_recall(text, rec["answer"])

    for name in QA_SETS:
        for rec in records[name]:
            has_tr = bool(rec["perturbed_nlls"])
            rec["truth_ratio"] = M.truth_ratio(rec["paraphrased_nll"], rec["perturbed_nlls"]) if has_tr else None
            if name in ("real_authors", "world_facts"):
                rec["probability"] = M.normalized_probability(rec["mean_nll"], rec["perturbed_nlls"])
            else:
                rec["probability"] = M.probability(rec["mean_nll"])

    summary = _summarize(records, meta, ref)
    per_item = [rec for name in sets for rec in records[name]]
    return TofuResult(summary=summary, per_item=per_item, meta=meta)


def _summarize(records: dict[str, list[dict]], meta: dict, ref: TofuResult | None) -> dict[str, Any]:
    s: dict[str, Any] = {}
    meta["truth_ratio_items"] = {}
    for name in QA_SETS:
        recs = records[name]
        s[f"{name}_probability"] = M.nanmean([r["probability"] for r in recs])
        s[f"{name}_rouge_l"] = M.nanmean([r["rouge_l_recall"] for r in recs])
        trs = [r["truth_ratio"] for r in recs if r["truth_ratio"] is not None]
        meta["truth_ratio_items"][name] = f"{len(trs)}/{len(recs)}"
        if len(trs) < len(recs):
            note = (f"{name}: {len(recs) - len(trs)} of {len(recs)} items have no paraphrased/perturbed answers "
                    f"(only ids 0-399 and 3600-3999 do); truth ratios use the other {len(trs)}")
            meta["notes"].append(note)
            warnings.warn(note, stacklevel=3)
        s[f"{name}_truth_ratio_symmetric"] = M.truth_ratio_forget_score(trs) if trs else None
        s[f"{name}_truth_ratio_one_minus"] = M.truth_ratio_retain_score(trs) if trs else None
        form = "symmetric" if name == "forget" else "one_minus"
        s[f"{name}_truth_ratio"] = s[f"{name}_truth_ratio_{form}"]
        if name in ("forget", "retain"):
            s[f"{name}_extraction_strength"] = M.nanmean([r["extraction_strength"] for r in recs])
            s[f"{name}_exact_memorization"] = M.nanmean([r["exact_memorization"] for r in recs])
    parts = [s[f"{n}_{m}"] for n in UTILITY_SETS for m in ("probability", "rouge_l", "truth_ratio")]
    s["model_utility"] = M.model_utility(parts) if all(p is not None for p in parts) else None
    if s["model_utility"] is None:
        meta["notes"].append("model utility is undefined: a utility set has no truth ratio")

    attacks = meta.get("mia_attacks", M.MIA_ATTACKS)
    forget, holdout = records["forget"], records["holdout"]
    for attack in M.MIA_ATTACKS:
        present = attack in attacks and all(attack in r.get("mia", {}) for r in forget + holdout)
        s[f"mia_{attack}_auc"] = (M.mia_auc([r["mia"][attack] for r in forget], [r["mia"][attack] for r in holdout])
                                  if present else None)
    model_trs = [r["truth_ratio"] for r in forget if r["truth_ratio"] is not None]
    s["forget_quality"] = None
    s["privleak"] = None
    for attack in M.MIA_ATTACKS:
        s[f"privleak_{attack}"] = None
    if ref is not None:
        ref_trs = ref.forget_truth_ratios()
        if model_trs and ref_trs:
            s["forget_quality"] = M.forget_quality(model_trs, ref_trs)
        if "reference" in attacks:
            s["mia_reference_auc"] = _reference_attack_auc(forget, holdout, ref, meta)
        for attack in M.MIA_ATTACKS:
            ref_auc = 0.5 if attack == "reference" else ref.summary.get(f"mia_{attack}_auc")
            if s[f"mia_{attack}_auc"] is not None and ref_auc is not None and ref_auc < 1.0:
                s[f"privleak_{attack}"] = M.privleak(s[f"mia_{attack}_auc"], ref_auc)
        s["privleak"] = s["privleak_min_k"]
        meta["reference"] = ref.meta.get("model")
    return s



def _reference_attack_auc(forget: list[dict], holdout: list[dict], ref: TofuResult, meta: dict) -> float | None:
    """AUC of the reference-model attack: each item's loss minus the retain-only reference's loss on the same item."""
    ref_loss = {(r["set"], r["id"]): r["mia"]["loss"] for r in ref.per_item
                if r.get("set") in ("forget", "holdout") and "loss" in r.get("mia", {})}
    missing = [(name, r["id"]) for name, recs in (("forget", forget), ("holdout", holdout)) for r in recs
               if (name, r["id"]) not in ref_loss]
    if missing:
        meta["notes"].append(f"reference attack skipped: the reference result has no loss for {len(missing)} of the "
                             f"forget/holdout items (first: {missing[0]}); evaluate it with the same max_items")
        return None
    return M.mia_auc([M.reference_attack_score(r["mia"]["loss"], ref_loss[("forget", r["id"])]) for r in forget],
                     [M.reference_attack_score(r["mia"]["loss"], ref_loss[("holdout", r["id"])]) for r in holdout])
