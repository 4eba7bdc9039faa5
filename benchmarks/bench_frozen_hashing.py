"""The cost of hashing a LoRA recording's frozen base as it starts: how many SHA-256 passes go over each frozen tensor,
and their CPU time.

SmolLM2-135M (the shared GGUF, de-quantised to fp32) with a LoRA adapter (r=8 on q/v), ``trace_recording(DPOTrainer)``
over 16 TOFU pairs for 1 optimizer step (a checkpoint at step 0 and 1, no self-check). ``hashing.tensor_hash`` is
wrapped: a call on a frozen base tensor's storage is a pass; its thread CPU time is summed (``tensor_hashes`` runs
them on torch's threads). Also the process CPU time of the lineage's start hashing (``record_lineage``) and of the
frozen store's save (``FrozenTensors.save``). Medians over ``--repeats`` recordings of one loaded model.

    PYTHONPATH=. python benchmarks/bench_frozen_hashing.py --repeats 3
    git archive <parent> hf_unlearn | tar -x -C /tmp/parent && PYTHONPATH=/tmp/parent python \
        benchmarks/bench_frozen_hashing.py --repeats 3        # the code before the change
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

SHARED = Path(os.environ.get("HF_UNLEARN_SHARED") or Path(__file__).resolve().parents[2] / "shared")
warnings.filterwarnings("ignore")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    import torch

    from hf_unlearn.runtime import quiet_benchmark

    quiet_benchmark(1)
    from datasets import Dataset
    from peft import LoraConfig
    from trl import DPOConfig, DPOTrainer

    from hf_unlearn import load_tofu, trace_recording
    from hf_unlearn.models import load_model, load_tokenizer
    from hf_unlearn.trace import checkpoints, hashing
    from hf_unlearn.trace.recorder import opening

    model_dir = str(SHARED / "models" / "SmolLM2-135M-Instruct")
    tok, base = load_tokenizer(model_dir), load_model(model_dir, dtype=torch.float32)
    rows = load_tofu("full", SHARED / "data" / "tofu").select(range(17))
    answers = [" " + x for x in rows["answer"]]
    pairs = Dataset.from_dict({"id": rows["id"][:16], "prompt": rows["question"][:16], "chosen": answers[:16],
                               "rejected": answers[1:17]})

    frozen_ptrs: set[int] = set()
    stats = {"passes": 0, "hash_cpu": 0.0, "lineage_cpu": 0.0, "store_cpu": 0.0}
    plain_hash, lineage_fn, store_save = hashing.tensor_hash, opening.record_lineage, checkpoints.FrozenTensors.save

    def counted_hash(name, t):
        c0 = time.thread_time()
        try:
            return plain_hash(name, t)
        finally:
            if t.untyped_storage().data_ptr() in frozen_ptrs:
                stats["passes"] += 1
                stats["hash_cpu"] += time.thread_time() - c0

    def timed(key, fn):
        def wrapper(*args, **kwargs):
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                stats[key] += time.process_time() - c0
        return wrapper

    hashing.tensor_hash = counted_hash
    opening.record_lineage = timed("lineage_cpu", lineage_fn)
    checkpoints.FrozenTensors.save = timed("store_cpu", store_save)
    out = Path(tempfile.mkdtemp(prefix="bench_frozen_hashing_"))
    got = []
    try:
        for r in range(a.repeats):
            config = DPOConfig(output_dir=str(out / f"r{r}"), max_steps=1, learning_rate=1e-4, max_length=64,
                               per_device_train_batch_size=2, dataset_num_proc=None, report_to=[], seed=0,
                               use_cpu=True, logging_steps=1000, disable_tqdm=True, save_strategy="no")
            lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                              task_type="CAUSAL_LM")
            trainer = trace_recording(DPOTrainer)(
                model=copy.deepcopy(base), args=config, train_dataset=pairs, processing_class=tok, peft_config=lora,
                trace_checkpoint_steps=1, trace_dir=out / f"r{r}" / "trace", trace_self_check=False)
            model = trainer.accelerator.unwrap_model(trainer.model)
            frozen = [t for t in model.parameters() if not t.requires_grad]
            frozen_ptrs.clear()
            frozen_ptrs.update(t.untyped_storage().data_ptr() for t in frozen)
            stats.update(passes=0, hash_cpu=0.0, lineage_cpu=0.0, store_cpu=0.0)
            c0 = time.process_time()
            trainer.train()
            train_cpu = time.process_time() - c0
            frozen_bytes = sum(t.numel() * t.element_size() for t in frozen)
            got.append({**stats, "train_cpu": train_cpu, "tensors": len(frozen), "mib": frozen_bytes / 2**20})
            print(f"  repeat {r}: {stats['passes']} hash passes over {len(frozen)} frozen tensors "
                  f"({frozen_bytes / 2**20:.0f} MiB), their CPU {stats['hash_cpu']:.2f} s; record_lineage "
                  f"{stats['lineage_cpu']:.2f} s, FrozenTensors.save {stats['store_cpu']:.2f} s; train() {train_cpu:.1f} s",
                  flush=True)
            del trainer, model, frozen
            shutil.rmtree(out / f"r{r}", ignore_errors=True)
    finally:
        hashing.tensor_hash, opening.record_lineage, checkpoints.FrozenTensors.save = plain_hash, lineage_fn, store_save
        shutil.rmtree(out, ignore_errors=True)

    def med(k):
        return statistics.median(g[k] for g in got)

    print(f"frozen base: {got[0]['tensors']} tensors, {got[0]['mib']:.0f} MiB; hash passes over them per recording: "
          f"{med('passes') / got[0]['tensors']:.2f} each; CPU of those passes {med('hash_cpu'):.2f} s; "
          f"record_lineage {med('lineage_cpu'):.2f} s + FrozenTensors.save {med('store_cpu'):.2f} s = "
          f"{med('lineage_cpu') + med('store_cpu'):.2f} s CPU; train() {med('train_cpu'):.1f} s CPU "
          f"(medians of {a.repeats})")


if __name__ == "__main__":
    main()
