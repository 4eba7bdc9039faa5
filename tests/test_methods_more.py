"""IdkDPO, IdkNLL, UNDIAL, CE-U, WGA, SatImp and PDU: a few steps on a tiny memorised Llama, their data paths and state."""

from __future__ import annotations

import pytest
import torch

from hf_unlearn.errors import UnlearnError

from .methods_helpers import FORGET_IDS, MAX_LENGTH, memorised_model, raw_rows, save_memorised_model, tiny_data

COMMON = dict(report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=1, max_steps=3,
              per_device_train_batch_size=2, learning_rate=1e-3)

# name -> (trainer, config, extra config, card method name, needs a reference model)
NEW = {
    "idk_dpo": ("IdkDPOTrainer", "IdkDPOConfig", {}, "IdkDPO"),
    "idk_nll": ("IdkNLLTrainer", "IdkNLLConfig", {}, "IdkNLL"),
    "undial": ("UNDIALTrainer", "UNDIALConfig", {}, "UNDIAL"),
    "ce_u": ("CEUTrainer", "CEUConfig", {}, "CE-U"),
    "wga": ("WGATrainer", "WGAConfig", {}, "WGA"),
    "satimp": ("SatImpTrainer", "SatImpConfig", {}, "SatImp"),
    "pdu": ("PDUTrainer", "PDUConfig", {"dual_warmup_ratio": 0.0}, "PDU"),
}


def _trainer(name, tmp_path, forget=None, peft_config=None, model=None, **kw):
    import hf_unlearn.methods as methods

    trainer_name, config_name, extra, _ = NEW[name]
    tok, tok_forget, retain = tiny_data()
    args = getattr(methods, config_name)(output_dir=str(tmp_path), max_length=MAX_LENGTH, **{**COMMON, **extra, **kw})
    return getattr(methods, trainer_name)(model=model if model is not None else memorised_model(), args=args,
                                          forget_dataset=tok_forget if forget is None else forget,
                                          retain_dataset=retain, processing_class=tok, peft_config=peft_config)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(NEW))
def test_every_parameter_changes_and_the_card_names_the_paper(name, tmp_path):
    trainer = _trainer(name, tmp_path)
    before = _snapshot(trainer.model)
    trainer.train()
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(before[n], p)]
    assert not unchanged, f"{name} left {unchanged} unchanged"
    assert trainer.state.global_step == 3
    info = trainer.unlearning_card_info()
    assert info["method"] == NEW[name][3] and info["paper"].startswith("https://arxiv.org/abs/") and info["citation"]
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert "forget_loss" in logged


@pytest.mark.parametrize("name", list(NEW))
def test_lora_changes_only_the_adapter(name, tmp_path):
    from peft import LoraConfig

    trainer = _trainer(name, tmp_path, max_steps=2,
                       peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    before = _snapshot(trainer.model)
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed)
    assert {n for n in before if "lora_B" in n} <= changed
    if name in ("idk_dpo", "undial"):  # the reference is the base with the adapter disabled: no copy is made
        assert trainer.ref_model is None


# ---------------------------------------------------------------------------------------------- refusal answers


def test_shipped_refusals_are_several_dozen_distinct_phrasings():
    from hf_unlearn.methods import load_refusals

    refusals = load_refusals()
    assert len(refusals) >= 48 and len(set(refusals)) == len(refusals)
    assert all(r and not r.startswith("#") for r in refusals)


def test_refusal_choice_depends_on_seed_and_id_only():
    from hf_unlearn.methods.preference import load_refusals, pick_refusal

    refusals = load_refusals()
    picks = [pick_refusal(i, refusals, seed=0) for i in range(200)]
    assert picks == [pick_refusal(i, refusals, seed=0) for i in range(200)]
    assert len(set(picks)) > 30  # spread over the list
    assert picks != [pick_refusal(i, refusals, seed=1) for i in range(200)]
    assert any(pick_refusal(str(i), refusals) != pick_refusal(i, refusals) for i in range(20))


def test_raw_and_tokenised_rows_get_the_same_alternate_sequences(tmp_path):
    from hf_unlearn.data.tokenize import encode_qa
    from hf_unlearn.methods.preference import load_refusals, pick_refusal

    tok = tiny_data()[0]
    raw = raw_rows().filter(lambda r: r["id"] in FORGET_IDS)
    from_raw = _trainer("idk_nll", tmp_path, forget=raw, seed=3).train_dataset
    from_tokens = _trainer("idk_nll", tmp_path, seed=3).train_dataset
    refusals = load_refusals()
    for a, b, row in zip(from_raw, from_tokens, raw):
        assert a["id"] == b["id"] == row["id"]
        assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"]
        expected = encode_qa(tok, row["question"], pick_refusal(row["id"], refusals, 3), MAX_LENGTH)
        assert a["alt_input_ids"] == b["alt_input_ids"] == expected["input_ids"]
        assert a["alt_labels"] == b["alt_labels"] == expected["labels"]
    assert set(from_raw.column_names) == {"id", "input_ids", "attention_mask", "labels", *(
        f"alt_{k}" for k in ("input_ids", "attention_mask", "labels"))}


def test_own_alternate_column_and_refusals_file(tmp_path):
    tok = tiny_data()[0]
    raw = raw_rows().filter(lambda r: r["id"] in FORGET_IDS)
    own = raw.add_column("alternate_answer", [f"No comment number {i}." for i in range(len(raw))])
    data = _trainer("idk_dpo", tmp_path, forget=own).train_dataset
    text = tok.decode([t for t in data[1]["alt_labels"] if t != -100], skip_special_tokens=True)
    assert text.strip() == "No comment number 1."
    path = tmp_path / "mine.txt"
    path.write_text("# mine\n\nNope.\n")
    trainer = _trainer("idk_nll", tmp_path, refusals_file=str(path))
    for row in trainer.train_dataset:
        assert tok.decode([t for t in row["alt_labels"] if t != -100], skip_special_tokens=True).strip() == "Nope."
    assert trainer.unlearning_card_info()["hyperparameters"]["alternate_answers"] == str(path)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(UnlearnError, match="holds no refusal answers"):
        _trainer("idk_nll", tmp_path, refusals_file=str(empty))
    with pytest.raises(UnlearnError, match="cannot read the refusals file"):
        _trainer("idk_nll", tmp_path, refusals_file=str(tmp_path / "missing.txt"))


def test_partial_alternate_columns_and_a_collator_without_them_are_refused(tmp_path):
    _, forget, _ = tiny_data()
    with pytest.raises(UnlearnError, match="only some of alt_input_ids"):
        _trainer("idk_dpo", tmp_path, forget=forget.add_column("alt_input_ids", forget["input_ids"]))
    import hf_unlearn.methods as methods
    from hf_unlearn.data import QACollator

    tok, forget, retain = tiny_data()
    args = methods.IdkDPOConfig(output_dir=str(tmp_path), **{**COMMON, "max_steps": 1})
    plain = QACollator.from_tokenizer(tok)  # a QACollator passed as is would be wrapped; a custom collator is not
    trainer = methods.IdkDPOTrainer(model=memorised_model(), args=args, forget_dataset=forget, retain_dataset=retain,
                                    processing_class=tok, data_collator=lambda features: plain(features))
    with pytest.raises(UnlearnError, match="the data collator must pad the alternate answers"):
        trainer.train()


def test_idk_dpo_moves_likelihood_from_the_answer_to_the_refusal(tmp_path):
    from hf_unlearn.losses import sequence_logprob

    trainer = _trainer("idk_dpo", tmp_path, max_steps=6, beta=0.5)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])

    def logps(model):
        with torch.no_grad():
            ans = sequence_logprob(model(input_ids=batch["input_ids"]).logits, batch["labels"])
            alt = sequence_logprob(model(input_ids=batch["alt_input_ids"]).logits, batch["alt_labels"])
        return ans, alt

    ans0, alt0 = logps(trainer.model)
    trainer.train()
    ans1, alt1 = logps(trainer.model)
    assert (ans1 < ans0).all() and (alt1 > alt0).all()


# ---------------------------------------------------------------------------------------------- PDU


def test_pdu_budget_defaults_to_twice_the_initial_retain_loss_and_the_multiplier_rises_when_violated(tmp_path):
    from hf_unlearn.losses import nll_loss

    trainer = _trainer("pdu", tmp_path, max_steps=4, learning_rate=5e-3, lambda_retain=0.0)
    with torch.no_grad():  # 8 retain rows in draws of 2: the whole retain set
        batches = [trainer.retain_batch(draw=d) for d in range(4)]
        assert sorted(int(i) for b in batches for i in b["id"]) == list(range(8))
        initial = sum(float(nll_loss(trainer.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                     b["labels"])) for b in batches) / 4
    trainer.train()
    dual = trainer.dual
    assert dual.epsilon == pytest.approx(2 * trainer.initial_retain_loss)
    assert trainer.initial_retain_loss == pytest.approx(initial, rel=1e-4)
    # with a zero starting multiplier the forget loss wrecks the retain loss, so the multiplier must have risen
    assert [h["step"] for h in dual.history] == [1, 2, 3, 4]
    assert dual.history[-1]["retain_loss"] > dual.epsilon and dual.multiplier > 0
    for prev, cur in zip(dual.history, dual.history[1:]):
        expected = max(0.0, prev["multiplier"] + 5.0 * (cur["retain_loss"] - dual.epsilon))
        assert cur["multiplier"] == pytest.approx(expected)
    info = trainer.unlearning_card_info()["extra"]
    assert info["retain_epsilon"] == dual.epsilon and info["final_multiplier"] == dual.multiplier


def test_pdu_warm_start_holds_the_multiplier(tmp_path):
    trainer = _trainer("pdu", tmp_path, max_steps=4, dual_warmup_ratio=0.5, retain_loss_eps=0.0)
    trainer.train()
    assert [h["multiplier"] for h in trainer.dual.history[:2]] == [100.0, 100.0]
    assert trainer.dual.history[2]["multiplier"] > 100.0  # budget 0 is always exceeded


def test_pdu_dual_state_survives_resume(tmp_path):
    full = _trainer("pdu", tmp_path / "full", max_steps=4)
    full.train()
    first = _trainer("pdu", tmp_path / "ckpt", max_steps=4, save_strategy="steps", save_steps=2)
    first.train()
    resumed = _trainer("pdu", tmp_path / "ckpt", max_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "ckpt" / "checkpoint-2"))
    assert resumed.dual.epsilon == pytest.approx(full.dual.epsilon)
    assert [h["step"] for h in resumed.dual.history] == [1, 2, 3, 4]
    assert resumed.dual.multiplier == pytest.approx(full.dual.multiplier, rel=1e-4)


@pytest.mark.parametrize("bad, match", [
    ({"retain_loss": "none"}, "PDU constrains the retain loss"),
    ({"retain_loss": "kl"}, "set retain_loss_eps"),
    ({"dual_warmup_ratio": 1.5}, "dual_warmup_ratio must lie in"),
])
def test_pdu_config_errors(bad, match, tmp_path):
    from hf_unlearn.methods import PDUConfig

    with pytest.raises(UnlearnError, match=match):
        PDUConfig(output_dir=str(tmp_path), **bad)


@pytest.mark.parametrize("config, bad, match", [
    ("IdkDPOConfig", {"beta": 0.0}, "beta must be > 0"),
    ("UNDIALConfig", {"beta": -1.0}, "beta must be >= 0"),
    ("CEUConfig", {"skip_first": -1}, "skip_first must be >= 0"),
    ("WGAConfig", {"beta": -1.0}, "beta must be >= 0"),
    ("SatImpConfig", {"beta1": -1.0}, "beta1 and beta2 must be >= 0"),
])
def test_config_errors(config, bad, match, tmp_path):
    import hf_unlearn.methods as methods

    with pytest.raises(UnlearnError, match=match):
        getattr(methods, config)(output_dir=str(tmp_path), **bad)


# ---------------------------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_memorised_model(tmp_path_factory.mktemp("tiny-llama-memorised"))


def _cli(method, model_dir, out, *extra):
    from .conftest import TOFU_DIR

    return ["unlearn", method, str(model_dir), "--forget-split", "forget01", "--out", str(out), "--tofu", str(TOFU_DIR),
            "--max-forget-rows", "4", "--max-retain-rows", "8", "--max-length", "256", "--batch-size", "2",
            "--lr", "1e-3", "--max-steps", "2", *extra]


@pytest.mark.parametrize("method, extra, hp", [
    ("idk_dpo", ["--beta", "0.5"], {"beta": 0.5, "alternate_answers": "hf_unlearn/data/refusals.txt"}),
    ("pdu", ["--dual-warmup-ratio", "0", "--retain-tolerance", "0.5"], {"dual_warmup_ratio": 0.0,
                                                                          "retain_tolerance": 0.5}),
])
def test_cli_runs_new_methods_on_raw_tofu_rows(method, extra, hp, tiny_model_dir, tmp_path, capsys):
    import json

    from hf_unlearn.cli import main

    out = tmp_path / "out"
    assert main(_cli(method, tiny_model_dir, out, *extra)) == 0
    info = json.loads((out / "unlearning.json").read_text())
    assert info["method"] == NEW[method][3] and info["paper"].startswith("https://arxiv.org/abs/")
    assert hp.items() <= info["hyperparameters"].items()
    assert "forget_ids" not in info and (out / "config.json").is_file()
    assert f"with {NEW[method][3]}" in capsys.readouterr().out


def test_cli_nonfinite_training_is_a_one_line_error_and_writes_no_model(tiny_model_dir, tmp_path, capsys):
    from hf_unlearn.cli import main

    out = tmp_path / "out"
    assert main(_cli("grad_ascent", tiny_model_dir, out, "--lr", "1e30", "--max-steps", "4")) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # (and a progress bar)
    assert len(errors) == 1 and "hf-unlearn: error: GradAscentTrainer: the " in errors[0]
    assert "not finite" in errors[0] and "at step 2; training stopped before" in errors[0]
    assert not (out / "config.json").exists() and not (out / "unlearning.json").exists()


# ---------------------------------------------------------------------------------------------- other model families


def _family_model(family, tok):
    import transformers

    from hf_unlearn.models import build_tiny_model

    if family == "gpt2":
        return build_tiny_model("gpt2", tok, hidden_size=32, num_layers=2, num_heads=2)
    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    if family == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(head_dim=16, **common))


@pytest.mark.parametrize("name, family", [("idk_dpo", "qwen2"), ("idk_dpo", "gemma"), ("pdu", "gpt2")])
def test_gpt2_qwen2_gemma_with_string_ids_from_raw_rows(family, name, gpt2_tokenizer, tmp_path):
    import hf_unlearn.methods as methods
    from hf_unlearn import load_tofu

    from .conftest import TOFU_DIR

    rows = load_tofu("forget01", TOFU_DIR).select(range(4))
    forget = rows.remove_columns("id").add_column("id", [f"author-a/{i}" for i in range(4)])
    retain = load_tofu("retain99", TOFU_DIR).select(range(4))
    retain = retain.remove_columns("id").add_column("id", [f"author-b/{i}" for i in range(4)])
    trainer_name, config_name, extra, _ = NEW[name]
    args = getattr(methods, config_name)(output_dir=str(tmp_path), max_length=128, **{**COMMON, **extra, "max_steps": 2})
    trainer = getattr(methods, trainer_name)(model=_family_model(family, gpt2_tokenizer), args=args,
                                             forget_dataset=forget, retain_dataset=retain,
                                             processing_class=gpt2_tokenizer)
    before = _snapshot(trainer.model)
    trainer.train()
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(before[n], p)]
    assert not unchanged, f"{name} on {family} left {unchanged} unchanged"
    assert trainer.forget_ids == [f"author-a/{i}" for i in range(4)]


@pytest.mark.parametrize("name", ["idk_dpo", "pdu"])
def test_model_card_names_the_method_and_keys_the_ids(name, tmp_path, monkeypatch):
    from hf_unlearn.hub.cards import check_card_metadata, find_raw_ids

    monkeypatch.setenv("HF_UNLEARN_TAG_KEY", "cd" * 32)
    trainer = _trainer(name, tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model()
    text = trainer.create_model_card(model_name=f"org/{name}-unlearned", dataset_name="locuslab/TOFU")
    meta = check_card_metadata(text)
    assert NEW[name][3].lower() in " ".join(meta["tags"]).lower() and "unlearning" in meta["tags"]
    assert trainer.paper in text
    assert not find_raw_ids(text, FORGET_IDS)
