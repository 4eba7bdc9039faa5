"""Does forgetting generalise? Fine-tune on a multiple-choice task, forget it with random labels, test unseen rows.

    python examples/random_label_forgetting.py                              # tiny Llama on 48 RTE rows, ~1 min
    accelerate launch --cpu --num_processes 2 examples/random_label_forgetting.py   # 2 processes (DDP)
    python examples/random_label_forgetting.py --model ../shared/models/SmolLM2-135M-Instruct --task sciq --epochs 2

``MultipleChoiceTrainer`` learns the task; ``RandomLabelForgetTrainer`` is the same trainer on the same rows with
labels re-drawn (seeded). Task rows come from --data or $HF_UNLEARN_DATA_DIR/tasks (``../shared/data/tasks`` here).
It prints accuracy on the trained and the unseen rows before and after forgetting, and the forget ratio of each
(1 = back to chance, 0 = nothing forgotten), e.g. ``unseen rows: accuracy 0.542 -> 0.500 (chance 0.500)``.
"""

from __future__ import annotations

import argparse
import os

from hf_unlearn import (
    MultipleChoiceConfig,
    MultipleChoiceTrainer,
    RandomLabelConfig,
    RandomLabelForgetTrainer,
    evaluate_multiple_choice,
    forget_ratio,
    load_model,
    load_task,
    load_tokenizer,
)
from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer
from hf_unlearn.runtime import init_processes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--task", default="rte", help="task name (default rte)")
    p.add_argument("--data", default=None, help="folder of task .jsonl files (default: $HF_UNLEARN_DATA_DIR/tasks)")
    p.add_argument("--model", default=None, help="causal LM (default: a tiny Llama built here)")
    p.add_argument("--rows", type=int, default=96, help="rows used, half trained, half unseen (default 96)")
    p.add_argument("--epochs", type=float, default=3.0, help="fine-tuning and forgetting epochs (default 3)")
    p.add_argument("--out", default="random_label_output", help="output folder (default random_label_output)")
    args = p.parse_args()
    init_processes()  # every process prints "process R of N" (2 of them under cpu_2proc.yaml)
    if args.data is None and "HF_UNLEARN_DATA_DIR" not in os.environ and os.path.isdir("../shared/data/tasks"):
        args.data = "../shared/data/tasks"

    task = load_task(args.task, args.data, test_size=0.5, max_rows=args.rows, seed=0)
    if args.model is None:
        texts = [f"{r['context'] or ''} {r['question']} {' '.join(r['choices'])}" for r in task["train"]]
        tokenizer = build_tiny_tokenizer(texts, vocab_size=1024)
        model = build_tiny_model("llama", tokenizer, hidden_size=64, num_layers=2, num_heads=4)
        lr = 1e-3
    else:
        tokenizer, model, lr = load_tokenizer(args.model), load_model(args.model), 2e-5
    common = dict(num_train_epochs=args.epochs, per_device_train_batch_size=8, learning_rate=lr, max_length=192,
                  save_strategy="no", logging_steps=5, seed=0)

    MultipleChoiceTrainer(model=model, args=MultipleChoiceConfig(output_dir=f"{args.out}/finetune", **common),
                          train_dataset=task["train"], processing_class=tokenizer).train()
    ft = {s: evaluate_multiple_choice(model, tokenizer, task[s]) for s in ("train", "test")}
    trainer = RandomLabelForgetTrainer(model=model, args=RandomLabelConfig(output_dir=f"{args.out}/forget",
                                                                           label_mode="uniform", **common),
                                       train_dataset=task["train"], processing_class=tokenizer)
    trainer.train()
    after = {s: evaluate_multiple_choice(model, tokenizer, task[s]) for s in ("train", "test")}
    if trainer.accelerator.is_main_process:
        for split, name in (("train", "trained rows"), ("test", "unseen rows")):
            a, b = ft[split], after[split]
            print(f"{name}: accuracy {a.accuracy:.3f} -> {b.accuracy:.3f} (chance {b.chance:.3f}), forget ratio "
                  f"{forget_ratio(a.accuracy, b.accuracy, b.chance):.2f}")


if __name__ == "__main__":
    main()
