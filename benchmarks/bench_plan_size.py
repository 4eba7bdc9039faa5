"""Provenance size of a long run: plan + WAL + manifest against one checkpoint (issue #24 item 4).

    PYTHONPATH=. python benchmarks/bench_plan_size.py [--microbatches 1000000] [--slots 4] [--accum 4]
        [--rows 10000,100000,300000,1000000] [--checkpoint-mb 1615]

For each dataset size N in ``--rows`` (side by side in one run), writes a synthetic run of that many microbatches
through the recorder's own writer (``TraceWriter``: plan.bin frames, WAL records, manifest tags, one segment at a
time as training appends them) the way ``Trainer`` serves it: every epoch in the order accelerate's
``SeedableRandomSampler`` draws (``torch.randperm(N)`` seeded with ``seed + epoch``), so a run of M microbatches of
S rows is M * S / N epochs; per-row token lengths and label counts (the normaliser is the segment's label count),
the learning rate of transformers' linear schedule with warmup, the recorder's seeds, one keyed batch digest per
microbatch. It seals the run, checks it (every frame's CRC and keyed MAC), compacts it
(:func:`hf_unlearn.trace.compact.compact_run`, the same as ``hf-unlearn trace compact``), checks the compacted run
again (decoding, block MACs, keyed seal) and prints, for both layouts, the bytes per microbatch and the share of one
checkpoint (SmolLM2-135M with AdamW: 1,615 MB, measured by ``bench_trace_smollm2.py``), with the lower bound of
any provenance that keeps one 8-byte tag per distinct row (8 N bytes).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path


def synthetic_segments(microbatches: int, slots: int, accum: int, rows: int, seed: int = 0):
    """Segments as a recorder writes them for ``rows`` distinct rows served by the seedable sampler, epoch after
    epoch: keyed 8-byte tags, TOFU-like per-row lengths and label counts, transformers' linear schedule."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    from hf_unlearn.trace.compact import sampler_order
    from hf_unlearn.trace.plan import PlanEntry
    from hf_unlearn.trace.recording import microbatch_seed

    rng = random.Random(seed)
    tags = [rng.randbytes(8).hex() for _ in range(rows)]
    lens = [rng.randrange(20, 129) for _ in range(rows)]
    labels = [n - rng.randrange(5, min(40, n)) for n in lens]
    steps = -(-microbatches // accum)  # about: segments cut by an epoch's end add a few
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
    sched = get_linear_schedule_with_warmup(opt, steps // 50, steps)
    mb = epoch = pos = 0
    order = sampler_order(rows, seed).tolist()
    step = 0
    while mb < microbatches:
        lr = opt.param_groups[0]["lr"]
        if pos == rows:  # as Trainer does, a segment ends with its epoch (the epoch's last one may be short)
            epoch, pos = epoch + 1, 0
            order = sampler_order(rows, seed + epoch).tolist()
        seg_rows = []
        while len(seg_rows) < min(accum, microbatches - mb) and pos < rows:
            take = order[pos:pos + slots]
            pos += len(take)
            seg_rows.append(take)
        n = len(seg_rows)
        norm = float(sum(labels[r] for take in seg_rows for r in take))
        yield [PlanEntry(mb=mb + j, step=step, j=j, end=j == n - 1, seed=microbatch_seed(seed, step, j), lr=lr,
                         norm=norm, norm_dtype="int64", accum=n, slots=[tags[r] for r in take],
                         lens=[lens[r] for r in take], epoch=epoch, batch=[rng.randbytes(8).hex()])
               for j, take in enumerate(seg_rows)]
        opt.step()
        sched.step()
        mb, step = mb + n, step + 1


def measure(a, rows: int, tmp: Path) -> dict:
    from hf_unlearn.trace.compact import compact_run
    from hf_unlearn.trace.recording import TraceWriter
    from hf_unlearn.trace.run import FORMAT, check_run
    from hf_unlearn.trace.tags import recording_key

    run = tmp / f"run-{rows}"
    key = recording_key(run, b"k" * 32)
    writer = TraceWriter(run, key)
    header = {"run_id": f"bench-{rows}", "format": FORMAT, "dataset": {}, "determinism": {"seed": 0},
              "training_args": {"seed": 0}}
    writer.open(header)
    json_bytes = 0
    t = time.perf_counter()
    for seg in synthetic_segments(a.microbatches, a.slots, a.accum, rows):
        writer.append(seg)
        if rows == a.rows[0]:
            json_bytes += sum(len(e.to_line()) for e in seg)
    writer.seal(header)
    write_s = time.perf_counter() - t
    rep, _, _ = check_run(run, key=key, check_checkpoints=False)
    assert rep.ok and rep.summary["controls"] == "keyed", rep.errors
    sizes = {n: (run / n).stat().st_size for n in ("plan.bin", "wal.bin", "manifest.bin")}
    t = time.perf_counter()
    info = compact_run(run)
    compact_s = time.perf_counter() - t
    t = time.perf_counter()
    rep, _, plan = check_run(run, key=key, check_checkpoints=False)
    check_s = time.perf_counter() - t
    assert rep.ok and rep.summary["controls"] == "keyed" and len(plan) == a.microbatches, rep.errors
    return {"rows": rows, "sizes": sizes, "compact": info, "json": json_bytes, "write_s": write_s,
            "compact_s": compact_s, "check_s": check_s}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=1_000_000)
    p.add_argument("--slots", type=int, default=4, help="rows per microbatch (per_device_train_batch_size)")
    p.add_argument("--accum", type=int, default=4, help="gradient_accumulation_steps")
    p.add_argument("--checkpoint-mb", type=float, default=1615.0, help="one checkpoint (model + optimizer), MB")
    p.add_argument("--tmp", default=None, help="scratch folder (default: a temporary one, removed)")
    p.add_argument("--rows", default="10000,100000,300000,1000000",
                   help="distinct rows N (comma-separated; the run is microbatches * slots / N epochs)")
    a = p.parse_args(argv)
    a.rows = [int(x) for x in a.rows.split(",")]
    tmp = Path(a.tmp or tempfile.mkdtemp(prefix="bench_plan_"))
    ck = a.checkpoint_mb * 1e6
    print(f"{a.microbatches:,} microbatches of {a.slots} rows, accumulation {a.accum} "
          f"({-(-a.microbatches // a.accum):,} optimizer steps); one checkpoint {a.checkpoint_mb:,.0f} MB; "
          f"0.2% = {0.002 * ck / 1e6:.2f} MB = {0.002 * ck / a.microbatches:.2f} B/microbatch")
    print(f"{'rows N':>9s} {'epochs':>7s} | {'plan.bin':>9s} {'wal.bin':>9s} {'manifest':>9s} {'recorded':>9s} "
          f"{'% ckpt':>7s} | {'compact':>9s} {'B/mb':>6s} {'% ckpt':>7s} {'bound 8N/mb':>9s} | target | claims")
    for rows in a.rows:
        r = measure(a, rows, tmp)
        recorded = sum(r["sizes"].values())
        c = r["compact"]
        mb = a.microbatches
        print(f"{rows:9,d} {mb * a.slots / rows:7.1f} | " + " ".join(f"{v / mb:7.2f} B" for v in r["sizes"].values())
              + f" {recorded / mb:7.2f} B {100 * recorded / ck:6.3f}% | {c['bytes'] / 1e6:6.2f} MB {c['bytes'] / mb:6.2f} "
              f"{100 * c['bytes'] / ck:6.3f}% {8 * rows / mb:7.2f} B | {'met' if c['bytes'] <= 0.002 * ck else 'NOT met'}"
              f" | order {c['order']}, seeds {c['seeds']}, lengths {c['lens']} "
              f"(write {r['write_s']:.0f} s, compact {r['compact_s']:.0f} s, check {r['check_s']:.0f} s)", flush=True)
        if r["json"]:
            print(f"{'':9s} the same plan as plan.jsonl: {r['json'] / mb:.0f} B/microbatch")
        shutil.rmtree(tmp / f"run-{rows}", ignore_errors=True)
    if a.tmp is None:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
