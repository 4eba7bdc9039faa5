"""hf_unlearn.losses on hand-computed tensors."""

from __future__ import annotations

import math

import pytest
import torch

from hf_unlearn import losses as L


def _logits(*rows):
    """[1, len(rows), vocab] logits from per-position rows."""
    return torch.tensor([rows], dtype=torch.float32)


# position t predicts labels[t+1]: labels [-100, 1, 0] -> targets 1 (from position 0) and 0 (from position 1)
LOGITS = _logits([0.0, 0.0], [math.log(3.0), 0.0], [5.0, 5.0])
LABELS = torch.tensor([[-100, 1, 0]])


def test_token_logprobs_shift_and_mask():
    logp, mask = L.token_logprobs(LOGITS, LABELS)
    assert mask.tolist() == [[True, True]]
    assert logp[0].tolist() == pytest.approx([math.log(0.5), math.log(0.75)])


def test_nll_matches_hand_value_and_cross_entropy():
    expected = -(math.log(0.5) + math.log(0.75)) / 2
    assert float(L.nll_loss(LOGITS, LABELS)) == pytest.approx(expected)
    ce = torch.nn.functional.cross_entropy(LOGITS[0, :-1], LABELS[0, 1:])
    assert float(L.nll_loss(LOGITS, LABELS)) == pytest.approx(float(ce))
    assert float(L.gradient_ascent_loss(LOGITS, LABELS)) == pytest.approx(-expected)


def test_prompt_tokens_are_ignored():
    labels = torch.tensor([[-100, -100, 0]])  # only the last target counts
    assert float(L.nll_loss(LOGITS, labels)) == pytest.approx(-math.log(0.75))


def test_sequence_logprob_sum_and_mean():
    total = math.log(0.5) + math.log(0.75)
    assert float(L.sequence_logprob(LOGITS, LABELS)) == pytest.approx(total)
    assert float(L.sequence_logprob(LOGITS, LABELS, average=True)) == pytest.approx(total / 2)


def test_npo_loss_hand_values():
    same = torch.tensor([-4.0, -7.0])
    assert float(L.npo_loss(same, same, beta=0.5)) == pytest.approx(2 / 0.5 * math.log(2))
    # log(pi/pi_ref) = log 3, beta 1: sigmoid(-log 3) = 1/4 -> loss = 2 log 4
    assert float(L.npo_loss(torch.tensor([math.log(3.0)]), torch.tensor([0.0]), beta=1.0)) == pytest.approx(
        2 * math.log(4)
    )


def test_npo_loss_decreases_as_policy_likelihood_drops():
    ref = torch.tensor([-5.0])
    assert float(L.npo_loss(torch.tensor([-9.0]), ref, 0.1)) < float(L.npo_loss(torch.tensor([-5.0]), ref, 0.1))


def test_simnpo_loss_hand_value():
    # avg logp -1, beta 2, gamma 0: -(2/2) log sigmoid(2) = log(1 + e^-2)
    assert float(L.simnpo_loss(torch.tensor([-1.0]), beta=2.0)) == pytest.approx(math.log(1 + math.exp(-2)))
    # gamma sits inside the beta scaling, as in the authors' code and OpenUnlearning (their delta):
    # -(2/beta) log sigmoid(beta * (mean NLL - gamma)) = -(2/2) log sigmoid(2 * (1 - 0.5)) = log(1 + e^-1)
    assert float(L.simnpo_loss(torch.tensor([-1.0]), beta=2.0, gamma=0.5)) == pytest.approx(
        math.log(1 + math.exp(-1))
    )
    # beta 4.5, gamma 1 (not beta * 1 = 4.5 outside): argument 4.5 * (1 - 1) = 0 -> (2/4.5) log 2
    assert float(L.simnpo_loss(torch.tensor([-1.0]), beta=4.5, gamma=1.0)) == pytest.approx(2 / 4.5 * math.log(2))


def test_union_bound_shares_sum_to_at_most_delta():
    shares = [L.union_bound_delta(0.1, i) for i in range(1, 10_001)]
    assert shares[0] == pytest.approx(0.1 * 6 / math.pi ** 2) and shares[1] == pytest.approx(shares[0] / 4)
    assert sum(shares) < 0.1 and sum(shares) > 0.0999  # sum 6/(pi^2 i^2) -> 1
    with pytest.raises(ValueError):
        L.union_bound_delta(0.1, 0)


def test_kl_retain_loss_hand_value():
    ref = _logits([0.0, 0.0], [0.0, 0.0])  # p0 = [1/2, 1/2]
    policy = _logits([math.log(3.0), 0.0], [0.0, 0.0])  # p_theta = [3/4, 1/4] at position 0
    labels = torch.tensor([[-100, 1]])
    expected = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    assert float(L.kl_retain_loss(policy, ref, labels)) == pytest.approx(expected)
    assert float(L.kl_retain_loss(ref, ref, labels)) == pytest.approx(0.0)


def test_rmu_masked_mse():
    hidden = torch.tensor([[[1.0, 1.0], [3.0, 3.0]]])
    mask = torch.tensor([[1, 0]])
    assert float(L.rmu_forget_loss(hidden, torch.zeros(2), mask)) == pytest.approx(1.0)
    assert float(L.rmu_retain_loss(hidden, torch.zeros_like(hidden), torch.ones(1, 2))) == pytest.approx(5.0)


def test_rmu_terms_weigh_rows_equally_over_their_answer_tokens():
    # row 0: answer tokens at positions 1, 2 (squared errors 4 and 16 -> mean 10); row 1: one answer token (1);
    # row 2: no answer token (ignored). OpenUnlearning: per-row token mean, then the mean over rows -> (10 + 1) / 2
    hidden = torch.tensor([[[0.0], [2.0], [4.0]], [[9.0], [1.0], [9.0]], [[5.0], [5.0], [5.0]]])
    labels = torch.tensor([[-100, 7, 8], [-100, 3, -100], [-100, -100, -100]])
    mask = L.answer_token_mask(labels)
    assert mask.tolist() == [[False, True, True], [False, True, False], [False, False, False]]
    assert float(L.rmu_forget_loss(hidden, torch.zeros(1), mask)) == pytest.approx(5.5)


def test_masc_threshold():
    assert L.masc_threshold(0.5) == 0.0
    assert L.masc_threshold(0.75) == pytest.approx(math.log(3))
    for bad in (0.0, 1.0, -0.1, 2.0):
        with pytest.raises(ValueError):
            L.masc_threshold(bad)


# one position predicting target 0 over a 4-token vocabulary
Z = _logits([2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0])
TARGET = torch.tensor([[-100, 0]])


def test_masc_margin_current_competitors():
    m, mask = L.masc_margin(Z, TARGET, k=2)
    assert mask.tolist() == [[True]]
    assert float(m[0, 0]) == pytest.approx(2 - math.log(math.e + 1))
    assert float(L.masc_margin(Z, TARGET, k=1)[0][0, 0]) == pytest.approx(1.0)
    assert float(L.masc_margin(Z, TARGET, k=2, beta=2.0)[0][0, 0]) == pytest.approx(4 - math.log(math.exp(2) + 1))


def test_masc_margin_reference_competitors_choose_the_set_not_the_values():
    ref = _logits([0.0, -5.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0])  # reference's top-2 non-target: tokens 3 and 2
    m, _ = L.masc_margin(Z, TARGET, k=2, competitor_logits=ref)
    assert float(m[0, 0]) == pytest.approx(2 - math.log(math.exp(-1) + 1))


def test_masc_margin_gradient_flows_to_target_and_competitor_values():
    z = Z.clone().requires_grad_(True)
    m, _ = L.masc_margin(z, TARGET, k=1)
    m.sum().backward()
    assert z.grad[0, 0].tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0])


def test_masc_active_mask_suffix_and_all():
    mask = torch.tensor([[False, True, True, True, True]])
    assert L.masc_active_mask(mask, "suffix", 0.5).long().tolist() == [[0, 0, 0, 1, 1]]
    assert L.masc_active_mask(mask, "suffix", 0.6).long().tolist() == [[0, 0, 1, 1, 1]]
    assert L.masc_active_mask(mask, "suffix", 0.01).long().tolist() == [[0, 0, 0, 0, 1]]
    assert L.masc_active_mask(mask, "all", skip_first=1).long().tolist() == [[0, 0, 1, 1, 1]]
    with pytest.raises(ValueError):
        L.masc_active_mask(mask, "prefix")


def test_masc_forget_loss_buffered_hinge():
    margin = torch.tensor([[0.5, -2.0, 3.0, 9.0]])
    active = torch.tensor([[True, True, True, False]])
    # tau 0, eta 1: relu(m + 1) = [1.5, 0, 4] over the 3 active tokens
    assert float(L.masc_forget_loss(margin, active, tau=0.0, eta=1.0)) == pytest.approx(5.5 / 3)
    # eta 0.5: relu(m + 0.5) / 0.5 = [2, 0, 7]
    assert float(L.masc_forget_loss(margin, active, tau=0.0, eta=0.5)) == pytest.approx(9 / 3)


def test_masc_violation_rates_per_example():
    margin = torch.tensor([[0.5, -2.0, 3.0], [-1.0, -1.0, 5.0], [1.0, 1.0, 1.0]])
    active = torch.tensor([[True, True, True], [True, True, False], [False, False, False]])
    rates, valid = L.masc_violation_rates(margin, active, tau=0.0)
    assert rates.tolist() == pytest.approx([2 / 3, 0.0, 0.0])
    assert valid.tolist() == [True, True, False]


def test_hoeffding_upper_bound():
    assert L.hoeffding_upper_bound(0.1, 50, 0.05) == pytest.approx(0.1 + math.sqrt(math.log(20) / 100))
    assert L.hoeffding_upper_bound(0.1, 0, 0.05) == math.inf
