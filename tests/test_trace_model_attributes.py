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


@pytest.mark.parametrize("build", [_resized, *[pytest.param(b, marks=pytest.mark.slow) for b in (_config_edited, _checkpointed)]])
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
    assert run.header["fidelity"]["proof"]["proven"]
    forget = run.ids_at_steps([1])[:1]
    assert delete(run.path, forget, tmp_path / "del")[1]["verified"]
    plain = independent_counterfactual(tok, data, build(tok), run.path, forget, tmp_path / "plain", **KW)
    oracle = load_state(tmp_path / "del" / "oracle")["model"]
    assert not [n for n, t in oracle.items() if not torch.equal(t, plain[n])]
