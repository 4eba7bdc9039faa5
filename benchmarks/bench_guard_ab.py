"""A step's guard checks with an earlier commit's code and with this code, alternating in one process.

The recorder's checks at a step (``ProgramGuard``: when the batches are fetched, then before and after
``optimizer.step()``, the AdamW step included) on two copies of one model, each with its own optimizer, one checked
by the earlier code and one by this code, the arms alternating every step (order swapped each step), CPU time of
this process; the first four steps of each arm are warm-up. The earlier code is imported as a renamed package:

    mkdir -p /tmp/basepkg && git archive abfd05b hf_unlearn | tar -x -C /tmp/basepkg
    mv /tmp/basepkg/hf_unlearn /tmp/basepkg/hf_unlearn_base
    grep -rl hf_unlearn /tmp/basepkg/hf_unlearn_base --include=*.py | xargs sed -i -E \\
        's/(from|import) hf_unlearn(\\.| |$)/\\1 hf_unlearn_base\\2/g; s/"hf_unlearn\\./"hf_unlearn_base./g'
    PYTHONPATH=.:/tmp/basepkg python benchmarks/bench_guard_ab.py --model smollm2 --lora --steps 40
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--lora", action="store_true", help="a PEFT LoRA r=8 on q/v over the model (about 1,000 modules)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--base", default="hf_unlearn_base", help="the earlier code's package name")
    a = p.parse_args()

    import importlib

    import torch
    from bench_recording import build_model
    from transformers import TrainingArguments

    import hf_unlearn.trace.guards as now_guards

    old_guards = importlib.import_module(f"{a.base}.trace.guards")
    torch.set_num_threads(1)
    base = build_model(a.model)
    if a.lora:
        from peft import LoraConfig, get_peft_model

        base = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                               task_type="CAUSAL_LM"))
    args = TrainingArguments(output_dir="/tmp/bench_guard_ab", use_cpu=True, report_to=[])
    arms = {}
    for name, guards in (("earlier", old_guards), ("now", now_guards)):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
        for q in model.parameters():
            if q.requires_grad:
                q.grad = torch.randn_like(q) * 1e-3
        arms[name] = (guards.ProgramGuard(model, opt, {}, context=lambda: {"args": args}), opt, [])
    for step in range(a.steps):
        for name in (("earlier", "now") if step % 2 else ("now", "earlier")):
            guard, opt, times = arms[name]
            t = time.process_time()
            guard.between_steps(step, [1e-3])
            opt.step()
            if step >= 4:
                times.append(time.process_time() - t)
    before, after = (statistics.median(arms[n][2]) * 1000 for n in ("earlier", "now"))
    ratios = [n / e for n, e in zip(arms["now"][2], arms["earlier"][2])]
    print(f"{a.model}{' LoRA' if a.lora else ''}: a step's guard checks, earlier {before:.1f} ms CPU, now {after:.1f} ms "
          f"CPU: {after / before:.2f}x (median of {len(ratios)} paired ratios {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    main()
