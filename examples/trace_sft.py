"""Exact deletion for a TRL SFT script: record an SFTTrainer fine-tune, then honour a deletion request bit for bit.

    python examples/trace_sft.py                                        # tiny Llama on 64 TOFU rows, ~1 minute
    accelerate launch --config_file examples/accelerate/cpu_2proc.yaml examples/trace_sft.py   # 2 processes (DDP)
    python examples/trace_sft.py --model ../shared/models/SmolLM2-135M-Instruct --rows 16

The data is TOFU as prompt-completion pairs with an ``id`` column; SFTTrainer tokenises it, adds EOS and trains on
the completions only. The one change to an ordinary TRL script is the class: ``trace_recording(SFTTrainer)``
instead of ``SFTTrainer``. Replays rebuild SFTTrainer from the recorded run (its class, its SFTConfig, the tokenizer)
and run its own loss; the last line is ``VERIFIED: ...`` when the replay from the redacted store is bit-identical
(parameters and optimizer state) to the trace oracle. Needs ``pip install 'hf_unlearn[trl]'``. With one process the
same deletion is ``hf-unlearn forget trace_sft_example/trace --ids IDS --out OUT --oracle``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import hf_unlearn  # noqa: F401  (first: it drops two notices bitsandbytes prints offline when transformers imports it)

# isort: split
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from hf_unlearn import OracleReplayTrainer, RedactedReplayTrainer, load_tofu, redact_store, replay_cost, trace_recording
from hf_unlearn.data.embedded import load_embedded_tofu
from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer, load_model, load_tokenizer
from hf_unlearn.runtime import init_processes
from hf_unlearn.trace import open_run, verify
from hf_unlearn.trace.proof import prove_fresh_start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model to fine-tune (default: a tiny Llama built locally)")
    parser.add_argument("--tofu", default=None, help="TOFU folder (default: the embedded subset for up to 200 rows)")
    parser.add_argument("--rows", type=int, default=64, help="TOFU rows to fine-tune on")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--out", default=None, help="output folder (default trace_sft_example; trace_sft_example_2proc for 2 processes, "
                                                    "so the README's python and accelerate commands do not collide)")
    args = parser.parse_args()
    state = init_processes()  # several processes on a CPU talk over gloo; each prints "process R of N"
    cpu = state.device.type == "cpu"
    n = state.num_processes
    out = Path(args.out or ("trace_sft_example" if n == 1 else f"trace_sft_example_{n}proc"))

    rows = (load_embedded_tofu() if args.tofu is None and args.rows <= 200 else load_tofu("full", args.tofu))
    rows = rows.select(range(args.rows))
    if args.model is None:
        tokenizer = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
        model = build_tiny_model("llama", tokenizer, hidden_size=64, num_layers=2, num_heads=4)
    else:
        tokenizer, model = load_tokenizer(args.model), load_model(args.model)
    data = Dataset.from_dict({"id": rows["id"], "prompt": rows["question"],
                              "completion": [" " + a for a in rows["answer"]]})

    # 1. Record: an ordinary SFT script with the class swapped.
    config = SFTConfig(output_dir=str(out / "finetune"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                       num_train_epochs=1, learning_rate=3e-3 if args.model is None else 2e-5, warmup_steps=2,
                       max_length=args.max_length, save_strategy="no", report_to=[], logging_steps=5, seed=0,
                       use_cpu=cpu, bf16=False)
    trainer = trace_recording(SFTTrainer)(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                                          trace_dir=out / "trace", trace_checkpoint_steps=2)
    trainer.train()
    state.wait_for_everyone()

    # 2. A deletion request: two rows of the last optimizer step (a late deletion: a short suffix replay).
    run = open_run(out / "trace")
    forget = run.ids_at_steps([run.total_steps - 1])[:2]
    if state.is_main_process:
        cost = replay_cost(run, forget)
        print(f"recorded {run.header['trainer']['class']}; replay from checkpoint step {cost['start_checkpoint']}: "
              f"{cost['steps_to_replay']} of {cost['total_steps']} steps")
        receipt = redact_store(run.store_path, forget, out / "redacted_store", run.key)  # one process writes it
        print(f"redacted store: {receipt['rows_after']} rows; {receipt['checks']['id_column_scanned']}")
    state.wait_for_everyone()
    # its fresh start at a kept checkpoint, when the deleted rows' step is that checkpoint's: one probe step from it
    # with no deletion (the original store), as `hf-unlearn forget` does; otherwise the replay's first step proves it
    proven_start = prove_fresh_start(run, forget)
    RedactedReplayTrainer(run, out / "redacted_store", forget, out / "replay",  # every process replays
                          proven_start=proven_start).train()

    # 3. Check it against the trace oracle (full replay on the original store, deleted slots at weight 0).
    OracleReplayTrainer(run, forget, out_dir=out / "oracle").train()
    if state.is_main_process:
        report = verify(out / "replay", out / "oracle")
        if not report["verified"]:
            raise SystemExit(f"NOT VERIFIED: {report['provenance']['problems'] or 'the states differ'}")
        print(f"VERIFIED: the SFTTrainer replay equals the oracle bit for bit (parameters and optimizer state) for "
              f"{len(forget)} deleted id(s)")


if __name__ == "__main__":
    main()
