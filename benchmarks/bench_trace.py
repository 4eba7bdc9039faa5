"""Exact deletion benchmarks on a small Llama: recording overhead, provenance size, replay cost by geometry.

    PYTHONPATH=. python benchmarks/bench_trace.py [--rows 256] [--hidden 64] [--repeats 3] [--plot FILE]

Prints side-by-side ratios (the machine is shared: wall times are noisy, the minimum of repeats is used).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "data"))
warnings.filterwarnings("ignore")


def setup(rows: int, hidden: int):
    from hf_unlearn.data import load_tofu, tokenize_qa
    from hf_unlearn.models import build_tiny_tokenizer

    data = load_tofu("full").select(range(rows))
    tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in data], vocab_size=1024)
    return tok, tokenize_qa(data, tok, max_length=128)


def make_trainer(kind, tok, data, out, hidden, every=None):
    from transformers import Trainer, TrainingArguments

    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.models import build_tiny_model
    from hf_unlearn.trace import TraceRecordingTrainer

    model = build_tiny_model("llama", tok, hidden_size=hidden, num_layers=2, num_heads=4, seed=0)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             num_train_epochs=1, learning_rate=3e-3, warmup_steps=2, max_grad_norm=1.0, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, logging_strategy="no")
    collator = QACollator.from_tokenizer(tok)
    if kind == "plain":
        return Trainer(model=model, args=args, train_dataset=data, data_collator=_DropIds(collator))
    return TraceRecordingTrainer(model=model, args=args, train_dataset=data, data_collator=collator,
                                 trace_checkpoint_steps=every)


def bench_recording(tok, data, hidden, repeats, tmp):
    """Alternate the two trainers; report the minimum wall and CPU (process) time of each."""
    wall = {"plain": [], "trace": []}
    cpu = {"plain": [], "trace": []}
    for r in range(repeats):
        for kind in (("plain", "trace") if r % 2 == 0 else ("trace", "plain")):
            out = tmp / f"{kind}{r}"
            trainer = make_trainer(kind, tok, data, out, hidden)
            t, c = time.perf_counter(), time.process_time()
            trainer.train()
            wall[kind].append(time.perf_counter() - t)
            cpu[kind].append(time.process_time() - c)
    for name, d in (("wall", wall), ("CPU", cpu)):
        plain, trace = min(d["plain"]), min(d["trace"])
        print(f"recording overhead ({name} time, min of {repeats}): Trainer {plain:.2f} s, TraceRecordingTrainer "
              f"{trace:.2f} s; ratio {trace / plain:.3f}")
    return tmp / f"trace{repeats - 1}" / "trace", min(cpu["trace"]) / min(cpu["plain"])


def bench_size(run):
    from hf_unlearn.trace.run import list_checkpoints

    cps = list_checkpoints(run)
    ck = (cps[max(cps)] / "state.pt").stat().st_size
    wal, man = (run / "wal.bin").stat().st_size, (run / "manifest.bin").stat().st_size
    plan = (run / "plan.jsonl").stat().st_size
    print(f"provenance size: WAL {wal} B + manifest {man} B = {wal + man} B; one checkpoint (model + optimizer) "
          f"{ck / 1e6:.2f} MB; ratio {100 * (wal + man) / ck:.4f}% (plan.jsonl {plan} B, {100 * plan / ck:.3f}%)")
    return (wal + man) / ck


def bench_geometry(run, tmp, plot):
    from hf_unlearn.trace import RedactedReplayTrainer, open_run, redact_store, replay_cost

    r = open_run(run)
    total = r.total_steps
    ids = r.ids_at_steps(range(total))
    n = max(1, len(ids) // 20)  # 5% of the rows
    geometries = {
        "early": r.ids_at_steps([0])[:n],
        "middle": r.ids_at_steps([total // 2])[:n],
        "late": r.ids_at_steps([total - 1])[:n],
        "random 5%": random.Random(0).sample(ids, n),
    }
    rows = []
    print(f"replay cost by deletion geometry ({n} rows = 5% of {len(ids)}, {total} optimizer steps, "
          f"checkpoints every {r.header['checkpoint_steps']} steps):")
    print(f"{'geometry':10s} {'start':>5s} {'replayed':>8s} {'fraction':>8s} {'replay CPU s':>12s}")
    for name, forget in geometries.items():
        cost = replay_cost(r, forget)
        store = tmp / f"store-{name}"
        redact_store(r.store_path, forget, store, r.key)
        t = time.process_time()
        RedactedReplayTrainer(r, store, forget, tmp / f"replay-{name}").train()
        secs = time.process_time() - t
        rows.append((name, cost["start_checkpoint"], cost["steps_to_replay"], cost["fraction_replayed"], secs))
        print(f"{name:10s} {cost['start_checkpoint']:5d} {cost['steps_to_replay']:8d} {cost['fraction_replayed']:8.3f} "
              f"{secs:12.2f}")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar([x[0] for x in rows], [x[3] for x in rows], color="#4477aa")
        ax.set_ylabel("replayed steps / total")
        ax.set_ylim(0, 1.05)
        ax.set_title("Suffix replay cost by deletion geometry")
        fig.tight_layout()
        fig.savefig(plot, dpi=120)
        print(f"plot: {plot}")
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plot", default="benchmarks/trace_replay_cost.png")
    a = p.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    import datasets

    datasets.disable_progress_bars()
    tmp = Path(tempfile.mkdtemp(prefix="bench_trace_"))
    try:
        tok, data = setup(a.rows, a.hidden)
        run, _ = bench_recording(tok, data, a.hidden, a.repeats, tmp)
        bench_size(run)
        bench_geometry(run, tmp, a.plot)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
