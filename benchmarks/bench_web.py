"""The web stack on this machine, 127.0.0.1 only (docs/benchmarks/web.md).

1. Intake: ``--clients`` concurrent clients (64) each POST ``--per-client`` requests to ``/api/v1/requests`` of an
   :class:`~hf_unlearn.web.intake.IntakeServer` over a fresh ledger: every request is checked against the run,
   appended to the hash chain, signed, fsync'd (journal and ledger) and acknowledged with a signed receipt before it
   is answered. Prints requests/s and latency percentiles; checks the ledger holds each request exactly once.
2. Hub downloads: the same stored file fetched through the new server and the old hand-written one (its module as
   of ``--old-commit``, loaded from ``git show``), each in its own process, interleaved, one at a time and 8 at a
   time; prints MB/s (median of the rounds) and the ratio.

    PYTHONPATH=. python benchmarks/bench_web.py [--clients 64 --per-client 4 --file-mb 64 --rounds 3]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]


def bench_intake(clients: int, per_client: int) -> dict:
    from hf_unlearn.deletion import DeletionLedger
    from hf_unlearn.web.intake import Intake, IntakeServer
    from tests.test_trace_common import get_recorded, ids_at_step

    run = get_recorded()
    ids = [i for s in range(1, 9) for i in ids_at_step(run, s)]
    ledger = DeletionLedger(run, Path(tempfile.mkdtemp(prefix="bench_web_")) / "ledger")
    latencies, failures = [], []
    with IntakeServer(Intake(ledger), {"tok": "bench"}, ["op"]) as server:
        u = urlsplit(server.url)
        barrier = threading.Barrier(clients)

        def client(c):
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
            barrier.wait()
            for k in range(per_client):
                body = json.dumps({"ids": [ids[(c * per_client + k) % len(ids)]]})
                start = time.perf_counter()
                conn.request("POST", "/api/v1/requests", body, {"Authorization": "Bearer tok",
                                                                 "Content-Type": "application/json",
                                                                 "Idempotency-Key": f"bench-{c}-{k}"})
                r = conn.getresponse()
                r.read()
                latencies.append(time.perf_counter() - start)
                if r.status != 201:
                    failures.append(r.status)
            conn.close()

        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    n = clients * per_client
    assert not failures and len(ledger.requests()) == n and ledger.check().ok, failures[:5]
    q = statistics.quantiles(latencies, n=100)
    # the same appends without HTTP, one after another on a fresh ledger: what DeletionLedger.add costs alone
    alone = DeletionLedger(run, Path(tempfile.mkdtemp(prefix="bench_web_alone_")) / "ledger")
    t0 = time.perf_counter()
    for k in range(n):
        alone.add([ids[k % len(ids)]], ref=f"alone-{k}")
    alone_wall = time.perf_counter() - t0
    return {"requests": n, "clients": clients, "wall_s": round(wall, 2), "requests_per_s": round(n / wall, 1),
            "p50_ms": round(q[49] * 1000), "p99_ms": round(q[98] * 1000), "max_ms": round(max(latencies) * 1000),
            "ledger_add_alone_per_s": round(n / alone_wall, 1),
            "ratio_intake_over_add_alone": round((n / wall) / (n / alone_wall), 2)}


SERVE = """
import importlib.util, subprocess, sys
from pathlib import Path
root, commit, which = sys.argv[1:4]
if which == "old":  # the hand-written ThreadingHTTPServer of the commit, a sibling module of hf_unlearn.hub
    source = subprocess.run(["git", "show", commit + ":hf_unlearn/hub/server.py"], check=True, capture_output=True,
                            text=True).stdout
    path = Path(root).parent / "_old_server.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("hf_unlearn.hub._old_server", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
else:
    import hf_unlearn.hub.server as module
server = module.HubServer(root, {"t": "bench"})
print(server.url, flush=True)
server.serve_forever()
"""


def start_server(root: Path, commit: str, which: str):
    """Each server in its own process, as deployed: the clients' threads do not share its interpreter."""
    import os

    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(root), commit, which], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc, proc.stdout.readline().strip()


def fetch(url: str) -> int:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
    conn.request("GET", u.path)
    r = conn.getresponse()
    total = 0
    while True:
        chunk = r.read(1 << 20)
        if not chunk:
            break
        total += len(chunk)
    conn.close()
    assert r.status == 200, r.status
    return total


def bench_downloads(file_mb: int, rounds: int, commit: str) -> dict:
    import os

    from hf_unlearn.hub.store import RepoStore

    root = Path(tempfile.mkdtemp(prefix="bench_hub_"))
    store = RepoStore(root)
    store.create_repo("model", "org/m", private=False, author="bench")
    data = os.urandom(file_mb << 20)
    store.apply_commit("model", "org/m", "main", message="weights", description="", author="bench",
                       operations=[("file", "model.bin", data)])
    del data
    servers = {name: start_server(root, commit, name) for name in ("new", "old")}
    out = {name: {"sequential": [], "parallel8": []} for name in servers}
    try:
        for _ in range(rounds):
            for name, (_, base) in servers.items():  # interleaved: both arms see the same machine load
                url = f"{base}/org/m/resolve/main/model.bin"
                t0 = time.perf_counter()
                size = fetch(url)
                out[name]["sequential"].append(size / (time.perf_counter() - t0) / 1e6)
                threads = [threading.Thread(target=fetch, args=(url,)) for _ in range(8)]
                t0 = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                out[name]["parallel8"].append(8 * size / (time.perf_counter() - t0) / 1e6)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    result = {f"{name}_{mode}_MBps": round(statistics.median(v), 1) for name, d in out.items() for mode, v in d.items()}
    for mode in ("sequential", "parallel8"):
        result[f"ratio_{mode}_new_over_old"] = round(result[f"new_{mode}_MBps"] / result[f"old_{mode}_MBps"], 2)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--per-client", type=int, default=4)
    p.add_argument("--file-mb", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--old-commit", default="e33caa4", help="a commit whose hub/server.py is the old server")
    p.add_argument("--skip-intake", action="store_true")
    p.add_argument("--skip-downloads", action="store_true")
    args = p.parse_args()
    if not args.skip_intake:
        print("intake", json.dumps(bench_intake(args.clients, args.per_client)), flush=True)
    if not args.skip_downloads:
        print("downloads", json.dumps(bench_downloads(args.file_mb, args.rounds, args.old_commit)), flush=True)


if __name__ == "__main__":
    main()
