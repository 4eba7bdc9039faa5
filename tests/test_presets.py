"""The OpenUnlearning conventions: each option reproduces OpenUnlearning's value on hand-computed tensors, the
``open-unlearning`` preset sets them, and the evaluation page's "Remaining differences" list names only options that exist."""

from __future__ import annotations

import inspect
import json
import math
import re
import zlib
from pathlib import Path

import pytest
import torch

from hf_unlearn.errors import UnlearnError
from hf_unlearn.losses import kl_retain_loss, masked_mse
from hf_unlearn.presets import CONVENTIONS, evaluation_preset, training_preset

EVALUATION_PAGE = Path(__file__).resolve().parents[1] / "docs" / "evaluation.md"


def test_kl_retain_over_answer_tokens_or_every_position():
    # position 0 predicts the answer token; the reference puts (3/4, 1/4) there, the policy is uniform everywhere
    policy = torch.zeros(1, 2, 2)
    ref = torch.tensor([[[math.log(3.0), 0.0], [0.0, 0.0]]])
    labels = torch.tensor([[-100, 1]])
    kl0 = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # 0.130812
    assert kl_retain_loss(policy, ref, labels).item() == pytest.approx(kl0, rel=1e-6)
    # OpenUnlearning: kl_div(batchmean) over the flattened batch = sum over both positions / (batch * seq)
    assert kl_retain_loss(policy, ref, labels, positions="all").item() == pytest.approx(kl0 / 2, rel=1e-6)
    with pytest.raises(ValueError, match="positions"):
        kl_retain_loss(policy, ref, labels, positions="prompt")


def test_rmu_mean_per_row_and_open_unlearnings_broadcast():
    hidden = torch.tensor([[[1.0], [2.0], [0.0]], [[3.0], [0.0], [0.0]]])  # squared errors against 0: 1, 4 | 9
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mse(hidden, torch.zeros(1), mask).item() == pytest.approx((2.5 + 9.0) / 2)
    # OpenUnlearning: S [2] / n [2, 1] -> [2, 2], mean = mean(S) * mean(1/n) = 7 * 0.75
    assert masked_mse(hidden, torch.zeros(1), mask, "open_unlearning").item() == pytest.approx(5.25)
    one = masked_mse(hidden[:1], torch.zeros(1), mask[:1])
    assert masked_mse(hidden[:1], torch.zeros(1), mask[:1], "open_unlearning").item() == pytest.approx(one.item())
    empty = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert math.isfinite(masked_mse(hidden, torch.zeros(1), empty).item())
    assert not math.isfinite(masked_mse(hidden, torch.zeros(1), empty, "open_unlearning").item())


def test_min_k_plus_plus_variance_floor():
    from hf_unlearn.eval.metrics import token_statistics

    # a confident model (logits 40 vs 0) scored on the token it rules out: variance 6.8e-15, below both floors
    logits = torch.tensor([[[40.0, 0.0], [0.0, 0.0]]])
    labels = torch.tensor([[-100, 1]])
    for floor in (1e-12, 1e-6):
        z = token_statistics(logits, labels, variance_floor=floor)[0].zscores[0]
        assert z == pytest.approx(-40.0 / math.sqrt(floor), rel=1e-5)
    with pytest.raises(UnlearnError, match="variance_floor"):
        token_statistics(logits, labels, variance_floor=0.0)


@pytest.mark.slow  # two TOFU evaluations (~10 s)
def test_zlib_on_the_raw_or_the_decoded_answer():
    from hf_unlearn.data.tokenize import encode_qa
    from hf_unlearn.eval.tofu import evaluate_tofu
    from hf_unlearn.models import build_tiny_model, load_tokenizer

    from .conftest import TOFU_DIR, TOKENIZERS

    tok = load_tokenizer(TOKENIZERS / "gpt2")
    model = build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2)
    kwargs = dict(max_items=2, max_new_tokens=2, progress=False, tofu_path=TOFU_DIR, mia_attacks=["loss", "zlib"])
    raw = evaluate_tofu(model, tok, **kwargs)
    dec = evaluate_tofu(model, tok, zlib_text="decoded", **kwargs)
    for a, b in zip(raw.per_item, dec.per_item):
        if "mia" not in a:
            continue
        assert a["mia"]["zlib"] == pytest.approx(a["mia"]["loss"] / len(zlib.compress(a["answer"].encode())))
        labels = encode_qa(tok, a["question"], a["answer"], 512, False)["labels"]
        decoded = tok.decode([t for t in labels if t != -100], skip_special_tokens=True)
        assert b["mia"]["zlib"] == pytest.approx(b["mia"]["loss"] / len(zlib.compress(decoded.encode())))
        assert b["mia"]["loss"] == a["mia"]["loss"]
    with pytest.raises(UnlearnError, match="zlib_text"):
        evaluate_tofu(model, tok, zlib_text="raw", **kwargs)
    with pytest.raises(UnlearnError, match="zlib_text"):  # a reference with the other convention is not comparable
        evaluate_tofu(model, tok, reference=raw, **{**kwargs, "zlib_text": "decoded"})


def test_open_unlearning_preset_values():
    ou = training_preset("open-unlearning", "rmu", n_forget_rows=400)
    assert ou == {"num_train_epochs": 10.0, "learning_rate": 1e-5, "weight_decay": 0.01, "per_device_train_batch_size": 8,
                  "gradient_accumulation_steps": 4, "max_length": 512, "kl_positions": "all", "layer_id": 7,
                  "steering_coeff": 2.0, "lambda_retain": 1.0, "lambda_forget": 1.0, "trainable_parameters": "all",
                  "loss_reduction": "open_unlearning", "warmup_steps": 12,  # 1 epoch: 400 // (8 * 4)
                  "prompt_format": "open-unlearning", "attention_mask": "not_pad"}
    assert training_preset("open-unlearning", "npo")["retain_loss"] == "ce"  # OpenUnlearning's NPO is NPO+RT
    assert "retain_loss" not in training_preset("open-unlearning", "npo_klr", fixed={"retain_loss": "kl"})
    assert training_preset(None, "npo") == {} == training_preset("hf-unlearn", "npo")
    assert evaluation_preset("open-unlearning", "muse_news") == {"max_length": 2048, "variance_floor": 1e-6,
                                                                 "verbmem_stop": "eos", "max_prompt_tokens": None,
                                                                 "attention_mask": "not_pad"}
    tofu = evaluation_preset("open-unlearning", "tofu")
    assert (tofu["zlib_text"], tofu["es_no_match"], tofu["prompt_format"]) == ("decoded", "one_over_n",
                                                                              "open-unlearning")
    assert evaluation_preset("open-unlearning", "robustness") == {"max_length": 512, "es_no_match": "one_over_n",
                                                                  "prompt_format": "open-unlearning",
                                                                  "attention_mask": "not_pad"}
    assert tofu["attention_mask"] == "not_pad"
    with pytest.raises(UnlearnError, match="unknown preset"):
        training_preset("openunlearning", "npo")
    # every value is a real config field of the method
    from hf_unlearn.methods.registry import get_method

    for method in ("rmu", "npo"):
        config = get_method(method).make_config(output_dir="unused", report_to=[],
                                                **training_preset("open-unlearning", method, 40))
        assert config.kl_positions == "all" and config.gradient_accumulation_steps == 4 and config.warmup_steps == 1
        assert config.prompt_format == "open-unlearning" and config.attention_mask == "not_pad"


def test_cli_preset_runs_with_open_unlearnings_budget(tmp_path):
    from hf_unlearn.cli import main

    from .conftest import TOFU_DIR
    from .methods_helpers import memorised_model, tiny_data

    model_dir = tmp_path / "model"
    memorised_model().save_pretrained(model_dir)
    tiny_data()[0].save_pretrained(model_dir)
    out = tmp_path / "out"
    assert main(["unlearn", "npo", str(model_dir), "--forget-split", "forget01", "--out", str(out), "--tofu",
                 str(TOFU_DIR), "--max-forget-rows", "4", "--max-retain-rows", "8", "--max-steps", "1",
                 "--batch-size", "2", "--preset", "open-unlearning"]) == 0
    hp = json.loads((out / "unlearning.json").read_text())["hyperparameters"]
    assert hp["per_device_train_batch_size"] == 2  # the explicit option wins over the preset's 8
    assert hp["gradient_accumulation_steps"] == 4 and hp["weight_decay"] == 0.01 and hp["retain_loss"] == "ce"
    assert hp["prompt_format"] == "open-unlearning"  # trained with OpenUnlearning's prompts, as its configs do


def _remaining_differences() -> str:
    text = EVALUATION_PAGE.read_text(encoding="utf-8")
    start = text.index("Remaining differences from OpenUnlearning")
    return text[start:text.index("\n\n", start)]


def _resolve(name: str):
    import hf_unlearn
    import hf_unlearn.eval.metrics as metrics
    import hf_unlearn.eval.muse as muse
    import hf_unlearn.eval.tofu as tofu
    import hf_unlearn.methods.base as base
    import hf_unlearn.methods.baselines as baselines
    import hf_unlearn.presets as presets

    for module in (hf_unlearn, metrics, muse, tofu, baselines, base, presets):
        if hasattr(module, name):
            return getattr(module, name)
    raise AssertionError(f"docs/evaluation.md names {name}, which hf_unlearn does not have")


def test_readme_remaining_differences_name_real_options_and_every_convention():
    section = _remaining_differences()
    named = re.findall(r"`(\w+)\((\w+)=\)`", section)
    assert len(named) >= len(CONVENTIONS)
    for obj, param in named:
        target = _resolve(obj)
        fields = getattr(target, "__dataclass_fields__", None)
        params = fields if fields is not None else inspect.signature(target).parameters
        assert param in params, f"docs/evaluation.md names {obj}({param}=), which does not exist"
    for convention in CONVENTIONS:
        assert f"`{convention.option}`" in section, f"docs/evaluation.md's list misses {convention.name} ({convention.option})"
    assert not [b for b in section.split("\n- ") if "privleak" in b and "1024" in b]  # privleak: 2048 everywhere
    for option in ("evaluate_tofu(es_no_match=)", "evaluate_muse_news(verbmem_stop=)", "evaluate_tofu(prompt_format=)"):
        assert option in {c.option for c in CONVENTIONS} and f"`{option}`" in section  # issue #34's entries


def test_forget_preset_keeps_every_option_given_explicitly():
    from hf_unlearn.deletion import ForgetConfig, _preset_values
    from hf_unlearn.methods.registry import get_method

    ou = _preset_values(ForgetConfig(output_dir="x", preset="open-unlearning", batch_size=2), get_method("rmu"), 40)
    assert ou["per_device_train_batch_size"] == 2 and ou["num_train_epochs"] == 10.0 and ou["layer_id"] == 7
    assert ou["warmup_steps"] == 40 // (2 * 4)  # one epoch at the batch actually used
    # given explicitly and equal to the command's default: still given, so it wins over the preset's 10 epochs
    five = _preset_values(ForgetConfig(output_dir="x", preset="open-unlearning", num_train_epochs=5.0, batch_size=4),
                          get_method("npo"), 40)
    assert (five["num_train_epochs"], five["per_device_train_batch_size"], five["max_length"]) == (5.0, 4, 512)
    plain = _preset_values(ForgetConfig(output_dir="x"), get_method("rmu"), 40)
    assert plain == {"num_train_epochs": 5.0, "learning_rate": 1e-5, "per_device_train_batch_size": 4,
                     "max_length": 256, "per_device_eval_batch_size": 4}
    with pytest.raises(UnlearnError, match="unknown preset"):
        from hf_unlearn import forget

        forget("missing-model", [1], "unused-out", preset="ou")


def test_eval_commands_pass_the_preset_and_explicit_options_win():
    from hf_unlearn.cli import build_parser
    from hf_unlearn.commands.eval import _preset, _tofu_kwargs

    parser = build_parser()
    tofu = _tofu_kwargs(parser.parse_args(["eval", "tofu", "m", "--preset", "open-unlearning"]))
    assert (tofu["zlib_text"], tofu["variance_floor"], tofu["max_length"]) == ("decoded", 1e-6, 512)
    assert "zlib_text" not in _tofu_kwargs(parser.parse_args(["eval", "tofu", "m"]))
    muse = parser.parse_args(["eval", "muse-news", "m", "--preset", "open-unlearning", "--max-length", "1024"])
    assert _preset(muse, "muse_news") == {"max_length": 1024, "variance_floor": 1e-6, "verbmem_stop": "eos",
                                          "max_prompt_tokens": None, "attention_mask": "not_pad"}
    muse = parser.parse_args(["eval", "muse-news", "m", "--preset", "open-unlearning", "--verbmem-stop", "ground_truth"])
    assert _preset(muse, "muse_news")["verbmem_stop"] == "ground_truth"  # the default, given: it wins
    assert _preset(parser.parse_args(["eval", "muse-news", "m"]), "muse_news") == {}  # evaluate_muse_news: 2048
    quantized = parser.parse_args(["eval", "quantized", "m", "--preset", "open-unlearning"])
    assert _tofu_kwargs(quantized)["zlib_text"] == "decoded"
    given = _tofu_kwargs(parser.parse_args(["eval", "tofu", "m", "--preset", "open-unlearning", "--es-no-match", "zero",
                                            "--prompt-format", "hf-unlearn"]))
    assert (given["es_no_match"], given["prompt_format"], given["zlib_text"]) == ("zero", "hf-unlearn", "decoded")
    # eval robustness takes --preset, as the README says
    robust = parser.parse_args(["eval", "robustness", "m", "--preset", "open-unlearning", "--max-length", "256"])
    assert _preset(robust, "robustness") == {"max_length": 256, "es_no_match": "one_over_n",
                                             "prompt_format": "open-unlearning", "attention_mask": "not_pad"}
    given = parser.parse_args(["eval", "muse-news", "m", "--preset", "open-unlearning", "--attention-mask", "tokens",
                               "--max-prompt-tokens", "512"])
    assert (_preset(given, "muse_news")["attention_mask"], _preset(given, "muse_news")["max_prompt_tokens"]) == \
        ("tokens", 512)
    assert _preset(parser.parse_args(["eval", "robustness", "m"]), "robustness") == {}


def test_forget_command_preset_with_explicit_default_epochs(tmp_path):
    """`hf-unlearn forget --preset open-unlearning --epochs 5` parses to 5 given epochs (not 'unset'), and the
    parsed config resolves to 5 epochs; without --epochs the preset's 10."""
    from hf_unlearn.cli import build_parser
    from hf_unlearn.deletion import ForgetConfig, _preset_values
    from hf_unlearn.methods.registry import get_method

    parser = build_parser()
    ids = tmp_path / "ids.jsonl"
    ids.write_text("3600\n")

    def epochs(*extra):
        args = parser.parse_args(["forget", "m", "--ids", str(ids), "--out", str(tmp_path / "o"), "--preset",
                                  "open-unlearning", *extra])
        values = {f: getattr(args, f) for f in ForgetConfig.__dataclass_fields__ if hasattr(args, f)}
        values["method_args"] = {}
        return _preset_values(ForgetConfig(**values), get_method("npo"), 40)["num_train_epochs"]

    assert epochs("--epochs", "5") == 5.0
    assert epochs() == 10.0
