"""UnlearningEvalCallback inside a real Trainer run on a tiny Llama."""

import pytest

from hf_unlearn.errors import UnlearnError

from .conftest import TOFU_DIR

EVAL = dict(tofu_path=TOFU_DIR, max_items=2, max_new_tokens=2, batch_size=8)


def _trainer(tmp_path, model, tok, callback, max_steps=2):
    from transformers import Trainer, TrainingArguments

    from hf_unlearn.data import QACollator, load_tofu, tokenize_qa

    train = tokenize_qa(load_tofu("forget10", TOFU_DIR).select(range(8)), tok, max_length=64)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4,
                             learning_rate=1e-2, report_to=[], save_strategy="no", logging_steps=1,
                             disable_tqdm=True, use_cpu=True)
    return Trainer(model=model, args=args, train_dataset=train, data_collator=QACollator.from_tokenizer(tok),
                   callbacks=[callback])


@pytest.mark.slow  # a Trainer run with evaluation and checkpoints (~12 s)
def test_callback_logs_through_the_trainer_and_keeps_the_best_checkpoint(tmp_path, tiny_llama, gpt2_tokenizer):
    from hf_unlearn.eval.callback import UnlearningEvalCallback

    cb = UnlearningEvalCallback(gpt2_tokenizer, eval_steps=1, eval_kwargs=EVAL,
                                metric_for_best="forget_probability", greater_is_better=False)
    trainer = _trainer(tmp_path, tiny_llama, gpt2_tokenizer, cb)
    cb.trainer = trainer
    trainer.train()
    logged = [h for h in trainer.state.log_history if "unlearn/forget_probability" in h]
    assert [h["step"] for h in logged] == [1, 2]  # the end-of-training evaluation at step 2 is not repeated
    assert [h["step"] for h in cb.history] == [1, 2]
    best = min(cb.history, key=lambda h: h["forget_probability"])
    assert cb.best_step == best["step"] and cb.best_score == pytest.approx(best["forget_probability"])
    saved = tmp_path / "best_unlearning_checkpoint"
    assert (saved / "config.json").is_file() and (saved / "unlearning_eval.json").is_file()
    assert cb.best_model_path == str(saved)
    assert cb.state()["attributes"] == {"best_score": cb.best_score, "best_step": cb.best_step}


def test_callback_without_trainer_uses_log_history_and_callable_score(tmp_path, tiny_llama, gpt2_tokenizer):
    from hf_unlearn.eval.callback import UnlearningEvalCallback

    cb = UnlearningEvalCallback(eval_steps=0, eval_kwargs=EVAL,  # tokenizer from the Trainer's processing_class
                                metric_for_best=lambda s: s["retain_probability"] - s["forget_probability"])
    trainer = _trainer(tmp_path, tiny_llama, gpt2_tokenizer, cb, max_steps=1)
    trainer.processing_class = gpt2_tokenizer
    trainer.callback_handler.processing_class = gpt2_tokenizer
    trainer.train()
    logged = [h for h in trainer.state.log_history if "unlearn/model_utility" in h]
    assert len(logged) == 1 and logged[0]["step"] == 1 and "unlearn/best_score" in logged[0]


def test_unknown_metric_for_best_is_a_clear_error():
    from hf_unlearn.eval.callback import UnlearningEvalCallback

    cb = UnlearningEvalCallback(eval_steps=1, metric_for_best="accuracy")
    with pytest.raises(UnlearnError, match="accuracy.*forget_probability"):
        cb._score({"forget_probability": 0.5, "model_utility": 0.3})
    with pytest.raises(UnlearnError, match="eval_steps"):
        UnlearningEvalCallback(eval_steps=-1)
