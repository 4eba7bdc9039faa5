"""Exact deletion end to end: record a fine-tune, then honour a deletion request bit for bit.

    python examples/trace_deletion.py                                   # tiny Llama on 64 TOFU rows, ~1 minute
    accelerate launch examples/trace_deletion.py                        # same, through accelerate (one process)
    accelerate launch --config_file examples/accelerate/cpu_2proc.yaml examples/trace_deletion.py   # 2 processes (DDP)
    python examples/trace_deletion.py --model ../shared/models/SmolLM2-135M-Instruct --rows 16 --max-length 96

Rows come from the TOFU subset shipped with hf_unlearn (or --tofu DIR / $HF_UNLEARN_DATA_DIR/tofu for more than 200).
It prints the replay's start step, the redaction check and ``replay == oracle, parameters and optimizer state bit
for bit: True``.

The only change to an ordinary fine-tuning script is the class: ``TraceRecordingTrainer`` instead of ``Trainer``
(any collator; here transformers' ``DataCollatorForSeq2Seq``). The same steps are available as
``hf-unlearn trace inspect|cost|redact|replay|oracle|verify``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import hf_unlearn  # noqa: F401  (first: it drops two notices bitsandbytes prints offline when transformers imports it)

# isort: split
from transformers import DataCollatorForSeq2Seq, TrainingArguments

from hf_unlearn import (
    OracleReplayTrainer,
    RedactedReplayTrainer,
    TraceRecordingTrainer,
    load_tofu,
    redact_store,
    replay_cost,
    tokenize_qa,
    verify_replay,
)
from hf_unlearn.data.embedded import load_embedded_tofu
from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer, load_model, load_tokenizer
from hf_unlearn.runtime import init_processes
from hf_unlearn.trace import open_run
from hf_unlearn.trace.proof import prove_fresh_start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model to fine-tune (default: a tiny Llama built locally)")
    parser.add_argument("--tofu", default=None, help="TOFU folder (default: the embedded subset for up to 200 rows, "
                                                     "else $HF_UNLEARN_DATA_DIR/tofu)")
    parser.add_argument("--rows", type=int, default=64, help="TOFU rows to fine-tune on")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--epochs", type=float, default=1)
    parser.add_argument("--out", default=None, help="output folder (default trace_example; trace_example_2proc for 2 processes, "
                                                    "so the README's python and accelerate commands do not collide)")
    args = parser.parse_args()
    state = init_processes()  # several processes on a CPU talk over gloo; each prints "process R of N"
    cpu = state.device.type == "cpu"
    n = state.num_processes
    out = Path(args.out or ("trace_example" if n == 1 else f"trace_example_{n}proc"))

    if args.tofu is None and args.rows <= 200:
        rows = load_embedded_tofu().select(range(args.rows))
    else:
        rows = load_tofu("full", args.tofu).select(range(args.rows))
    if args.model is None:
        tokenizer = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
        model = build_tiny_model("llama", tokenizer, hidden_size=64, num_layers=2, num_heads=4)
    else:
        tokenizer, model = load_tokenizer(args.model), load_model(args.model)
    data = tokenize_qa(rows, tokenizer, max_length=args.max_length)

    # 1. Record: a drop-in Trainer (accumulation, clipping and warmup included).
    training_args = TrainingArguments(
        output_dir=str(out / "finetune"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_train_epochs=args.epochs, learning_rate=3e-3 if args.model is None else 2e-5, warmup_steps=2,
        max_grad_norm=1.0, save_strategy="no", report_to=[], logging_steps=5, seed=0, use_cpu=cpu,
    )
    trainer = TraceRecordingTrainer(model=model, args=training_args, train_dataset=data,
                                    data_collator=DataCollatorForSeq2Seq(tokenizer), trace_dir=out / "trace",
                                    trace_checkpoint_steps=2)
    trainer.train()
    state.wait_for_everyone()

    # 2. A deletion request: four rows of the last optimizer step (a late deletion: a short suffix replay).
    run = open_run(out / "trace")
    forget = run.ids_at_steps([run.total_steps - 1])[:4]
    if state.is_main_process:
        cost = replay_cost(run, forget)
        print(f"replay from checkpoint step {cost['start_checkpoint']}: {cost['steps_to_replay']} of "
              f"{cost['total_steps']} steps")
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
        report = verify_replay(out / "replay", out / "oracle")
        print(f"replay == oracle, parameters and optimizer state bit for bit: {report['verified']}")
        if not report["verified"]:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
