"""The approximate-method run on a model: the method of the registry with the budget of the command (or a preset),
evaluated before and after on the forget rows and a sample of the retained rows, saved with its card.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..errors import UnlearnError
from ..presets import COMMAND_BUDGET, training_preset
from ..utils import has_cuda, weights_follow_umask
from ..validation import looks_like_hub_id
from .config import ForgetConfig
from .forget_receipt import ForgetReceipt, _receipt
from .publishing import _own_settings

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)


def _preset_values(config: ForgetConfig, spec, n_forget_rows: int) -> dict:
    """The budget keywords: the options ``config`` sets (not None) over ``config.preset``'s values over the command's
    own budget (:data:`hf_unlearn.presets.COMMAND_BUDGET`)."""
    own = {"num_train_epochs": "num_train_epochs", "learning_rate": "learning_rate",
           "per_device_train_batch_size": "batch_size", "max_length": "max_length"}
    given = {key: getattr(config, name) for key, name in own.items() if getattr(config, name) is not None}
    values = {**COMMAND_BUDGET, **training_preset(config.preset, spec.name, n_forget_rows, fixed=spec.preset,
                                                  overrides=given)}
    values["per_device_eval_batch_size"] = values["per_device_train_batch_size"]
    return values


def _approximate(plan: dict, config: ForgetConfig, out: Path, log) -> ForgetReceipt:
    from ..eval.qa import evaluate_qa
    from ..hub.mixin import write_model_card
    from ..models import load_model, load_tokenizer

    spec, timings = plan["spec"], {}
    forget_rows, retain_rows = plan["forget_rows"], plan["retain_rows"]
    model_dir = out / "model"
    try:
        args = spec.make_config(**{
            **_preset_values(config, spec, len(forget_rows)),
            **dict(output_dir=str(model_dir), max_steps=config.max_steps, seed=config.seed, save_strategy="no",
                   report_to=[], logging_steps=10, disable_tqdm=not config.progress, dataloader_pin_memory=has_cuda(),
                   id_column=config.id_column), **plan["method_args"]})
    except (TypeError, ValueError) as e:
        raise UnlearnError(f"{spec.name}: {str(e).splitlines()[0]}") from None
    t = time.perf_counter()
    tokenizer = load_tokenizer(plan["source"])
    model = load_model(plan["source"])
    timings["load_s"] = time.perf_counter() - t
    peft_config = None
    if config.lora:
        from peft import LoraConfig
        from transformers.pytorch_utils import Conv1D

        peft_config = LoraConfig(r=config.lora_r, lora_alpha=2 * config.lora_r, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM",
                                 # GPT-2's Conv1D stores weights transposed (peft warns and flips it otherwise)
                                 fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()))
    sets = None
    if config.eval_rows:
        sets = {"forget": forget_rows.select(range(min(config.eval_rows, len(forget_rows)))).to_list(),
                "retain": retain_rows.select(range(min(config.eval_rows, len(retain_rows)))).to_list()}
    before = after = {}
    from ..data.prompts import prompt_format

    eval_kw = dict(max_length=args.max_length, max_new_tokens=config.max_new_tokens, progress=config.progress,
                   use_chat_template=prompt_format(args.prompt_format, tokenizer),  # the format it trains with
                   attention_mask=args.attention_mask)
    from ..eval.qa import rouge_missing

    skipped = rouge_missing() if sets else None  # said once, and kept in the receipt
    if skipped:
        log(skipped)
    if sets:
        t = time.perf_counter()
        before = evaluate_qa(model, tokenizer, sets, **eval_kw)
        timings["eval_before_s"] = time.perf_counter() - t
    trainer = spec.trainer_class(model=model, args=args, forget_dataset=forget_rows, retain_dataset=retain_rows,
                                 processing_class=tokenizer, peft_config=peft_config)
    log(f"{spec.name} on {len(forget_rows)} forget row(s) of {plan['source']} ({len(retain_rows)} retained rows as "
        f"the retain set{', LoRA' if config.lora else ''})")
    t = time.perf_counter()
    trainer.train()
    timings["train_s"] = time.perf_counter() - t
    unlearned = trainer.accelerator.unwrap_model(trainer.model)
    if trainer.is_peft:
        unlearned = unlearned.merge_and_unload()
    if sets:
        t = time.perf_counter()
        after = evaluate_qa(unlearned, tokenizer, sets, **eval_kw)
        timings["eval_after_s"] = time.perf_counter() - t
    unlearned.save_pretrained(model_dir)
    weights_follow_umask(model_dir)
    tokenizer.save_pretrained(model_dir)
    card_info = trainer.unlearning_card_info()
    extra = card_info.setdefault("extra", {})
    if after:
        card_info["evaluation"] = {**(card_info.get("evaluation") or {}),
                                   **{f"{s}_{m}": v for s, r in after.items() for m, v in r.items()
                                      if m != "items" and v is not None}}
        extra["evaluation_before"] = {f"{s}_{m}": v for s, r in before.items() for m, v in r.items()
                                      if m != "items" and v is not None}
    write_model_card(model_dir, card_info, base_model=config.base_model or _hub_id(plan["source"]),
                     datasets=config.datasets, not_ids=_own_settings(card_info))
    evidence = {"method": spec.name, "hyperparameters": card_info.get("hyperparameters", {}),
                "steps": trainer.state.global_step, "train_seconds": timings["train_s"],
                "stopped_step": extra.get("stopped_step"), "stopped_by_rule": extra.get("stopped_by_rule"),
                "forget_rows": len(forget_rows), "retain_rows": len(retain_rows), "before": before, "after": after,
                **({"rouge_l": skipped} if skipped else {})}
    return _receipt(plan, config, out, model_dir, evidence, timings)


def _hub_id(source: str) -> str | None:
    return source if looks_like_hub_id(source) and not os.path.exists(source) else None
