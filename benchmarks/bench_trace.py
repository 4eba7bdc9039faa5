"""Exact deletion benchmarks on a small Llama: recording overhead, provenance size, replay cost by geometry.

    PYTHONPATH=. python benchmarks/bench_trace.py [--rows 256] [--hidden 64] [--repeats 3] [--plot FILE]
    PYTHONPATH=. python benchmarks/bench_trace.py --processes 2     # data parallel (relaunches itself with
                                                                     # accelerate launch --multi_gpu, CPU/gloo)

Prints side-by-side ratios (the machine is shared: wall times are noisy, the minimum of repeats is used). With
``--processes N`` it records one data-parallel run and prints the replay cost by deletion geometry, each replay
verified against the oracle.
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


def make_trainer(kind, tok, data, out, hidden, every=None, trace_dir=None):
    from transformers import Trainer, TrainingArguments

    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.models import build_tiny_model
    from hf_unlearn.trace import TraceRecordingTrainer

    model = build_tiny_model("llama", tok, hidden_size=hidden, num_layers=2, num_heads=4, seed=0)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             num_train_epochs=1, learning_rate=3e-3, warmup_steps=2, max_grad_norm=1.0, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, logging_strategy="no",
                             dataloader_drop_last=True)
    collator = QACollator.from_tokenizer(tok)
    if kind == "plain":
        return Trainer(model=model, args=args, train_dataset=data, data_collator=_DropIds(collator))
    return TraceRecordingTrainer(model=model, args=args, train_dataset=data, data_collator=collator,
                                 trace_checkpoint_steps=every, trace_dir=trace_dir)


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
    from hf_unlearn.trace.checkpoints import checkpoint_bytes
    from hf_unlearn.trace.run import list_checkpoints

    cps = list_checkpoints(run)
    ck = checkpoint_bytes(cps[max(cps)], with_frozen=True)
    wal, man = (run / "wal.bin").stat().st_size, (run / "manifest.bin").stat().st_size
    plan = (run / "plan.jsonl").stat().st_size
    print(f"provenance size: WAL {wal} B + manifest {man} B = {wal + man} B; one checkpoint (model + optimizer) "
          f"{ck / 1e6:.2f} MB; ratio {100 * (wal + man) / ck:.4f}% (plan.jsonl {plan} B, {100 * plan / ck:.3f}%)")
    return (wal + man) / ck


def bench_geometry(run, tmp, plot, verify_each: bool = False):
    """Suffix-replay cost of a 5% deletion placed early, in the middle, late, or scattered at random.

    Under ``accelerate launch`` every process replays; the main one redacts, prints and (``verify_each``) runs the
    oracle check.
    """
    from accelerate import PartialState

    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store, replay_cost, verify

    state = PartialState()
    r = open_run(run)
    total = r.total_steps
    ids = r.ids_at_steps(range(total))
    n = max(1, len(set(ids)) // 20)  # 5% of the rows
    geometries = {
        "early": r.ids_at_steps([0])[:n],
        "middle": r.ids_at_steps([total // 2])[:n],
        "late": r.ids_at_steps([total - 1])[:n],
        "random 5%": random.Random(0).sample(sorted(set(ids)), n),
    }
    rows = []
    say = print if state.is_main_process else (lambda *x, **k: None)
    say(f"replay cost by deletion geometry ({n} rows = 5% of {len(set(ids))}, {total} optimizer steps, checkpoints every "
        f"{r.header['checkpoint_steps']} steps, {r.header.get('world_size', 1)} process(es)):")
    say(f"{'geometry':10s} {'start':>5s} {'replayed':>8s} {'fraction':>8s} {'replay CPU s':>12s}"
        + (" verified" if verify_each else ""))
    for name, forget in geometries.items():
        cost = replay_cost(r, forget)
        store = tmp / f"store-{name}"
        if state.is_main_process:
            redact_store(r.store_path, forget, store, r.key)
        state.wait_for_everyone()
        t = time.process_time()
        RedactedReplayTrainer(r, store, forget, tmp / f"replay-{name}").train()
        secs = time.process_time() - t
        verdict = ""
        if verify_each:
            OracleReplayTrainer(r, forget, out_dir=tmp / f"oracle-{name}").train()
            if state.is_main_process:
                verdict = " yes" if verify(tmp / f"replay-{name}", tmp / f"oracle-{name}")["verified"] else " NO"
        rows.append((name, cost["start_checkpoint"], cost["steps_to_replay"], cost["fraction_replayed"], secs))
        say(f"{name:10s} {cost['start_checkpoint']:5d} {cost['steps_to_replay']:8d} {cost['fraction_replayed']:8.3f} "
            f"{secs:12.2f}{verdict}")
    if plot and state.is_main_process:
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


def relaunch(processes: int) -> int:
    """Run this script again under ``accelerate launch --multi_gpu --num_processes N`` (CPU processes use gloo)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
           "--main_process_port", str(port), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           __file__, *sys.argv[1:]]
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def main_distributed(a):
    """One data-parallel recording, then the geometry table (every replay verified against its oracle)."""
    from accelerate import PartialState

    state = PartialState(cpu=True)
    tok, data = setup(a.rows, a.hidden)
    shared = Path(tempfile.gettempdir()) / f"bench_trace_dp_{os.environ.get('MASTER_PORT', '0')}"
    make_trainer("trace", tok, data, shared / "ft", a.hidden, every=2, trace_dir=shared / "trace").train()
    state.wait_for_everyone()
    try:
        bench_geometry(shared / "trace", shared, None, verify_each=True)
    finally:
        state.wait_for_everyone()
        if state.is_main_process:
            shutil.rmtree(shared, ignore_errors=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--plot", default="benchmarks/trace_replay_cost.png")
    p.add_argument("--processes", type=int, default=1, help="data-parallel processes (CPU, gloo)")
    a = p.parse_args()
    if a.processes > 1 and "WORLD_SIZE" not in os.environ:
        raise SystemExit(relaunch(a.processes))
    import transformers

    transformers.logging.set_verbosity_error()
    import datasets

    datasets.disable_progress_bars()
    if "WORLD_SIZE" in os.environ:
        return main_distributed(a)
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
