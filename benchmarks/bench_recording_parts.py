"""Where a short LoRA recording's fixed costs go: CPU timers (no profiler) around the recorder's parts outside the
per-step guards, with w42lora's shortcuts switched off (``parent``) and on (``now``), arms alternating.

    PYTHONPATH=. python benchmarks/bench_recording_parts.py --only dpo --repeats 2

SmolLM2-135M LoRA r=8 on q/v, as ``bench_real_configs.py`` (``trace_self_check=False``, a trace checkpoint every
4 steps; SFT 12 steps, DPO 8). Per recording: the trainer's construction and ``train()``, and inside them the
preflight (at construction and again at opening; DPO: its two probe passes), the reference's record (DPO, at
construction), the opening (the lineage's SHA-256 of the starting weights inside it), the trace checkpoints (the
frozen store saved once at step 0 inside them) and the sealing (the output root inside it). The parent arm runs the
slow paths the shortcuts replace, as ``bench_overhead_ab.py`` does.
"""

from __future__ import annotations

import argparse
import copy
import functools
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=["sft", "dpo"], default="dpo")
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()
    from hf_unlearn.runtime import quiet_benchmark

    quiet_benchmark(1)
    from bench_overhead_ab import shortcuts_switch, smollm2_lora_data
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from hf_unlearn import trace_recording
    from hf_unlearn.trace import checkpoints, preference
    from hf_unlearn.trace.recorder import keeper, opening, preflight, sealing
    from hf_unlearn.trace.recorder import mixin as recorder_mixin

    spent: dict[str, float] = {}

    def timed(module, name, label):
        f = getattr(module, name)

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            c = time.process_time()
            try:
                return f(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.process_time() - c

        setattr(module, name, wrapper)

    for module, name, label in [(recorder_mixin, "start", "opening"), (opening, "record_lineage", "lineage"),
                                (keeper, "checkpoint", "checkpoints"),
                                (checkpoints.FrozenTensors, "save", "frozen store"), (sealing, "finish", "sealing"),
                                (sealing, "live_output_root", "output root"),
                                (preference, "describe_reference", "reference record"),
                                (preflight, "preflight", "preflight")]:
        timed(module, name, label)
    use = shortcuts_switch()
    tok, base, data = smollm2_lora_data()
    steps, cls = {"sft": (12, SFTTrainer), "dpo": (8, DPOTrainer)}[a.only]
    out = Path(tempfile.mkdtemp(prefix="bench_recording_parts_"))
    try:
        for r in range(a.repeats):
            for arm in ["parent", "now"] if r % 2 == 0 else ["now", "parent"]:
                use(arm == "parent")
                spent.clear()
                common = dict(output_dir=str(out / arm), max_steps=steps, learning_rate=1e-4, max_length=64,
                              report_to=[], seed=0, use_cpu=True, logging_steps=1000, disable_tqdm=True,
                              save_strategy="no")
                config = (SFTConfig(per_device_train_batch_size=4, **common) if a.only == "sft" else
                          DPOConfig(per_device_train_batch_size=2, dataset_num_proc=None, **common))
                lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                  task_type="CAUSAL_LM")
                c0 = time.process_time()
                trainer = trace_recording(cls)(
                    model=copy.deepcopy(base), args=config, train_dataset=data[a.only], processing_class=tok,
                    peft_config=lora, trace_checkpoint_steps=4, trace_dir=out / arm / "trace", trace_self_check=False)
                c1 = time.process_time()
                trainer.train()
                c2 = time.process_time()
                print(f"{a.only} {arm}: construction {c1 - c0:.2f} s CPU, train() {c2 - c1:.2f} | "
                      + ", ".join(f"{k} {v:.2f}" for k, v in spent.items()), flush=True)
                shutil.rmtree(out / arm, ignore_errors=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
