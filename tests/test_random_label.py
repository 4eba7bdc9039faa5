"""MultipleChoiceTrainer and RandomLabelForgetTrainer on a tiny Llama (hf_unlearn.methods.random_label)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from hf_unlearn.errors import UnlearnError
from hf_unlearn.eval.tasks import evaluate_multiple_choice
from hf_unlearn.methods.random_label import (
    MultipleChoiceConfig,
    MultipleChoiceTrainer,
    RandomLabelConfig,
    RandomLabelForgetTrainer,
    assign_random_labels,
)

WORDS = ["apple", "river", "stone", "cloud", "tiger", "piano", "lemon", "chair"]


def separable_task(n=16):
    """The label is a function of the word (even word index -> 'cat'): easy to fit."""
    from datasets import Dataset

    return Dataset.from_list([{"id": f"s{i}", "context": None, "question": f"{WORDS[i % 8]} {i}",
                               "choices": ["cat", "dog"], "label": (i % 8) % 2} for i in range(n)])


def _args(cls, tmp_path, epochs, **kw):
    return cls(output_dir=str(tmp_path), learning_rate=5e-3, num_train_epochs=epochs, per_device_train_batch_size=8,
               max_length=32, save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, **kw)


@pytest.fixture(scope="session")  # session: a module fixture was built again when xdist interleaved modules
def finetuned(tmp_path_factory):
    """A tiny Llama fine-tuned on the separable task, with its accuracy before and after."""
    from hf_unlearn.models import build_tiny_model, load_tokenizer

    from .conftest import TOKENIZERS

    tok = load_tokenizer(TOKENIZERS / "gpt2")
    model = build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2)
    ds = separable_task()
    before = evaluate_multiple_choice(model, tok, ds, max_length=32).accuracy
    trainer = MultipleChoiceTrainer(model=model, args=_args(MultipleChoiceConfig, tmp_path_factory.mktemp("ft"), 8),
                                    train_dataset=ds, processing_class=tok)
    trainer.train()
    return trainer, tok, ds, before


def test_uniform_labels_are_seeded_reproducible_and_uniform():
    labels, n = [0] * 3000, [3] * 3000
    a = assign_random_labels(labels, n, "uniform", seed=1)
    assert a == assign_random_labels(labels, n, "uniform", seed=1)
    assert a != assign_random_labels(labels, n, "uniform", seed=2)
    freq = Counter(a)
    assert set(freq) == {0, 1, 2} and all(abs(c / 3000 - 1 / 3) < 0.04 for c in freq.values())


def test_flipped_labels_never_keep_the_true_label():
    true = [i % 4 for i in range(400)]
    n = [4 if i % 3 else 2 for i in range(400)]
    true = [t % k for t, k in zip(true, n)]
    flipped = assign_random_labels(true, n, "flipped", seed=0)
    assert all(f != t and 0 <= f < k for f, t, k in zip(flipped, true, n))
    assert len(set(flipped)) == 4  # every wrong choice gets drawn


@pytest.mark.parametrize("labels, n, mode, match", [
    ([0], [2], "shuffled", "label_mode"),
    ([2], [2], "uniform", "outside"),
    ([0], [1], "flipped", "at least 2"),
    ([0, 1], [2], "uniform", "rows"),
])
def test_assign_random_labels_refuses_bad_input(labels, n, mode, match):
    with pytest.raises(UnlearnError, match=match):
        assign_random_labels(labels, n, mode)


def test_config_refuses_an_unknown_label_mode(tmp_path):
    with pytest.raises(UnlearnError, match="label_mode"):
        RandomLabelConfig(output_dir=str(tmp_path), label_mode="shuffled")


def test_finetuning_raises_train_accuracy(finetuned):
    trainer, tok, ds, before = finetuned
    after = trainer.score(ds).accuracy
    assert before <= 0.75 and after >= 0.9, (before, after)
    assert trainer.evaluate(ds)["eval_accuracy"] == pytest.approx(after)
    # every row's correctness under its label was logged from the training batches, at increasing steps
    assert set(trainer.correctness_history) == set(ds["id"])
    steps = [s for s, _ in trainer.correctness_history["s0"]]
    assert len(steps) == 8 and steps == sorted(steps)


@pytest.mark.slow  # a random-label training run (~18 s); the analysis is tested on its outputs in the default suite
def test_random_label_training_lowers_train_accuracy(finetuned, tmp_path):
    import copy

    trainer, tok, ds, _ = finetuned
    model = copy.deepcopy(trainer.model)
    forget = RandomLabelForgetTrainer(model=model, args=_args(RandomLabelConfig, tmp_path, 12, label_mode="flipped"),
                                      train_dataset=ds, processing_class=tok)
    forget.train()
    assert forget.score(ds).accuracy <= 0.25
    # history is logged against the true labels: rows end up wrong
    assert sum(not h[-1][1] for h in forget.correctness_history.values()) >= 12


def test_random_labels_are_fixed_before_training_and_true_labels_kept(finetuned, tmp_path):
    trainer, tok, ds, _ = finetuned
    args = _args(RandomLabelConfig, tmp_path, 1, label_mode="uniform", label_seed=7)
    t = RandomLabelForgetTrainer(model=trainer.model, args=args, train_dataset=ds, processing_class=tok)
    assert t.random_labels == assign_random_labels(ds["label"], [2] * len(ds), "uniform", 7)
    assert t.train_dataset["label"] == t.random_labels and t.train_dataset["true_label"] == ds["label"]
    again = RandomLabelForgetTrainer(model=trainer.model, args=args, train_dataset=ds, processing_class=tok)
    assert again.random_labels == t.random_labels


def test_unlearning_card_info(finetuned, tmp_path):
    trainer, tok, ds, _ = finetuned
    t = RandomLabelForgetTrainer(model=trainer.model, args=_args(RandomLabelConfig, tmp_path, 1, label_mode="flipped"),
                                 train_dataset=ds, processing_class=tok)
    info = t.unlearning_card_info()
    assert {"method", "hyperparameters", "forget_ids", "citation", "paper"} <= set(info)
    assert info["method"] == "RandomLabel" and info["forget_ids"] == ds["id"]
    assert "2409.02228" in info["paper"] and info["citation"].startswith("@article")
    assert info["hyperparameters"]["label_mode"] == "flipped" and info["extra"]["fraction_labels_changed"] == 1.0
    json.dumps(info)
    ft_info = trainer.unlearning_card_info()
    assert ft_info["method"] == "MultipleChoiceFineTune" and ft_info["forget_ids"] == []
    json.dumps(ft_info)


@pytest.mark.parametrize("bad, match", [({"label": 5}, "outside"), ({"choices": ["cat"], "label": 0}, "at least 2")])
def test_trainers_refuse_bad_rows(finetuned, tmp_path, bad, match):
    from datasets import Dataset

    trainer, tok, ds, _ = finetuned
    rows = [dict(r) for r in ds]
    rows[3].update(bad)
    bad_ds = Dataset.from_list(rows)
    with pytest.raises(UnlearnError, match=match):
        RandomLabelForgetTrainer(model=trainer.model, args=_args(RandomLabelConfig, tmp_path, 1),
                                 train_dataset=bad_ds, processing_class=tok)
    with pytest.raises(UnlearnError, match=match):
        MultipleChoiceTrainer(model=trainer.model, args=_args(MultipleChoiceConfig, tmp_path, 1),
                              train_dataset=bad_ds, processing_class=tok)


def test_trainer_refuses_an_empty_split_and_a_missing_tokenizer(finetuned, tmp_path):
    trainer, tok, ds, _ = finetuned
    with pytest.raises(UnlearnError, match="empty"):
        RandomLabelForgetTrainer(model=trainer.model, args=_args(RandomLabelConfig, tmp_path, 1),
                                 train_dataset=ds.select([]), processing_class=tok)
    with pytest.raises(UnlearnError, match="datasets.Dataset"):
        RandomLabelForgetTrainer(model=trainer.model, args=_args(RandomLabelConfig, tmp_path, 1),
                                 train_dataset=list(ds), processing_class=tok)
    with pytest.raises(UnlearnError, match="processing_class"):
        MultipleChoiceTrainer(model=trainer.model, args=_args(MultipleChoiceConfig, tmp_path, 1), train_dataset=ds)
