"""Named settings: ``open-unlearning`` reproduces OpenUnlearning's (locuslab/open-unlearning, commit d3d7cf9) training
budgets, method defaults and evaluation conventions, so that numbers can be compared with published ones.

:data:`CONVENTIONS` is the one list of the places where hf_unlearn's defaults differ from OpenUnlearning's: each entry
names the option that selects either behaviour, both values and why the default is what it is. The
"Remaining differences" list of docs/evaluation.md is checked against it (tests/test_presets.py).

Python::

    from hf_unlearn.presets import training_preset, evaluation_preset
    config = NPOConfig(output_dir="out", **training_preset("open-unlearning", "npo", n_forget_rows=len(forget)))
    result = evaluate_tofu(model, tok, **evaluation_preset("open-unlearning", "tofu"))

Command line: ``hf-unlearn unlearn METHOD ... --preset open-unlearning``, ``hf-unlearn forget ... --preset
open-unlearning`` and ``hf-unlearn eval tofu|muse-news|quantized|robustness ... --preset open-unlearning``; options given
explicitly win over the preset's values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import UnlearnError

PRESETS = ("hf-unlearn", "open-unlearning")
# the budget of `hf-unlearn unlearn` and `hf-unlearn forget` where neither an option nor a preset sets a value
COMMAND_BUDGET = {"num_train_epochs": 5.0, "learning_rate": 1e-5, "per_device_train_batch_size": 4, "max_length": 256}
OPEN_UNLEARNING_COMMIT = "d3d7cf9"
# How a padded batch's attention mask is built: "tokens" (1 on every token of a row, 0 on padding: hf_unlearn's) or
# "not_pad" (1 wherever the id is not the pad id, OpenUnlearning's collator: a pad id inside a row is masked too, e.g.
# SmolLM2's end-of-turn <|im_end|>, which is its pad token, in every chat prompt). Here, not in data/collators.py,
# so that the CLI's parser reads it without importing torch.
ATTENTION_MASKS = ("tokens", "not_pad")


@dataclass(frozen=True)
class Convention:
    """One difference from OpenUnlearning: ``option`` (``object(param=)`` as docs/evaluation.md names it) selects it."""

    name: str
    option: str
    ours: Any
    open_unlearning: Any
    default: str  # "aligned" (our default is OpenUnlearning's) or "kept" (ours, for ``why``)
    why: str


CONVENTIONS: tuple[Convention, ...] = (
    Convention("MUSE privleak text length", "evaluate_muse_news(max_length=)", 2048, 2048, "aligned",
               "every privleak text (1,693-1,868 tokens) was cut at the old 1024"),
    Convention("KL retain term positions", "UnlearningConfig(kl_positions=)", "answer", "all", "kept",
               "the retain signal is the answer; averaging over prompt and padding positions makes the term depend "
               "on how much padding a batch has"),
    Convention("RMU per-row mean", "RMUConfig(loss_reduction=)", "row_mean", "open_unlearning", "kept",
               "OpenUnlearning's [b] / [b, 1] division broadcasts to [b, b]: mean(S) * mean(1/n), which equals the "
               "per-row mean only at batch size 1 and is NaN/inf for a row with no answer token"),
    Convention("RMU steered layer", "RMUConfig(layer_id=)", "middle (n // 2)", 7, "kept",
               "7 is the middle of Llama-3.2-1B's 16 layers; n // 2 scales with the model"),
    Convention("RMU steering coefficient", "RMUConfig(steering_coeff=)", 6.5, 2.0, "kept",
               "6.5 is WMDP's value for 7B models, the paper's setting"),
    Convention("RMU retain weight", "RMUConfig(lambda_retain=)", 100.0, 1.0, "kept",
               "100 is WMDP's alpha; OpenUnlearning's 1 lets the retain activations drift"),
    Convention("RMU trained parameters", "RMUConfig(trainable_parameters=)", "mlp", "all", "kept",
               "WMDP trains the MLPs of the steered layer and two below; OpenUnlearning's TOFU config trains all"),
    Convention("Min-k%++ variance floor", "token_statistics(variance_floor=)", 1e-12, 1e-6, "kept",
               "the floor only guards a division by zero; 1e-6 shrinks the z-score of a confidently wrong token "
               "1000-fold (2.0e7 vs 20000.6) and so changes which tokens are the lowest k%"),
    Convention("zlib compressed text", "evaluate_tofu(zlib_text=)", "answer", "decoded", "kept",
               "the raw answer is the text itself, independent of the tokenizer's round trip (the sizes differ on "
               "177 of 400 TOFU answers, by up to 3.5%); MUSE privleak already compresses the scored tokens"),
    Convention("MUSE privleak start token", "evaluate_muse_news(max_length=)",
               "max_length text tokens after the start token", "max_length text tokens after the start token",
               "aligned", "the start token (BOS) is not part of the text; counting it kept one text token fewer than "
               "OpenUnlearning for tokenizers that add one"),
    Convention("extraction strength with no suffix predicted", "evaluate_tofu(es_no_match=)", "zero", "one_over_n",
               "kept", "0 says nothing was extracted; OpenUnlearning's loop (for k in range(n)) stops at k = n - 1 "
               "and scores 1/n, the same as an answer whose last token alone is predicted (retrain model: 0 here, "
               "0.033 there)"),
    Convention("MUSE verbmem generation length", "evaluate_muse_news(verbmem_stop=)", "ground_truth", "eos",
               "kept", "cut at the ground truth's length a verbatim reproduction scores ROUGE-L F1 1.0; with 128 "
               "tokens cut only at EOS what the model writes past the ground truth (95-124 tokens) lowers precision"),
    Convention("prompt format", "evaluate_tofu(prompt_format=)", "hf-unlearn", "open-unlearning", "kept",
               "the format every hf_unlearn model is trained with (the user turn alone, answer tokenised on its own); "
               "OpenUnlearning's system prompt, Llama-3 date string and Llama-2 [INST] wrapper follow its model "
               "configs, and its plain 'Answer: ' never scores the first answer token (the trailing space is a "
               "token of its own in the prompt and merges into that token in the full text)"),
    Convention("attention mask", "evaluate_tofu(attention_mask=)", "tokens", "not_pad", "kept",
               "OpenUnlearning's collator masks every position whose id is the pad id, and pad is EOS when a tokenizer "
               "has none: where EOS closes each chat turn (SmolLM2's <|im_end|>, its pad token) the prompt's turn ends "
               "are hidden from the model in training and evaluation (SmolLM2, 40 TOFU forget rows: forget "
               "probability 0.109 with it, 0.132 without). Every token of a row is input here. The same option on "
               "evaluate_muse_news, evaluate_robustness, UnlearningConfig and QACollator"),
    Convention("MUSE verbmem prompt length", "evaluate_muse_news(max_prompt_tokens=)",
               "1024 (the start token and the last 1023)", "the whole prompt", "kept",
               "a bound for models with 1024 positions (GPT-2); MUSE's 100 prompts are 819-972 tokens with the GPT-2, "
               "GPT-NeoX and SmolLM2 tokenizers, so it cuts none of them; None keeps the whole prompt"),
    Convention("training budget", "training_preset(preset=)", "5 epochs, batch 4, no warm-up, no weight decay",
               "10 epochs, batch 8 x 4 accumulation, 1 warm-up epoch, weight decay 0.01", "kept",
               "the command-line budget predates the preset and every recorded result uses it"),
)

# OpenUnlearning's configs/trainer/finetune.yaml with configs/experiment/unlearn/tofu/default.yaml on one device
_OU_TRAINING = {"num_train_epochs": 10.0, "learning_rate": 1e-5, "weight_decay": 0.01,
                "per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, "max_length": 512,
                "kl_positions": "all", "prompt_format": "open-unlearning", "attention_mask": "not_pad"}
_OU_METHODS: dict[str, dict[str, Any]] = {
    # OpenUnlearning's NPO is NPO with an NLL retain term (our npo_rt); its SimNPO default is the simnpo_tofu setting
    "npo": {"retain_loss": "ce"},
    "simnpo": {"beta": 4.5, "gamma": 0.0, "lambda_forget": 0.125, "lambda_retain": 1.0, "retain_loss": "ce"},
    "rmu": {"layer_id": 7, "steering_coeff": 2.0, "lambda_retain": 1.0, "lambda_forget": 1.0,
            "trainable_parameters": "all", "loss_reduction": "open_unlearning"},
}
_OU_EVALUATION = {"tofu": {"max_length": 512, "zlib_text": "decoded", "variance_floor": 1e-6,
                           "es_no_match": "one_over_n", "prompt_format": "open-unlearning", "attention_mask": "not_pad"},
                  "muse_news": {"max_length": 2048, "variance_floor": 1e-6, "verbmem_stop": "eos",
                                "max_prompt_tokens": None, "attention_mask": "not_pad"},
                  "robustness": {"max_length": 512, "es_no_match": "one_over_n", "prompt_format": "open-unlearning",
                                 "attention_mask": "not_pad"}}


def check_preset(preset: str | None) -> str | None:
    if preset is not None and preset not in PRESETS:
        raise UnlearnError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return preset


def warmup_steps(n_forget_rows: int, batch_size: int, accumulation: int, epochs: float = 1.0, world_size: int = 1) -> int:
    """OpenUnlearning's ``warmup_epochs``: ``int(epochs * rows // (batch * accumulation * devices))`` optimizer steps."""
    return int((epochs * n_forget_rows) // (batch_size * accumulation * world_size))


def training_preset(preset: str | None, method: str, n_forget_rows: int | None = None,
                    world_size: int = 1, fixed: dict[str, Any] | None = None,
                    overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Config keyword arguments of ``preset`` for ``method``, with ``overrides`` (the options given explicitly) on top;
    None / ``hf-unlearn`` give ``overrides`` alone (the config's own defaults apply).

    ``n_forget_rows`` sets the one warm-up epoch as ``warmup_steps`` from the final batch size and accumulation (left
    out when None). ``fixed``: values a registry variant fixes itself (``npo_klr``'s KL retain term), which the preset
    leaves alone. Not set: the optimizer (OpenUnlearning uses bitsandbytes' paged AdamW, the same update with paged
    memory) and bf16, which are device choices.
    """
    overrides = dict(overrides or {})
    if check_preset(preset) in (None, "hf-unlearn"):
        return overrides
    base = method.split("_")[0] if method.startswith(("npo", "simnpo")) else method
    values = {k: v for k, v in {**_OU_TRAINING, **_OU_METHODS.get(base, {})}.items() if k not in (fixed or {})}
    values.update(overrides)
    if n_forget_rows is not None and "warmup_steps" not in overrides:
        values["warmup_steps"] = warmup_steps(n_forget_rows, values["per_device_train_batch_size"],
                                              values["gradient_accumulation_steps"], world_size=world_size)
    return values


def evaluation_preset(preset: str | None, benchmark: str) -> dict[str, Any]:
    """Keyword arguments of ``preset`` for ``evaluate_tofu`` (``tofu``), ``evaluate_muse_news`` (``muse_news``) or
    ``evaluate_robustness`` (``robustness``). ``prompt_format="open-unlearning"`` is resolved per model family from
    the tokenizer (:meth:`hf_unlearn.data.prompts.PromptFormat.open_unlearning`)."""
    if benchmark not in _OU_EVALUATION:
        raise UnlearnError(f"unknown benchmark {benchmark!r}; choose one of {', '.join(_OU_EVALUATION)}")
    if check_preset(preset) in (None, "hf-unlearn"):
        return {}
    return dict(_OU_EVALUATION[benchmark])
