"""UnlearningTrainer: input checks, forget/retain pairing, the reference model, metrics, the card contract."""

from __future__ import annotations

import pytest
import torch

from hf_unlearn.errors import UnlearnError

from .methods_helpers import FORGET_IDS, memorised_model, raw_rows, tiny_data

COMMON = dict(report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=1,
              per_device_train_batch_size=2, learning_rate=1e-3)


def _config(cls, tmp_path, **kw):
    return cls(output_dir=str(tmp_path), **{**COMMON, **kw})


def _graddiff(tmp_path, model=None, forget=None, retain=None, tok=None, eval_dataset=None, **kw):
    from hf_unlearn.methods import GradDiffConfig, GradDiffTrainer

    t, f, r = tiny_data()
    return GradDiffTrainer(model=model if model is not None else memorised_model(),
                           args=_config(GradDiffConfig, tmp_path, **kw),
                           forget_dataset=f if forget is None else forget, retain_dataset=r if retain is None else retain,
                           processing_class=t if tok is None else tok, eval_dataset=eval_dataset)


# ------------------------------------------------------------------ bad input, each a clear UnlearnError


def test_empty_forget_set(tmp_path):
    _, forget, _ = tiny_data()
    with pytest.raises(UnlearnError, match="forget set is empty"):
        _graddiff(tmp_path, forget=forget.select([]))


def test_ids_in_both_forget_and_retain(tmp_path):
    from datasets import concatenate_datasets

    _, forget, retain = tiny_data()
    with pytest.raises(UnlearnError, match=r"1 id\(s\) are in both the forget and the retain set \(8\)"):
        _graddiff(tmp_path, retain=concatenate_datasets([retain, forget.select([0])]))


def test_tokenizer_without_pad_token(tmp_path):
    import copy

    tok = copy.deepcopy(tiny_data()[0])
    tok.pad_token = None
    with pytest.raises(UnlearnError, match="no pad token"):
        _graddiff(tmp_path, tok=tok)


def test_answers_empty_after_truncation_raw_rows(tmp_path):
    rows = raw_rows()
    forget = rows.filter(lambda r: r["id"] in FORGET_IDS)
    retain = rows.filter(lambda r: r["id"] not in FORGET_IDS)
    with pytest.raises(UnlearnError, match="empty after truncation"):
        _graddiff(tmp_path, forget=forget, retain=retain, max_length=8)


def test_answers_empty_in_pretokenised_rows(tmp_path):
    _, forget, _ = tiny_data()
    masked = forget.map(lambda r: {"labels": [-100] * len(r["labels"])})
    with pytest.raises(UnlearnError, match="has no answer token"):
        _graddiff(tmp_path, forget=masked)


@pytest.mark.parametrize("field", ["alpha", "rho"])
@pytest.mark.parametrize("value", [0.0, 1.0, -0.5, 1.5])
def test_alpha_rho_outside_unit_interval(tmp_path, field, value):
    from hf_unlearn.methods import MASCConfig

    with pytest.raises(UnlearnError, match=f"{field} must lie strictly between 0 and 1"):
        _config(MASCConfig, tmp_path, **{field: value})


def test_missing_retain_set_is_an_error_only_when_used(tmp_path):
    from hf_unlearn.methods import GradAscentConfig, GradAscentTrainer, GradDiffConfig, GradDiffTrainer

    tok, forget, _ = tiny_data()
    with pytest.raises(UnlearnError, match="needs a retain set"):
        GradDiffTrainer(model=memorised_model(), args=_config(GradDiffConfig, tmp_path), forget_dataset=forget,
                        processing_class=tok)
    GradAscentTrainer(model=memorised_model(), args=_config(GradAscentConfig, tmp_path), forget_dataset=forget,
                      processing_class=tok)


# ------------------------------------------------------------------ data


def test_raw_qa_rows_are_tokenised(tmp_path):
    rows = raw_rows()
    forget = rows.filter(lambda r: r["id"] in FORGET_IDS)
    retain = rows.filter(lambda r: r["id"] not in FORGET_IDS)
    trainer = _graddiff(tmp_path, forget=forget, retain=retain, max_length=96)
    _, tokenised, _ = tiny_data()
    assert trainer.train_dataset["input_ids"] == tokenised["input_ids"]
    assert trainer.forget_ids == FORGET_IDS


def test_retain_stream_is_seeded_cycles_and_depends_only_on_the_draw(tmp_path):
    trainer = _graddiff(tmp_path, retain_batch_size=3)
    retain_ids = set(tiny_data()[2]["id"])
    first_pass = [trainer.retain_batch(d)["id"].tolist() for d in range(2)]  # 8 rows, 3 per batch: 2 per pass
    assert all(len(b) == 3 for b in first_pass)
    assert len(set(sum(first_pass, []))) == 6 and set(sum(first_pass, [])) <= retain_ids
    assert trainer.retain_batch(2)["id"].tolist() != first_pass[0]  # a new permutation for the next pass
    again = _graddiff(tmp_path, retain_batch_size=3)  # a fresh trainer (e.g. after resume) draws the same batches
    assert again.retain_batch(5)["id"].tolist() == trainer.retain_batch(5)["id"].tolist()
    other_seed = _graddiff(tmp_path, retain_batch_size=3, seed=7)
    assert [other_seed.retain_batch(d)["id"].tolist() for d in range(2)] != first_pass


def test_joint_forward_matches_separate_forwards(tmp_path):
    trainer = _graddiff(tmp_path, retain_batch_size=3)
    forget = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    retain = trainer.retain_batch(0)
    f_out, r_out = trainer.joint_forward(trainer.model, forget, retain, output_hidden_states=True)
    with torch.no_grad():
        f_alone = trainer.model(**trainer._model_inputs(forget), output_hidden_states=True)
        r_alone = trainer.model(**trainer._model_inputs(retain))
    assert f_out.logits.shape == f_alone.logits.shape and r_out.logits.shape == r_alone.logits.shape
    assert torch.allclose(f_out.logits, f_alone.logits, atol=1e-4)
    assert torch.allclose(r_out.logits, r_alone.logits, atol=1e-4)
    assert torch.allclose(f_out.hidden_states[1], f_alone.hidden_states[1], atol=1e-4)


# ------------------------------------------------------------------ reference model


def test_reference_is_a_frozen_copy_without_peft(tmp_path):
    from hf_unlearn.methods import NPOConfig, NPOTrainer

    tok, forget, _ = tiny_data()
    model = memorised_model()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = NPOTrainer(model=model, args=_config(NPOConfig, tmp_path, max_steps=2), forget_dataset=forget,
                         processing_class=tok)
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    trainer.train()
    ref_state = trainer.ref_model.state_dict()
    assert all(torch.equal(ref_state[k], v) for k, v in original.items())
    assert any(not torch.equal(trainer.model.state_dict()[k], v) for k, v in original.items())


def test_reference_is_the_adapter_disabled_base_with_peft(tmp_path):
    from peft import LoraConfig

    from hf_unlearn.methods import NPOConfig, NPOTrainer

    tok, forget, _ = tiny_data()
    base = memorised_model()
    trainer = NPOTrainer(model=memorised_model(), args=_config(NPOConfig, tmp_path, max_steps=2), forget_dataset=forget,
                         processing_class=tok, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                      init_lora_weights=False))
    assert trainer.ref_model is None and trainer.is_peft
    trainer_batch = trainer.data_collator([forget[0], forget[1]])
    batch = {k: trainer_batch[k] for k in ("input_ids", "attention_mask")}
    ref_logits = trainer.reference_outputs(trainer_batch).logits
    with torch.no_grad():
        assert torch.allclose(ref_logits, base(**batch).logits, atol=1e-5)
        assert not torch.allclose(trainer.model(**batch).logits, ref_logits, atol=1e-4)  # the adapter is active


def test_lora_reference_forward_runs_without_dropout_in_training_mode(tmp_path):
    """With dropout everywhere (LoRA, attention, disable_dropout=False) and the model in training mode, two
    reference forwards of one batch are identical and equal the base model in eval mode."""
    from peft import LoraConfig

    from hf_unlearn.methods import NPOConfig, NPOTrainer

    tok, forget, _ = tiny_data()
    base = memorised_model()
    model = memorised_model()
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    trainer = NPOTrainer(model=model, args=_config(NPOConfig, tmp_path, disable_dropout=False), forget_dataset=forget,
                         processing_class=tok,
                         peft_config=LoraConfig(r=4, lora_dropout=0.5, target_modules=["q_proj", "v_proj"]))
    batch = trainer.data_collator([forget[0], forget[1]])
    trainer.model.train()
    with torch.no_grad():  # the test would catch the old behaviour: dropout is live in training mode
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        with unwrapped.disable_adapter():
            a = trainer.model(**trainer._model_inputs(batch)).logits
            b = trainer.model(**trainer._model_inputs(batch)).logits
        assert not torch.equal(a, b)
    first = trainer.reference_outputs(batch).logits
    second = trainer.reference_outputs(batch).logits
    assert torch.equal(first, second)
    assert trainer.model.training  # the training mode is restored
    with torch.no_grad():
        assert torch.allclose(first, base(**trainer._model_inputs(batch)).logits, atol=1e-5)


def test_disable_dropout_also_zeroes_attention_dropout_rates(tmp_path):
    model = memorised_model()
    model.config.attention_dropout = 0.3
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.3
    trainer = _graddiff(tmp_path, model=model)
    assert all(layer.self_attn.attention_dropout == 0.0 for layer in trainer.model.model.layers)


def test_validation_fraction_holds_out_a_seeded_share_and_keeps_it_in_the_request(tmp_path):
    trainer = _graddiff(tmp_path, validation_fraction=0.25)
    assert len(trainer.held_out_forget_ids) == 1 and len(trainer.train_dataset) == 3
    assert trainer.forget_ids == trainer.trained_forget_ids + trainer.held_out_forget_ids
    assert sorted(trainer.forget_ids) == FORGET_IDS  # the card keys every forget id, held out or not
    assert _graddiff(tmp_path, validation_fraction=0.25).held_out_forget_ids == trainer.held_out_forget_ids
    with pytest.raises(UnlearnError, match="leaves no row to train on"):
        _graddiff(tmp_path, validation_fraction=0.9)
    with pytest.raises(UnlearnError, match=r"validation_fraction must lie in \[0, 1\)"):
        _config(__import__("hf_unlearn.methods", fromlist=["GradDiffConfig"]).GradDiffConfig, tmp_path,
                validation_fraction=1.0)


# ------------------------------------------------------------------ metrics and card


def test_method_metrics_are_logged_and_card_info_follows_the_contract(tmp_path):
    import json

    trainer = _graddiff(tmp_path, max_steps=2)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged and all("forget_loss" in h and "retain_loss" in h for h in logged)
    info = trainer.unlearning_card_info()
    assert {"method", "hyperparameters", "forget_ids", "citation", "paper"} <= set(info)
    assert info["method"] == "GradDiff" and info["forget_ids"] == FORGET_IDS
    assert info["hyperparameters"]["retain_loss"] == "ce" and info["hyperparameters"]["max_steps"] == 2
    json.dumps(info)  # JSON-able
    assert "output_dir" not in info["hyperparameters"]  # only the method's own fields and the budget


def test_evaluate_reports_answer_cross_entropy_of_raw_eval_rows(tmp_path):
    from .methods_helpers import answer_loss

    rows = raw_rows()
    trainer = _graddiff(tmp_path, eval_dataset=rows.select(range(4)), max_length=96)
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(answer_loss(trainer.model, trainer.eval_dataset), rel=1e-4)
