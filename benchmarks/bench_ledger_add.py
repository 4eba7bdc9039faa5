"""One ``DeletionLedger.add`` on a ledger that already holds N requests: latency, and the work it does.

    PYTHONPATH=. python benchmarks/bench_ledger_add.py [--sizes 1000 10000] [--adds 5] [--profile]

Builds, over the tests' recorded run, a ledger of N signed ``request`` records as ``add`` writes them, each with its
acknowledgement and bundle under the head of its time (written directly, not through ``add``, so a 10,000-record
ledger takes seconds), then times ``--adds`` more ``add`` calls, the first in a fresh process state (a fresh
``DeletionLedger`` object: what a CLI ``hf-unlearn requests add`` pays) and the rest on the same object (what a
long-lived intake pays). Counts, per add: the whole-ledger chain checks (``check_chain`` calls), Ed25519 signature
verifications (records, heads and the evidence's receipts) and records hashed by ``read_records``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@contextmanager
def counting():
    """Counts calls of the checks an add makes (patched where they are looked up)."""
    from hf_unlearn import keys
    from hf_unlearn.deletion import chain, evidence, journal, records

    counts = {"check_chain": 0, "signature_ok": 0, "record_hash": 0}
    originals = {}

    def wrap(module, name, key):
        original = getattr(module, name)
        originals[(module, name)] = original

        def counted(*a, **kw):
            counts[key] += 1
            return original(*a, **kw)
        setattr(module, name, counted)

    wrap(journal, "check_chain", "check_chain")
    for m in (chain, evidence, keys):
        wrap(m, "signature_ok", "signature_ok")
    wrap(records, "record_hash", "record_hash")
    try:
        yield counts
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)


def build(run: Path, folder: Path, n: int) -> None:
    """A ledger of ``n`` requests as ``add`` leaves it (records, private ids, head, acknowledgement and bundle each)."""
    from hf_unlearn.deletion import DeletionLedger
    from hf_unlearn.deletion.chain import canonical, head_body, sign_head
    from hf_unlearn.deletion.receipts import acknowledge
    from hf_unlearn.deletion.records import HEAD_FILE, PRIVATE_FILE, RECORDS_FILE, Request
    from hf_unlearn.trace.tags import keyed_tags

    ledger = DeletionLedger(run, folder)
    key = ledger.tag_key
    records = [ledger._record([], ledger._opening())]
    (folder / "receipts").mkdir(parents=True)
    (folder / PRIVATE_FILE[0]).mkdir(mode=0o700)
    view = SimpleNamespace(records=lambda: records, path=folder, tag_key=key, signing_key=ledger.signing_key)
    private = []
    for k in range(n):
        rid, ids = f"r-{k + 1:04d}", [k]
        r = ledger._record(records, {"type": "request", "request": rid, "tags": keyed_tags(ids, key),
                                     "count": 1, "received": "2026-12-01T00:00:00Z",
                                     "deadline": "2026-12-31T00:00:00Z", "ref_tag": None})
        records.append(r)
        private.append(json.dumps({"request": rid, "ids": ids, "ref": None}, sort_keys=True))
        (folder / HEAD_FILE).write_text(json.dumps(sign_head(head_body(records[0]["ledger"], r),
                                                             ledger.signing_key), indent=1) + "\n")
        acknowledge(view, Request(id=rid, tags=r["tags"], received=r["received"], deadline=r["deadline"],
                                  ref_tag=None, seq=r["seq"], sha256=r["sha256"]))
    (folder / RECORDS_FILE).write_bytes(b"".join(canonical(r) + b"\n" for r in records))
    folder.joinpath(*PRIVATE_FILE).write_text("\n".join(private) + "\n")


def measure(run: Path, folder: Path, adds: int, profile: bool) -> dict:
    from hf_unlearn.deletion import DeletionLedger
    from hf_unlearn.deletion.records import read_records

    ids = list(range(20))
    out = {"records_before": len(read_records(folder)[0]), "adds": []}
    ledger = None
    for k in range(adds):
        if k == 0:
            ledger = DeletionLedger(run, folder)  # a fresh process state: nothing remembered yet
        prof = cProfile.Profile() if profile and k == adds - 1 else None
        with counting() as counts:
            t = time.perf_counter()
            if prof:
                prof.enable()
            ledger.add([ids[k % len(ids)]])
            if prof:
                prof.disable()
            wall = time.perf_counter() - t
        out["adds"].append({"seconds": round(wall, 4), **counts})
        if prof:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    warm = [a["seconds"] for a in out["adds"][1:]] or [out["adds"][0]["seconds"]]
    out["first_s"], out["warm_median_s"] = out["adds"][0]["seconds"], statistics.median(warm)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--adds", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="print a cProfile of the last add of each size")
    args = p.parse_args(argv)
    from tests.test_trace_common import get_recorded

    run = get_recorded()
    results = []
    for n in args.sizes:
        folder = Path(tempfile.mkdtemp(prefix="bench_ledger_add_")) / "ledger"
        t = time.perf_counter()
        build(run, folder, n)
        built = time.perf_counter() - t
        res = {"requests": n, "build_s": round(built, 1), **measure(run, folder, args.adds, args.profile)}
        results.append(res)
        print(f"{n} requests ({res['records_before']} records, built in {built:.0f} s): first add "
              f"{res['first_s']:.3f} s, then median {res['warm_median_s']:.3f} s")
        for k, a in enumerate(res["adds"]):
            print(f"  add {k + 1}: {a['seconds']:.3f} s, {a['check_chain']} chain check(s), {a['signature_ok']} "
                  f"signature verification(s), {a['record_hash']} record(s) hashed")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
