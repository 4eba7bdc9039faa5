"""The losses of IdkDPO, UNDIAL, CE-U, WGA, SatImp and PDU on hand-computed tensors (and their gradients)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_unlearn import losses as L


def _logits(*rows, grad=False):
    return torch.tensor([rows], dtype=torch.float32, requires_grad=grad)


# one answer token: position 0 predicts labels[1] = 0
ONE = torch.tensor([[-100, 0]])
LOG2 = math.log(2.0)


def test_dpo_loss_hand_values():
    same = torch.tensor([-3.0, -5.0])
    assert float(L.dpo_loss(same, same, same, same, beta=0.1)) == pytest.approx(2 / 0.1 * math.log(2))
    # (pi_w - ref_w) - (pi_l - ref_l) = (-1 + 2) - (-3 + 2) = 2; beta 0.5 -> -(4) log sigmoid(1)
    loss = L.dpo_loss(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), 0.5)
    assert float(loss) == pytest.approx(4 * math.log(1 + math.exp(-1)))
    # lowering the forget answer's likelihood lowers the loss; so does raising the refusal's
    base = float(L.dpo_loss(torch.tensor([-2.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), 1))
    assert float(L.dpo_loss(torch.tensor([-2.0]), torch.tensor([-4.0]), torch.tensor([-2.0]), torch.tensor([-2.0]),
                            1)) < base
    assert float(L.dpo_loss(torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), torch.tensor([-2.0]),
                            1)) < base


def test_undial_targets_the_reference_with_the_true_logit_lowered():
    ref = _logits([0.0, 0.0, 0.0], [9.0, 9.0, 9.0])  # teacher uniform; beta = log 2 -> q = [1/2, 1, 1] / 2.5
    student = _logits([LOG2, 0.0, 0.0], [0.0, 0.0, 0.0], grad=True)  # p = [1/2, 1/4, 1/4]
    loss = L.undial_loss(student, ref, ONE, beta=LOG2)
    assert float(loss.detach()) == pytest.approx(-(0.2 * math.log(0.5) + 0.8 * math.log(0.25)))  # = 1.8 log 2
    loss.backward()
    assert student.grad[0, 0].tolist() == pytest.approx([0.5 - 0.2, 0.25 - 0.4, 0.25 - 0.4])  # p - q
    assert student.grad[0, 1].abs().sum() == 0  # the last position predicts nothing
    # with beta = 0 and a student equal to the teacher, the loss is the teacher's entropy and the gradient is zero
    same = _logits([1.0, 2.0, 3.0], [0.0, 0.0, 0.0], grad=True)
    L.undial_loss(same, same.detach(), ONE, beta=0.0).backward()
    assert same.grad.abs().max() < 1e-6


def test_undial_and_ce_u_ignore_prompt_and_padding():
    logits = _logits([LOG2, 0.0, 0.0], [5.0, -3.0, 1.0], [2.0, 2.0, 0.0])
    labels = torch.tensor([[-100, 0, -100]])  # one answer token; the second position is padding
    assert float(L.ce_u_loss(logits, labels)) == pytest.approx(float(L.ce_u_loss(logits[:, :2], ONE)))
    assert float(L.undial_loss(logits, logits, labels, 1.0)) == pytest.approx(
        float(L.undial_loss(logits[:, :2], logits[:, :2], ONE, 1.0)))


def test_ce_u_removes_the_target_from_the_model_distribution():
    logits = _logits([LOG2, 0.0, 0.0], [0.0, 0.0, 0.0], grad=True)  # p = [1/2, 1/4, 1/4]; target 0
    loss = L.ce_u_loss(logits, ONE)  # q = [0, 1/2, 1/2] -> -(1/2 log 1/4 + 1/2 log 1/4) = log 4
    assert float(loss.detach()) == pytest.approx(math.log(4))
    loss.backward()
    assert logits.grad[0, 0].tolist() == pytest.approx([0.5, 0.25 - 0.5, 0.25 - 0.5])


def test_mask_first_answer_tokens():
    labels = torch.tensor([[-100, 5, 6, 7], [-100, -100, 8, -100]])
    assert L.mask_first_answer_tokens(labels, 1).tolist() == [[-100, -100, 6, 7], [-100, -100, -100, -100]]
    assert L.mask_first_answer_tokens(labels, 2).tolist() == [[-100, -100, -100, 7], [-100] * 4]
    assert torch.equal(L.mask_first_answer_tokens(labels, 0), labels)


# two answer tokens with p = 1/2 and 3/4 (as in test_losses.py)
TWO = _logits([0.0, 0.0], [math.log(3.0), 0.0], [5.0, 5.0])
TWO_LABELS = torch.tensor([[-100, 1, 0]])


def test_wga_weights_tokens_by_their_probability():
    expected = (0.5 * math.log(0.5) + 0.75 * math.log(0.75)) / 2
    assert float(L.wga_loss(TWO, TWO_LABELS, beta=1.0)) == pytest.approx(expected)
    expected2 = (0.25 * math.log(0.5) + 0.5625 * math.log(0.75)) / 2
    assert float(L.wga_loss(TWO, TWO_LABELS, beta=2.0)) == pytest.approx(expected2)
    # beta = 0 is plain gradient ascent
    assert float(L.wga_loss(TWO, TWO_LABELS, beta=0.0)) == pytest.approx(float(L.gradient_ascent_loss(TWO, TWO_LABELS)))


def test_satimp_weights_are_saturation_times_importance():
    w = [0.5 ** 2 * 0.5, 0.75 ** 2 * 0.25]
    expected = (w[0] * math.log(0.5) + w[1] * math.log(0.75)) / 2
    assert float(L.satimp_loss(TWO, TWO_LABELS, beta1=2.0, beta2=1.0)) == pytest.approx(expected)
    # the weights carry no gradient: d loss / d logp_t = w_t / n
    logits = TWO.clone().requires_grad_(True)
    L.satimp_loss(logits, TWO_LABELS, beta1=2.0, beta2=1.0).backward()
    # position 1 predicts token 0 with p = 3/4: d logp / d z = onehot - p
    assert logits.grad[0, 1].tolist() == pytest.approx([w[1] / 2 * 0.25, -w[1] / 2 * 0.25])


def test_logit_margin_flattening_is_zero_only_for_flat_logits():
    logits = _logits([3.0, 0.0, 0.0], [1.0, 1.0, 1.0], [7.0, 0.0, 0.0])
    labels = torch.tensor([[-100, 0, 1]])  # positions 0 and 1 predict answer tokens
    assert float(L.logit_margin_flattening_loss(logits, labels)) == pytest.approx((4.0 + 0.0) / 2)
    flat = _logits([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], [7.0, 0.0, 0.0])
    assert float(L.logit_margin_flattening_loss(flat, labels)) == 0.0


def test_dual_ascent_is_projected_on_nonnegative_multipliers():
    assert L.dual_ascent(1.0, 0.2, 0.3, 5.0) == pytest.approx(0.5)
    assert L.dual_ascent(0.2, 0.2, 0.3, 5.0) == 0.0
    assert L.dual_ascent(1.0, 0.5, 0.3, 5.0) == pytest.approx(2.0)
