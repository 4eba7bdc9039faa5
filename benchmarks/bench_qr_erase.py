"""Decomposition time of QR-Erase's subspace finders, side by side on the same matrices, as ratios to the SVD.

For each shape, the same float32 matrix goes through (interleaved, ``--repeats`` rounds, median per method):

- ``svd``: the UNLEARN baseline, ``torch.linalg.svd(full_matrices=False)`` (what ``svd_subspace`` runs);
- ``qr``: ``cpqr_subspace`` (scipy ``geqp3`` + ``orgqr`` for the ``--rank`` columns needed);
- ``qr-economic``: scipy's default ``qr(pivoting=True, mode="economic")`` that forms all of Q (for reference);
- ``qr-truncated@k``: ``truncated_cpqr_subspace`` at each ``--truncated-ranks`` k (range finder with ``--oversample``
  extra columns and ``--power-iters`` power iterations, then CPQR of the sketch).

Run it with the BLAS thread count fixed (``--threads``, default 1: it sets OMP/MKL/OpenBLAS threads and torch's
before either library loads), e.g.::

    PYTHONPATH=. python benchmarks/bench_qr_erase.py --threads 1 --out /tmp/bench_qr_erase.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

DEFAULT_SHAPES = "768x768,1024x1024,2048x2048,4096x4096,576x1536,1536x576"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of MxN (out x in); 576x1536/1536x576 are "
                   "SmolLM2-135M's MLP down/up(gate) projections")
    p.add_argument("--repeats", type=int, default=5, help="rounds per shape (median); shapes >= 4096 use --repeats-large")
    p.add_argument("--repeats-large", type=int, default=3)
    p.add_argument("--rank", type=int, default=16, help="directions the full CPQR forms (Q columns)")
    p.add_argument("--truncated-ranks", default="16,64,128", help="ranks of the truncated variant")
    p.add_argument("--oversample", type=int, default=10)
    p.add_argument("--power-iters", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="BLAS/LAPACK and torch threads (fixed for the whole run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)  # before numpy/scipy/torch load their BLAS
    import numpy as np
    import scipy.linalg
    import torch

    from hf_unlearn.editing.decompositions import cpqr_subspace, svd_subspace, truncated_cpqr_subspace

    torch.set_num_threads(args.threads)
    ranks = [int(k) for k in args.truncated_ranks.split(",") if k]
    rows = []
    print(f"threads: {args.threads} (torch {torch.get_num_threads()}), torch {torch.__version__}, scipy "
          f"{scipy.__version__}; medians of interleaved runs; ratio = method / svd", flush=True)
    for shape in args.shapes.split(","):
        m, n = (int(x) for x in shape.lower().split("x"))
        g = torch.Generator().manual_seed(args.seed)
        a = torch.randn(m, n, generator=g)
        methods = {
            "svd": lambda a=a: svd_subspace(a, rank=args.rank),
            "qr": lambda a=a: cpqr_subspace(a, rank=args.rank),
            "qr-economic": lambda a=a: scipy.linalg.qr(a.numpy(), pivoting=True, mode="economic", check_finite=False),
        }
        for k in ranks:
            if k + args.oversample <= min(m, n):
                methods[f"qr-truncated@{k}"] = (lambda k=k, a=a: truncated_cpqr_subspace(
                    a, rank=k, oversample=args.oversample, power_iters=args.power_iters, seed=args.seed))
        for f in methods.values():  # warm-up (first-call allocations, LAPACK workspace queries)
            f()
        repeats = args.repeats_large if max(m, n) >= 4096 else args.repeats
        times: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(repeats):
            for name, f in methods.items():
                start = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) for name, t in times.items()}
        row = {"shape": f"{m}x{n}", "repeats": repeats, "median_s": med,
               "spread_s": {name: [min(t), max(t)] for name, t in times.items()},
               "ratio_to_svd": {name: med[name] / med["svd"] for name in med if name != "svd"}}
        rows.append(row)
        cells = ", ".join(f"{name} {r:.3f}" for name, r in row["ratio_to_svd"].items())
        print(f"{m:>5} x {n:<5} svd {med['svd']:.3f} s | ratios: {cells}", flush=True)
    print("\n| shape | SVD s | CPQR s | CPQR / SVD | CPQR economic / SVD | "
          + " | ".join(f"truncated@{k} / SVD" for k in ranks) + " |")
    print("|---|---|---|---|---|" + "---|" * len(ranks))
    for r in rows:
        trunc = [r["ratio_to_svd"].get(f"qr-truncated@{k}") for k in ranks]
        print(f"| {r['shape']} | {r['median_s']['svd']:.3f} | {r['median_s']['qr']:.3f} | "
              f"{r['ratio_to_svd']['qr']:.3f} | {r['ratio_to_svd']['qr-economic']:.3f} | "
              + " | ".join("-" if t is None else f"{t:.4f}" for t in trunc) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "numpy": np.__version__, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
