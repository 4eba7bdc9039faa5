"""What the whole-program digest costs once per optimizer step, with a Trainer as context, on the tiny model or
SmolLM2-135M's shape (no training): the digest, and the code digests of the classes and modules inside it.

    PYTHONPATH=. python benchmarks/bench_program_digest.py [--model tiny|smollm2] [--lora] [--repeats 30]

Prints the median CPU time of each. Run it in two trees (``git archive REV | tar -x -C DIR``) one after the other to
compare two versions of ``hf_unlearn.trace.digests``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=("tiny", "smollm2"))
    p.add_argument("--lora", action="store_true")
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args()

    import torch
    import transformers
    from bench_recording import build_model

    from hf_unlearn.trace import digests

    model = build_model(a.model)
    if a.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    args = transformers.TrainingArguments(output_dir="/tmp/bench_program_digest", use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=model, args=args)
    classes = {type(m) for m in model.modules()} | {torch.Tensor, type(trainer), type(optimizer)}

    def whole():
        digests.program_state(model, optimizer, args=args, trainer=trainer)

    def code():
        d = digests.Digester()
        for c in classes:
            digests._class_code(c, d)
        for name in digests.CODE_MODULES:
            digests._module_code(sys.modules[name], d)

    for label, fn in (("whole-program digest", whole), ("of which code digests", code)):
        fn()
        fn()
        times = []
        for _ in range(a.repeats):
            t = time.process_time()
            fn()
            times.append(time.process_time() - t)
        print(f"{a.model}{' LoRA' if a.lora else ''}: {label}: {statistics.median(times) * 1000:.2f} ms CPU "
              f"(median of {a.repeats})")


if __name__ == "__main__":
    main()
