"""What a recording must say about itself (issue #31): a dynamic RoPE is a hazard at construction, a non-finite loss
or state is a hazard named with its step, and a checkpoint cut short by a kill is written again when the run
resumes (it used to be skipped, with a warning on every later open)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import TrainerCallback

from hf_unlearn.errors import UnlearnError

from .test_trace_common import get_trace_data, record, tiny, train_args


def _with_rope(family: str, tok, rope: dict):
    from transformers import (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  max_position_embeddings=64, rope_scaling=rope)
    torch.manual_seed(0)
    if family == "gpt_neox":
        return GPTNeoXForCausalLM(GPTNeoXConfig(**common))
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config)}[family]
    return cls(cfg(**common, num_key_value_heads=1))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt_neox"])
def test_a_dynamic_rope_is_refused_at_construction_with_the_reason(tmp_path, family):
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer

    tok, data = get_trace_data()
    kw = dict(args=train_args(tmp_path, max_steps=2), train_dataset=data.select(range(8)),
              data_collator=QACollator.from_tokenizer(tok))
    model = _with_rope(family, tok, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(UnlearnError, match="rotary embedding is 'dynamic'.*inv_freq buffers change with the longest "
                                           "sequence"):
        TraceRecordingTrainer(model=model, **kw)
    trainer = TraceRecordingTrainer(model=model, trace_allow_hazards=True, **kw)  # recorded, hazard listed
    trainer.train()
    hazards = json.loads((tmp_path / "trace" / "header.json").read_text())["hazards"]
    assert any("'dynamic'" in h for h in hazards)
    # a static scaling is not a hazard
    TraceRecordingTrainer(model=_with_rope(family, tok, {"rope_type": "linear", "factor": 2.0}), **kw)


class Diverge(TrainerCallback):
    """A run that trains to NaN: after optimizer step 2 a weight holds an infinity (an fp16 overflow would). At the
    top level of this module with no attributes, so it is a recorded callback: replays run it again (a callback the
    replay could not run would make the run not deletable, which is a different refusal)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2:
            with torch.no_grad():
                next(p for p in model.parameters() if p.dim() == 2)[0, 0] = float("inf")


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2"])
@pytest.mark.parametrize("every", [1, 4])
def test_a_non_finite_loss_or_state_is_a_hazard_named_with_its_step(tmp_path, family, every, capsys):
    """every=1: the checkpoint after 2 steps finds the infinity first; every=4: the loss of optimizer step 2 does.
    forget then says HAZARD with the step, and the receipt carries it (never a silent VERIFIED)."""
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.models import build_tiny_model
    from hf_unlearn.trace import open_run

    tok, data = get_trace_data()
    model = build_tiny_model(family, tok, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    with pytest.warns(UserWarning, match="NaN or infinity|loss was not finite"):
        record(tok, data.select(range(24)), tmp_path / "rec", model=model, every=every, max_steps=5,
               gradient_accumulation_steps=1, trainer_kwargs={"callbacks": [Diverge()]})
    run = tmp_path / "rec" / "trace"
    hazards = json.loads((run / "header.json").read_text())["hazards"]
    expected = "at the checkpoint after 2 optimizer steps" if every == 1 else "at optimizer step 2"
    assert len(hazards) == 1 and expected in hazards[0], hazards
    if every == 4 or family != "llama":
        return
    opened = open_run(run)
    write_ids(tmp_path / "early.jsonl", opened.ids_at_steps([1])[:1])  # the dummy's step is still finite
    write_ids(tmp_path / "late.jsonl", opened.ids_at_steps([4])[:1])  # after the state became non-finite
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["forget", str(run), "--ids", str(tmp_path / "early.jsonl"), "--out", str(tmp_path / "out"),
                     "--no-progress", "--oracle"])
        out, err = capsys.readouterr()
        assert code == 0, err[-2000:]
        assert "HAZARD (recorded with the run): parameter" in out and "after 2 optimizer steps" in out
        receipt = json.loads((tmp_path / "out" / "receipt.json").read_text())
        assert receipt["evidence"]["hazards"] == hazards and "hazard" in receipt["guarantee"]
        code = main(["forget", str(run), "--ids", str(tmp_path / "late.jsonl"), "--out", str(tmp_path / "late"),
                     "--no-progress", "--oracle"])
    out, err = capsys.readouterr()
    assert code == 1 and "received a non-finite gradient (nan) at optimizer step 4" in err
    assert "VERIFIED" not in out


def test_a_lora_runs_frozen_weight_turned_infinite_is_a_hazard_at_the_next_checkpoint(tmp_path):
    """A checkpoint after step 0 reads only what can have changed since the frozen base was read (the trainable
    parameters, and a frozen one whose tensor or version is not the one the store saved): an infinity written into
    the frozen embedding after step 2 is still named at the checkpoint after 2 steps."""
    from peft import LoraConfig, get_peft_model

    from hf_unlearn.models import build_tiny_model

    tok, data = get_trace_data()
    model = get_peft_model(build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2, seed=0),
                           LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    assert not next(p for p in model.parameters() if p.dim() == 2).requires_grad  # Diverge edits a frozen weight
    with pytest.warns(UserWarning, match="NaN or infinity|loss was not finite"):
        record(tok, data.select(range(24)), tmp_path / "rec", model=model, every=1, max_steps=4,
               gradient_accumulation_steps=1, trainer_kwargs={"callbacks": [Diverge()]})
    hazards = json.loads((tmp_path / "rec" / "trace" / "header.json").read_text())["hazards"]
    assert len(hazards) == 1 and "embed_tokens" in hazards[0] and "after 2 optimizer steps" in hazards[0], hazards


def test_a_checkpoint_cut_short_by_a_kill_is_written_again_on_resume(tmp_path):
    """A kill while the trace checkpoint of step 4 is written (after the Trainer saved checkpoint-4): the resumed run
    removes the partial folder, writes the checkpoint again and opens without a warning."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer, open_run
    from hf_unlearn.trace import recording as recording_module
    from hf_unlearn.trace.run import load_checkpoint

    tok, data = get_trace_data()
    data = data.select(range(32))
    key = b"k" * 32
    kw = dict(save_strategy="steps", save_steps=4, max_steps=8, gradient_accumulation_steps=1)
    record(tok, data, tmp_path / "full", trace_key=key, every=2, **kw)
    part = tmp_path / "part"
    real = recording_module.TraceWriter.save_checkpoint

    def killed_at_4(self, step, model, optimizer):
        if step == 4:
            d = self.run / "checkpoints" / "step-00000004"
            d.mkdir(parents=True)
            (d / "model.safetensors").write_bytes(b"half a file")  # then SIGKILL
            raise KeyboardInterrupt("killed while writing the checkpoint of step 4")
        return real(self, step, model, optimizer)

    def trainer():
        return TraceRecordingTrainer(model=tiny(tok), args=train_args(part, **kw), train_dataset=data,
                                     data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=2,
                                     trace_key=key, trace_checkpoint_retention="even")

    recording_module.TraceWriter.save_checkpoint = killed_at_4
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer().train()
    finally:
        recording_module.TraceWriter.save_checkpoint = real
    assert (part / "checkpoint-4").is_dir() and not (part / "trace" / "checkpoints" / "step-00000004" / "hashes.json").exists()
    trainer().train(resume_from_checkpoint=str(part / "checkpoint-4"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = open_run(part / "trace")
    assert not [str(w.message) for w in caught if "step 4" in str(w.message)]
    assert sorted(run.checkpoints()) == [0, 2, 4, 6, 8]
    full = open_run(tmp_path / "full" / "trace").checkpoints()
    for step in (4, 8):
        a, b = load_checkpoint(full[step])["model"], load_checkpoint(run.checkpoints()[step])["model"]
        assert all(torch.equal(a[n], b[n]) for n in a)
