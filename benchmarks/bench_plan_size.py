"""Provenance size of a long run: plan + WAL + manifest against one checkpoint (issue #24 item 4).

    PYTHONPATH=. python benchmarks/bench_plan_size.py [--microbatches 1000000] [--slots 4] [--accum 4]
        [--checkpoint-mb 1615]

Writes a synthetic plan of that many microbatches through the recorder's own writer (``TraceWriter``: plan.bin
frames, WAL records, manifest tags, one segment at a time as training appends them), then reads it back and checks
it (every frame's CRC and keyed MAC, and the first segments against the generator). Prints the bytes per
microbatch of each file, the total as a share of one checkpoint (SmolLM2-135M with AdamW: 1,615 MB, measured by
``bench_trace_smollm2.py``), the same plan as JSON lines (the format before it) for comparison, and the longest run
that stays within 0.2% of the checkpoint.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path


def synthetic_segments(microbatches: int, slots: int, accum: int, seed: int = 0):
    """Segments as a recorder writes them: keyed 8-byte tags, TOFU-like lengths, a decaying lr, integer normalisers."""
    from hf_unlearn.trace.plan import PlanEntry
    from hf_unlearn.trace.recording import microbatch_seed

    rng = random.Random(seed)
    steps = -(-microbatches // accum)
    mb = 0
    for step in range(steps):
        n = min(accum, microbatches - mb)
        lr = 3e-3 * (1 - step / steps)
        lens = [[rng.randrange(20, 129) for _ in range(slots)] for _ in range(n)]
        norm = float(sum(sum(x) for x in lens) - 10 * n * slots)
        yield [PlanEntry(mb=mb + j, step=step, j=j, end=j == n - 1, seed=microbatch_seed(0, step, j), lr=lr,
                         norm=norm, norm_dtype="int64", accum=n, slots=[rng.randbytes(8).hex() for _ in range(slots)],
                         lens=lens[j], epoch=0, batch=[rng.randbytes(8).hex()]) for j in range(n)]
        mb += n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatches", type=int, default=1_000_000)
    p.add_argument("--slots", type=int, default=4, help="rows per microbatch (per_device_train_batch_size)")
    p.add_argument("--accum", type=int, default=4, help="gradient_accumulation_steps")
    p.add_argument("--checkpoint-mb", type=float, default=1615.0, help="one checkpoint (model + optimizer), MB")
    p.add_argument("--tmp", default=None, help="scratch folder (default: a temporary one, removed)")
    a = p.parse_args(argv)

    from hf_unlearn.trace.plan import read_compact_plan, segment_entries
    from hf_unlearn.trace.recording import TraceWriter
    from hf_unlearn.trace.run import FORMAT, check_run
    from hf_unlearn.trace.wal import read_manifest, read_wal

    tmp = Path(a.tmp or tempfile.mkdtemp(prefix="bench_plan_"))
    run = tmp / "run"
    key = b"k" * 32
    writer = TraceWriter(run, key)
    header = {"run_id": "bench", "format": FORMAT, "dataset": {}}
    writer.open(header)
    json_bytes = 0
    t = time.perf_counter()
    for seg in synthetic_segments(a.microbatches, a.slots, a.accum):
        writer.append(seg)
        json_bytes += sum(len(e.to_line()) for e in seg)
    writer.seal(header)
    write_s = time.perf_counter() - t

    t = time.perf_counter()
    scan = read_compact_plan(run / "plan.bin")
    records = read_wal(run / "wal.bin").records
    manifest = read_manifest(run / "manifest.bin")
    read_s = time.perf_counter() - t
    assert scan.damaged_at is None and not scan.tail_bytes and len(records) == a.microbatches
    expected = synthetic_segments(a.microbatches, a.slots, a.accum)
    pos = mb = 0
    for seg in scan.segments[:1000]:  # the first segments read back as written
        want = next(expected)
        heads = []
        for e in want:
            heads.append((mb, records[mb].step, records[mb].seed, manifest[pos:pos + len(e.slots)]))
            mb, pos = mb + 1, pos + len(e.slots)
        assert segment_entries(seg, heads) == want
    t = time.perf_counter()
    rep, _, _ = check_run(run, key=key, check_checkpoints=False)
    check_s = time.perf_counter() - t
    assert rep.ok and rep.summary["controls"] == "keyed", rep.errors

    sizes = {n: (run / n).stat().st_size for n in ("plan.bin", "wal.bin", "manifest.bin")}
    total = sum(sizes.values())
    ck = a.checkpoint_mb * 1e6
    print(f"{a.microbatches:,} microbatches of {a.slots} rows, accumulation {a.accum} "
          f"({-(-a.microbatches // a.accum):,} optimizer steps); one checkpoint {a.checkpoint_mb:,.0f} MB")
    for name, size in sizes.items():
        print(f"  {name:12s} {size / 1e6:9.2f} MB  {size / a.microbatches:6.2f} B/microbatch  {100 * size / ck:7.4f}%")
    print(f"  {'total':12s} {total / 1e6:9.2f} MB  {total / a.microbatches:6.2f} B/microbatch  {100 * total / ck:7.4f}% "
          f"of one checkpoint (target 0.2%)")
    print(f"  the same plan as plan.jsonl: {json_bytes / 1e6:.1f} MB ({json_bytes / a.microbatches:.0f} B/microbatch): "
          f"plan.bin is {json_bytes / sizes['plan.bin']:.1f}x smaller; total with plan.jsonl "
          f"{100 * (json_bytes + total - sizes['plan.bin']) / ck:.3f}%")
    per = total / a.microbatches
    print(f"  within 0.2% of the checkpoint up to {int(0.002 * ck / per):,} microbatches (plan.jsonl: "
          f"{int(0.002 * ck / ((json_bytes + total - sizes['plan.bin']) / a.microbatches)):,}); WAL + manifest alone "
          f"(fixed: 32 B per record + 8 B per row) up to {int(0.002 * ck / ((sizes['wal.bin'] + sizes['manifest.bin']) / a.microbatches)):,}")
    print(f"  write {write_s:.1f} s ({1e6 * write_s / a.microbatches:.1f} us/microbatch, HMACs included), read "
          f"{read_s:.1f} s, full check (CRCs, MACs, cross-checks) {check_s:.1f} s")
    if a.tmp is None:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
