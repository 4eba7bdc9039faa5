"""A training pipeline on SmolLM2-135M: LoRA SFT, merged and saved, then LoRA DPO from it (the reference is the
policy with its adapter disabled, i.e. the merged SFT model; with the default full DPO, TRL reloads the merged SFT
folder as the reference). Recording overhead of each stage against its plain
trainer, and the cost of one deletion from stage 1 (the SFT stage's suffix replay plus a full replay of the DPO
stage from the new SFT output) against the oracle of the whole pipeline.

    PYTHONPATH=. python benchmarks/bench_trace_pipeline.py [--sft-steps 12] [--dpo-steps 8] [--repeats 2] [--dpo-lora]

Per stage, a plain trainer (``SFTTrainer`` / ``DPOTrainer``, no checkpoints) and the recording one
(``trace_recording(...)``, checkpoints every ``--every`` / ``--dpo-every`` steps, geometric retention, self-check
on) alternate
(order rotated per repeat); CPU time (user + system of this process) of ``train()``, median over the repeats. The
deletion is one id served at SFT step 1 (an early deletion, the expensive case): ``hf_unlearn.forget(DPO_RUN, ids,
oracle=True)`` finds the pipeline from the DPO run's lineage; its per-stage replay and oracle times are printed.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared"
os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(SHARED / "data"))
warnings.filterwarnings("ignore")


def cpu_of(fn) -> float:
    c = time.process_time()
    fn()
    return time.process_time() - c


def _print_breakdown(breakdown, what: str) -> None:
    if breakdown is None:
        return
    spent = breakdown.take()
    if spent:
        print(f"  {what}, where the recording's own CPU time went (exclusive s): "
              + "; ".join(f"{k} {v:.1f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]) if v >= 0.05),
              flush=True)


def lineage_costs(a) -> None:
    """CPU seconds (median of 3) of lineage's two additions to a SmolLM2-135M LoRA recording, on their own."""
    import torch
    from peft import LoraConfig, get_peft_model

    from hf_unlearn.models import load_model
    from hf_unlearn.trace.lineage import live_output_root, weights_root
    from hf_unlearn.trace.stack import numeric_stack

    model = get_peft_model(load_model(a.model, dtype=torch.float32),
                           LoraConfig(r=a.lora, lora_alpha=2 * a.lora, target_modules=["q_proj", "v_proj"]))
    header = {"model": {"peft": {"adapter_name": "default"}}, "numeric_stack": numeric_stack(torch.device("cpu"))}
    for label, fn in (("start: weights root of the starting model (every base tensor, SHA-256)",
                       lambda: weights_root(model.state_dict())),
                      ("end: output root sealed in the header (LoRA merged into a copy, then hashed)",
                       lambda: live_output_root(model, header))):
        xs = sorted(cpu_of(fn) for _ in range(3))
        print(f"  {label:80s} {xs[1]:5.2f} s CPU [{xs[0]:.2f}-{xs[2]:.2f}]", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sft-steps", type=int, default=12)
    p.add_argument("--dpo-steps", type=int, default=8)
    p.add_argument("--every", type=int, default=4, help="trace_checkpoint_steps of the SFT recording")
    p.add_argument("--dpo-every", type=int, default=0, help="trace_checkpoint_steps of the DPO recording (default: its "
                                                             "length: step 0 and the end, the least a run keeps)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--lora", type=int, default=8, help="LoRA rank (q_proj, v_proj) of the SFT stage")
    p.add_argument("--dpo-lora", action="store_true", help="a LoRA (same rank) for the DPO stage too (its reference: "
                                                           "the adapter disabled); default: DPO fine-tunes the merged "
                                                           "SFT model fully, TRL reloading it as the reference")
    p.add_argument("--model", default=str(SHARED / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tmp", default=None)
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (printed)")
    p.add_argument("--skip-deletion", action="store_true", help="only the recording overheads")
    p.add_argument("--breakdown", action="store_true", help="count the recordings' CPU time by cause (the functions "
                                                            "of bench_trace_sft.CAUSES and lineage's)")
    p.add_argument("--lineage-costs", action="store_true", help="only time what lineage adds to a recording: hashing "
                                                                "the starting weights, and the output root sealed at "
                                                                "the end (a LoRA merged into a copy)")
    a = p.parse_args()
    import torch

    from hf_unlearn.runtime import quiet_benchmark

    quiet_benchmark(a.threads)
    if a.lineage_costs:
        lineage_costs(a)
        return
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from hf_unlearn import forget, load_tofu, trace_recording
    from hf_unlearn.models import load_model, load_tokenizer

    out = Path(tempfile.mkdtemp(prefix="bench_pipeline_", dir=a.tmp))
    try:
        tok, base = load_tokenizer(a.model), load_model(a.model, dtype=torch.float32)
        rows = load_tofu("full", SHARED / "data" / "tofu").select(range(4 * a.sft_steps))
        answers = [" " + x for x in rows["answer"]]
        sft_data = Dataset.from_dict({"id": rows["id"], "prompt": rows["question"], "completion": answers})
        n_pairs = 2 * a.dpo_steps
        pairs = Dataset.from_dict({"id": rows["id"][:n_pairs], "prompt": rows["question"][:n_pairs],
                                   "chosen": answers[:n_pairs], "rejected": answers[1:n_pairs + 1]})

        def lora():
            return LoraConfig(r=a.lora, lora_alpha=2 * a.lora, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                              task_type="CAUSAL_LM")

        def sft_config(name):
            return SFTConfig(output_dir=str(out / name), per_device_train_batch_size=4, max_steps=a.sft_steps,
                             learning_rate=1e-4, max_length=a.max_length, save_strategy="no", report_to=[], seed=0,
                             use_cpu=True, logging_steps=1000, disable_tqdm=True)

        def dpo_config(name):
            return DPOConfig(output_dir=str(out / name), per_device_train_batch_size=2, max_steps=a.dpo_steps,
                             learning_rate=1e-4, max_length=a.max_length, save_strategy="no", report_to=[], seed=0,
                             use_cpu=True, logging_steps=1000, disable_tqdm=True, dataset_num_proc=None)

        breakdown = None
        if a.breakdown:  # bench_trace_sft's exclusive CPU-time counters, plus lineage's two additions
            import bench_trace_sft

            bench_trace_sft.CAUSES += [
                ("lineage: starting weights root + parent search", "hf_unlearn.trace.lineage", "record_lineage"),
                ("lineage: output root sealed at the end", "hf_unlearn.trace.lineage", "live_output_root")]
            breakdown = bench_trace_sft.Breakdown()
        rec = dict(trace_checkpoint_steps=a.every)
        dpo_rec = dict(trace_checkpoint_steps=a.dpo_every or a.dpo_steps)
        times: dict[str, list[float]] = {}
        merged_dir = out / "sft" / "merged"
        for r in range(a.repeats):
            arms = ["plain", "trace"] if r % 2 == 0 else ["trace", "plain"]
            for arm in arms:  # stage 1: SFT
                name = f"sft-{arm}-{r}"
                cls = SFTTrainer if arm == "plain" else trace_recording(SFTTrainer)
                kw = {} if arm == "plain" else dict(rec, trace_dir=out / "sft" / "trace") if r == 0 else \
                    dict(rec, trace_dir=out / name / "trace")
                t = cls(model=copy.deepcopy(base), args=sft_config(name), train_dataset=sft_data,
                        processing_class=tok, peft_config=lora(), **kw)
                times.setdefault(f"sft {arm}", []).append(cpu_of(t.train))
                _print_breakdown(breakdown, f"sft {arm} repeat {r}")
                if arm == "trace" and r == 0:  # stage 2 starts from this one: merged and saved
                    t.model.merge_and_unload().save_pretrained(merged_dir)
                    tok.save_pretrained(merged_dir)
                print(f"  sft {arm} repeat {r}: {times[f'sft {arm}'][-1]:.1f} s CPU", flush=True)
        for r in range(a.repeats):
            arms = ["plain", "trace"] if r % 2 == 0 else ["trace", "plain"]
            for arm in arms:  # stage 2: DPO from the merged SFT model
                name = f"dpo-{arm}-{r}"
                cls = DPOTrainer if arm == "plain" else trace_recording(DPOTrainer)
                kw = {} if arm == "plain" else dict(dpo_rec, trace_dir=out / ("dpo" if r == 0 else name) / "trace")
                t = cls(model=AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32),
                        args=dpo_config(name), train_dataset=pairs, processing_class=tok,
                        peft_config=lora() if a.dpo_lora else None, **kw)
                times.setdefault(f"dpo {arm}", []).append(cpu_of(t.train))
                _print_breakdown(breakdown, f"dpo {arm} repeat {r}")
                print(f"  dpo {arm} repeat {r}: {times[f'dpo {arm}'][-1]:.1f} s CPU", flush=True)
        print(f"\nrecording overhead (CPU s of train(), median of {a.repeats}; SmolLM2-135M fp32, LoRA r={a.lora}, "
              f"{a.threads} thread(s)):")
        for stage, steps in (("sft", a.sft_steps), ("dpo", a.dpo_steps)):
            plain, trace = statistics.median(times[f"{stage} plain"]), statistics.median(times[f"{stage} trace"])
            print(f"  {stage.upper():3s} {steps:2d} steps: plain {plain:7.1f}  recorded {trace:7.1f}  "
                  f"ratio {trace / plain:.3f}x  (all: plain {times[f'{stage} plain']}, recorded {times[f'{stage} trace']})")
        if a.skip_deletion:
            return
        from hf_unlearn.trace import open_run

        dpo_run = open_run(out / "dpo" / "trace")
        lineage = dpo_run.header["lineage"]
        print(f"\nDPO run's lineage: parent {lineage.get('parent')}")
        ids = open_run(out / "sft" / "trace").ids_at_steps([1])[:1]
        c = time.process_time()
        w = time.perf_counter()
        receipt = forget(out / "dpo" / "trace", ids, out / "deletion", oracle=True, progress=False, log=print)
        cpu, wall = time.process_time() - c, time.perf_counter() - w
        tm = receipt.timings
        replay = sum(v for k, v in tm.items() if k.endswith("_replay_s"))
        oracle = sum(v for k, v in tm.items() if k.endswith("_oracle_s"))
        if "pipeline_cost" not in receipt.evidence:
            raise SystemExit("the DPO run's parent was not found from its weights: no pipeline to delete through")
        pc = receipt.evidence["pipeline_cost"]
        print(f"\ndeletion of 1 id served at SFT step 1: {receipt.verdict}")
        print(f"  steps replayed {pc['total_steps_replayed']} of {pc['pipeline_steps']} (stage 1 from its checkpoint, "
              f"stage 2 in full); the oracle replays all {pc['pipeline_steps']}")
        for k, v in sorted(tm.items()):
            if k.startswith("stage_"):
                print(f"  {k:22s} {v:7.1f} s wall")
        print(f"  replay (both stages) {replay:.1f} s wall, oracle of the whole pipeline {oracle:.1f} s wall "
              f"(oracle includes its verification), ratio replay/oracle {replay / oracle:.2f}; forget total "
              f"{wall:.1f} s wall, {cpu:.1f} s CPU")
    finally:
        if a.keep:
            print(f"kept: {out}")
        else:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
