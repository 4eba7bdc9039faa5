"""Robustness of unlearning as one evaluation: does the forgotten knowledge come back?

Four attacks on the unlearned model, each also run on an optional reference (a retain-only model, or the exact
deletion of the same rows) so that a number is read against what a model that never learned the rows does:

* **relearning** (Lynch et al., 2024; Hu et al., 2025): fine-tune a *copy* for ``k`` steps (default 0, 10, 25, 50)
  on one half of the forget rows (a seeded split, or the rows you name) and measure the answer probability of the
  other half. The **recovery fraction** at ``k`` is ``(p_k - p_0) / (p_before - p_0)``: the share of what unlearning
  removed that ``k`` steps on *other* rows bring back (``p_before``: the model before unlearning, ``original=``; for
  the reference, its own ``p_0``). A model that only hid the knowledge recovers it from related rows; one that never
  had it (exact deletion) can only learn what the relearned rows teach.
* **quantisation** (Zhang et al., 2024): the same metrics on bitsandbytes 4-bit and 8-bit copies
  (:func:`hf_unlearn.eval.quantized.quantize_model`, its CPU backend included).
* **paraphrased questions**: TOFU's ``paraphrased_question`` instead of the question (forgetting that holds only for
  the trained wording is shallow).
* **linear probe**: per layer, a cross-validated logistic-regression probe on the mean hidden state of the forget
  answers against holdout answers (:func:`hf_unlearn.eval.probes.probe_by_layer`): above the reference's accuracy
  means the forget rows are still recognisable in the representations; and a **truth probe**: fitted on the hidden
  states of true vs perturbed answers of rows every model kept (``probe_rows``), scored on the forget rows' true vs
  perturbed answers (TOFU's ``perturbed_answer``): above the reference means the forgotten answers are still told
  apart from false ones inside the model.

The evaluated models are never modified (relearning and quantisation work on copies, scoring runs in eval mode and
restores the training flag), and the result is a function of the models, the rows and ``seed``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import UnlearnError
from ..utils import independent_generator
from . import metrics as M
from .probes import majority_baseline, probe_by_layer, transfer_accuracy
from .result import EvalResult, fmt

DEFAULT_STEPS = (0, 10, 25, 50)
RECOVERY_MIN_REMOVED = 0.01  # answer probability unlearning must remove for a recovery fraction to be reported
RELEARN_SOURCES = ("half", "paraphrased")
IN_CONTEXT_ROWS = 4
TOFU_QUESTIONS_PER_AUTHOR = 20
DEFAULT_BITS = (4, 8)
ATTACKS = ("relearning", "in_context", "quantization", "paraphrase", "probe")


def recovery_fraction(after_relearning: float, after_unlearning: float, before: float | None,
                      min_removed: float = RECOVERY_MIN_REMOVED) -> float | None:
    """``(after relearning - after unlearning) / (before - after unlearning)``; None without a ``before`` value or
    when unlearning moved the metric by less than ``min_removed`` (the denominator): a fraction of almost nothing
    is unbounded noise (0.98, 0.99999, 1.0 would give -1999)."""
    return recovery(after_relearning, after_unlearning, before, min_removed)["recovery"]


def recovery(after_relearning: float | None, after_unlearning: float | None, before: float | None,
             min_removed: float = RECOVERY_MIN_REMOVED) -> dict[str, Any]:
    """``{"recovery", "removed", "recovery_note"}``: the recovery fraction with its denominator ``removed`` (what
    unlearning took away, ``before - after unlearning``), and why the fraction is None when it is."""
    if before is None or after_relearning is None or after_unlearning is None:
        return {"recovery": None, "removed": None, "recovery_note": "no model before unlearning (original=)"}
    removed = float(before - after_unlearning)
    if not removed >= min_removed:
        return {"recovery": None, "removed": removed,
                "recovery_note": f"unlearning removed {removed:.2g} < {min_removed:g}"}
    return {"recovery": float((after_relearning - after_unlearning) / removed), "removed": removed,
            "recovery_note": None}


def split_relearn_rows(rows: Sequence[dict], relearn_ids: Iterable | None = None,
                       seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``(relearned rows, evaluated rows)``: the rows with ``relearn_ids``, or a seeded half (the larger half
    evaluated). Both sides must be non-empty."""
    rows = list(rows)
    if len(rows) < 2:
        raise UnlearnError(f"the relearning attack needs at least 2 forget rows (one to relearn, one to measure), "
                           f"got {len(rows)}")
    if relearn_ids is not None:
        wanted = {str(i) for i in relearn_ids}
        unknown = wanted - {str(r["id"]) for r in rows}
        if unknown:
            raise UnlearnError(f"relearn ids {sorted(unknown)[:5]} are not forget rows; name rows of the forget set")
        relearn = [r for r in rows if str(r["id"]) in wanted]
    else:
        import torch

        perm = torch.randperm(len(rows), generator=independent_generator(seed, "relearn-split")).tolist()
        relearn = [rows[i] for i in sorted(perm[: len(rows) // 2])]
    chosen = {id(r) for r in relearn}
    evaluated = [r for r in rows if id(r) not in chosen]
    if not relearn or not evaluated:
        raise UnlearnError("the relearn rows must leave at least one forget row to measure; name fewer rows")
    return relearn, evaluated


def related_relearn_rows(rows: Sequence[dict], relearn_rows=None, relearn_ids: Iterable | None = None,
                         seed: int = 0) -> tuple[str, list[dict], list[dict]]:
    """``(relearn_on, relearned rows, measured rows)`` for :func:`evaluate_robustness`'s ``relearn_rows``: None = a
    seeded half of ``rows`` (:func:`split_relearn_rows`); ``"paraphrased"`` = every row's paraphrased question and
    answer, all rows measured; rows = those rows, all forget rows measured (rows sharing an id with a forget row are
    refused: that is the forget data itself)."""
    if relearn_rows is None:
        relearn, evaluated = split_relearn_rows(rows, relearn_ids, seed)
        return "half", relearn, evaluated
    if relearn_ids is not None:
        raise UnlearnError("relearn_ids picks forget rows to relearn on; it does not go with relearn_rows")
    if isinstance(relearn_rows, str):
        if relearn_rows != "paraphrased":
            raise UnlearnError(f"relearn_rows must be None, 'paraphrased' or rows, got {relearn_rows!r}")
        usable = [r for r in rows if r.get("paraphrased_question") and r.get("paraphrased_answer")]
        if not usable:
            raise UnlearnError("relearn_rows='paraphrased' needs paraphrased_question and paraphrased_answer on the "
                               "forget rows (TOFU has them for ids 0-399 and 3600-3999)")
        return "paraphrased", [{**r, "question": r["paraphrased_question"], "answer": r["paraphrased_answer"]}
                               for r in usable], list(rows)
    related = _rows(relearn_rows)
    overlap = {str(r["id"]) for r in related} & {str(r["id"]) for r in rows}
    if overlap:
        raise UnlearnError(f"relearn_rows share ids with the forget rows ({sorted(overlap)[:5]}); relearning on "
                           "related data means rows that are not forgotten")
    if not related:
        raise UnlearnError("relearn_rows is empty; pass related rows to relearn on")
    return "given rows", related, list(rows)


def in_context_choice(rows: Sequence[dict], n: int, seed: int = 0) -> list[dict]:
    """The ``n`` of ``rows`` the in-context attack shows (a seeded choice, in row order)."""
    import torch

    order = torch.randperm(len(rows), generator=independent_generator(seed, "in-context")).tolist()[:n]
    return [rows[i] for i in sorted(order)]


def in_context_prefix(rows: Sequence[dict], n: int, seed: int = 0, lead: str = "Question: ") -> str:
    """The in-context attack's prefix to a measured question: the :func:`in_context_choice` of ``rows`` as
    ``Question: q\\nAnswer: a`` blocks separated by a blank line, ending in ``Question: `` (the measured question
    follows). ``lead``: what the prompt format already puts before the question (a plain prompt's ``Question: ``) is
    not repeated."""
    blocks = [f"{r['question']}\nAnswer: {r['answer']}\n\nQuestion: " for r in in_context_choice(rows, n, seed)]
    return ("" if lead == "Question: " else "Question: ") + "".join(blocks)


def own_answer_shown(measured: Sequence[dict], shown: Sequence[dict]) -> list:
    """Ids of the ``measured`` rows whose own answer is in the in-context prompt: a shown row with the same id (with
    ``relearn_rows="paraphrased"`` the shown rows are the measured rows' own paraphrases) or the same answer text.
    Measured, they would score the model copying its answer from the prompt, not recalling it."""
    def norm(text) -> str:
        return " ".join(str(text).split()).casefold()

    ids, answers = {str(r["id"]) for r in shown}, {norm(r["answer"]) for r in shown}
    return [r["id"] for r in measured if str(r["id"]) in ids or norm(r["answer"]) in answers]


# ---------------------------------------------------------------------------------------------------------------
# measurements


def _encode(tokenizer, rows, chat: bool, max_length: int, question_key: str = "question") -> list[dict]:
    from ..data.tokenize import encode_qa

    out = []
    for r in rows:
        try:
            out.append(encode_qa(tokenizer, r[question_key], r["answer"], max_length, chat))
        except UnlearnError as e:
            raise UnlearnError(f"forget row {r['id']}: {e}") from None
    return out


def answer_metrics(model, tokenizer, encodings: Sequence[dict], *, batch_size: int = 16,
                   es_no_match: str = "zero", attention_mask: str = "tokens") -> dict[str, float]:
    """Mean answer probability (``exp(-mean NLL)``), exact memorisation and extraction strength (answers without their
    final EOS for the last two, as :func:`~hf_unlearn.eval.tofu.evaluate_tofu` scores them)."""
    from .runner import pad_token_id, score_sequences

    stats = score_sequences(model, encodings, pad_id=pad_token_id(tokenizer), batch_size=batch_size, progress=False,
                            attention_mask=attention_mask)
    eos = tokenizer.eos_token_id
    bodies = [M.drop_final_eos(st, enc["labels"], eos) for st, enc in zip(stats, encodings)]
    return {"probability": M.nanmean([M.probability(st.mean_nll) for st in stats]),
            "exact_memorization": M.nanmean([M.exact_memorization(b.correct) for b in bodies]),
            "extraction_strength": M.nanmean([M.extraction_strength(b.correct, es_no_match) for b in bodies])}


def _check_relearning(steps, learning_rate: float, batch_size: int) -> list[int]:
    steps = sorted({int(k) for k in steps})
    if not steps or steps[0] < 0:
        raise UnlearnError(f"relearning steps must be >= 0, got {steps}")
    if learning_rate <= 0 or batch_size < 1:
        raise UnlearnError("the relearning learning rate must be > 0 and its batch size >= 1")
    return steps


def relearning_curve(model, tokenizer, relearn: Sequence[dict], evaluated: Sequence[dict], *,
                     steps: Sequence[int] = DEFAULT_STEPS, learning_rate: float = 1e-5, batch_size: int = 4,
                     seed: int = 0, batch_size_eval: int = 16, progress: bool = True,
                     desc: str = "relearning", es_no_match: str = "zero",
                     attention_mask: str = "tokens") -> list[dict[str, float]]:
    """Answer metrics of ``evaluated`` after ``k`` AdamW steps on ``relearn`` (tokenised encodings), for each ``k``.

    The steps train a deep copy of ``model`` (``model`` itself is untouched), one run up to ``max(steps)`` with the
    metrics taken on the way, on batches of a seeded order that cycles through ``relearn``; the global torch RNG is
    seeded inside a fork, so dropout is reproducible and the caller's RNG state is left as it was. A plain loop
    instead of a ``Trainer``: it measures between steps and writes no files.
    """
    import torch
    from tqdm.auto import tqdm

    from ..data.collators import QACollator

    steps = _check_relearning(steps, learning_rate, batch_size)
    from .runner import pad_token_id

    collate = QACollator(pad_token_id=pad_token_id(tokenizer), attention_mask=attention_mask)
    attacked = copy.deepcopy(model)
    device = next(attacked.parameters()).device
    params = [p for p in attacked.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    gen = independent_generator(seed, "relearn-order")
    order: list[int] = []
    curve = []
    # the attack fine-tunes whatever the caller's grad mode (an evaluation script may have turned it off)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.enable_grad():
        torch.manual_seed(seed)
        bar = tqdm(total=steps[-1], desc=desc, disable=not progress, leave=False)
        for k in range(steps[-1] + 1):
            if k in steps:
                curve.append({"step": k, **answer_metrics(attacked, tokenizer, evaluated, batch_size=batch_size_eval,
                                                          es_no_match=es_no_match, attention_mask=attention_mask)})
            if k == steps[-1]:
                break
            picked = []
            while len(picked) < min(batch_size, len(relearn)):
                if not order:
                    order = torch.randperm(len(relearn), generator=gen).tolist()
                picked.append(order.pop(0))
            batch = collate([{key: relearn[i][key] for key in ("input_ids", "attention_mask", "labels")}
                             for i in picked])
            attacked.train()
            loss = attacked(**{key: v.to(device) for key, v in batch.items()}).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            bar.update(1)
        bar.close()
    del attacked, optimizer
    return curve


def answer_hidden_states(model, encodings: Sequence[dict], pad_id: int, batch_size: int = 16,
                         attention_mask: str = "tokens"):
    """``[layers + 1, rows, hidden]``: per layer (0 = embeddings), the mean hidden state over each row's answer tokens."""
    import numpy as np
    import torch

    from ..data.collators import attention_mask as batch_mask

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    rows = []
    try:
        with torch.inference_mode():
            for start in range(0, len(encodings), batch_size):
                chunk = encodings[start:start + batch_size]
                length = max(len(e["input_ids"]) for e in chunk)
                ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
                mask = torch.zeros((len(chunk), length), dtype=torch.long)
                answer = torch.zeros((len(chunk), length), dtype=torch.bool)
                for i, e in enumerate(chunk):
                    n = len(e["input_ids"])
                    ids[i, :n] = torch.tensor(e["input_ids"])
                    mask[i, :n] = 1
                    answer[i, :n] = torch.tensor(e["labels"]) != M.IGNORE_INDEX
                mask = batch_mask(ids, mask, pad_id, attention_mask)
                out = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
                weights = answer.to(device).float().unsqueeze(-1)
                layers = [(h.float() * weights).sum(1) / weights.sum(1).clamp(min=1) for h in out.hidden_states]
                rows.append(torch.stack(layers).cpu().numpy())
    finally:
        model.train(was_training)
    return np.concatenate(rows, axis=1)


def probe_scores(model, forget_enc, holdout_enc, pad_id: int, seed: int = 0,
                 attention_mask: str = "tokens") -> dict[str, Any]:
    """Per-layer cross-validated probe accuracy separating forget from holdout answers, its maximum, and chance."""
    states = answer_hidden_states(model, list(forget_enc) + list(holdout_enc), pad_id, attention_mask=attention_mask)
    labels = [1] * len(forget_enc) + [0] * len(holdout_enc)
    by_layer = probe_by_layer(states, labels, seed=seed)
    return {"by_layer": by_layer, "max": max(by_layer), "chance": majority_baseline(labels)}


def truth_probe_scores(model, train: tuple[Sequence[dict], Sequence[dict]], test: tuple[Sequence[dict], Sequence[dict]],
                       pad_id: int, attention_mask: str = "tokens") -> dict[str, Any]:
    """Per layer, a probe fitted on the mean answer hidden states of true vs perturbed answers of ``train`` (rows the
    models kept) and scored on ``test`` (the forget rows): can the hidden states still tell a forgotten answer from a
    false one? ``train``/``test``: (true-answer encodings, perturbed-answer encodings)."""
    n_train, n_test = len(train[0]) + len(train[1]), len(test[0]) + len(test[1])
    states = answer_hidden_states(model, [*train[0], *train[1], *test[0], *test[1]], pad_id,
                                  attention_mask=attention_mask)
    y_train = [1] * len(train[0]) + [0] * len(train[1])
    y_test = [1] * len(test[0]) + [0] * len(test[1])
    by_layer = [transfer_accuracy(layer[:n_train], y_train, layer[n_train:n_train + n_test], y_test)
                for layer in states]
    return {"by_layer": by_layer, "max": max(by_layer), "chance": 0.5}


# ---------------------------------------------------------------------------------------------------------------
# the evaluation


class RobustnessResult(EvalResult):
    """``summary``: ``{"steps", "models": {name: {...}}}``; per model ``relearning`` (one dict per step: probability,
    exact memorisation, extraction strength, ``recovery``), ``quantization`` (``{bits: metrics + recovery}``),
    ``paraphrase`` (metrics on the paraphrased questions and on the originals), ``probe`` and ``truth_probe``
    (per-layer accuracy, max, chance) and ``forget`` (the metrics on every forget row, the baseline of quantisation). Names: ``model``,
    ``original`` (before unlearning: the recovery baseline) and the reference's name."""

    kind = "robustness"

    def curves(self) -> dict[str, list[float | None]]:
        """Recovery fraction per relearning step for each attacked model (None where undefined)."""
        return {name: [p.get("recovery") for p in m["relearning"]] for name, m in self.summary["models"].items()
                if m.get("relearning") and name != "original"}

    def to_markdown(self) -> str:
        models = self.summary["models"]
        names = list(models)
        lines = [f"## Robustness ({self.meta.get('model', 'model')}; forget probability, in brackets the recovery "
                 f"fraction of what unlearning removed)", "", "| attack | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

        def cell(m: dict | None) -> str:
            if not m:
                return "n/a"
            rec, note = m.get("recovery"), m.get("recovery_note")
            if rec is not None:
                return f"{fmt(m.get('probability'))} ({fmt(rec, 3)} of {fmt(m.get('removed'), 3)})"
            if note and m.get("removed") is not None:
                return f"{fmt(m.get('probability'))} (not computed: {note})"
            return fmt(m.get("probability"))

        lines.append("| no attack (all forget rows) | " + " | ".join(cell(models[n].get("forget")) for n in names) + " |")
        for i, k in enumerate(self.summary.get("steps", [])):
            row = [cell(models[n]["evaluated_half"] if n == "original" else
                        (models[n].get("relearning") or [None] * (i + 1))[i]) for n in names]
            what = {"half": "held-out half", "paraphrased": "on paraphrases; all forget rows",
                    "given rows": "on the given rows; all forget rows"}[self.meta.get("relearn_on", "half")]
            lines.append(f"| relearning, {k} steps ({what}) | " + " | ".join(row) + " |")
        if any(models[n].get("in_context") for n in names):
            row = [cell(models[n].get("in_context")) for n in names]
            shown = {"half": "forget", "paraphrased": "paraphrased forget",
                     "given rows": "given"}[self.meta.get("relearn_on", "half")]
            left_out = len(self.meta.get("in_context_excluded_ids") or [])
            lines.append(f"| in-context, {self.meta.get('in_context_rows')} {shown} QA pairs in the prompt"
                         + (f" ({left_out} rows whose own answer is shown not measured)" if left_out else "")
                         + " | " + " | ".join(row) + " |")
        for bits in self.meta.get("bits", []):
            row = [cell((models[n].get("quantization") or {}).get(str(bits))) for n in names]
            lines.append(f"| {bits}-bit quantisation | " + " | ".join(row) + " |")
        if any(models[n].get("paraphrase") for n in names):
            lines.append("| paraphrased questions | " + " | ".join(cell(models[n].get("paraphrase")) for n in names) + " |")
        if any(models[n].get("probe") for n in names):
            row = [fmt((models[n].get("probe") or {}).get("max")) for n in names]
            lines.append("| linear probe, best layer accuracy (forget vs holdout) | " + " | ".join(row) + " |")
        if any(models[n].get("truth_probe") for n in names):
            row = [fmt((models[n].get("truth_probe") or {}).get("max")) for n in names]
            lines.append("| truth probe, best layer accuracy (forget answers vs perturbed) | " + " | ".join(row) + " |")
        notes = self.meta.get("notes") or []
        if notes:
            lines += [""] + [f"- {n}" for n in notes]
        return "\n".join(lines) + "\n"


def _truth_pairs(tokenizer, rows, chat: bool, max_length: int) -> tuple[list[dict], list[dict]]:
    """(true-answer, first perturbed-answer) encodings of the rows that have a ``perturbed_answer``."""
    rows = [r for r in rows if r.get("perturbed_answer")]
    false = [{**r, "answer": r["perturbed_answer"][0]} for r in rows]
    return _encode(tokenizer, rows, chat, max_length), _encode(tokenizer, false, chat, max_length)


def _rows(rows) -> list[dict]:
    if rows is None:
        return []
    if hasattr(rows, "to_list"):
        rows = rows.to_list()
    rows = [dict(r) for r in rows]
    for r in rows:
        missing = [k for k in ("id", "question", "answer") if k not in r]
        if missing:
            raise UnlearnError(f"robustness rows need id, question and answer; a row lacks {', '.join(missing)}")
    return rows


def evaluate_robustness(
    model,
    tokenizer,
    forget_rows,
    *,
    original=None,
    reference=None,
    reference_name: str = "reference",
    holdout_rows=None,
    probe_rows=None,
    relearn_ids: Iterable | None = None,
    steps: Sequence[int] = DEFAULT_STEPS,
    learning_rate: float = 1e-5,
    relearn_batch_size: int = 4,
    bits: Sequence[int] = DEFAULT_BITS,
    attacks: Iterable[str] = ATTACKS,
    seed: int = 0,
    use_chat_template: bool | None = None,
    max_length: int = 512,
    batch_size: int = 16,
    relearn_rows=None,
    in_context_rows: int = IN_CONTEXT_ROWS,
    recovery_min_removed: float = RECOVERY_MIN_REMOVED,
    es_no_match: str = "zero",
    prompt_format=None,
    attention_mask: str = "tokens",
    progress: bool = True,
) -> RobustnessResult:
    """Run the relearning, quantisation, paraphrase and probe attacks on ``model`` (and ``reference``).

    Args:
        forget_rows: the forgotten rows (dicts or a ``datasets.Dataset`` with ``id``, ``question``, ``answer`` and,
            for the paraphrase attack, ``paraphrased_question``; :func:`tofu_robustness_rows` builds them for TOFU).
        original: the model before unlearning (the recovery baseline ``p_before``); without it recovery is None.
        reference: a retain-only model or the exact deletion of the same rows, attacked the same way.
        holdout_rows: rows none of the models trained on, for the membership probe (same keys); without them none.
        probe_rows: rows every model trained on and kept (retain rows) with ``perturbed_answer``, for the truth
            probe (fitted on them, scored on the forget rows that have a ``perturbed_answer``); without them none.
        relearn_ids: the forget rows to relearn on (default: a seeded half); the others are measured.
        steps: relearning steps at which to measure (0 = before relearning).
        bits: quantisation widths (4 = NF4, 8 = LLM.int8) to re-evaluate; needs bitsandbytes.
        attacks: a subset of :data:`ATTACKS`.
        relearn_rows: what the relearning attack trains on: None (a seeded half of the forget rows, or
            ``relearn_ids``; the other half is measured), ``"paraphrased"`` (every forget row's
            ``paraphrased_question`` and ``paraphrased_answer``: the same facts in other words; every forget row is
            measured) or rows of related but different data (e.g. ``tofu_robustness_rows(...)["kept_same_authors"]``,
            the forgotten authors' other questions, which the model was trained on and kept; every forget row is
            measured).
        in_context_rows: the ``in_context`` attack puts this many relearn rows (question and answer) in the prompt
            before each measured question: the forget facts given to the model instead of trained into it.
        recovery_min_removed: below this change of the answer probability by unlearning (``before - after``), the
            recovery fraction is not computed (None, with the reason in ``recovery_note``).
        es_no_match, prompt_format, attention_mask: as for :func:`~hf_unlearn.eval.tofu.evaluate_tofu` (the mask
            also for the relearning steps and the probes' hidden states).
    """
    from ..data.collators import check_attention_mask
    from .tofu import resolve_prompt_format

    attacks = tuple(attacks)
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise UnlearnError(f"unknown robustness attack {unknown[0]!r}; choose from {', '.join(ATTACKS)}")
    bits = [int(b) for b in bits] if "quantization" in attacks else []
    if any(b not in (4, 8) for b in bits):
        raise UnlearnError(f"quantisation bits must be 4 or 8, got {bits}")
    if "relearning" in attacks:
        _check_relearning(steps, learning_rate, relearn_batch_size)
    M.check_es_no_match(es_no_match)
    check_attention_mask(attention_mask)
    if in_context_rows < 1:
        raise UnlearnError(f"in_context_rows must be >= 1, got {in_context_rows}")
    chat = resolve_prompt_format(tokenizer, use_chat_template, prompt_format)
    rows, holdout = _rows(forget_rows), _rows(holdout_rows)
    relearn_on, relearned, evaluated_rows = related_relearn_rows(rows, relearn_rows, relearn_ids, seed)
    notes: list[str] = []
    if bits:
        from .quantized import _bnb

        _bnb()  # a clear error before any model pass
    if "probe" in attacks and not holdout:
        notes.append("no holdout rows: the probe attack was skipped")
    para_rows = [r for r in rows if r.get("paraphrased_question")]
    if "paraphrase" in attacks and len(para_rows) < len(rows):
        notes.append(f"{len(rows) - len(para_rows)} of {len(rows)} forget rows have no paraphrased_question; the "
                     f"paraphrase attack uses the other {len(para_rows)}")

    enc_all = _encode(tokenizer, rows, chat, max_length)
    enc_relearn = _encode(tokenizer, relearned, chat, max_length)
    enc_eval = _encode(tokenizer, evaluated_rows, chat, max_length)
    context = in_context_prefix(relearned, in_context_rows, seed, "" if chat.chat_template else chat.user_start)
    shown = in_context_choice(relearned, in_context_rows, seed)
    excluded = own_answer_shown(evaluated_rows, shown) if "in_context" in attacks else []
    icl_rows = [r for r in evaluated_rows if r["id"] not in set(excluded)]
    if excluded:
        notes.append(f"in-context: {len(excluded)} measured rows whose own answer is in the prompt are not measured "
                     f"(ids {', '.join(map(str, excluded[:8]))}{', ...' if len(excluded) > 8 else ''})"
                     + ("; no row is left: the attack was skipped" if not icl_rows else ""))
        if not icl_rows:
            attacks = tuple(a for a in attacks if a != "in_context")
    enc_icl = (_encode(tokenizer, [{**r, "question": context + r["question"]} for r in icl_rows], chat,
                       max_length + len(tokenizer(context, add_special_tokens=False)["input_ids"]))
               if "in_context" in attacks else [])
    enc_icl_plain = _encode(tokenizer, icl_rows, chat, max_length) if excluded and icl_rows else enc_eval
    enc_para = _encode(tokenizer, para_rows, chat, max_length, "paraphrased_question") if para_rows else []
    enc_para_orig = _encode(tokenizer, para_rows, chat, max_length) if para_rows else []
    enc_hold = _encode(tokenizer, holdout, chat, max_length) if holdout else []
    truth_train = _truth_pairs(tokenizer, _rows(probe_rows), chat, max_length)
    truth_test = _truth_pairs(tokenizer, rows, chat, max_length)
    use_truth = "probe" in attacks and bool(truth_train[0]) and bool(truth_test[0])
    if "probe" in attacks and probe_rows is not None and not use_truth:
        notes.append("the truth probe needs perturbed_answer on probe rows and forget rows; skipped")
    from .runner import pad_token_id

    pad = pad_token_id(tokenizer)

    models: dict[str, Any] = {"model": model}
    if reference is not None:
        if reference_name in ("model", "original"):
            raise UnlearnError("reference_name must not be 'model' or 'original'")
        models[reference_name] = reference
    out: dict[str, dict[str, Any]] = {}
    if original is not None:
        def base(encodings):
            return answer_metrics(original, tokenizer, encodings, batch_size=batch_size, es_no_match=es_no_match,
                                  attention_mask=attention_mask)

        out["original"] = {"forget": base(enc_all), "evaluated_half": base(enc_eval)}
        if enc_icl_plain is not enc_eval:  # the in-context attack measures fewer rows: its own baseline
            out["original"]["in_context_measured"] = base(enc_icl_plain)
        if enc_para:
            out["original"]["paraphrase"] = base(enc_para)
    before_all = out.get("original", {}).get("forget", {}).get("probability")
    before_half = out.get("original", {}).get("evaluated_half", {}).get("probability")
    before_icl = out.get("original", {}).get("in_context_measured", {}).get("probability", before_half)

    def metrics_of(m, encodings):
        return answer_metrics(m, tokenizer, encodings, batch_size=batch_size, es_no_match=es_no_match,
                              attention_mask=attention_mask)

    def recovered(value, after_unlearning, before):
        return recovery(value, after_unlearning, before, recovery_min_removed)

    for name, m in models.items():
        res: dict[str, Any] = {"forget": metrics_of(m, enc_all)}
        p0 = res["forget"]["probability"]
        if "relearning" in attacks:
            curve = relearning_curve(m, tokenizer, enc_relearn, enc_eval, steps=steps, learning_rate=learning_rate,
                                     batch_size=relearn_batch_size, seed=seed, batch_size_eval=batch_size,
                                     progress=progress, desc=f"relearning {name}", es_no_match=es_no_match,
                                     attention_mask=attention_mask)
            for point in curve:
                point.update(recovered(point["probability"], curve[0]["probability"], before_half))
            res["relearning"] = curve
        if "in_context" in attacks:
            icl = metrics_of(m, enc_icl)
            icl["without_context_probability"] = metrics_of(m, enc_icl_plain)["probability"]
            icl.update(recovered(icl["probability"], icl["without_context_probability"], before_icl))
            res["in_context"] = icl
        if bits:
            from .quantized import quantize_model, quiet_int8

            res["quantization"] = {}
            for b in bits:
                q = quantize_model(m, b)
                with quiet_int8():
                    metrics = metrics_of(q, enc_all)
                metrics.update(recovered(metrics["probability"], p0, before_all))
                res["quantization"][str(b)] = metrics
                del q
        if "paraphrase" in attacks and enc_para:
            para = metrics_of(m, enc_para)
            para["original_question_probability"] = metrics_of(m, enc_para_orig)["probability"]
            res["paraphrase"] = para
        if "probe" in attacks and enc_hold:
            res["probe"] = probe_scores(m, enc_all, enc_hold, pad, seed=seed, attention_mask=attention_mask)
        if use_truth:
            res["truth_probe"] = truth_probe_scores(m, truth_train, truth_test, pad, attention_mask=attention_mask)
        out[name] = res
    if "probe" in attacks and enc_hold and original is not None:
        out["original"]["probe"] = probe_scores(original, enc_all, enc_hold, pad, seed=seed,
                                                attention_mask=attention_mask)
    if use_truth and original is not None:
        out["original"]["truth_probe"] = truth_probe_scores(original, truth_train, truth_test, pad,
                                                            attention_mask=attention_mask)

    summary = {"steps": sorted({int(k) for k in steps}) if "relearning" in attacks else [], "models": out}
    meta = {
        "model": getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__,
        "reference_name": reference_name if reference is not None else None,
        "forget_ids": [r["id"] for r in rows], "relearn_ids": [r["id"] for r in relearned], "relearn_on": relearn_on,
        "in_context_rows": min(in_context_rows, len(relearned)), "recovery_min_removed": recovery_min_removed,
        "in_context_shown_ids": [r["id"] for r in shown], "in_context_excluded_ids": excluded,
        "es_no_match": es_no_match, "prompt_format": chat.to_dict(), "attention_mask": attention_mask,
        "evaluated_ids": [r["id"] for r in evaluated_rows], "holdout_ids": [r["id"] for r in holdout],
        "attacks": list(attacks), "bits": bits, "seed": seed, "learning_rate": learning_rate,
        "relearn_batch_size": relearn_batch_size, "max_length": max_length, "chat_template": chat.chat_template,
        "recovery": "(after relearning - after unlearning) / (before - after unlearning), on the measured rows; "
                    "'before' is the original model",
        "notes": notes,
    }
    return RobustnessResult(summary=summary, per_item=[], meta=meta)


def tofu_robustness_rows(forget_split: str = "forget10", tofu_path: str | os.PathLike | None = None,
                         forget_ids: Iterable[int] | None = None, retain_ids: Iterable[int] | None = None,
                         max_items: int | Mapping[str, int] | None = None) -> dict[str, list[dict]]:
    """``{"forget", "holdout", "retain", "kept_same_authors"}`` rows of TOFU for :func:`evaluate_robustness`
    (``forget_rows``, ``holdout_rows``, ``probe_rows``, ``relearn_rows``), with ``paraphrased_question``,
    ``paraphrased_answer`` and ``perturbed_answer`` where TOFU has them (ids 0-399 and 3600-3999). ``retain``:
    ``retain_ids``, else ``retain_perturbed`` minus the forget ids. ``kept_same_authors``: the questions of the
    forgotten rows' authors (TOFU's 20 consecutive ids per author) that are not forgotten: rows the model was trained
    on and kept, not outside data (empty when every question of those authors is forgotten)."""
    from ..data.tofu import load_tofu
    from .tofu import tofu_sets

    sets = tofu_sets(forget_split, tofu_path, forget_ids=forget_ids, retain_ids=retain_ids, max_items=max_items)
    forgotten = {int(r["id"]) for r in sets["forget"]}
    authors = {i // TOFU_QUESTIONS_PER_AUTHOR for i in forgotten}
    same = [{"id": int(r["id"]), "question": r["question"], "answer": r["answer"]}
            for r in load_tofu("full", tofu_path).to_list()
            if int(r["id"]) // TOFU_QUESTIONS_PER_AUTHOR in authors and int(r["id"]) not in forgotten]
    return {"forget": sets["forget"], "holdout": sets["holdout"], "retain": sets["retain"], "kept_same_authors": same}
