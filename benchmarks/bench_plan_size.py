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


def measure(a, rows: int, tmp: Path, recorded: bool) -> dict:
    """Encode the synthetic plan (decoded again and compared, block MACs checked); with ``recorded`` also write it
    through the recorder, seal, check, compact with ``compact_run`` and check the compacted run (slow at 1e6)."""
    import dataclasses

    from hf_unlearn.trace.compact import decode, encode, forged_blocks

    key, run_id = b"k" * 32, f"bench-{rows}"
    t = time.perf_counter()
    entries = [e for seg in synthetic_segments(a.microbatches, a.slots, a.accum, rows) for e in seg]
    gen_s = time.perf_counter() - t
    t = time.perf_counter()
    data = encode(entries, key, run_id, seed_base=0, sampler_seeds=(0,))
    encode_s = time.perf_counter() - t
    t = time.perf_counter()
    decoded = decode(data)
    assert decoded.entries == [dataclasses.replace(e, batch=None) for e in entries]
    assert not forged_blocks(key, run_id, decoded)
    decode_s = time.perf_counter() - t
    out = {"rows": rows, "bytes": len(data), "meta": decoded.meta, "json": 0, "sizes": None,
           "times": f"generate {gen_s:.0f} s, encode {encode_s:.0f} s, decode + compare + MAC check {decode_s:.0f} s"}
    if rows == a.rows[0]:
        out["json"] = sum(len(e.to_line()) for e in entries)
    if recorded:
        out.update(record_and_compact(a, rows, tmp, entries, data))
    return out


def record_and_compact(a, rows: int, tmp: Path, entries, expected: bytes) -> dict:
    from hf_unlearn.trace.compact import compact_run
    from hf_unlearn.trace.plan import segments
    from hf_unlearn.trace.recording import TraceWriter
    from hf_unlearn.trace.run import FORMAT, check_run
    from hf_unlearn.trace.tags import recording_key

    run = tmp / f"run-{rows}"
    key = recording_key(run, b"k" * 32)
    writer = TraceWriter(run, key)
    header = {"run_id": f"bench-{rows}", "format": FORMAT, "dataset": {}, "determinism": {"seed": 0},
              "training_args": {"seed": 0}}
    writer.open(header)
    for seg in segments(entries):
        writer.append(seg)
    writer.seal(header)
    sizes = {n: (run / n).stat().st_size for n in ("plan.bin", "wal.bin", "manifest.bin")}
    compact_run(run)  # checks the recorded run (CRCs, MACs, digests) first
    assert (run / "provenance.bin").read_bytes() == expected  # the recorder's files compact to what encode wrote
    rep, _, plan = check_run(run, key=key, check_checkpoints=False)
    assert rep.ok and rep.summary["controls"] == "keyed" and len(plan) == a.microbatches, rep.errors
    shutil.rmtree(run, ignore_errors=True)
    return {"sizes": sizes}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=1_000_000)
    p.add_argument("--slots", type=int, default=4, help="rows per microbatch (per_device_train_batch_size)")
    p.add_argument("--accum", type=int, default=4, help="gradient_accumulation_steps")
    p.add_argument("--checkpoint-mb", type=float, default=1615.0, help="one checkpoint (model + optimizer), MB")
    p.add_argument("--tmp", default=None, help="scratch folder (default: a temporary one, removed)")
    p.add_argument("--rows", default="10000,100000,300000,1000000",
                   help="distinct rows N (comma-separated; the run is microbatches * slots / N epochs)")
    p.add_argument("--recorded", action="store_true",
                   help="also write each plan through the recorder (plan.bin, wal.bin, manifest.bin), compact it with "
                        "compact_run and check both layouts (about 10x slower)")
    a = p.parse_args(argv)
    a.rows = [int(x) for x in a.rows.split(",")]
    tmp = Path(a.tmp or tempfile.mkdtemp(prefix="bench_plan_"))
    ck = a.checkpoint_mb * 1e6
    print(f"{a.microbatches:,} microbatches of {a.slots} rows, accumulation {a.accum} "
          f"({-(-a.microbatches // a.accum):,} optimizer steps); one checkpoint {a.checkpoint_mb:,.0f} MB; "
          f"0.2% = {0.002 * ck / 1e6:.2f} MB = {0.002 * ck / a.microbatches:.2f} B/microbatch")
    if not a.recorded:
        print("(--recorded also writes each plan in the recorded layout, plan.bin + wal.bin + manifest.bin, and compacts "
              "that with compact_run)")
    print(f"{'rows N':>9s} {'epochs':>7s} | {'compact':>9s} {'B/mb':>6s} {'% ckpt':>7s} {'8N/mb':>7s} | 0.2% target | "
          f"claims")
    for rows in a.rows:
        r = measure(a, rows, tmp, a.recorded)
        mb, meta = a.microbatches, r["meta"]
        print(f"{rows:9,d} {mb * a.slots / rows:7.1f} | {r['bytes'] / 1e6:6.2f} MB {r['bytes'] / mb:6.2f} "
              f"{100 * r['bytes'] / ck:6.3f}% {8 * rows / mb:5.2f} B | {'met' if r['bytes'] <= 0.002 * ck else 'NOT met':11s}"
              f" | order {meta['order']['rule']}, seeds {meta['seeds']['rule']}, lengths {meta['lens']} ({r['times']})",
              flush=True)
        if r["sizes"]:
            total = sum(r["sizes"].values())
            print(f"{'':9s} recorded: " + ", ".join(f"{n} {v / mb:.2f} B" for n, v in r["sizes"].items())
                  + f" = {total / mb:.2f} B/microbatch ({100 * total / ck:.3f}%); compact_run's file == the encoder's")
        if r["json"]:
            print(f"{'':9s} the same plan as plan.jsonl: {r['json'] / mb:.0f} B/microbatch")
    if a.tmp is None:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
