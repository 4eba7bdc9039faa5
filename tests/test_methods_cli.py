"""`hf-unlearn unlearn METHOD MODEL ...` on a tiny local model (in-process)."""

from __future__ import annotations

import json

import pytest
import torch

from hf_unlearn.cli import main

from .conftest import TOFU_DIR
from .methods_helpers import memorised_model, tiny_data


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    memorised_model().save_pretrained(path)
    tiny_data()[0].save_pretrained(path)
    return path


def _args(method, model_dir, out, *extra):
    return ["unlearn", method, str(model_dir), "--forget-split", "forget01", "--out", str(out), "--tofu", str(TOFU_DIR),
            "--max-forget-rows", "4", "--max-retain-rows", "8", "--max-length", "256", "--batch-size", "2",
            "--lr", "1e-3", *extra]


def test_cli_masc_saves_model_and_report(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    assert main(_args("masc", tiny_model_dir, out, "--max-steps", "2", "--probe-steps", "1", "--k", "5")) == 0
    printed = capsys.readouterr().out
    assert "unlearning 4 forget01 rows with MASC" in printed and "answer loss forget" in printed
    info = json.loads((out / "unlearning.json").read_text())
    assert info["method"] == "MASC" and info["hyperparameters"]["k"] == 5 and info["retain_split"] == "retain99"
    assert "forget_ids" not in info  # raw ids never land in a folder that may be published
    assert info["extra"]["probe_size"] == 2  # the default probe takes at most half of the 4 forget rows
    assert (out / "masc_stopping.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(reloaded.model.layers[0].mlp.up_proj.weight, original.model.layers[0].mlp.up_proj.weight)


def test_cli_lora_saves_a_merged_plain_model(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    assert main(_args("npo", tiny_model_dir, out, "--lora", "--lora-r", "4", "--max-steps", "2",
                      "--retain-loss", "kl")) == 0
    assert not (out / "adapter_config.json").exists()
    info = json.loads((out / "unlearning.json").read_text())
    assert info["method"] == "NPO+KLR" and info["hyperparameters"]["peft"]["r"] == 4
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert not torch.equal(reloaded.model.layers[0].self_attn.q_proj.weight,
                           original.model.layers[0].self_attn.q_proj.weight)


def test_cli_bad_alpha_is_one_line_error(tiny_model_dir, tmp_path, capsys):
    assert main(_args("masc", tiny_model_dir, tmp_path / "x", "--alpha", "1.5")) == 1
    err = capsys.readouterr().err
    assert err.strip() == "hf-unlearn: error: --alpha must be in (0, 1), got 1.5"  # checked before torch loads


def test_cli_unknown_forget_split_needs_retain_split(tiny_model_dir, tmp_path, capsys):
    assert main(_args("grad_diff", tiny_model_dir, tmp_path / "x") [:3] + ["--forget-split", "holdout01", "--out",
                                                                          str(tmp_path / "x")]) == 1
    assert "pass --retain-split" in capsys.readouterr().err
