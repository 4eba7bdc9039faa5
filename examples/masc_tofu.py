"""Unlearn a TOFU forget split with MASC (stops by itself), optionally with LoRA.

    python examples/masc_tofu.py --lora                     # tiny Llama taught 3 TOFU authors here, offline
    accelerate launch --config_file examples/accelerate/cpu_2proc.yaml examples/masc_tofu.py --lora   # same stop on each
    python examples/masc_tofu.py --model ../shared/models/SmolLM2-135M-Instruct --forget-split forget01 --tofu ../shared/data/tofu

With --model, data come from --tofu DIR or $HF_UNLEARN_DATA_DIR/tofu, else the Hub; without it, a tiny Llama first
memorises the first 3 authors of the TOFU subset shipped with hf_unlearn and MASC forgets the third. The unlearned
model (LoRA merged) is saved to --out with masc_stopping.json and masc_violation_curve.png (the stop step, why, and
the violation curve). By default 10% of the forget rows are held out from training and the stop certifies them
(--validation-fraction). It prints ``stopped at step N (budget M); curve in OUT``.
"""

from __future__ import annotations

import argparse

from hf_unlearn import MASCConfig, MASCTrainer, load_model, load_tofu, load_tokenizer
from hf_unlearn.data.embedded import author_ids
from hf_unlearn.demo import tiny_tofu_model
from hf_unlearn.runtime import init_processes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Hub id, local folder or .gguf file of a model fine-tuned on TOFU "
                                                 "(default: a tiny Llama taught 3 TOFU authors here)")
    p.add_argument("--forget-split", default="forget01")
    p.add_argument("--tofu", default=None)
    p.add_argument("--out", default="masc_tofu_output")
    p.add_argument("--lora", action="store_true")
    p.add_argument("--max-retain-rows", type=int, default=400)
    p.add_argument("--validation-fraction", type=float, default=0.1,
                   help="forget rows held out from training; the stopping rule certifies them (0: the trained rows)")
    args = p.parse_args()
    init_processes()  # every process prints "process R of N" (2 of them under cpu_2proc.yaml)

    if args.model is None:
        model, tokenizer, rows = tiny_tofu_model(authors=3)
        third = set(author_ids(2))
        forget, retain = rows.filter(lambda r: r["id"] in third), rows.filter(lambda r: r["id"] not in third)
    else:
        forget = load_tofu(args.forget_split, args.tofu)
        retain = load_tofu(f"retain{100 - int(args.forget_split[-2:]):02d}", args.tofu)
        retain = retain.select(range(min(args.max_retain_rows, len(retain))))
        tokenizer = load_tokenizer(args.model)
        model = load_model(args.model)
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")

    config = MASCConfig(
        output_dir=args.out,
        num_train_epochs=10,  # a cap: MASC stops when the violation rate on held-out forget rows is <= alpha
        learning_rate=(1e-2 if args.lora else 1e-3) if args.model is None else (1e-4 if args.lora else 1e-5),
        per_device_train_batch_size=4,
        validation_fraction=args.validation_fraction,  # probe: the training batches; confirmation: the held-out rows
        k=10, rho=0.5, eta=1.0, alpha=0.2, probe_steps=5,
        retain_loss="kl", save_strategy="no", report_to="none",
    )
    trainer = MASCTrainer(model=model, args=config, forget_dataset=forget, retain_dataset=retain,
                          processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    if trainer.accelerator.is_main_process:
        print(f"stopped at step {trainer.stopped_step} (budget {trainer.state.max_steps}; {trainer.stop_reason}); "
              f"curve in {args.out}")
        model = trainer.accelerator.unwrap_model(trainer.model)
        (model.merge_and_unload() if trainer.is_peft else model).save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)


if __name__ == "__main__":
    main()
