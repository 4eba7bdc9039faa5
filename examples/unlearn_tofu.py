"""Approximate unlearning with any registered trainer (MASC, GradAscent, GradDiff, NPO, SimNPO, RMU, ...) on TOFU rows.

    python examples/unlearn_tofu.py --method masc                                   # tiny Llama, offline, ~1 min
    python examples/unlearn_tofu.py --method npo --max-steps 10
    accelerate launch --cpu --num_processes 2 examples/unlearn_tofu.py --method grad_diff   # 2 processes (DDP)
    python examples/unlearn_tofu.py --method simnpo --model ../shared/models/SmolLM2-135M-Instruct --tofu ../shared/data/tofu

Without --model it first teaches a tiny Llama the first 3 authors of the TOFU subset shipped with hf_unlearn (a few
seconds), then makes it forget the third. Every method is a ``transformers.Trainer`` subclass with its own config,
read from the one method registry (``hf_unlearn.methods.registry``); the script is the same for all of them.
It prints the answer loss on the forget and retain rows before and after, e.g.
``grad_diff: 6 steps; forget answer loss 0.041 -> 3.912, retain 0.037 -> 0.218``.
"""

from __future__ import annotations

import argparse

from hf_unlearn import load_model, load_tofu, load_tokenizer
from hf_unlearn.data.embedded import author_ids
from hf_unlearn.demo import mean_answer_loss, tiny_tofu_model
from hf_unlearn.methods.registry import METHODS, get_method
from hf_unlearn.runtime import init_processes
from hf_unlearn.utils import has_cuda


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="masc", choices=sorted(METHODS), help="the unlearning method (default masc)")
    p.add_argument("--model", default=None, help="a model fine-tuned on TOFU (default: a tiny Llama taught here)")
    p.add_argument("--tofu", default=None, help="TOFU folder, with --model (default: $HF_UNLEARN_DATA_DIR/tofu)")
    p.add_argument("--forget-author", type=int, default=2, help="TOFU author to forget (default 2)")
    p.add_argument("--max-steps", type=int, default=6, help="step budget (MASC may stop earlier; default 6)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: 1e-3 tiny model, 1e-5 otherwise)")
    p.add_argument("--out", default="unlearn_tofu_output", help="output folder (default unlearn_tofu_output)")
    args = p.parse_args()
    init_processes()  # every process prints "process R of N" (2 of them under cpu_2proc.yaml)

    if args.model is None:
        model, tokenizer, rows = tiny_tofu_model(authors=3)
    else:
        model, tokenizer = load_model(args.model), load_tokenizer(args.model)
        rows = load_tofu("full", args.tofu).select(range(20 * (args.forget_author + 1)))
    forget_ids = set(author_ids(args.forget_author))
    forget = rows.filter(lambda r: r["id"] in forget_ids)
    retain = rows.filter(lambda r: r["id"] not in forget_ids)

    spec = get_method(args.method)
    config = spec.make_config(output_dir=args.out, max_steps=args.max_steps, per_device_train_batch_size=4,
                              learning_rate=args.lr or (1e-3 if args.model is None else 1e-5), max_length=96,
                              save_strategy="no", report_to=[], logging_steps=2, seed=0,
                              dataloader_pin_memory=has_cuda())
    trainer = spec.trainer_class(model=model, args=config, forget_dataset=forget, retain_dataset=retain,
                                 processing_class=tokenizer)
    forget_tok, retain_tok = trainer.train_dataset, trainer.retain_dataset
    before = mean_answer_loss(trainer.model, tokenizer, forget_tok), mean_answer_loss(trainer.model, tokenizer, retain_tok)
    trainer.train()
    after = mean_answer_loss(trainer.model, tokenizer, forget_tok), mean_answer_loss(trainer.model, tokenizer, retain_tok)
    if trainer.accelerator.is_main_process:
        print(f"{args.method}: {trainer.state.global_step} steps; forget answer loss {before[0]:.3f} -> {after[0]:.3f}, "
              f"retain {before[1]:.3f} -> {after[1]:.3f}")
        trainer.save_model(args.out)
        print(f"saved to {args.out}; trainer.push_to_hub('org/name', deletion=True) publishes it with its card")


if __name__ == "__main__":
    main()
