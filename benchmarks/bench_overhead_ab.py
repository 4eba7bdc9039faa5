"""The recording overhead of a change to the recorder, A/B in one process (issue #42's benchmark).

Three arms alternate, order rotated per repeat: the plain trainer (Trainer checkpoints every 4 steps), the recording
as its parent code ran it (``parent``), and the recording as it is (``now``; ``trace_self_check=False``, a trace
checkpoint every 4 steps). SmolLM2-135M LoRA r=8 on q/v, as ``bench_real_configs.py``. CPU time of ``train()`` and
of construction + ``train()``, median over the repeats, and the paired difference per repeat: on a shared machine
the load moves the plain arm by seconds between runs, which a pair of neighbouring arms does not see.

``--parent DIR`` (w42dpo's change): the parent commit's ``program_state`` (trace/digests.py), ``live_output_root``
(trace/lineage.py) and row-0 dummy-weight probe patched in from a copy of its ``hf_unlearn/`` (into this code: the
probes' rows cut since). Without it (w42lora's change): this code with its own shortcuts switched off, the slow
paths they replace kept beside them: the DPO probe on the whole shortest pair (``probe_pair``), SFT's on the whole
shortest row (``probe_window``), the adapter-disabled reference hashed at construction (``is_start_root``), the
sealed output root hashing every tensor of a deep copy merged (``output_root_now``, ``merged_state``).

    git archive 49cd2be hf_unlearn | tar -x -C /tmp/parent
    PYTHONPATH=. python benchmarks/bench_overhead_ab.py --only dpo --repeats 3 --parent /tmp/parent/hf_unlearn
    PYTHONPATH=. python benchmarks/bench_overhead_ab.py --only dpo --repeats 3
    PYTHONPATH=. python benchmarks/bench_overhead_ab.py --only dpo --repeats 5 --fp32 --no-parent  # the goal's ratio

``--fp32``: both arms train with ``bf16=False``. TRL's configs default to bf16 autocast; on a CPU with native bf16
(AVX-512 BF16, AMX) that is fast, on one without (AVX2 only) a step is several times slower and the recording's fixed
costs vanish in it: compare ratios only between runs on one kind of CPU and precision.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
warnings.filterwarnings("ignore")


def parent_module(parent: str, name: str):
    """The parent's ``hf_unlearn/trace/<name>.py`` under another module name (its relative imports: this package's)."""
    spec = importlib.util.spec_from_file_location(f"hf_unlearn.trace._parent_{name}", f"{parent}/trace/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "hf_unlearn.trace"
    spec.loader.exec_module(mod)
    return mod


def shortcuts_switch():
    """``use(parent)``: w42lora's shortcuts switched off (``parent=True``: the slow paths they replace) or on."""
    from hf_unlearn.trace import lineage, preference
    from hf_unlearn.trace.recorder import probe, sealing

    now = (preference.probe_pair, probe.probe_window, preference.is_start_root, sealing.output_root_now,
           lineage.merged_state)

    def whole_root(trainer):  # the output root hashing every tensor of the merged model
        return sealing.live_output_root(trainer.accelerator.unwrap_model(trainer.model), trainer._trace_header)

    before = (lambda row: row, lambda row: row, lambda policy: False, whole_root,
              lambda m: lineage.merged_copy(m).state_dict())

    def use(parent: bool) -> None:
        (preference.probe_pair, probe.probe_window, preference.is_start_root, sealing.output_root_now,
         lineage.merged_state) = before if parent else now

    return use


def smollm2_lora_data():
    """SmolLM2-135M (fp32), its tokenizer, and the TOFU rows of both kinds: 48 SFT rows, 16 DPO pairs."""
    import torch
    from datasets import Dataset

    from hf_unlearn import load_tofu
    from hf_unlearn.models import load_model, load_tokenizer

    model_dir = str(SHARED / "models" / "SmolLM2-135M-Instruct")
    tok, base = load_tokenizer(model_dir), load_model(model_dir, dtype=torch.float32)
    rows = load_tofu("full", SHARED / "data" / "tofu").select(range(49))
    answers = [" " + x for x in rows["answer"]]
    data = {"sft": Dataset.from_dict({"id": rows["id"][:-1], "prompt": rows["question"][:-1],
                                      "completion": answers[:-1]}),
            "dpo": Dataset.from_dict({"id": rows["id"][:16], "prompt": rows["question"][:16],
                                      "chosen": answers[:16], "rejected": answers[1:17]})}
    return tok, base, data


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=["sft", "dpo"], default="dpo")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fp32", action="store_true",
                   help="train in fp32 (bf16=False): TRL's configs default to bf16 autocast, which a CPU without native "
                        "bf16 (AVX2 only) runs several times slower than fp32, hiding every fixed cost in it")
    p.add_argument("--no-parent", action="store_true",
                   help="two arms only, the plain trainer and the recording as it is (no `parent` arm)")
    p.add_argument("--parent", default=None, help="the parent commit's hf_unlearn/ folder (w42dpo's change); "
                                                    "without it: this code's shortcuts switched off")
    a = p.parse_args()

    from hf_unlearn.runtime import quiet_benchmark

    quiet_benchmark(1)
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from hf_unlearn import trace_recording
    from hf_unlearn.trace import digests
    from hf_unlearn.trace.recorder import preflight, sealing

    if a.parent:
        old_digests, old_lineage = parent_module(a.parent, "digests"), parent_module(a.parent, "lineage")
        now = (digests.program_state, sealing.output_root_now, preflight.probe_row)

        def row_0(served, id_column):
            return {k: v for k, v in served[0].items() if k != id_column}

        def old_root(trainer):
            return old_lineage.live_output_root(trainer.accelerator.unwrap_model(trainer.model), trainer._trace_header)

        def use(parent: bool) -> None:
            digests.program_state, sealing.output_root_now, preflight.probe_row = (
                (old_digests.program_state, old_root, row_0) if parent else now)
    else:
        use = shortcuts_switch()
    tok, base, data = smollm2_lora_data()
    kind = a.only
    steps, cls = {"sft": (12, SFTTrainer), "dpo": (8, DPOTrainer)}[kind]
    out = Path(tempfile.mkdtemp(prefix="bench_overhead_ab_"))
    arms = ["plain", "now"] if a.no_parent else ["plain", "parent", "now"]
    got: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
    try:
        for r in range(a.repeats):
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                name = f"{arm}-{r}"
                save = dict(save_strategy="steps", save_steps=4) if arm == "plain" else dict(save_strategy="no")
                common = dict(output_dir=str(out / name), max_steps=steps, learning_rate=1e-4, max_length=64,
                              report_to=[], seed=0, use_cpu=True, logging_steps=1000, disable_tqdm=True, **save,
                              **({"bf16": False} if a.fp32 else {}))
                config = (SFTConfig(per_device_train_batch_size=4, **common) if kind == "sft" else
                          DPOConfig(per_device_train_batch_size=2, dataset_num_proc=None, **common))
                lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                  task_type="CAUSAL_LM")
                kw = {} if arm == "plain" else dict(trace_checkpoint_steps=4, trace_dir=out / name / "trace",
                                                    trace_self_check=False)
                use(arm == "parent")
                model = copy.deepcopy(base)
                c0 = time.process_time()
                trainer = (cls if arm == "plain" else trace_recording(cls))(
                    model=model, args=config, train_dataset=data[kind], processing_class=tok, peft_config=lora, **kw)
                c1 = time.process_time()
                trainer.train()
                c2 = time.process_time()
                got[arm].append((c1 - c0, c2 - c1))
                print(f"  {kind} {arm} repeat {r}: train {c2 - c1:.1f} s CPU, construction {c1 - c0:.1f}", flush=True)
                shutil.rmtree(out / name, ignore_errors=True)
    finally:
        use(False)
        shutil.rmtree(out, ignore_errors=True)
    train = {arm: statistics.median(x[1] for x in v) for arm, v in got.items()}
    whole = {arm: statistics.median(x[0] + x[1] for x in v) for arm, v in got.items()}
    for arm in arms[1:]:
        print(f"{kind.upper()} {steps} steps: {arm:6s} recorded train() {train[arm]:.1f} s CPU = "
              f"{train[arm] / train['plain']:.3f}x plain ({train['plain']:.1f}); with construction "
              f"{whole[arm] / whole['plain']:.3f}x")
    other = arms[-2]
    print(f"paired per repeat, now - {other}, train() CPU s:",
          [round(n[1] - q[1], 2) for q, n in zip(got[other], got["now"])])


if __name__ == "__main__":
    main()
