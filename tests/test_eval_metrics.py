"""Unlearning metrics as pure functions, on hand-computed values."""

import math
import zlib

import numpy as np
import pytest
import torch

from hf_unlearn.errors import UnlearnError
from hf_unlearn.eval import metrics as M


def test_ks_forget_quality_is_one_for_identical_distributions():
    values = [0.2, 0.5, 0.9, 1.3, 2.0]
    assert M.forget_quality(values, list(values)) == pytest.approx(1.0)


def test_ks_forget_quality_is_small_for_disjoint_distributions():
    # 20 vs 20 fully separated samples: exact two-sided KS p = 2 / C(40, 20)
    p = M.forget_quality(np.linspace(0, 1, 20), np.linspace(2, 3, 20))
    assert p == pytest.approx(2 / math.comb(40, 20), rel=1e-6)


def test_truth_ratio_from_known_probabilities():
    # P(paraphrased) = 1/2, P(perturbed) = 1/4 and 1/16 -> geometric mean 1/8 -> TR = 1/4
    tr = M.truth_ratio(math.log(2), [math.log(4), math.log(16)])
    assert tr == pytest.approx(0.25)
    assert M.truth_ratio_forget_score([0.25, 4.0]) == pytest.approx(0.25)  # min(TR, 1/TR) is symmetric
    assert M.truth_ratio_retain_score([0.25, 4.0]) == pytest.approx((0.75 + 0.0) / 2)  # max(0, 1 - TR)


def test_probability_and_normalised_probability():
    assert M.probability(math.log(2)) == pytest.approx(0.5)
    # P(true) = 1/2, P(false) = 1/4 each: 0.5 / (0.5 + 0.25 + 0.25)
    assert M.normalized_probability(math.log(2), [math.log(4), math.log(4)]) == pytest.approx(0.5)


def test_rouge_l_on_a_known_pair():
    # LCS of "the cat on the mat" with "the cat sat on the mat" is 5 tokens: recall 5/6, precision 1, F1 10/11
    recall, precision, f1 = M.rouge_l("the cat on the mat", "the cat sat on the mat")
    assert (recall, precision, f1) == pytest.approx((5 / 6, 1.0, 10 / 11))
    assert M.rouge_l_recall("completely different words", "the cat sat") == 0.0
    assert M.rouge_l_f1("the cat sat", "the cat sat") == pytest.approx(1.0)


def test_model_utility_is_a_harmonic_mean():
    assert M.model_utility([0.5, 1.0]) == pytest.approx(2 / 3)
    assert M.model_utility([0.3] * 9) == pytest.approx(0.3)
    assert M.model_utility([0.9, 0.0, 0.8]) == 0.0
    with pytest.raises(UnlearnError, match="missing"):
        M.model_utility([0.5, float("nan")])


def test_extraction_strength_and_exact_memorization():
    assert M.extraction_strength([True, True, True]) == 1.0
    assert M.extraction_strength([False, True, True, True]) == pytest.approx(0.75)
    assert M.extraction_strength([True, False, True]) == pytest.approx(1 / 3)
    assert M.extraction_strength([True, True, False]) == 0.0
    assert M.exact_memorization([True, False, True, True]) == pytest.approx(0.75)


def test_mia_auc_on_separable_and_identical_scores():
    members, nonmembers = [1.0, 2.0, 3.0], [4.0, 5.0, 6.0]  # non-membership scores: members score low
    assert M.mia_auc(members, nonmembers) == 1.0
    assert M.mia_auc(nonmembers, members) == 0.0
    assert M.mia_auc([1.0, 2.0], [1.0, 2.0]) == pytest.approx(0.5)
    assert M.mia_auc([1.0, 3.0], [2.0, 4.0]) == pytest.approx(3 / 4)


def test_privleak():
    assert M.privleak(0.5, 0.5) == 0.0
    assert M.privleak(1.0, 0.5) == pytest.approx(-100.0)  # forget set perfectly recognisable
    assert M.privleak(0.4, 0.5) == pytest.approx(20.0)
    with pytest.raises(UnlearnError, match="undefined"):
        M.privleak(0.5, 1.0)


def test_mia_scores_min_k_and_zlib():
    stats = M.TokenStats(logprobs=np.array([-1.0, -2.0, -3.0, -4.0, -5.0]), correct=np.ones(5, bool),
                         zscores=np.array([0.5, -1.0, 2.0, -2.0, 0.0]))
    s = M.mia_scores(stats, "some text", k=0.4)
    assert s["loss"] == pytest.approx(3.0)
    assert s["min_k"] == pytest.approx(4.5)  # the 2 lowest log-probs: -5, -4
    assert s["min_k_plus_plus"] == pytest.approx(1.5)  # the 2 lowest z-scores: -2, -1
    assert s["zlib"] == pytest.approx(3.0 / len(zlib.compress(b"some text")))


def test_token_statistics_on_hand_built_logits():
    # position 0 predicts label 0 with p = [3/4, 1/4]; position 1 predicts label 1 with a uniform (tied) distribution
    logits = torch.tensor([[[math.log(3.0), 0.0], [0.0, 0.0], [5.0, 5.0]]])
    labels = torch.tensor([[-100, 0, 1]])
    (st,) = M.token_statistics(logits, labels)
    assert st.logprobs == pytest.approx([math.log(0.75), math.log(0.5)])
    assert list(st.correct) == [True, False]  # a tie is not a correct prediction of token 1 (argmax picks 0)
    p = np.array([0.75, 0.25])
    mu = (p * np.log(p)).sum()
    sigma = math.sqrt((p * np.log(p) ** 2).sum() - mu**2)
    assert st.zscores[0] == pytest.approx((math.log(0.75) - mu) / sigma, rel=1e-5)
    assert st.mean_nll == pytest.approx(-(math.log(0.75) + math.log(0.5)) / 2)


def test_token_statistics_ignores_padding_on_either_side():
    torch.manual_seed(0)
    logits = torch.randn(1, 4, 7)
    labels = torch.tensor([[-100, 3, 5, 1]])
    (ref,) = M.token_statistics(logits, labels)
    left = torch.cat([torch.randn(1, 2, 7), logits], dim=1)
    (padded,) = M.token_statistics(left, torch.tensor([[-100, -100, -100, 3, 5, 1]]))
    np.testing.assert_allclose(padded.logprobs, ref.logprobs, rtol=1e-6)
    np.testing.assert_array_equal(padded.correct, ref.correct)


def test_metrics_load_the_evaluate_way():
    import evaluate

    from hf_unlearn.eval.hf_metrics import UNLEARNING_METRIC_PATH

    rouge = evaluate.load(UNLEARNING_METRIC_PATH, "rouge_l")
    out = rouge.compute(predictions=["the cat on the mat"], references=["the cat sat on the mat"])
    assert out == pytest.approx({"rouge_l_recall": 5 / 6, "rouge_l_f1": 10 / 11})
    auc = evaluate.load(UNLEARNING_METRIC_PATH, "mia_auc")
    assert auc.compute(predictions=[0.1, 0.2, 0.9, 0.8], references=[1, 1, 0, 0]) == {"auc": 1.0}
