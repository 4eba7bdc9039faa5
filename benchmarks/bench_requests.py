"""The deletion service over a simulated month: 20 requests, exact deletion in batches by a policy vs one by one.

    PYTHONPATH=. python benchmarks/bench_requests.py [--rows 800] [--requests 20] [--max-wait-days 25]
                                                     [--out DIR] [--plot FILE]

Records a tiny Llama run of ``rows / 4`` optimizer steps (one epoch, 4 rows a step, a checkpoint every
``--every`` steps), then simulates a month: ``--requests`` requests arrive at seeded random times over 30 days, each
naming 1-3 rows drawn from the whole run. A cron job runs ``serve --due`` once a day (policy: ``max_wait_days``);
every exact batch runs the oracle, and every receipt is checked with the public key alone (signature, chain to the
ledger, the model's state-hash root). Prints, side by side, the optimizer steps replayed by the batches (executed)
against serving each request alone (``replay_cost`` of each request, computed by the planner, not executed), and the
days from each request to its exact deletion, then the disk the service keeps (ledger, batches and the recorded
run, hard links counted once) before and after ``requests purge``, per served request.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(Path(__file__).resolve().parents[2] / "shared" / "data"))
warnings.filterwarnings("ignore")


def parse_args(argv=None):
    from hf_unlearn.runtime import bench_output_dir

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=800, help="training rows (optimizer steps = rows / 4)")
    p.add_argument("--every", type=int, default=10, help="checkpoint cadence in optimizer steps")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--days", type=int, default=30, help="the requests arrive over this many days")
    p.add_argument("--max-wait-days", type=float, default=25.0, help="the policy's max_wait_days")
    p.add_argument("--deadline-days", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-oracle", dest="oracle", action="store_false", help="skip the oracle of each batch")
    p.add_argument("--execute-one-by-one", action="store_true",
                   help="also serve every request alone (a second ledger, no oracle) and count the steps replayed")
    p.add_argument("--out", default=bench_output_dir("requests"), help="work folder (run, ledger, results.json)")
    p.add_argument("--plot", default=None, help="also write the figure here (default OUT/requests.png)")
    return p.parse_args(argv)


def record(args, out: Path) -> Path:
    from transformers import TrainingArguments

    from hf_unlearn.data import QACollator, load_tofu, tokenize_qa
    from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer
    from hf_unlearn.trace import TraceRecordingTrainer

    rows = load_tofu("full").select(range(args.rows))
    tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
    data = tokenize_qa(rows, tok, max_length=128)
    model = build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    targs = TrainingArguments(output_dir=str(out / "train"), per_device_train_batch_size=4, num_train_epochs=1,
                              learning_rate=3e-3, warmup_steps=2, max_grad_norm=1.0, report_to=[], save_strategy="no",
                              use_cpu=True, seed=0, disable_tqdm=True, logging_strategy="no")
    trainer = TraceRecordingTrainer(model=model, args=targs, train_dataset=data,
                                    data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=args.every,
                                    trace_dir=str(out / "trace"))
    trainer.train()
    return out / "trace"


def simulate(args, run: Path, out: Path) -> dict:
    from hf_unlearn.deletion import DeletionLedger, Policy, verify_receipt
    from hf_unlearn.trace.replay import replay_cost
    from hf_unlearn.trace.run import open_run

    rng = random.Random(args.seed)
    trace = open_run(run, check_checkpoints=False)
    all_ids = sorted({i for e in range(trace.total_steps) for i in trace.ids_at_steps([e])})
    start = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    arrivals = sorted(start + dt.timedelta(days=rng.uniform(0, args.days)) for _ in range(args.requests))
    wanted = [rng.sample(all_ids, rng.randint(1, 3)) for _ in arrivals]
    alone = [replay_cost(trace, ids)["steps_to_replay"] for ids in wanted]  # each request served alone (planner)
    ledger = DeletionLedger(run, out / "ledger", deadline_days=args.deadline_days)
    policy = Policy(max_wait_days=args.max_wait_days, oracle=args.oracle)
    added, batches, t0 = 0, [], time.perf_counter()
    for day in range(args.days + int(args.max_wait_days) + 2):  # cron: once a day at 02:00
        now = start + dt.timedelta(days=day, hours=2)
        while added < len(arrivals) and arrivals[added] <= now:
            ledger.add(wanted[added], ref=f"ticket-{added}", received=arrivals[added])
            added += 1
        result = ledger.serve_due(policy, now=now, progress=False, log=lambda m: None)
        if result["exact"] is not None:
            done = ledger.last("batch_done")
            batches.append({"day": day, "batch": done["batch"], "requests": len(done["requests"]),
                            "steps_replayed": done["steps_replayed"], "verified": done["verified"],
                            "reason": result["reasons"][0]})
            print(f"day {day:2d}: {done['batch']} served {len(done['requests'])} request(s), replayed "
                  f"{done['steps_replayed']} steps, oracle verified {done['verified']} ({result['reasons'][0]})")
    serve_s = time.perf_counter() - t0
    from hf_unlearn.keys import load_signing_key

    public = load_signing_key().public_key()
    receipts = sorted(p for p in (ledger.path / "receipts").glob("*.json")
                      if not p.name.endswith((".bundle.json", ".ack.json")))
    verified = {}
    for path in receipts:
        body = json.loads(path.read_text())
        verified[path.name] = verify_receipt(path, public, model=ledger.path / body["model"]).ok
    bundles = sorted((ledger.path / "receipts").glob("*.bundle.json"))
    bundles_ok = sum(verify_receipt(path, public).ok for path in bundles)  # each alone: receipt, records, head
    # erasure: the disk the service keeps before and after `requests purge`, per served request
    from hf_unlearn.deletion.erasure import purge

    kept_before = disk_bytes(ledger.path, run)
    purged = purge(ledger, log=lambda m: None)
    kept_after = disk_bytes(ledger.path, run)
    current = ledger.served_model()  # every old exact receipt still checks against the current model
    after_purge_ok = sum(verify_receipt(path, public, model=current).ok for path in receipts
                         if json.loads(path.read_text()).get("kind") == "exact")
    executed_alone = None
    if args.execute_one_by_one:  # the baseline for real: each request its own exact deletion, in arrival order
        alone_ledger = DeletionLedger(run, out / "ledger-one-by-one", deadline_days=args.deadline_days)
        executed_alone = 0
        for ids, received in zip(wanted, arrivals):
            alone_ledger.add(ids, received=received)
            alone_ledger.serve_exact(now=received, progress=False, log=lambda m: None)
            executed_alone += alone_ledger.last("batch_done")["steps_replayed"]
        print(f"one by one, executed: {executed_alone} steps replayed in {len(wanted)} deletions")
    requests = ledger.requests()
    delays = [(dt.datetime.fromisoformat(r.served.replace("Z", "+00:00")) -
               dt.datetime.fromisoformat(r.received.replace("Z", "+00:00"))).total_seconds() / 86400
              for r in requests if r.served]
    late = [r.id for r in requests if r.state != "exact" or r.served > r.deadline]
    batched = sum(b["steps_replayed"] for b in batches)
    return {"total_steps": trace.total_steps, "checkpoint_every": args.every, "requests": len(requests),
            "ids": sum(len(w) for w in wanted), "batches": batches, "steps_batched": batched,
            "steps_one_by_one": sum(alone), "steps_one_by_one_executed": executed_alone, "ratio": sum(alone) / batched if batched else None,
            "days_to_exact": {"min": min(delays), "mean": sum(delays) / len(delays), "max": max(delays)},
            "delays": delays, "arrival_days": [(a - start).total_seconds() / 86400 for a in arrivals],
            "late_or_unserved": late, "receipts": len(receipts), "receipts_verified": sum(verified.values()),
            "serve_seconds": serve_s, "max_wait_days": args.max_wait_days, "deadline_days": args.deadline_days,
            "bundles": len(bundles), "bundles_verified": bundles_ok,
            "disk_kept_bytes": {"before_purge": kept_before, "after_purge": kept_after,
                                "per_served_request_before": kept_before / max(len(delays), 1),
                                "per_served_request_after": kept_after / max(len(delays), 1),
                                "purged_paths": len(purged.removed)},
            "exact_receipts_verified_against_current_model_after_purge": after_purge_ok}


def disk_bytes(*folders: Path) -> int:
    """Bytes on disk under the folders, a hard-linked file once (replays share their clean prefix by links)."""
    seen, total = set(), 0
    for folder in folders:
        for p in folder.rglob("*"):
            if p.is_file() and not p.is_symlink():
                st = p.stat()
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [2.2, 1]})
    arrivals = res["arrival_days"]
    served = [d + s for d, s in zip(arrivals, res["delays"])]
    for d, s in zip(arrivals, served):
        a.plot([d, s], [d, d], color="0.7", lw=1)
    a.scatter(arrivals, arrivals, s=14, label="request received")
    a.scatter(served, arrivals, s=14, marker="s", label="exact deletion (batch)")
    a.set_xlabel("day")
    a.set_ylabel("day received")
    a.set_title(f"{res['requests']} requests, {len(res['batches'])} batch(es) (max_wait_days {res['max_wait_days']:g})")
    a.legend(loc="lower right", fontsize=8)
    b.bar(["one by one\n(planned)", "batched\n(executed)"], [res["steps_one_by_one"], res["steps_batched"]],
          color=["0.6", "C0"])
    b.set_ylabel("optimizer steps replayed")
    b.set_title(f"{res['ratio']:.1f}x fewer on a {res['total_steps']}-step run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        if not (out / "results.json").is_file():
            raise SystemExit(f"{out} is not empty and holds no earlier results.json of this benchmark; choose --out")
        shutil.rmtree(out)  # an earlier run of this benchmark
    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    run = record(args, out)
    print(f"recorded {run} in {time.perf_counter() - t:.0f} s")
    res = simulate(args, run, out)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    print(f"\nrun of {res['total_steps']} optimizer steps (checkpoint every {res['checkpoint_every']}); "
          f"{res['requests']} requests ({res['ids']} ids) over {args.days} days; policy max_wait_days "
          f"{args.max_wait_days:g}, deadline {args.deadline_days:g} days")
    print(f"  replayed steps: one by one {res['steps_one_by_one']} (planned by replay_cost), batched "
          f"{res['steps_batched']} in {len(res['batches'])} batches (executed): {res['ratio']:.1f}x fewer "
          f"(goal >= 5x: {'met' if res['ratio'] >= 5 else 'NOT met'})")
    d = res["days_to_exact"]
    if res["steps_one_by_one_executed"] is not None:
        print(f"  one by one, executed: {res['steps_one_by_one_executed']} steps replayed (the planner said "
              f"{res['steps_one_by_one']})")
    print(f"  days from request to exact deletion: min {d['min']:.1f}, mean {d['mean']:.1f}, max {d['max']:.1f}; "
          f"late or unserved: {res['late_or_unserved'] or 'none'}")
    print(f"  receipts verified with the public key (signature, ledger chain, model root): "
          f"{res['receipts_verified']} of {res['receipts']}; every batch oracle-verified: "
          f"{all(b['verified'] for b in res['batches'])}")
    k = res["disk_kept_bytes"]
    print(f"  receipt bundles verified alone: {res['bundles_verified']} of {res['bundles']}")
    print(f"  disk the service keeps (ledger + run, hard links once): {k['before_purge'] / 2**20:.1f} MiB before "
          f"`requests purge`, {k['after_purge'] / 2**20:.1f} MiB after ({k['purged_paths']} paths removed); per "
          f"served request {k['per_served_request_before'] / 2**20:.2f} -> {k['per_served_request_after'] / 2**20:.2f} "
          f"MiB; exact receipts verified against the current model after the purge: "
          f"{res['exact_receipts_verified_against_current_model_after_purge']}")
    plot(res, Path(args.plot) if args.plot else out / "requests.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
