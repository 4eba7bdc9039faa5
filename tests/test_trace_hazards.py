"""Nothing a replay cannot reproduce gets through: NEFTune, custom optimizers and schedulers, PEFT, model families
with dropout and tied weights are recorded and replayed exactly; what cannot be is refused at construction."""

from __future__ import annotations

import json

import pytest
import torch

from .test_trace_common import delete, get_trace_data, record, replays_the_recording, tiny, train_args


def _family(name: str, tok, dropout: float = 0.0):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

    from hf_unlearn.models import build_tiny_model

    if name == "gpt2":
        return build_tiny_model("gpt2", tok, hidden_size=32, num_layers=2, num_heads=2, dropout=dropout)
    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, attention_dropout=dropout, tie_word_embeddings=True,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    if name == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    return Gemma3ForCausalLM(Gemma3TextConfig(**common, head_dim=16, sliding_window=8))


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "gemma3"])
def test_families_with_dropout_and_tied_weights(tmp_path, family):
    """Dropout 0.1 (GPT-2's *_pdrop included), tied embedding/LM head: stored and counted once, replay == oracle."""
    tok, data = get_trace_data()
    model = _family(family, tok, dropout=0.1)
    from hf_unlearn.trace.recording import dropout_settings

    found = dropout_settings(model)
    assert found and all(v == 0.1 for k, v in found.items() if k != "modules")
    if family == "gpt2":
        assert {"resid_pdrop", "embd_pdrop", "attn_pdrop"} <= set(found)
    record(tok, data.select(range(16)), tmp_path / "rec", model=model, every=1, max_steps=2)
    run = tmp_path / "rec" / "trace"
    header = json.loads((run / "header.json").read_text())
    assert any("dropout" in n for n in header["notes"]) and header["determinism"]["dropout"]
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    ck = load_checkpoint(open_run(run).final_checkpoint())
    embed, head = [n for n in model.state_dict() if n.endswith(("wte.weight", "embed_tokens.weight"))][0], "lm_head.weight"
    assert ck["tied"] == {head: embed} and head not in ck["model"]
    forget = open_run(run).ids_at_steps([1])[:1]
    replay, report = delete(run, forget, tmp_path)
    assert report["verified"]
    unique = sum(p.numel() for p in model.parameters())  # named_parameters() lists a tied tensor once
    assert report["params"]["elements"] == unique == header["model"]["num_parameters"]
    assert replay.model.lm_head.weight is replay.model.get_input_embeddings().weight  # the tie survives a replay


def test_neftune_is_reproduced_not_dropped(tmp_path):
    tok, data = get_trace_data()
    data = data.select(range(16))
    noisy = record(tok, data, tmp_path / "noisy", every=1, max_steps=2, neftune_noise_alpha=5.0)
    plain = record(tok, data, tmp_path / "plain", every=1, max_steps=2)
    a, b = noisy.model.state_dict(), plain.model.state_dict()
    assert not all(torch.equal(a[k], b[k]) for k in a)  # the noise changed the run ...
    run = tmp_path / "noisy" / "trace"
    assert replays_the_recording(run)  # ... and a replay reproduces it bit for bit
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import ReplayTrainer
    from hf_unlearn.trace.replay import training_args_from_header

    header = json.loads((run / "header.json").read_text())
    args = training_args_from_header(header, tmp_path / "x", neftune_noise_alpha=None)
    with pytest.raises(UnlearnError, match=r"TrainingArguments differ .* neftune_noise_alpha \(None vs recorded 5.0\)"):
        ReplayTrainer(run, start="full", args=args)
    forget = [data[3]["id"]]
    assert delete(run, forget, tmp_path)[1]["verified"]


def test_custom_optimizer_and_momentum_cycling_scheduler(tmp_path):
    """optimizers=(SGD, OneCycleLR): the class and arguments are rebuilt, the cycled momentum is recorded per step."""
    tok, data = get_trace_data()
    data = data.select(range(24))
    model = tiny(tok)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=3, cycle_momentum=True)
    record(tok, data, tmp_path / "rec", model=model, every=1, max_steps=3, trainer_kwargs={"optimizers": (opt, sched)})
    run = tmp_path / "rec" / "trace"
    header = json.loads((run / "header.json").read_text())
    assert header["optimizer"]["class"] == "SGD" and header["optimizer"]["source"] == "custom"
    from hf_unlearn.trace.plan import read_plan

    momenta = [e.extra["groups"][0]["momentum"] for e in read_plan(run) if "groups" in e.extra]
    assert len(set(momenta)) == 3  # changed every step, so written every step
    assert replays_the_recording(run)
    from hf_unlearn.trace import open_run

    forget = open_run(run).ids_at_steps([1])[:2]
    assert delete(run, forget, tmp_path)[1]["verified"]


def test_optimizer_cls_and_kwargs_is_rebuilt(tmp_path):
    tok, data = get_trace_data()
    record(tok, data.select(range(16)), tmp_path / "rec", every=1, max_steps=2,
           trainer_kwargs={"optimizer_cls_and_kwargs": (torch.optim.Adagrad, {"lr_decay": 0.01})})
    run = tmp_path / "rec" / "trace"
    assert json.loads((run / "header.json").read_text())["optimizer"]["class"] == "Adagrad"
    assert replays_the_recording(run)


class _Scaled(torch.optim.SGD):
    """An importable subclass with a constructor argument its defaults do not keep: not rebuildable."""

    def __init__(self, params, scale):
        super().__init__(params, lr=0.1 * scale)


def test_optimizers_a_replay_cannot_rebuild_are_refused_at_construction(tmp_path):
    from hf_unlearn.data import QACollator
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import TraceRecordingTrainer

    tok, data = get_trace_data()
    kw = dict(args=train_args(tmp_path), train_dataset=data, data_collator=QACollator.from_tokenizer(tok))

    class LocalSGD(torch.optim.SGD):
        pass

    for opt_cls, why in ((LocalSGD, "defined locally"), (_Scaled, "fails")):
        model = tiny(tok)
        opt = opt_cls(model.parameters(), lr=0.1) if opt_cls is LocalSGD else opt_cls(model.parameters(), 2.0)
        with pytest.raises(UnlearnError, match=f"must rebuild the optimizer and cannot: .*{why}"):
            TraceRecordingTrainer(model=model, optimizers=(opt, None), **kw)
    model = tiny(tok)
    extra = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD(list(model.parameters()) + [extra], lr=0.1)
    with pytest.raises(UnlearnError, match="1 optimized tensor.* not parameters of the model"):
        TraceRecordingTrainer(model=model, optimizers=(opt, None), **kw)
    assert not (tmp_path / "trace").exists()


def test_fp16_and_a_collator_giving_the_dummy_weight_are_refused(tmp_path):
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import TraceRecordingTrainer

    tok, data = get_trace_data()
    no_labels = data.remove_columns("labels")

    def lm_collator(features):  # labels = input_ids everywhere: a dummy row would be trained on
        from hf_unlearn.data import QACollator

        batch = QACollator.from_tokenizer(tok)(features)
        batch["labels"] = batch["input_ids"].clone()
        return batch

    with pytest.raises(UnlearnError, match="gives the dummy row that replaces a deleted sample a label"):
        TraceRecordingTrainer(model=tiny(tok), args=train_args(tmp_path), train_dataset=no_labels,
                              data_collator=lm_collator)
    with pytest.raises(UnlearnError, match="has no 'id' column"):
        TraceRecordingTrainer(model=tiny(tok), args=train_args(tmp_path), train_dataset=data.remove_columns("id"))


def test_parallel_setups_a_replay_cannot_reproduce_are_refused(tmp_path, monkeypatch):
    """FSDP, DeepSpeed, nn.DataParallel over several GPUs and split/dispatched batches are refused with a line that
    names the setup and what is supported (the settings are forced here: this machine has no GPUs to run them)."""
    from transformers import TrainingArguments

    from hf_unlearn.data import QACollator
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import TraceRecordingTrainer

    tok, data = get_trace_data()
    trainer = TraceRecordingTrainer(model=tiny(tok), args=train_args(tmp_path), train_dataset=data,
                                    data_collator=QACollator.from_tokenizer(tok))
    for attr, name in (("is_fsdp_enabled", "an FSDP1"), ("is_deepspeed_enabled", "a DeepSpeed")):  # FSDP2: #36
        monkeypatch.setattr(trainer, attr, True)
        with pytest.raises(UnlearnError, match=f"cannot replay {name} run.*supported: one process"):
            trainer._trace_check_parallelism()
        monkeypatch.setattr(trainer, attr, False)
    with monkeypatch.context() as m:
        m.setattr(TrainingArguments, "n_gpu", property(lambda self: 2))
        with pytest.raises(UnlearnError, match="torch.nn.DataParallel over 2 GPUs"):
            trainer._trace_check_parallelism()
    for flag in ("split_batches", "dispatch_batches"):
        with monkeypatch.context() as m:
            m.setattr(trainer.accelerator.dataloader_config, flag, True)
            with pytest.raises(UnlearnError, match="split_batches/dispatch_batches"):
                trainer._trace_check_parallelism()
    trainer._trace_check_parallelism()  # and the plain single-process setup passes


def test_a_custom_loss_a_replay_cannot_rebuild_is_refused_at_construction_or_declared(tmp_path):
    """Replays run the recorded trainer's own loss, so its class must be importable: a subclass defined inside a
    function is refused at construction (naming it); a compute_loss_func is not recorded at all, so it is a hazard
    (replays would agree with each other on a loss the run never trained on, and verify would say VERIFIED). An
    importable subclass with its own loss works: tests/test_trace_sft.py."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import TraceRecordingTrainer

    tok, data = get_trace_data()
    kw = dict(args=train_args(tmp_path), train_dataset=data, data_collator=QACollator.from_tokenizer(tok))

    class Doubled(TraceRecordingTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 2 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    with pytest.raises(UnlearnError, match=r"trainer class .*Doubled is defined inside a function, so a replay "
                                           r"cannot import it"):
        Doubled(model=tiny(tok), **kw)

    def my_loss(outputs, labels, num_items_in_batch=None):
        return outputs.loss

    with pytest.raises(UnlearnError, match=r"a custom loss \(compute_loss_func=.*my_loss\)"):
        TraceRecordingTrainer(model=tiny(tok), compute_loss_func=my_loss, **kw)
    assert not (tmp_path / "trace").exists()
    allowed = TraceRecordingTrainer(model=tiny(tok), compute_loss_func=my_loss, trace_allow_hazards=True, **kw)
    assert any("custom loss" in h for h in allowed.trace_preflight()[1])  # recorded, with the hazard declared
    plain = TraceRecordingTrainer(model=tiny(tok), **kw)  # the stock loss: no hazard
    assert not any("custom loss" in h for h in plain.trace_preflight()[1])


def test_peft_model_is_rebuilt_by_replays(tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    tok, data = get_trace_data()
    data = data.select(range(16))
    model = get_peft_model(tiny(tok), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1))
    record(tok, data, tmp_path / "rec", model=model, every=1, max_steps=2, learning_rate=1e-2)
    run = tmp_path / "rec" / "trace"
    header = json.loads((run / "header.json").read_text())
    assert header["model"]["peft"]["adapter_name"] == "default" and (run / "model" / "adapter").is_dir()
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run

    forget = write_ids(tmp_path / "f.jsonl", open_run(run).ids_at_steps([1])[:1])
    for cmd in (["redact", run, "--forget", forget, "--out", tmp_path / "s"],
                ["replay", run, "--store", tmp_path / "s", "--forget", forget, "--out", tmp_path / "r"],
                ["oracle", run, "--forget", forget, "--out", tmp_path / "o"],
                ["verify", tmp_path / "r", tmp_path / "o"]):
        assert main(["trace", *map(str, cmd)]) == 0, capsys.readouterr().err
    assert "VERIFIED" in capsys.readouterr().out
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import ReplayTrainer

    with pytest.raises(UnlearnError, match="not the recorded one: a PEFT adapter it does not have"):
        ReplayTrainer(run, start="full", model=tiny(tok))
    with pytest.raises(UnlearnError, match=r"config .*attention_dropout=0.5"):
        ReplayTrainer(run, start="full", model=get_peft_model(tiny(tok, dropout=0.5), LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"])))
