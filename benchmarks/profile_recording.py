"""Where a LoRA recording's time goes, by sampling (py-spy), one arm per process.

    pip install py-spy
    py-spy record -r 50 -f raw -o rec.txt -- python benchmarks/profile_recording.py --arm recording
    py-spy record -r 50 -f raw -o plain.txt -- python benchmarks/profile_recording.py --arm plain
    python benchmarks/profile_recording.py --summarize rec.txt plain.txt

SmolLM2-135M (fp32) with LoRA r=8 on q/v, TRL's DPOTrainer (``--kind sft``: SFTTrainer), the settings of
``bench_overhead_ab.py --fp32``: 8 steps, a checkpoint every 4 (the plain arm's Trainer checkpoints, the recording's
trace checkpoints, ``trace_self_check=False``). A sampler at 50 Hz barely slows the Python it watches, unlike
cProfile, so the seconds it gives hf_unlearn's frames are close to their cost. ``--summarize``: seconds under
``train()`` and under the trainer's construction, and the recorder's own frames (the outermost hf_unlearn frame below
the recorder's ``train``), largest first.
"""

from __future__ import annotations

import argparse
import collections
import copy
import re
import shutil
import tempfile
import time
import warnings

RATE = 50  # samples per second, as the py-spy command above
TRAIN = r"^\w+\.train \("  # a trainer's train() frame


def run(arm: str, kind: str) -> None:
    warnings.filterwarnings("ignore")
    from bench_overhead_ab import smollm2_lora_data

    from hf_unlearn.runtime import quiet_benchmark

    quiet_benchmark(1)
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from hf_unlearn import trace_recording

    tok, base, data = smollm2_lora_data()
    out = tempfile.mkdtemp(prefix="profile_recording_")
    save = dict(save_strategy="steps", save_steps=4) if arm == "plain" else dict(save_strategy="no")
    common = dict(output_dir=out, max_steps=8, learning_rate=1e-4, max_length=64, report_to=[], seed=0, use_cpu=True,
                  logging_steps=1000, disable_tqdm=True, bf16=False, **save)
    config = (DPOConfig(per_device_train_batch_size=2, dataset_num_proc=None, **common) if kind == "dpo" else
              SFTConfig(per_device_train_batch_size=4, **common))
    cls = DPOTrainer if kind == "dpo" else SFTTrainer
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    kw = {} if arm == "plain" else dict(trace_checkpoint_steps=4, trace_dir=f"{out}/trace", trace_self_check=False)
    try:
        c0 = time.process_time()
        trainer = (cls if arm == "plain" else trace_recording(cls))(
            model=copy.deepcopy(base), args=config, train_dataset=data[kind], processing_class=tok, peft_config=lora,
            **kw)
        c1 = time.process_time()
        trainer.train()
        print(f"{arm}: construction {c1 - c0:.2f} s CPU, train() {time.process_time() - c1:.2f} s CPU")
    finally:
        shutil.rmtree(out, ignore_errors=True)


def summarize(path: str, top: int = 15) -> None:
    rows = []
    for line in open(path):
        stack, n = line.rstrip().rsplit(" ", 1)
        rows.append((stack.split(";"), int(n)))

    def seconds(pattern: str) -> float:
        return sum(n for frames, n in rows if any(re.search(pattern, f) for f in frames)) / RATE

    train = seconds(TRAIN)
    step, built = seconds(r"training_step \("), seconds(r"(Trainer|RecordingHooks|TraceMixin)\.__init__ \(")
    print(f"{path}: train() {train:.2f} s, training_step {step:.2f} s, construction {built:.2f} s (wall, sampled)")
    outer = collections.Counter()
    for frames, n in rows:
        ours = [f for f in frames if "hf_unlearn/" in f and "RecordingHooks.train (" not in f
                and "training_step (" not in f]
        if ours and any(re.search(TRAIN, f) for f in frames):
            outer[re.sub(r" \(.*hf_unlearn/", " (", ours[0])] += n
    for frame, n in outer.most_common(top):
        print(f"  {n / RATE:6.2f} s  {frame}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arm", choices=["plain", "recording"])
    p.add_argument("--kind", choices=["dpo", "sft"], default="dpo")
    p.add_argument("--summarize", nargs="*", default=None, help="py-spy raw outputs to summarize")
    a = p.parse_args()
    if a.summarize:
        for path in a.summarize:
            summarize(path)
    else:
        run(a.arm or "recording", a.kind)


if __name__ == "__main__":
    main()
