"""Multiple-choice prompt format, per-choice scoring and accuracy (hf_unlearn.eval.tasks)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_unlearn.errors import UnlearnError
from hf_unlearn.eval.tasks import (
    MultipleChoiceCollator,
    accuracy,
    choice_score_grid,
    encode_mc_row,
    evaluate_multiple_choice,
    format_mc_prompt,
    multiple_choice_loss,
    sequence_logprob,
)

ROW = {"id": "r0", "context": "It rained all night.", "question": "The ground is wet.",
       "choices": ["entailment", "not_entailment"], "label": 0}


def _rows(n=6):
    return [{"id": f"r{i}", "context": None, "question": f"Is {i} even?", "choices": ["yes", "no", "maybe"][: 2 + i % 2],
             "label": i % 2} for i in range(n)]


def test_prompt_lists_context_question_choices_and_ends_with_answer():
    p = format_mc_prompt(ROW)
    assert p == ("Context: It rained all night.\nQuestion: The ground is wet.\nChoices:\n- entailment\n"
                 "- not_entailment\nAnswer:")
    assert "Context" not in format_mc_prompt({**ROW, "context": None})
    assert "Choices" not in format_mc_prompt(ROW, list_choices=False)


def test_encoding_appends_each_choice_and_cuts_the_prompt_from_the_left(gpt2_tokenizer):
    tok = gpt2_tokenizer
    full = encode_mc_row(ROW, tok, max_length=512)
    assert len(full) == 2
    prompt_ids = tok(format_mc_prompt(ROW), add_special_tokens=False)["input_ids"]
    for (ids, n_prompt), choice in zip(full, ROW["choices"]):
        assert ids[1:n_prompt] == prompt_ids  # after the BOS token
        assert ids[n_prompt:] == tok(" " + choice, add_special_tokens=False)["input_ids"]
    short = encode_mc_row(ROW, tok, max_length=12)
    for ids, n_prompt in short:
        assert len(ids) <= 12
        assert ids[n_prompt - 2: n_prompt] == prompt_ids[-2:]  # "Answer:" survives the cut


def test_sequence_logprob_matches_hand_computation():
    # vocab 3, one sequence [0, 1, 2] whose last two tokens are the choice
    logits = torch.tensor([[[0.0, math.log(3.0), 0.0], [math.log(2.0), 0.0, math.log(2.0)], [0.0, 0.0, 0.0]]])
    ids = torch.tensor([[0, 1, 2]])
    target = torch.tensor([[0, 1, 1]])
    lp1 = math.log(3 / 5)  # p(token 1 | pos 0) = 3 / (1 + 3 + 1)
    lp2 = math.log(2 / 5)  # p(token 2 | pos 1) = 2 / (2 + 1 + 2)
    assert sequence_logprob(logits, ids, target, normalize=False).item() == pytest.approx(lp1 + lp2)
    assert sequence_logprob(logits, ids, target, normalize=True).item() == pytest.approx((lp1 + lp2) / 2)


def test_score_grid_marks_missing_choices_and_loss_is_cross_entropy():
    seq = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.1])
    grid = choice_score_grid(seq, torch.tensor([0, 0, 0, 1, 1]), torch.tensor([0, 1, 2, 0, 1]), 2)
    assert grid.shape == (2, 3) and math.isinf(grid[1, 2].item())
    labels = torch.tensor([1, 0])
    row0 = -2.0 - math.log(math.exp(-1) + math.exp(-2) + math.exp(-0.5))
    row1 = -3.0 - math.log(math.exp(-3) + math.exp(-0.1))
    assert multiple_choice_loss(grid, labels).item() == pytest.approx(-(row0 + row1) / 2)


def test_accuracy_and_its_errors():
    assert accuracy([0, 1, 1, 0], [0, 1, 0, 0]) == 0.75
    with pytest.raises(UnlearnError, match="predictions"):
        accuracy([0], [0, 1])
    with pytest.raises(UnlearnError, match="empty"):
        accuracy([], [])


def test_batched_scoring_equals_one_row_at_a_time(tiny_llama, gpt2_tokenizer):
    from datasets import Dataset

    ds = Dataset.from_list(_rows(6))
    a = evaluate_multiple_choice(tiny_llama, gpt2_tokenizer, ds, batch_size=4, hidden_states=True, max_length=64)
    b = evaluate_multiple_choice(tiny_llama, gpt2_tokenizer, ds, batch_size=1, hidden_states=True, max_length=64)
    assert a.predictions == b.predictions
    assert a.true_prob == pytest.approx(b.true_prob, abs=1e-5)
    assert a.hidden_states.shape == (3, 6, 32)  # embeddings + 2 layers, rows, hidden
    assert abs(a.hidden_states - b.hidden_states).max() < 1e-4
    assert a.n_choices == [2, 3, 2, 3, 2, 3] and a.chance == pytest.approx((0.5 + 1 / 3) / 2)
    assert a.accuracy == accuracy(a.predictions, a.labels)


def test_prediction_is_the_best_length_normalised_choice(tiny_llama, gpt2_tokenizer):
    from datasets import Dataset

    row = _rows(2)[1]
    res = evaluate_multiple_choice(tiny_llama, gpt2_tokenizer, Dataset.from_list([row]), max_length=64)
    means = []
    for ids, n_prompt in encode_mc_row(row, gpt2_tokenizer, 64):
        with torch.no_grad():
            logp = torch.log_softmax(tiny_llama(torch.tensor([ids])).logits[0], -1)
        means.append(sum(logp[t - 1, ids[t]].item() for t in range(n_prompt, len(ids))) / (len(ids) - n_prompt))
    assert res.predictions == [max(range(len(means)), key=means.__getitem__)]
    probs = torch.softmax(torch.tensor(means), 0)
    assert res.true_prob[0] == pytest.approx(probs[row["label"]].item(), abs=1e-5)


@pytest.mark.parametrize("bad, match", [
    ({"label": 2}, "outside"),
    ({"label": -1}, "outside"),
    ({"choices": ["only"], "label": 0}, "at least 2"),
])
def test_bad_rows_are_refused(tiny_llama, gpt2_tokenizer, bad, match):
    from datasets import Dataset

    with pytest.raises(UnlearnError, match=match):
        evaluate_multiple_choice(tiny_llama, gpt2_tokenizer, Dataset.from_list([{**ROW, **bad}]))
    with pytest.raises(UnlearnError, match=match):
        MultipleChoiceCollator(gpt2_tokenizer)([{**ROW, **bad}])


def test_empty_split_is_refused(tiny_llama, gpt2_tokenizer):
    from datasets import Dataset

    empty = Dataset.from_list(_rows(2)).select([])
    with pytest.raises(UnlearnError, match="empty"):
        evaluate_multiple_choice(tiny_llama, gpt2_tokenizer, empty)
