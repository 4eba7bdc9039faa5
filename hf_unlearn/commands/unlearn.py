"""`hf-unlearn unlearn METHOD MODEL --forget-split forget10 --out OUT [--lora]`: approximate unlearning on TOFU.

Loads MODEL (Hub id, local folder or GGUF file), the TOFU forget split and its complementary retain split, runs the
method (MASC until its stopping rule fires, the baselines for their budget) and saves a plain model (LoRA merged)
with its tokenizer and ``unlearning.json`` (method, hyperparameters, stop step, answer losses; no raw sample ids).
"""

from __future__ import annotations

import re

from ..utils import weights_follow_umask
from . import add_subcommands, add_tofu_splits

# hf_unlearn.eval.stopping.TARGET_METRICS, written out so that `hf-unlearn --help` imports no torch (a test keeps
# the two lists equal)
TARGET_METRIC_NAMES = ("violation_rate", "forget_probability", "truth_ratio")


def register(parser) -> None:
    from ..methods.registry import METHODS

    sub = add_subcommands(parser)
    for method, spec in METHODS.items():
        p = sub.add_parser(method, help=spec.help, description=f"{method}: {spec.help}")
        p.add_argument("model", help="Hub id, local folder or .gguf file")
        add_tofu_splits(p)
        p.add_argument("--out", required=True, help="output folder for the unlearned model")
        p.add_argument("--lora", action="store_true", help="train a LoRA adapter (merged into the saved model)")
        p.add_argument("--lora-r", type=int, default=8, help="LoRA rank (default 8)")
        p.add_argument("--max-steps", type=int, default=-1, help="step budget (default: --epochs)")
        p.add_argument("--epochs", type=float, default=None, help="epoch budget over the forget set (default 5)")
        p.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-5)")
        p.add_argument("--batch-size", type=int, default=None, help="forget (and retain) rows per step (default 4)")
        p.add_argument("--max-length", type=int, default=None, help="tokens per QA pair (default 256)")
        p.add_argument("--preset", choices=("hf-unlearn", "open-unlearning"), default=None,
                       help="open-unlearning: OpenUnlearning's budget (10 epochs, batch 8 x 4 accumulation, one "
                            "warm-up epoch, weight decay 0.01, 512 tokens), its KL-over-all-positions convention and "
                            "its method defaults (see hf_unlearn.presets); options given explicitly win")
        p.add_argument("--forget-ids", default=None,
                       help="unlearn only these rows of the forget split: an id file, e.g. the easy/hard/random "
                            "sets of `hf-unlearn analyze stratify` (typed .jsonl/.json, or one id a line)")
        p.add_argument("--max-forget-rows", type=int, default=None, help="use only the first N forget rows")
        p.add_argument("--max-retain-rows", type=int, default=None, help="use only the first N retain rows")
        p.add_argument("--retain-loss", choices=["none", "ce", "kl"], default=None, help="retain term (method default)")
        p.add_argument("--lambda-forget", type=float, default=None, help="weight of the forget term (default 1)")
        p.add_argument("--lambda-retain", type=float, default=None, help="weight of the retain term (method default)")
        p.add_argument("--gradient-checkpointing", action="store_true", help="trade compute for activation memory")
        p.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
        p.add_argument("--validation-fraction", type=float, default=None,
                       help="hold out this share of the forget rows from training; the stopping rules measure "
                            "forgetting on them (default 0)")
        p.add_argument("--stop-metric", choices=list(TARGET_METRIC_NAMES), default=None,
                       help="stop when this forget metric on the held-out rows reaches --stop-target (any method; "
                            "needs --validation-fraction); the best checkpoint is kept in OUT/stopping_checkpoint")
        p.add_argument("--stop-target", type=float, default=None,
                       help="the target: violation_rate / forget_probability <= it, truth_ratio >= it")
        p.add_argument("--stop-every", type=int, default=5, help="check the stop metric every N steps (default 5)")
        for option in spec.options:
            p.add_argument(option.flag, type=option.type, default=None, help=option.help)
        p.set_defaults(func=run, method=method)


def retain_split_for(forget_split: str) -> str:
    """``forget10`` -> ``retain90`` (TOFU's complementary retain split)."""
    from ..errors import UnlearnError

    m = re.fullmatch(r"forget(\d\d)", forget_split)
    if not m:
        raise UnlearnError(f"cannot infer the retain split of {forget_split!r}; pass --retain-split")
    return f"retain{100 - int(m.group(1)):02d}"


def load_tofu_splits(args, retain_split: str):
    """The forget and retain splits named by ``args`` (``--forget-split``, ``--tofu``), the forget split narrowed to
    ``--forget-ids`` where the command has it, then cut to ``--max-*-rows``."""
    from ..data import load_tofu

    forget = load_tofu(args.forget_split, args.tofu)
    retain = load_tofu(retain_split, args.tofu)
    if getattr(args, "forget_ids", None):
        from ..data.ids import read_ids, select_ids

        forget = select_ids(forget, read_ids(args.forget_ids), f"TOFU {args.forget_split}", args.forget_ids)
    if args.max_forget_rows:
        forget = forget.select(range(min(args.max_forget_rows, len(forget))))
    if args.max_retain_rows:
        retain = retain.select(range(min(args.max_retain_rows, len(retain))))
    return forget, retain


def run(args) -> int:
    import json
    import time
    from pathlib import Path

    from ..demo import mean_answer_loss
    from ..errors import UnlearnError
    from ..methods.base import UnlearningTrainer
    from ..methods.registry import get_method
    from ..models import load_model, load_tokenizer
    from ..presets import COMMAND_BUDGET, training_preset
    from ..utils import activation_checkpointing_kwargs, atomic_write_text, has_cuda

    spec = get_method(args.method)
    retain_split = args.retain_split or retain_split_for(args.forget_split)
    if (args.stop_metric is None) != (args.stop_target is None):
        raise UnlearnError("--stop-metric and --stop-target go together")
    if args.stop_metric and not args.validation_fraction:
        raise UnlearnError("--stop-metric measures held-out forget rows: add --validation-fraction (e.g. 0.1)")
    options = {"retain_loss": args.retain_loss, "lambda_forget": args.lambda_forget,
               "lambda_retain": args.lambda_retain, "validation_fraction": args.validation_fraction}
    for option in spec.options:
        options[option.field] = getattr(args, option.field)
    options = {k: v for k, v in options.items() if v is not None}
    budget = {"num_train_epochs": args.epochs, "learning_rate": args.lr, "per_device_train_batch_size": args.batch_size,
              "max_length": args.max_length}
    budget = {k: v for k, v in budget.items() if v is not None}

    def make_config(n_forget_rows=None):
        values = {**COMMAND_BUDGET, **training_preset(args.preset, args.method, n_forget_rows, fixed=spec.preset,
                                                  overrides={**budget, **options})}
        values.setdefault("per_device_eval_batch_size", values["per_device_train_batch_size"])
        return spec.make_config(
            output_dir=args.out, max_steps=args.max_steps, seed=args.seed, save_strategy="no", report_to=[],
            logging_steps=10, disable_tqdm=False, dataloader_pin_memory=has_cuda(),
            **activation_checkpointing_kwargs(args.gradient_checkpointing), **values)

    make_config()  # the config is checked first (bad options fail before anything heavy loads)
    forget, retain = load_tofu_splits(args, retain_split)
    config = make_config(len(forget))  # the preset's warm-up epoch needs the number of forget rows
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    callbacks = []
    if args.stop_metric:
        from ..eval.stopping import UnlearningStoppingCallback

        callbacks.append(UnlearningStoppingCallback(args.stop_metric, args.stop_target, eval_steps=args.stop_every,
                                                    tofu_path=args.tofu))
    trainer: UnlearningTrainer = spec.trainer_class(model=model, args=config, forget_dataset=forget, retain_dataset=retain,
                                             processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
    forget_tok, retain_tok = trainer.train_dataset, trainer.retain_dataset
    retain_probe = retain_tok.select(range(min(100, len(retain_tok))))
    before = {"forget": mean_answer_loss(trainer.model, tokenizer, forget_tok),
              "retain": mean_answer_loss(trainer.model, tokenizer, retain_probe)}
    print(f"== unlearning {len(forget)} {args.forget_split} rows with {trainer.method_name} "
          f"({'LoRA' if args.lora else 'full'}; retain {retain_split}, {len(retain)} rows)", flush=True)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    after = {"forget": mean_answer_loss(trainer.model, tokenizer, forget_tok),
             "retain": mean_answer_loss(trainer.model, tokenizer, retain_probe)}

    out = Path(args.out)
    model = trainer.accelerator.unwrap_model(trainer.model)
    if trainer.is_peft:
        model = model.merge_and_unload()
    model.save_pretrained(out)
    weights_follow_umask(out)
    tokenizer.save_pretrained(out)
    info = trainer.unlearning_card_info()
    info.pop("forget_ids")  # raw ids stay local; the Hub card code publishes keyed tags only
    info.update({"forget_split": args.forget_split, "retain_split": retain_split, "train_seconds": seconds,
                 "answer_loss_before": before, "answer_loss_after": after, "base_model": str(args.model)})
    if callbacks:
        info["stopping"] = {k: v for k, v in callbacks[0].summary().items() if k != "checkpoint"}  # no local paths
    atomic_write_text(out / "unlearning.json", json.dumps(info, indent=2) + "\n")
    stop = info["extra"].get("stopped_step")
    print(f"done in {seconds:.1f} s, {trainer.state.global_step} steps"
          + (f" (MASC stopped at step {stop})" if stop is not None else ""))
    print(f"answer loss forget {before['forget']:.3f} -> {after['forget']:.3f}, "
          f"retain {before['retain']:.3f} -> {after['retain']:.3f}")
    print(f"saved to {out}")
    if callbacks:
        cb = callbacks[0]
        if cb.reached_step is not None:
            print(f"stopped at step {cb.reached_step}: held-out {cb.metric} {cb.reached_value:.4f} reached the target "
                  f"{cb.target:g}")
        else:
            print(f"note: held-out {cb.metric} never reached {cb.target:g}; the best check (step {cb.best_step}, "
                  f"{cb.best_score:.4f}) is saved in {cb.best_model_path}")
    if info["extra"].get("stopped_by_rule") is False:
        print("note: MASC reached the step budget before its stopping rule fired; raise --epochs/--max-steps or --lr")
    return 0

