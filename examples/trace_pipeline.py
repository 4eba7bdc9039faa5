"""Exact deletion through a training pipeline: SFT, then DPO from the SFT model (its reference), one request, one proof.

    python examples/trace_pipeline.py                                    # tiny Llama on TOFU rows, about a minute
    accelerate launch --num_processes 1 examples/trace_pipeline.py       # forget replays in one process

Stage 1 fine-tunes with ``trace_recording(SFTTrainer)`` on TOFU questions and answers and saves its model; stage 2
loads that folder and trains ``trace_recording(DPOTrainer)`` on preference pairs (the answer chosen, another author's
answer rejected) with ``ref_model=None``: TRL reloads the SFT model as the reference. Nothing declares the pipeline:
the DPO recording finds that its starting weights are the SFT run's output (same weights root) and records the SFT
run as its parent. A person's rows sit in both stages; one ``hf_unlearn.forget(DPO_RUN, ids, oracle=True)`` (the
lineage found from the last run) replays the SFT run without them from its checkpoint, then the whole DPO run from the
new SFT output (its reference replaced too), each stage checked against its oracle. The last line is ``VERIFIED:
...`` when every stage is bit-identical to its oracle and the chain checks (``hf-unlearn trace verify OUT``). Needs
``pip install 'hf_unlearn[trl]'``. Same from the shell: ``hf-unlearn forget OUT/dpo/trace --ids IDS --out OUT/deletion
--oracle`` and ``hf-unlearn trace lineage OUT/dpo/trace``.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import hf_unlearn  # noqa: F401  (first: it drops two notices bitsandbytes prints offline when transformers imports it)

# isort: split
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from hf_unlearn import forget, load_tofu, trace_recording
from hf_unlearn.data.embedded import load_embedded_tofu
from hf_unlearn.deletion.pipeline import verify_pipeline
from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer
from hf_unlearn.runtime import init_processes
from hf_unlearn.trace import open_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tofu", default=None, help="TOFU folder (default: the embedded subset for up to 200 rows)")
    parser.add_argument("--rows", type=int, default=32, help="TOFU rows: SFT on all of them, DPO pairs on the first half")
    parser.add_argument("--max-length", type=int, default=96)
    parser.add_argument("--out", default="trace_pipeline_example", help="output folder (replaced)")
    args = parser.parse_args()
    state = init_processes()
    if state.num_processes > 1:
        raise SystemExit("run this example in one process: forget replays a pipeline in one process")
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    rows = load_embedded_tofu() if args.tofu is None and args.rows <= 200 else load_tofu("full", args.tofu)
    rows = rows.select(range(args.rows))
    tokenizer = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
    answers = [" " + a for a in rows["answer"]]

    # 1. SFT: an ordinary TRL script with the class swapped; the model is saved where stage 2 loads it from.
    sft_data = Dataset.from_dict({"id": rows["id"], "prompt": rows["question"], "completion": answers})
    sft = trace_recording(SFTTrainer)(
        model=build_tiny_model("llama", tokenizer, hidden_size=64, num_layers=2, num_heads=4),
        args=SFTConfig(output_dir=str(out / "sft"), per_device_train_batch_size=4, num_train_epochs=1,
                       learning_rate=3e-3, max_length=args.max_length, save_strategy="no", report_to=[], seed=0,
                       use_cpu=True, logging_steps=100),
        train_dataset=sft_data, processing_class=tokenizer, trace_dir=out / "sft" / "trace", trace_checkpoint_steps=2)
    sft.train()
    sft.save_model(str(out / "sft"))

    # 2. DPO from the SFT model, which TRL reloads as the reference (ref_model=None).
    half = args.rows // 2
    pairs = Dataset.from_dict({"id": rows["id"][:half], "prompt": rows["question"][:half],
                               "chosen": answers[:half], "rejected": answers[1:half + 1]})
    dpo = trace_recording(DPOTrainer)(
        model=AutoModelForCausalLM.from_pretrained(out / "sft"),
        args=DPOConfig(output_dir=str(out / "dpo"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                       max_steps=4, learning_rate=1e-3, max_length=args.max_length, save_strategy="no", report_to=[],
                       seed=0, use_cpu=True, logging_steps=100, dataset_num_proc=None),
        train_dataset=pairs, processing_class=tokenizer, trace_dir=out / "dpo" / "trace", trace_checkpoint_steps=2)
    dpo.train()
    lineage = open_run(out / "dpo" / "trace").header["lineage"]
    print(f"DPO run's parent (found from its weights): recorded run {lineage['parent']['run_id']} (the SFT run), "
          f"weights root {lineage['start_root'][:16]}...")

    # 3. A person's rows: an early SFT row that is also a DPO pair, and a row of DPO's first step.
    sft_run, dpo_run = open_run(out / "sft" / "trace"), open_run(out / "dpo" / "trace")
    ids = [i for i in sft_run.ids_at_steps([1]) if i in set(rows["id"][:half])][:1]
    ids += [i for i in dpo_run.ids_at_steps([0]) if i not in ids][:1]
    receipt = forget(out / "dpo" / "trace", ids, out / "deletion", oracle=True, progress=False, tokenizer=tokenizer)
    print(receipt.summary_table())
    report = verify_pipeline(out / "deletion")
    if not (receipt.ok and report["verified"]):
        raise SystemExit(f"NOT VERIFIED: {report['problems']}")
    print(f"VERIFIED: {len(ids)} id(s) deleted from the SFT run and the DPO run started from it; every stage is "
          f"bit-identical to its oracle and the chain checks")


if __name__ == "__main__":
    main()
