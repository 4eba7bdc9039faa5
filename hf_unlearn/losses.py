"""Every unlearning loss as a pure function of tensors.

Trainers only wire these up: each function takes logits / log-probabilities / hidden states and a mask and
returns a tensor, so each can be tested on hand-computed inputs without a model.

Conventions: ``logits`` are ``[batch, seq, vocab]`` as a causal LM returns them, ``labels`` are ``[batch, seq]``
with ``-100`` on prompt and padding (as :func:`hf_unlearn.data.tokenize_qa` builds them). Functions that take both
shift them internally (position ``t`` predicts token ``t+1``); functions that take per-token tensors expect them
already aligned (``[batch, seq-1]``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------------------------------------------
# token log-probabilities


def shift_for_causal_lm(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Align logits with next-token targets: ``(logits[:, :-1], targets, mask)``; ``targets`` are 0 where masked."""
    logits = logits[:, :-1]
    labels = labels[:, 1:]
    mask = labels != IGNORE_INDEX
    return logits, labels.masked_fill(~mask, 0), mask


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``log p(y_t)`` on answer tokens, ``([batch, seq-1], mask)``; 0 where masked. Computed in fp32."""
    logits, targets, mask = shift_for_causal_lm(logits, labels)
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp * mask, mask


def sequence_logprob(logits: torch.Tensor, labels: torch.Tensor, average: bool = False) -> torch.Tensor:
    """``log p(answer | prompt)`` per sequence ``[batch]``: the sum over answer tokens, or the mean if ``average``."""
    logp, mask = token_logprobs(logits, labels)
    total = logp.sum(-1)
    return total / mask.sum(-1).clamp(min=1) if average else total


def nll_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over every answer token of the batch (what ``model(labels=...)`` returns)."""
    logp, mask = token_logprobs(logits, labels)
    return -logp.sum() / mask.sum().clamp(min=1)


# ----------------------------------------------------------------------------------------------------------------
# baselines


def gradient_ascent_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Gradient ascent on the forget answers: the negated token-mean cross-entropy."""
    return -nll_loss(logits, labels)


def npo_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """Negative Preference Optimization (Zhang et al., 2024): ``-(2/beta) * mean(log sigmoid(-beta * log(pi/pi_ref)))``.

    ``policy_logps`` and ``ref_logps`` are sequence log-probabilities ``[batch]`` (sums over answer tokens). At
    ``pi == pi_ref`` the loss is ``(2/beta) log 2``; it decreases as the policy's likelihood of the answer drops.
    """
    log_ratio = policy_logps - ref_logps
    return -(2.0 / beta) * F.logsigmoid(-beta * log_ratio).mean()


def simnpo_loss(avg_logps: torch.Tensor, beta: float, gamma: float = 0.0) -> torch.Tensor:
    """SimNPO (Fan et al., 2024): reference-free NPO on length-normalised log-likelihood.

    ``-(2/beta) * mean(log sigmoid(beta * (-avg_logp - gamma)))`` with ``avg_logps`` the per-sequence mean answer
    log-probability ``[batch]`` (``sequence_logprob(..., average=True)``) and ``gamma`` the reward margin, which sits
    inside the ``beta`` scaling as in the authors' code (``gamma`` in Unlearn-Simple's TOFU config) and OpenUnlearning
    (``delta``): the loss saturates once the mean answer NLL exceeds ``gamma`` by a few ``1/beta``.
    """
    return -(2.0 / beta) * F.logsigmoid(beta * (-avg_logps - gamma)).mean()


KL_POSITIONS = ("answer", "all")


def kl_retain_loss(policy_logits: torch.Tensor, ref_logits: torch.Tensor, labels: torch.Tensor,
                   positions: str = "answer") -> torch.Tensor:
    """``KL(p_0 || p_theta)`` over the full vocabulary, averaged over the answer tokens of the batch.

    ``p_0`` is the reference (original) model; the forward direction keeps the policy from dropping mass anywhere
    the original model put it. ``positions="all"`` is OpenUnlearning's convention: the sum over every position of the
    batch (prompt, padding and the last position included, unshifted) divided by ``batch * seq``
    (``kl_div(..., reduction="batchmean")`` on the flattened logits).
    """
    if positions not in KL_POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(KL_POSITIONS)}, got {positions!r}")
    if positions == "all":
        logp = torch.log_softmax(policy_logits.float(), dim=-1)
        logq = torch.log_softmax(ref_logits.float(), dim=-1)
        kl = (logq.exp() * (logq - logp)).sum(-1)
        return kl.sum() / kl.numel()
    policy, _, mask = shift_for_causal_lm(policy_logits, labels)
    ref = ref_logits[:, :-1]
    logp = torch.log_softmax(policy.float(), dim=-1)
    logq = torch.log_softmax(ref.float(), dim=-1)
    kl = (logq.exp() * (logq - logp)).sum(-1)
    return (kl * mask).sum() / mask.sum().clamp(min=1)


def answer_token_mask(labels: torch.Tensor) -> torch.Tensor:
    """``[batch, seq]`` True at the answer tokens themselves (``labels != -100``, not shifted): the positions whose
    hidden states RMU steers, as OpenUnlearning selects them."""
    return labels != IGNORE_INDEX


MSE_REDUCTIONS = ("row_mean", "open_unlearning")


def masked_mse(hidden: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, reduction: str = "row_mean") -> torch.Tensor:
    """Per row, the mean over masked positions of the mean squared difference over the hidden dimension; then the
    mean over rows that have a masked position (every row weighs the same, as OpenUnlearning's RMU intends).

    ``hidden`` ``[batch, seq, dim]``; ``target`` broadcastable to it (a ``[dim]`` control vector or frozen
    activations); ``mask`` ``[batch, seq]``. ``reduction="open_unlearning"`` reproduces OpenUnlearning's code: its
    per-row sums ``S [b]`` divided by the counts ``n [b, 1]`` broadcast to ``[b, b]``, whose mean is
    ``mean(S) * mean(1/n)``: the per-row mean at batch size 1 only, NaN or inf when a row has no masked position.
    """
    if reduction not in MSE_REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(MSE_REDUCTIONS)}, got {reduction!r}")
    sq = (hidden.float() - target.float()).pow(2).mean(-1)
    mask = mask.to(sq.dtype)
    count = mask.sum(-1)
    if reduction == "open_unlearning":
        return ((sq * mask).sum(-1) / count.unsqueeze(-1)).mean()
    per_row = (sq * mask).sum(-1) / count.clamp(min=1)
    rows = (count > 0).to(sq.dtype)
    return (per_row * rows).sum() / rows.sum().clamp(min=1)


def rmu_forget_loss(hidden: torch.Tensor, control: torch.Tensor, mask: torch.Tensor,
                    reduction: str = "row_mean") -> torch.Tensor:
    """RMU (Li et al., 2024) forget term: push layer activations on forget text towards ``control = c * u``."""
    return masked_mse(hidden, control, mask, reduction)


def rmu_retain_loss(hidden: torch.Tensor, ref_hidden: torch.Tensor, mask: torch.Tensor,
                    reduction: str = "row_mean") -> torch.Tensor:
    """RMU retain term: keep layer activations on retain text equal to the frozen model's."""
    return masked_mse(hidden, ref_hidden, mask, reduction)


# ----------------------------------------------------------------------------------------------------------------
# MASC (margin self-correction)


def masc_threshold(rho: float) -> float:
    """``tau = log(rho / (1 - rho))``: the margin at which the target holds probability ``rho`` among its competitors.

    The restricted softmax over ``{target} + top-k competitors`` gives the target probability ``sigmoid(m)``, so
    ``m > tau`` exactly when that probability exceeds ``rho``.
    """
    if not 0.0 < rho < 1.0:
        raise ValueError(f"rho must lie in (0, 1), got {rho}")
    return math.log(rho / (1.0 - rho))


def masc_margin(
    logits: torch.Tensor,
    labels: torch.Tensor,
    k: int,
    beta: float = 1.0,
    competitor_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Restricted margin ``m_t = beta*z(y_t) - logsumexp_{v in top-k non-target}(beta*z(v))`` per answer token.

    ``z`` are the current model's logits; the set of ``k`` competitors is chosen on ``competitor_logits`` (the
    reference model's, or None for the current model's own), never including the target, and without gradient
    (only the values ``z(v)`` carry gradient). Returns ``(margin [batch, seq-1], mask)``; margin is 0 where masked.
    """
    z, targets, mask = shift_for_causal_lm(logits, labels)
    z = z.float() * beta
    source = z.detach() if competitor_logits is None else competitor_logits[:, :-1].detach().float()
    source = source.scatter(-1, targets.unsqueeze(-1), float("-inf"))
    k = min(k, z.shape[-1] - 1)
    competitors = source.topk(k, dim=-1).indices
    target_z = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    margin = target_z - torch.logsumexp(z.gather(-1, competitors), dim=-1)
    return margin * mask, mask


def masc_active_mask(
    mask: torch.Tensor, rule: str = "suffix", suffix_fraction: float = 0.5, skip_first: int = 0
) -> torch.Tensor:
    """The answer positions MASC trains on and counts, from the (shifted) answer mask ``[batch, seq-1]``.

    * ``"all"``: every answer token after the first ``skip_first``.
    * ``"suffix"``: the last ``ceil(suffix_fraction * n)`` of the ``n`` answer tokens (at least one), after
      ``skip_first``. TOFU answers open by restating the question ("The author's full name is ..."), so the
      author-specific content sits in the answer's suffix; the opening tokens are generic and forgetting them
      damages retained knowledge of the same template.
    """
    if rule not in ("all", "suffix"):
        raise ValueError(f"unknown active-token rule {rule!r}; use 'all' or 'suffix'")
    mask = mask.bool()
    pos = mask.long().cumsum(-1) - 1  # index of each answer token within its answer
    n = mask.sum(-1, keepdim=True)
    active = mask & (pos >= skip_first)
    if rule == "suffix":
        keep = torch.ceil(n.float() * suffix_fraction).long().clamp(min=1)
        active = active & (pos >= n - keep)
    return active


def masc_forget_loss(margin: torch.Tensor, active: torch.Tensor, tau: float, eta: float) -> torch.Tensor:
    """Buffered hinge ``relu(m - (tau - eta)) / eta`` averaged over the active tokens of the batch.

    Zero once every active margin is at least ``eta`` below the threshold, so training stops pushing tokens that
    are already forgotten (no runaway ascent).
    """
    hinge = torch.relu(margin - (tau - eta)) / eta
    active = active.to(hinge.dtype)
    return (hinge * active).sum() / active.sum().clamp(min=1)


def masc_violation_rates(margin: torch.Tensor, active: torch.Tensor, tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example, the fraction of active tokens whose margin is above ``tau`` (still "dominant").

    Returns ``(rates [batch], valid [batch])``; examples with no active token are not valid (rate 0). The
    violation rate of a set is the mean of the valid rates.
    """
    active = active.bool()
    count = active.sum(-1)
    violating = ((margin > tau) & active).sum(-1)
    valid = count > 0
    return violating.float() / count.clamp(min=1).float(), valid


def hoeffding_upper_bound(mean: float, n: int, delta: float) -> float:
    """One-sided Hoeffding bound for the mean of ``n`` independent values in [0, 1]: holds with prob. ``1-delta``."""
    if n <= 0:
        return float("inf")
    return mean + math.sqrt(math.log(1.0 / delta) / (2.0 * n))


def union_bound_delta(delta: float, check: int) -> float:
    """The share of a total error ``delta`` spent on the ``check``-th check (1-based): ``delta * 6 / (pi^2 check^2)``.

    The shares sum to at most ``delta`` over any number of checks, so bounds that each hold with probability
    ``1 - share`` hold all at once with probability ``1 - delta``, including at a stop chosen by looking at them.
    """
    if check < 1:
        raise ValueError(f"check numbers start at 1, got {check}")
    return delta * 6.0 / (math.pi ** 2 * check ** 2)


# ----------------------------------------------------------------------------------------------------------------
# preference, distillation, reweighted-ascent and constrained methods (the rest of OpenUnlearning's set)


def dpo_loss(
    policy_win: torch.Tensor,
    policy_lose: torch.Tensor,
    ref_win: torch.Tensor,
    ref_lose: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """DPO (Rafailov et al., 2023) used for unlearning (IdkDPO): prefer the alternate answer over the forget answer.

    ``-(2/beta) * mean(log sigmoid(beta * ((pi_w - ref_w) - (pi_l - ref_l))))`` on sequence log-probabilities
    ``[batch]`` (sums over answer tokens); ``w`` is the preferred answer (a refusal), ``l`` the answer to forget.
    The DPO paper's loss is ``-log sigmoid(...)``; the ``2/beta`` factor is OpenUnlearning's (as in NPO, which is this
    loss without the preferred answer), so ``lambda_forget``/``lambda_retain`` weigh the terms as its IdkDPO does.
    At ``pi == ref`` the loss is ``(2/beta) log 2``.
    """
    margin = (policy_win - ref_win) - (policy_lose - ref_lose)
    return -(2.0 / beta) * F.logsigmoid(beta * margin).mean()


def _answer_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``-sum_v q_v log p_v`` with ``p = softmax(logits)``, averaged over the masked (aligned) positions.

    ``logits`` and ``target_probs`` are ``[batch, seq-1, vocab]``, already aligned with their targets; the target
    distribution ``q`` carries no gradient.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    return _answer_mean(-(target_probs.detach() * logp).sum(-1), mask)


def undial_loss(logits: torch.Tensor, ref_logits: torch.Tensor, labels: torch.Tensor, beta: float) -> torch.Tensor:
    """UNDIAL (Dong et al., 2025): self-distillation towards the reference's logits with the target's logit lowered.

    Per answer token, the teacher distribution is ``softmax(z_ref - beta * onehot(y_t))`` (``beta``: the penalty
    strength, the paper's ``gamma``); the loss is the cross-entropy of the current model against it, averaged over
    answer tokens. OpenUnlearning averages over every position of the batch (prompt and padding included); here only
    the answer tokens being unlearned count.
    """
    z, targets, mask = shift_for_causal_lm(logits, labels)
    ref = ref_logits[:, :-1].float()
    index = targets.unsqueeze(-1)
    adjusted = ref.scatter(-1, index, ref.gather(-1, index) - beta)
    return soft_cross_entropy(z, torch.softmax(adjusted, dim=-1), mask)


def mask_first_answer_tokens(labels: torch.Tensor, n: int) -> torch.Tensor:
    """``labels`` with the first ``n`` answer tokens of every row set to ``-100`` (CE-U's footnote trick)."""
    if n <= 0:
        return labels
    answer = labels != IGNORE_INDEX
    return labels.masked_fill(answer & (answer.long().cumsum(-1) <= n), IGNORE_INDEX)


def ce_u_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """CE-U (Yang et al., 2025): cross-entropy against the model's own distribution with the target token removed.

    Per answer token the target is ``softmax(z)`` with ``z(y_t) = -inf`` (from the detached logits), so the gradient
    w.r.t. the logits is ``p - q``: the target's probability goes down and the others rise in proportion, with no
    runaway ascent. Averaged over answer tokens (OpenUnlearning's ``F.cross_entropy`` over the valid positions).
    """
    z, targets, mask = shift_for_causal_lm(logits, labels)
    suppressed = z.detach().float().scatter(-1, targets.unsqueeze(-1), float("-inf"))
    return soft_cross_entropy(z, torch.softmax(suppressed, dim=-1), mask)


def weighted_ascent_loss(logp: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``mean_t(w_t * log p(y_t))`` over answer tokens, ``w`` without gradient: minimising it lowers the weighted
    log-likelihood (gradient ascent on the forget answers, token by token)."""
    return _answer_mean(weights.detach() * logp, mask)


def wga_loss(logits: torch.Tensor, labels: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """WGA (Wang et al., 2025): gradient ascent with each token weighted by ``p(y_t)^beta`` (detached).

    Tokens the model no longer predicts get small weights, so the ascent fades where forgetting is done; averaged over
    the answer tokens of the batch, as OpenUnlearning does.
    """
    logp, mask = token_logprobs(logits, labels)
    return weighted_ascent_loss(logp, mask, logp.detach().exp().pow(beta))


def satimp_loss(logits: torch.Tensor, labels: torch.Tensor, beta1: float = 5.0, beta2: float = 1.0) -> torch.Tensor:
    """SatImp (Yang et al., 2025): gradient ascent weighted by ``p^beta1 * (1 - p)^beta2`` per token (detached).

    ``p^beta1`` is saturation (fade once forgotten), ``(1 - p)^beta2`` importance (tokens the model is unsure of carry
    the information worth removing); averaged over the answer tokens of the batch, as OpenUnlearning does.
    """
    logp, mask = token_logprobs(logits, labels)
    p = logp.detach().exp()
    return weighted_ascent_loss(logp, mask, p.pow(beta1) * (1.0 - p).pow(beta2))


def logit_margin_flattening_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """PDU's forget term (Entesari et al., 2025): ``(max_v z_v - mean_v z_v)^2`` per answer position, averaged.

    Zero exactly when the next-token logits are all equal (the uniform distribution); softmax-free, so its gradient
    does not vanish near uniformity. Taken at the positions that predict answer tokens (OpenUnlearning takes the
    positions of the answer tokens themselves, one to the right).
    """
    z, _, mask = shift_for_causal_lm(logits, labels)
    z = z.float()
    return _answer_mean((z.max(-1).values - z.mean(-1)).square(), mask)


def dual_ascent(multiplier: float, constraint_value: float, epsilon: float, step_size: float) -> float:
    """One projected dual-ascent step for ``constraint_value <= epsilon``: ``max(0, lambda + step * (value - eps))``."""
    return max(0.0, multiplier + step_size * (constraint_value - epsilon))
