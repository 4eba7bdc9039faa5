"""Unlearning metrics as pure functions of numbers, strings and tensors (no model, no data loading).

Definitions follow the TOFU paper (Maini et al., 2024), MUSE (Shi et al., 2024) and the evaluation code the community
uses for them:

* probability: ``exp(-mean per-token NLL)`` of the answer; on real_authors/world_facts the per-token-normalised
  probability of the true answer divided by the sum over the true and the perturbed answers;
* ROUGE-L recall (TOFU) / F1 (MUSE) via ``rouge_score``;
* truth ratio ``TR = geomean_i P(perturbed_i)^(1/|a_i|) / P(paraphrased)^(1/|a|)``, reported as
  ``mean(min(TR, 1/TR))`` on the forget set and ``mean(max(0, 1 - TR))`` on the others;
* forget quality: the two-sample Kolmogorov-Smirnov p-value between the model's and a retain-only reference
  model's per-item forget truth ratios;
* model utility: harmonic mean of the nine retain / real-authors / world-facts values;
* extraction strength and exact memorisation from teacher-forced argmax predictions;
* membership inference (LOSS, zlib, Min-k%, Min-k%++, gradient norm, reference model) AUC and privleak.

As in OpenUnlearning, extraction strength, exact memorisation, Min-k%, Min-k%++ and the gradient norm score an answer
without its final EOS token (:func:`drop_final_eos`); probability, LOSS, zlib and the reference attack keep it.

Membership scores here are *non-membership* scores, like a loss: higher means "looks unseen". ``mia_auc`` is the
probability that a held-out (unseen) item scores higher than a forget item: 1.0 means the forget set is perfectly
recognisable as training data, 0.5 means indistinguishable from unseen data.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ..errors import UnlearnError

IGNORE_INDEX = -100
VARIANCE_FLOOR = 1e-12  # Min-k%++; OpenUnlearning floors at 1e-6 (hf_unlearn.presets.CONVENTIONS says why not here)


# ----------------------------------------------------------------------------------------------------------------
# per-token statistics from a forward pass


@dataclass
class TokenStats:
    """Per answer-token statistics of one sequence (positions whose label is not ``-100``)."""

    logprobs: np.ndarray  # log p(x_t | x_<t)
    correct: np.ndarray  # teacher-forced argmax == x_t
    zscores: np.ndarray  # Min-k%++ standardised log-probabilities

    @property
    def mean_nll(self) -> float:
        return float(-self.logprobs.mean()) if self.logprobs.size else float("nan")

    def without_last(self) -> TokenStats:
        return TokenStats(self.logprobs[:-1], self.correct[:-1], self.zscores[:-1])


def token_statistics(logits, labels, ignore_index: int = IGNORE_INDEX,
                     variance_floor: float = VARIANCE_FLOOR) -> list[TokenStats]:
    """Per-sequence :class:`TokenStats` from causal-LM ``logits [B, T, V]`` and ``labels [B, T]`` (unshifted).

    Works on any padding side: only label positions count. Min-k%++ uses ``(log p(x_t) - mu_t) / sigma_t`` with the
    mean and standard deviation of ``log p(.)`` under the model's own next-token distribution (Zhang et al., 2024);
    the variance is floored at ``variance_floor`` (OpenUnlearning: 1e-6).
    """
    if not variance_floor > 0:
        raise UnlearnError(f"variance_floor must be > 0, got {variance_floor}")
    import torch

    logits = logits[:, :-1].float()
    targets = labels[:, 1:]
    mask = targets != ignore_index
    safe = targets.masked_fill(~mask, 0)
    logp = torch.log_softmax(logits, dim=-1)
    tok = logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    correct = logits.argmax(-1) == safe
    p = logp.exp()
    mu = (p * logp).sum(-1)
    var = ((p * logp.square()).sum(-1) - mu.square()).clamp_min(variance_floor)
    z = (tok - mu) / var.sqrt()
    out = []
    for i in range(labels.shape[0]):
        m = mask[i]
        out.append(
            TokenStats(
                logprobs=tok[i][m].double().cpu().numpy(),
                correct=correct[i][m].cpu().numpy(),
                zscores=z[i][m].double().cpu().numpy(),
            )
        )
    return out


def final_eos_index(labels: Sequence[int], eos_token_id: int | None) -> int | None:
    """Position in ``labels`` of the final EOS an answer is scored without, or None (see :func:`drop_final_eos`)."""
    scored = [i for i, t in enumerate(labels) if t != IGNORE_INDEX]
    if eos_token_id is None or len(scored) < 2 or labels[scored[-1]] != eos_token_id:
        return None
    return scored[-1]


def drop_final_eos(stats: TokenStats, labels: Sequence[int], eos_token_id: int | None) -> TokenStats:
    """``stats`` without the final token when the scored sequence (its ``labels``) ends with EOS.

    The EOS after an answer says nothing about what the model knows, and a model that never learned to stop scores 0
    extraction strength on every answer with it. Unchanged when the last label is not EOS (an answer cut by
    ``max_length``) or EOS is the only scored token.
    """
    return stats if final_eos_index(labels, eos_token_id) is None else stats.without_last()


def labels_without_final_eos(labels: Sequence[int], eos_token_id: int | None) -> list[int]:
    """``labels`` with the final EOS masked (``-100``): the same scoring for a fresh forward (the gradient norm)."""
    labels = list(labels)
    i = final_eos_index(labels, eos_token_id)
    if i is not None:
        labels[i] = IGNORE_INDEX
    return labels


# ----------------------------------------------------------------------------------------------------------------
# probability and truth ratio


def probability(mean_nll: float) -> float:
    """Per-token-normalised probability of an answer, ``exp(-mean NLL)``."""
    return float(math.exp(-mean_nll))


def normalized_probability(true_nll: float, false_nlls: Sequence[float]) -> float:
    """``P(true) / (P(true) + sum P(false))`` with per-token-normalised probabilities (real_authors, world_facts)."""
    # softmax over -NLL, shifted by the smallest NLL: no 0/0 when every answer is very unlikely
    low = min(true_nll, *false_nlls)
    p_true = math.exp(low - true_nll)
    return float(p_true / (p_true + sum(math.exp(low - x) for x in false_nlls)))


def truth_ratio(paraphrased_nll: float, perturbed_nlls: Sequence[float]) -> float:
    """``geomean P(perturbed) / P(paraphrased)`` from per-token mean NLLs (per-token-normalised probabilities).

    The geometric mean of the perturbed probabilities is ``exp(-mean(perturbed NLLs))``.
    """
    if len(perturbed_nlls) == 0:
        raise UnlearnError("truth ratio needs at least one perturbed answer")
    log_ratio = paraphrased_nll - float(np.mean(perturbed_nlls))
    return math.inf if log_ratio > 700 else float(math.exp(log_ratio))  # inf: both report forms are then 0


def truth_ratio_forget_score(ratios: Sequence[float]) -> float:
    """Forget-set report form ``mean(min(TR, 1/TR))``: 1 when the model cannot tell true from false."""
    r = np.asarray(ratios, dtype=float)
    return float(np.mean(np.minimum(r, 1.0 / r)))


def truth_ratio_retain_score(ratios: Sequence[float]) -> float:
    """Retain/utility report form ``mean(max(0, 1 - TR))``: 1 when the true answer is far likelier."""
    r = np.asarray(ratios, dtype=float)
    return float(np.mean(np.maximum(0.0, 1.0 - r)))


def forget_quality(model_ratios: Sequence[float], reference_ratios: Sequence[float]) -> float:
    """Two-sample KS-test p-value between per-item forget truth ratios of the model and of the retain-only reference.

    High (close to 1) means the unlearned model is statistically indistinguishable from one never trained on the
    forget set.
    """
    from scipy.stats import ks_2samp

    if len(model_ratios) == 0 or len(reference_ratios) == 0:
        raise UnlearnError("forget quality needs truth ratios from both the model and the reference")
    return float(ks_2samp(np.asarray(model_ratios, float), np.asarray(reference_ratios, float)).pvalue)


def model_utility(values: Sequence[float]) -> float:
    """Harmonic mean (TOFU's model utility over retain / real_authors / world_facts x probability, ROUGE, TR).

    Any zero makes it zero, as a harmonic mean should.
    """
    v = np.asarray([x for x in values], dtype=float)
    if v.size == 0 or np.isnan(v).any():
        raise UnlearnError("model utility needs all its component values (none may be missing)")
    if (v < 0).any():
        raise UnlearnError("model utility components must be non-negative")
    if (v == 0).any():
        return 0.0
    return float(v.size / np.sum(1.0 / v))


# ----------------------------------------------------------------------------------------------------------------
# ROUGE


@lru_cache(maxsize=2)
def _scorer(use_stemmer: bool):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=use_stemmer)


def rouge_l(prediction: str, reference: str, use_stemmer: bool = True) -> tuple[float, float, float]:
    """ROUGE-L ``(recall, precision, f1)`` of ``prediction`` against ``reference`` (rouge_score, stemmed)."""
    s = _scorer(use_stemmer).score(reference, prediction)["rougeL"]
    return float(s.recall), float(s.precision), float(s.fmeasure)


def rouge_l_recall(prediction: str, reference: str) -> float:
    """TOFU's ROUGE-L recall of a generated answer against the ground truth."""
    return rouge_l(prediction, reference)[0]


def rouge_l_f1(prediction: str, reference: str) -> float:
    """MUSE's ROUGE-L F1 of a generated continuation / answer against the ground truth."""
    return rouge_l(prediction, reference)[2]


# ----------------------------------------------------------------------------------------------------------------
# memorisation


def exact_memorization(correct: Sequence[bool]) -> float:
    """Fraction of answer tokens the model predicts exactly under teacher forcing (Tirumala et al., 2022)."""
    c = np.asarray(correct, dtype=bool)
    if c.size == 0:
        raise UnlearnError("exact memorisation needs at least one answer token")
    return float(c.mean())


ES_NO_MATCH = ("zero", "one_over_n")


def check_es_no_match(es_no_match: str) -> str:
    if es_no_match not in ES_NO_MATCH:
        raise UnlearnError(f"es_no_match must be one of {', '.join(ES_NO_MATCH)}, got {es_no_match!r}")
    return es_no_match


def extraction_strength(correct: Sequence[bool], no_match: str = "zero") -> float:
    """``1 - k/n`` for the shortest prefix ``k`` after which every remaining answer token is predicted exactly.

    1 means the whole answer is reproduced from the question alone, 0 means not even the last token is.
    ``no_match="one_over_n"`` is OpenUnlearning's loop (``for k in range(n)``, which ends at ``k = n - 1`` when no
    suffix matches): ``k`` is at most ``n - 1``, so an answer with nothing extracted scores ``1/n``, the same as one
    whose last token alone is predicted.
    """
    check_es_no_match(no_match)
    c = np.asarray(correct, dtype=bool)
    n = c.size
    if n == 0:
        raise UnlearnError("extraction strength needs at least one answer token")
    wrong = np.flatnonzero(~c)
    k = 0 if wrong.size == 0 else int(wrong[-1]) + 1
    if no_match == "one_over_n":
        k = min(k, n - 1)
    return float(1.0 - k / n)


# ----------------------------------------------------------------------------------------------------------------
# membership inference

SCORE_ATTACKS = ("loss", "zlib", "min_k", "min_k_plus_plus")  # one teacher-forced forward gives all four
MIA_ATTACKS = (*SCORE_ATTACKS, "gradnorm", "reference")


def _lowest_mean(values: np.ndarray, k: float) -> float:
    if not 0 < k <= 1:
        raise UnlearnError(f"Min-k% needs 0 < k <= 1, got {k}")
    n = max(1, int(len(values) * k))
    return float(np.sort(values)[:n].mean())


def mia_scores(stats: TokenStats, text: str, k: float = 0.4, body: TokenStats | None = None) -> dict[str, float]:
    """Non-membership scores (higher = looks unseen) of one sequence for every attack in :data:`SCORE_ATTACKS`.

    * loss: mean NLL; zlib: mean NLL divided by the zlib-compressed size of ``text`` in bytes (Carlini et al., 2021);
    * min_k: minus the mean of the ``k`` fraction lowest token log-probs (Shi et al., 2024);
    * min_k_plus_plus: the same on standardised log-probs (Zhang et al., 2024).

    ``body`` (default ``stats``) is what Min-k% and Min-k%++ score: the answer without its final EOS
    (:func:`drop_final_eos`), as OpenUnlearning does; LOSS and zlib keep it.
    """
    body = stats if body is None else body
    if stats.logprobs.size == 0 or body.logprobs.size == 0:
        raise UnlearnError("membership scores need at least one scored token")
    loss = stats.mean_nll
    return {
        "loss": loss,
        "zlib": loss / len(zlib.compress(text.encode("utf-8"))),
        "min_k": -_lowest_mean(body.logprobs, k),
        "min_k_plus_plus": -_lowest_mean(body.zscores, k),
    }


def reference_attack_score(loss: float, reference_loss: float) -> float:
    """Reference-model attack (Carlini et al., 2021; OpenUnlearning's ``mia_reference``): the model's mean NLL minus
    the reference model's on the same sequence. A member's loss drops below what a model that never saw it predicts,
    so low scores look like members. With the retain-only reference, the reference scored against itself gives 0 for
    every item, AUC 0.5: privleak for this attack is measured against 0.5."""
    return float(loss - reference_loss)


def check_mia_attacks(attacks) -> tuple[str, ...]:
    """``attacks`` (None = all of :data:`MIA_ATTACKS`) as a tuple in canonical order; unknown names raise."""
    if attacks is None:
        return MIA_ATTACKS
    attacks = [attacks] if isinstance(attacks, str) else list(attacks)
    unknown = [a for a in attacks if a not in MIA_ATTACKS]
    if unknown:
        raise UnlearnError(f"unknown membership-inference attack {unknown[0]!r}; choose from {', '.join(MIA_ATTACKS)}")
    return tuple(a for a in MIA_ATTACKS if a in attacks)


def mia_auc(member_scores: Sequence[float], nonmember_scores: Sequence[float]) -> float:
    """AUROC of telling members (forget) from non-members (holdout) with non-membership scores.

    ``P(score(nonmember) > score(member)) + 0.5 P(tie)``, computed from ranks (Mann-Whitney U).
    """
    from scipy.stats import rankdata

    m = np.asarray(member_scores, dtype=float)
    h = np.asarray(nonmember_scores, dtype=float)
    if m.size == 0 or h.size == 0:
        raise UnlearnError("MIA AUC needs at least one member and one non-member score")
    ranks = rankdata(np.concatenate([m, h]))
    u = ranks[m.size:].sum() - h.size * (h.size + 1) / 2
    return float(u / (m.size * h.size))


def privleak(auc: float, reference_auc: float) -> float:
    """MUSE privleak in percent, ``((1 - AUC) - (1 - AUC_ref)) / (1 - AUC_ref) * 100``.

    0 = as private as the retain-only reference; strongly negative = the forget set is still recognisable
    (under-unlearning); positive = over-unlearning.
    """
    base = 1.0 - reference_auc
    if base <= 0:
        raise UnlearnError(
            f"privleak is undefined for a reference AUC of {reference_auc} (the reference itself separates the sets)"
        )
    return float(((1.0 - auc) - base) / base * 100.0)


def nanmean(values: Sequence[float | None]) -> float | None:
    """Mean over the values that are present (None when none are)."""
    v = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(v)) if v else None
