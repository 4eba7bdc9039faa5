"""Each baseline trainer runs a few steps on a tiny Llama and changes what it should (and nothing else)."""

from __future__ import annotations

import pytest
import torch

from .methods_helpers import memorised_model, tiny_data

COMMON = dict(report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=1, max_steps=3,
              per_device_train_batch_size=2, learning_rate=1e-3)

METHODS = {
    "GradAscent": ({}, "GradAscentTrainer", "GradAscentConfig"),
    "GradDiff": ({}, "GradDiffTrainer", "GradDiffConfig"),
    "NPO": ({}, "NPOTrainer", "NPOConfig"),
    "NPO+KLR": ({"retain_loss": "kl"}, "NPOTrainer", "NPOConfig"),
    "NPO+RT": ({"retain_loss": "ce"}, "NPOTrainer", "NPOConfig"),
    "SimNPO": ({}, "SimNPOTrainer", "SimNPOConfig"),
    "MASC": ({"probe_steps": 100, "probe_size": 2}, "MASCTrainer", "MASCConfig"),
}


def _trainer(name, tmp_path, peft_config=None, **kw):
    import hf_unlearn.methods as methods

    extra, trainer_name, config_name = METHODS.get(name, ({}, f"{name}Trainer", f"{name}Config"))
    tok, forget, retain = tiny_data()
    args = getattr(methods, config_name)(output_dir=str(tmp_path), **{**COMMON, **extra, **kw})
    return getattr(methods, trainer_name)(model=memorised_model(), args=args, forget_dataset=forget,
                                          retain_dataset=retain, processing_class=tok, peft_config=peft_config)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(METHODS))
def test_every_parameter_changes(name, tmp_path):
    trainer = _trainer(name, tmp_path)
    before = _snapshot(trainer.model)
    trainer.train()
    after = _snapshot(trainer.model)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"{name} left {unchanged} unchanged"
    assert trainer.state.global_step == 3
    info = trainer.unlearning_card_info()
    assert info["method"] == name and info["paper"].startswith("https://arxiv.org/abs/") and info["citation"]


def test_forget_losses_push_forget_answers_away(tmp_path):
    from .methods_helpers import answer_loss

    trainer = _trainer("NPO", tmp_path, max_steps=5)
    _, forget, _ = tiny_data()
    before = answer_loss(trainer.model, forget)
    trainer.train()
    assert answer_loss(trainer.model, forget) > before + 0.1


def test_rmu_trains_only_the_selected_mlps(tmp_path):
    trainer = _trainer("RMU", tmp_path, layer_id=1, update_layers=[1])
    before = _snapshot(trainer.model)
    trainer.train()
    after = _snapshot(trainer.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all(".layers.1.mlp." in n for n in changed)
    assert {n for n in before if ".layers.1.mlp." in n} == changed
    assert trainer.unlearning_card_info()["hyperparameters"]["layer_id"] == 1


def test_rmu_steers_answer_tokens_only(tmp_path):
    """Prompt tokens do not enter RMU's terms: changing their hidden states leaves both terms unchanged."""
    trainer = _trainer("RMU", tmp_path, layer_id=1, update_layers=[1])
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    seen = {}

    def rmu_forget_loss(hidden, control, mask, reduction="row_mean"):
        seen["mask"] = mask
        return hidden.sum() * 0

    import hf_unlearn.methods.baselines as B

    original, B.rmu_forget_loss = B.rmu_forget_loss, rmu_forget_loss
    try:
        trainer.compute_loss(trainer.model, batch)
    finally:
        B.rmu_forget_loss = original
    assert torch.equal(seen["mask"], batch["labels"] != -100)
    assert not torch.equal(seen["mask"], batch["attention_mask"].bool())  # prompts are attended, not steered


def test_simnpo_tofu_preset_is_the_authors_forget10_setting(tmp_path):
    from hf_unlearn.methods.registry import get_method

    cfg = get_method("simnpo_tofu").make_config(output_dir=str(tmp_path))
    assert (cfg.beta, cfg.gamma, cfg.lambda_forget, cfg.lambda_retain, cfg.retain_loss) == (4.5, 0.0, 0.125, 1.0, "ce")
    assert get_method("npo_rt").make_config(output_dir=str(tmp_path)).retain_loss == "ce"


def test_rmu_layer_out_of_range(tmp_path):
    from hf_unlearn.errors import UnlearnError

    with pytest.raises(UnlearnError, match="layer_id must be in"):
        _trainer("RMU", tmp_path, layer_id=5)


@pytest.mark.parametrize("name", ["NPO+KLR", "MASC"])
def test_lora_changes_only_the_adapter_with_gradient_checkpointing(name, tmp_path):
    from peft import LoraConfig

    trainer = _trainer(name, tmp_path, gradient_checkpointing=True,
                       peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    before = _snapshot(trainer.model)
    trainer.train()
    after = _snapshot(trainer.model)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed and all("lora_" in n for n in changed)
    assert {n for n in before if "lora_B" in n} <= changed  # B starts at zero and must move
    assert trainer.unlearning_card_info()["hyperparameters"]["peft"]["r"] == 4


@pytest.mark.slow
def test_masc_and_npo_klr_step_on_smollm2_with_lora(tmp_path):
    from peft import LoraConfig

    from hf_unlearn import load_model, load_tofu, load_tokenizer
    from hf_unlearn.methods import MASCConfig, MASCTrainer, NPOConfig, NPOTrainer

    from .conftest import SMOLLM2_DIR, TOFU_DIR

    tok = load_tokenizer(SMOLLM2_DIR)
    forget = load_tofu("forget01", TOFU_DIR).select(range(4))
    retain = load_tofu("retain99", TOFU_DIR).select(range(4))
    base = load_model(SMOLLM2_DIR)
    for trainer_cls, config_cls, extra in ((MASCTrainer, MASCConfig, {"probe_steps": 1, "probe_size": 2}),
                                           (NPOTrainer, NPOConfig, {"retain_loss": "kl"})):
        import copy

        args = config_cls(output_dir=str(tmp_path / trainer_cls.__name__), max_length=128,
                          **{**COMMON, "max_steps": 1, "learning_rate": 1e-4}, **extra)
        trainer = trainer_cls(model=copy.deepcopy(base), args=args, forget_dataset=forget, retain_dataset=retain,
                              processing_class=tok, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        before = _snapshot(trainer.model)
        trainer.train()
        after = _snapshot(trainer.model)
        changed = {n for n in before if not torch.equal(before[n], after[n])}
        assert changed and all("lora_" in n for n in changed)


def test_trainers_write_a_model_card_without_raw_ids(tmp_path, monkeypatch):
    """Every unlearning trainer is an UnlearningHubMixin: its card names the method and keys the forget ids."""
    from hf_unlearn.hub.cards import check_card_metadata, find_raw_ids

    from .methods_helpers import FORGET_IDS

    monkeypatch.setenv("HF_UNLEARN_TAG_KEY", "ab" * 32)
    trainer = _trainer("NPO+KLR", tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model()
    text = trainer.create_model_card(model_name="org/npo-unlearned", dataset_name="locuslab/TOFU")
    meta = check_card_metadata(text)
    assert "unlearning" in meta["tags"] and "npo" in " ".join(meta["tags"]).lower()
    assert meta["hf_unlearn"]["params_root"]
    assert not find_raw_ids(text, FORGET_IDS)
