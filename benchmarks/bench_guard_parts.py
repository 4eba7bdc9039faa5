"""What the recorder's per-step checks cost, part by part, on a model of SmolLM2-135M's shape (no training):

    PYTHONPATH=. python benchmarks/bench_guard_parts.py [--model smollm2|tiny] [--repeats 5] [--lora] [--only]

Prints the CPU and wall time (median of the repeats; the exact checksums hash on torch's threads) of a whole step's
guard checks (``ProgramGuard``: when the batches are fetched, before and after ``optimizer.step()``; ``--only``: that
alone), then of each part the guards run once per optimizer step: the whole-program
digest (hf_unlearn.trace.digests.program_state), the cheap snapshot (storage, version counters, samples, controls),
the exact checksums of the gradients (before optimizer.step()) and of what the step wrote (the trainable parameters
and buffers, after it; every tensor with AdamW's moments for scale: what a watched callback's events cost), one AdamW
step for scale, and one checkpoint as a plain ``Trainer`` and as the recording save it (its SHA-256 hashes computed
while its files are written).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


_TMP = None


def fresh_dir():
    """An empty folder under this run's temporary folder (each save writes a new checkpoint)."""
    import tempfile

    global _TMP
    _TMP = _TMP or Path(tempfile.mkdtemp(prefix="bench_guard_parts_"))
    return Path(tempfile.mkdtemp(dir=_TMP))


def trainer_like_save(model, opt):
    """What ``Trainer._save_checkpoint`` writes that costs: the weights (safetensors) and the optimizer
    (``torch.save``)."""
    import torch
    from safetensors.torch import save_model

    d = fresh_dir()
    save_model(model, str(d / "model.safetensors"), metadata={"format": "pt"})
    torch.save(opt.state_dict(), d / "optimizer.pt")


def main():
    import torch
    from bench_recording import build_model
    from transformers import TrainingArguments

    from hf_unlearn.trace.checkpoints import capture_state, save_checkpoint
    from hf_unlearn.trace.checksums import gradient_tensors
    from hf_unlearn.trace.digests import program_state
    from hf_unlearn.trace.guards import (
        ProgramGuard,
        program_controls,
        snapshot,
        state_tensors,
        step_state_tensors,
        tensor_checksums,
    )
    from hf_unlearn.trace.hashing import checkpoint_hashes

    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=["tiny", "smollm2"], default="smollm2")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--lora", action="store_true", help="a PEFT LoRA r=8 on q/v over the model (about 1,000 modules)")
    p.add_argument("--only", action="store_true", help="only a step's guard checks (the first part)")
    a = p.parse_args()
    model = build_model(a.model)
    if a.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    for q in model.parameters():
        if q.requires_grad:
            q.grad = torch.randn_like(q) * 1e-3
    opt.step()
    args = TrainingArguments(output_dir="/tmp/bench_guard_parts", use_cpu=True, report_to=[])
    grads = gradient_tensors(model)
    guard = ProgramGuard(model, opt, {}, context=lambda: {"args": args})
    steps = iter(range(10**6))

    def guarded_step():  # the checks when a step's batches are fetched, then optimizer.step() with its two checks
        guard.between_steps(next(steps), [1e-3])
        opt.step()

    parts = {
        "a step's guard checks (batches fetched, before and after optimizer.step(); the AdamW step included)":
            guarded_step,
        "whole-program digest (program_state)": lambda: program_state(model, opt, args=args),
        "cheap snapshot (storage, versions, samples, controls)": lambda: snapshot(model, opt),
        "  of which the program controls (modules' attributes, hooks, forward code)":
            lambda: program_controls(model, opt),
        "  of which listing every state tensor": lambda: state_tensors(model, opt),
        "exact checksums of the gradients": lambda: tensor_checksums(grads),
        "exact checksums a step reads (trainable parameters, buffers)":
            lambda: tensor_checksums(step_state_tensors(model)),
        "exact checksums of every tensor, AdamW moments included (a watched callback's events)":
            lambda: tensor_checksums(state_tensors(model, opt)),
        "one AdamW step (for scale)": opt.step,
        "a checkpoint as Trainer saves it (model.safetensors, optimizer.pt)": lambda: trainer_like_save(model, opt),
        "a checkpoint as the recording saves it (safetensors, SHA-256 hashes.json)":
            lambda: save_checkpoint(fresh_dir(), 4, model, opt),
        "  of which the SHA-256 state hashes": lambda: checkpoint_hashes(capture_state(model, opt, 4)),
    }
    n = sum(q.numel() for q in model.parameters())
    parts = {k: v for k, v in parts.items() if not a.only or k == next(iter(parts))}
    print(f"{a.model}: {n / 1e6:.1f}M parameters, {torch.get_num_threads()} torch thread(s) (hashing threads too); median of "
          f"{a.repeats}")
    for name, fn in parts.items():
        fn()
        times, walls = [], []
        for _ in range(a.repeats):
            t, w = time.process_time(), time.perf_counter()
            fn()
            times.append((time.process_time() - t) * 1000)
            walls.append((time.perf_counter() - w) * 1000)
        print(f"  {name}: {statistics.median(times):.1f} ms CPU, {statistics.median(walls):.1f} ms wall")
        if fn is guarded_step:
            guard.close()  # the parts below time optimizer.step() alone
    if _TMP is not None:
        shutil.rmtree(_TMP, ignore_errors=True)


if __name__ == "__main__":
    main()
