"""Module attributes copied from the config at construction and left behind by an ordinary edit: a replay builds the
model from its config, so it must be given the recorded module's values."""

from __future__ import annotations

import pytest
import torch

from .test_trace_common import config_model, delete, get_trace_data, record

KW = dict(gradient_accumulation_steps=1, max_steps=4)


def _resized(tok):
    """Tokens added, then ``resize_token_embeddings`` (every chat recipe): ``config.vocab_size`` grows, the inner
    ``LlamaModel.vocab_size`` keeps the old value."""
    model = config_model("llama", tok)
    model.resize_token_embeddings(model.config.vocab_size + 8, mean_resizing=False)
    return model


def _config_edited(tok):
    """``config.attention_dropout`` set after the model was built: the attention modules keep their copy (0.0), so the
    run trains without dropout, while a model built from the config has it."""
    model = config_model("llama", tok)
    model.config.attention_dropout = 0.3
    return model


def _checkpointed(tok):
    """``model.gradient_checkpointing_enable(...)`` called by the program, ``TrainingArguments`` left at
    ``gradient_checkpointing=False`` (a common LoRA recipe): a replay built the model without it."""
    model = config_model("llama", tok)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _attributes_set(tok):
    """Attributes no config field names, set by the program after the model was built: an attention's ``scaling``,
    the rotary embedding's ``attention_scaling``, a norm's ``variance_epsilon``. The proof failed at step 0 and every
    deletion was refused without naming them."""
    model = config_model("llama", tok)
    model.model.layers[0].self_attn.scaling = 0.5
    model.model.rotary_emb.attention_scaling = 0.7
    model.model.norm.variance_epsilon = 1e-2
    return model


@pytest.mark.parametrize("build", [_resized, _attributes_set, *[pytest.param(b, marks=pytest.mark.slow)
                                                                 for b in (_config_edited, _checkpointed)]])
def test_a_module_attribute_left_behind_by_an_edit_replays_as_recorded(tmp_path, build):
    """Attack (ordinary programs): ``resize_token_embeddings`` recorded, proved, and then every deletion refused (the
    proof's replay rebuilt ``LlamaModel.vocab_size`` from the config: "other program controls"); an edited
    ``config.attention_dropout`` sealed "the engine did not reproduce", and so did a program's own
    ``gradient_checkpointing_enable()``: every deletion was refused. The recording keeps the module attributes that
    disagree with the config, and the checkpointing, and a replay gives them back: VERIFIED and equal to the plain
    ``Trainer`` on the same model (GQA Llama)."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.verification import load_state

    from .test_trace_fidelity import independent_counterfactual

    tok, data = get_trace_data()
    data = data.select(range(16))
    record(tok, data, tmp_path / "rec", model=build(tok), **KW)
    run = open_run(tmp_path / "rec" / "trace")
    assert run.header["model"]["layout"].get("attributes" if build is not _checkpointed else "activation_checkpointing")
    if build is _attributes_set:
        assert run.header["model"]["layout"]["attributes"] == {"model.layers.0.self_attn": {"scaling": 0.5},
                                                               "model.rotary_emb": {"attention_scaling": 0.7},
                                                               "model.norm": {"variance_epsilon": 1e-2}}
    assert run.header["fidelity"]["proof"]["proven"]
    forget = run.ids_at_steps([1])[:1]
    assert delete(run.path, forget, tmp_path / "del")[1]["verified"]
    plain = independent_counterfactual(tok, data, build(tok), run.path, forget, tmp_path / "plain", **KW)
    oracle = load_state(tmp_path / "del" / "oracle")["model"]
    assert not [n for n, t in oracle.items() if not torch.equal(t, plain[n])]


def _trainer(tok, data, out, model):
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer

    from .test_trace_common import train_args

    return TraceRecordingTrainer(model=model, args=train_args(out, **KW), train_dataset=data,
                                 data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=2)


def test_a_module_replaced_after_loading_is_refused_at_construction(tmp_path):
    """Attack (C1): ``model.lm_head`` replaced by an ``nn.Linear`` with a bias before training trained the whole run,
    and then ``train()`` raised ``Unexpected key(s) in state_dict: "lm_head.bias"`` in the recording's own proof (a
    replay rebuilds the model from its class and config and loads every checkpoint into it strictly). The model a
    replay builds is compared with the live one (names, shapes, dtypes, on the meta device) at construction, and
    the first differing tensor is named in one line."""
    from hf_unlearn.errors import UnlearnError

    tok, data = get_trace_data()
    model = config_model("llama", tok)
    model.lm_head = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with pytest.raises(UnlearnError, match=r"differs from this one at lm_head\.bias .*part of the model's class or "
                                           "config") as e:
        _trainer(tok, data.select(range(8)), tmp_path, model)
    assert "\n" not in str(e.value)
    model = config_model("llama", tok)
    model.lm_head.to(torch.float64)  # a module cast alone: the replay's model would hold it in float32
    with pytest.raises(UnlearnError, match=r"at lm_head\.weight \(float64 \[\d+, \d+\]; rebuilt: float32"):
        _trainer(tok, data.select(range(8)), tmp_path, model)


def _lora(tok):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(config_model("llama", tok), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                  modules_to_save=["lm_head"], task_type="CAUSAL_LM"))


@pytest.mark.parametrize("build", [
    _resized, _lora, lambda tok: config_model("gemma3", tok, tie_word_embeddings=True),
    lambda tok: config_model("gpt_neox", tok), lambda tok: config_model("qwen2", tok).to(torch.bfloat16)],
    ids=["resized", "lora", "gemma3-tied", "gpt_neox", "qwen2-bf16"])
def test_ordinary_models_are_not_refused_as_unrebuildable(tmp_path, build):
    """The comparison with the rebuilt model refuses none of the ordinary ones: tokens added and embeddings resized,
    a LoRA adapter with a saved module, tied embeddings, GPT-NeoX, a model cast to bf16 (construction only; the
    resized model's run is recorded and deleted above)."""
    tok, data = get_trace_data()
    _trainer(tok, data.select(range(8)), tmp_path, build(tok))
