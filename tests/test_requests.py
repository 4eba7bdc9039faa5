"""The deletion service: `hf-unlearn requests` / `hf_unlearn.deletion.DeletionLedger` on the shared recorded run
(tiny Llama, 8 optimizer steps, checkpoints every 2). Ledgers live in tmp folders, never inside the shared run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hf_unlearn.errors import UnlearnError

from .conftest import ROOT
from .test_forget import _walk
from .test_trace_common import get_recorded, get_trace_data, ids_at_step

QUIET = {"progress": False, "log": lambda m: None}


def cli(capsys, *args) -> tuple[int, str]:
    """``hf-unlearn ARGS`` in this process (the subprocess tests below start real processes where it matters)."""
    from hf_unlearn.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def ledger_at(path, **kw):
    from hf_unlearn.deletion import DeletionLedger

    return DeletionLedger(get_recorded(), path, **kw)


def public_key():
    from hf_unlearn.keys import load_signing_key

    return load_signing_key().public_key()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Three requests (steps 2, 5, 6) served as one exact batch with the oracle, then one more (step 7) as a second
    batch deleting from the first batch's replay."""
    run = get_recorded()
    tok, _ = get_trace_data()
    ledger = ledger_at(tmp_path_factory.mktemp("served") / "ledger")
    requests = [ledger.add(ids_at_step(run, s)[:2], ref=f"TICKET-{s}", received="2026-11-01") for s in (2, 5, 6)]
    plan = ledger.plan(now="2026-11-03")
    first = ledger.serve_exact(tokenizer=tok, oracle=True, now="2026-11-03", **QUIET)
    late = ledger.add(ids_at_step(run, 7)[:1], received="2026-11-04")
    second = ledger.serve_exact(tokenizer=tok, oracle=True, now="2026-11-06", **QUIET)
    return ledger, requests + [late], plan, first, second


def test_one_batch_serves_every_pending_request_with_one_replay(served):
    ledger, requests, plan, first, second = served
    # the planner priced it before: one replay from step 2 instead of three (6 + 3 + 2 ... steps)
    assert plan["pending"] == 3 and plan["batch_now"] == 6 and plan["batch_start_checkpoint"] == 2
    assert plan["each_alone"] == {"r-0001": 6, "r-0002": 4, "r-0003": 2} and plan["each_alone_total"] == 12
    fr = first.forget_receipt
    assert first.requests == ["r-0001", "r-0002", "r-0003"] and fr.ok and fr.evidence["verified"] is True
    assert fr.evidence["replay"]["start_step"] == 2 and fr.evidence["redaction"]["rows_before"] - \
        fr.evidence["redaction"]["rows_after"] == 6
    # the second batch deletes from the first one's replay (so its model lacks every row deleted so far)
    assert second.requests == ["r-0004"] and second.forget_receipt.evidence["verified"] is True
    assert second.forget_receipt.source == str(ledger.path / "batches" / "batch-0001" / "replay")
    states = {r.id: (r.state, r.batch) for r in ledger.requests()}
    assert states == {"r-0001": ("exact", "batch-0001"), "r-0002": ("exact", "batch-0001"),
                      "r-0003": ("exact", "batch-0001"), "r-0004": ("exact", "batch-0002")}
    assert ledger.served_model() == ledger.path / "batches" / "batch-0002" / "model"
    # one receipt per request naming the batch and its own tags, and a batch receipt
    r1 = json.loads(first.receipts["r-0001"].read_text())
    assert r1["batch"]["name"] == "batch-0001" and r1["batch"]["requests"] == first.requests
    assert r1["request"]["tags"] == requests[0].tags and r1["request"]["tags"] != requests[1].tags
    assert "bit-identical to the oracle" in r1["guarantee"] and "not from an approximately" in r1["guarantee"]
    batch = json.loads(first.batch_receipt.read_text())
    assert batch["batch"]["tags"] == sorted(requests[0].tags + requests[1].tags + requests[2].tags)
    assert batch["state_hashes"]["params_root"] == fr.state_hashes["params_root"] == r1["state_hashes"]["params_root"]


def test_a_batch_summary_ends_with_the_purge_command_that_erases_what_still_holds_the_rows(served):
    """A served batch's summary names what still holds the rows and the service's own erasure command (the ledger
    is bound to the run: `rm -r` of the run is not what a service should do)."""
    ledger, _, _, first, second = served
    rows = first.forget_receipt.summary_rows()
    assert [k for k, _ in rows][-2:] == ["still holds", "to erase"]
    assert f"the source run {get_recorded()} (its token store" in rows[-2][1]
    assert rows[-1][1].startswith(f"`hf-unlearn requests purge {get_recorded()} --ledger {ledger.path}`")
    held = dict(second.forget_receipt.summary_rows())["still holds"]  # it deleted from batch-0001's replay
    assert f"{ledger.path / 'batches' / 'batch-0001'} (the earlier deletion this one deletes from" in held


def test_ledger_and_receipts_hold_tags_never_raw_ids(served):
    ledger, requests, *_ = served
    run = get_recorded()
    raw = [i for s in (2, 5, 6) for i in ids_at_step(run, s)[:2]] + ["TICKET-2"]
    public = [ledger.path / "ledger.jsonl", ledger.path / "head.json", *(ledger.path / "receipts").glob("*.json")]
    for path in public:  # (the run's ids are small ints, which counts also are: no list may hold the request's ids)
        text = path.read_text()
        assert "TICKET-2" not in text, path
        records = [json.loads(line) for line in text.splitlines()] if path.suffix == ".jsonl" else [json.loads(text)]
        for value in _walk(records):
            assert not (isinstance(value, list) and len(set(v for v in value if isinstance(v, int)) & set(raw)) >= 2)
    private = ledger.path / "private" / "ids.jsonl"
    assert oct(private.stat().st_mode & 0o777) == "0o600" and oct((ledger.path / "private").stat().st_mode & 0o777) \
        == "0o700"
    assert "TICKET-2" in private.read_text()
    # ledger, head and receipts are readable by the group (the umask decides; 022 in tests), raw ids owner-only
    os.umask(mask := os.umask(0o022))
    if not mask & 0o040:
        for path in public:
            assert path.stat().st_mode & 0o040, path


def test_receipts_verify_with_the_public_key_alone(served, tmp_path, capsys):
    from hf_unlearn.deletion import verify_receipt

    ledger, _, _, first, second = served
    model = ledger.path / "batches" / "batch-0001" / "model"
    for path in [*first.receipts.values(), first.batch_receipt]:
        report = verify_receipt(path, public_key(), model=model)
        assert report.ok, report.summary()
    key = tmp_path / "issuer.pub"
    assert cli(capsys, "requests", "public-key", "--out", key)[0] == 0
    code, out = cli(capsys, "requests", "verify", second.receipts["r-0004"], "--public-key", key, "--model",
                    ledger.path / "batches" / "batch-0002" / "model")
    assert code == 0 and "verify OK" in out, out
    code, out = cli(capsys, "requests", "verify", second.receipts["r-0004"], "--public-key", key, "--model",
                    ledger.path / "batches" / "batch-0001" / "model")
    assert code == 1 and "verify FAILED" in out and "model         FAIL" in out, out


def test_verify_cannot_be_fooled(served, tmp_path):
    """A tampered receipt, one signed by another key, one from another ledger, a swapped model, an edited ledger."""
    import shutil

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from hf_unlearn.deletion import verify_receipt
    from hf_unlearn.deletion.receipts import sign_receipt

    ledger, _, _, first, second = served
    pub = public_key()
    copy = tmp_path / "ledger"
    shutil.copytree(ledger.path, copy, ignore=shutil.ignore_patterns("batches", "provisional"))
    receipt = copy / "receipts" / "r-0002.exact.json"
    original = json.loads(receipt.read_text())

    def check(body, **kw) -> dict:
        receipt.write_text(json.dumps(body))
        report = verify_receipt(receipt, kw.pop("key", pub), **kw)
        assert not report.ok
        return {name: ok for name, ok, _ in report.checks}

    forged = json.loads(json.dumps(original))
    forged["request"]["tags"] = forged["request"]["tags"][:1]  # claims fewer rows were deleted
    assert check(forged) == {"signature": False}
    other = Ed25519PrivateKey.generate()
    assert check(sign_receipt(forged, other)) == {"signature": False}
    # signed by another key and checked with that key: the ledger head (signed by the issuer) and chain refuse it
    result = check(sign_receipt(forged, other), key=other.public_key())
    assert result["signature"] and not result["ledger head"] and not result.get("ledger chain", False)
    # a genuine receipt of another ledger (same run, same key) is not in this one
    foreign = ledger_at(tmp_path / "other")
    foreign.add(ids_at_step(get_recorded(), 3)[:1])
    foreign_receipt = json.loads(json.dumps(original))
    foreign_receipt["ledger"]["id"] = foreign.ledger_id
    result = check(sign_receipt(foreign_receipt, ledger.signing_key), ledger=foreign.path)
    assert result["signature"] and result["ledger head"] and not result["ledger chain"]
    assert check(original, ledger=foreign.path)["ledger id"] is False
    # a swapped model: batch-0001's weights (which still hold r-0004's row) for batch-0002's receipt
    later = copy / "receipts" / "r-0004.exact.json"
    report = verify_receipt(later, pub, model=ledger.path / "batches" / "batch-0001" / "model")
    assert not report.ok and {n: ok for n, ok, _ in report.checks}["model"] is False
    # ... while batch-0002's model also excludes r-0002's rows (it deletes from batch-0001's replay): it passes, saying so
    report = verify_receipt(receipt, pub, model=ledger.path / "batches" / "batch-0002" / "model")
    assert report.ok and "via batch-0001 -> batch-0002" in report.summary(), report.summary()
    # an edited ledger record is named
    receipt.write_text(json.dumps(original))
    assert verify_receipt(receipt, pub).ok
    lines = (copy / "ledger.jsonl").read_text().splitlines()
    lines[2] = lines[2].replace('"received":"2026-11-01', '"received":"2026-11-21')
    (copy / "ledger.jsonl").write_text("\n".join(lines) + "\n")
    report = verify_receipt(receipt, pub)
    assert not report.ok and "record 3 (line 3) fails its checksum" in report.summary()


def test_add_refuses_unknown_and_wrongly_typed_ids_naming_them(tmp_path, capsys):
    ledger = ledger_at(tmp_path / "ledger")
    good = ids_at_step(get_recorded(), 3)[:1]
    with pytest.raises(UnlearnError, match="never appear in the recorded plan.*987654"):
        ledger.add([*good, 987654])
    with pytest.raises(UnlearnError, match=str(good[0])):
        ledger.add([str(good[0])])  # the run's ids are ints: "5" is not 5
    assert not (tmp_path / "ledger" / "ledger.jsonl").exists()
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps(good[0]) + "\n")
    code, out = cli(capsys, "requests", "add", get_recorded(), "--ledger", tmp_path / "ledger", "--ids", ids, "--ref",
                    "T-1", "--received", "2026-10-01", "--deadline-days", "10")
    assert code == 0 and "r-0001" in out and "deadline 2026-10-11" in out, out
    code, out = cli(capsys, "requests", "list", get_recorded(), "--ledger", tmp_path / "ledger", "--now", "2026-10-15")
    assert "r-0001" in out and "pending" in out and "OVERDUE" in out
    code, out = cli(capsys, "requests", "status", get_recorded(), "--ledger", tmp_path / "ledger", "--now",
                    "2026-10-15")
    assert code == 1 and "overdue            ['r-0001']" in out, out  # exit 1 while a request is overdue
    code, out = cli(capsys, "requests", "add", get_recorded(), "--ledger", tmp_path / "ledger", "--ids", ids,
                    "--received", "last tuesday")
    assert code == 1 and "not an ISO date" in out
    # group-readable ledger (umask 022 of the test process), owner-only raw ids
    assert (tmp_path / "ledger" / "ledger.jsonl").stat().st_mode & 0o040
    assert (tmp_path / "ledger" / "private" / "ids.jsonl").stat().st_mode & 0o077 == 0


def test_a_torn_tail_is_cut_off_and_edited_or_removed_records_are_named(tmp_path):
    ledger = ledger_at(tmp_path / "ledger")
    run = get_recorded()
    for step in (1, 2, 3):
        ledger.add(ids_at_step(run, step)[:1])
    path = ledger.path / "ledger.jsonl"
    good = path.read_bytes()
    path.write_bytes(good + b'{"type":"request","seq":5')  # an append cut off by a crash: never acknowledged
    assert [r.id for r in ledger.requests()] == ["r-0001", "r-0002", "r-0003"]
    ledger.add(ids_at_step(run, 4)[:1])
    assert [r.id for r in ledger.requests()] == ["r-0001", "r-0002", "r-0003", "r-0004"]
    assert path.read_bytes().startswith(good) and path.read_bytes().endswith(b"\n")
    lines = path.read_text().splitlines()
    edited = lines[:2] + [lines[2].replace('"count":1', '"count":2')] + lines[3:]
    path.write_text("\n".join(edited) + "\n")
    with pytest.raises(UnlearnError, match=r"record 3 \(line 3\) fails its checksum"):
        ledger.requests()
    path.write_text("\n".join(lines[:2] + lines[3:]) + "\n")
    with pytest.raises(UnlearnError, match=r"record 3 \(line 3\) does not chain to record 2"):
        ledger.add(ids_at_step(run, 5)[:1])


ADD_MANY = """
import sys
from hf_unlearn.deletion import DeletionLedger
ledger = DeletionLedger(sys.argv[1], sys.argv[2])
for i in sys.argv[3:]:
    ledger.add([int(i)])
"""


@pytest.mark.slow
def test_concurrent_adds_from_parallel_processes_lose_nothing(tmp_path):
    run = get_recorded()
    ids = [i for s in range(8) for i in ids_at_step(run, s)][:12]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", ADD_MANY, str(run), str(tmp_path / "ledger"),
                               *map(str, ids[k::4])], env=env, stderr=subprocess.PIPE) for k in range(4)]
    errors = [p.communicate()[1].decode()[-500:] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    ledger = ledger_at(tmp_path / "ledger")
    requests = ledger.requests()
    assert [r.id for r in requests] == [f"r-{n:04d}" for n in range(1, 13)]  # numbered once each, chain intact
    assert sorted(i for ids_ in ledger.private_ids([r.id for r in requests]).values() for i in ids_) == sorted(ids)


def test_approximate_first_then_exact_supersedes_it(served, tmp_path):
    """The hot path: MASC on the served model, a provisional receipt; the exact batch later comes from the recorded
    run's replay chain (not from the approximate model) and supersedes it."""
    import shutil

    ledger, *_ = served
    work = ledger_at(tmp_path / "ledger")
    shutil.copytree(ledger.path, work.path, dirs_exist_ok=True)
    req = work.add(ids_at_step(get_recorded(), 4)[:2], received="2026-11-07")
    approx = work.serve_approximate(now="2026-11-07", max_steps=2, eval_rows=2, max_length=64, **QUIET)
    assert approx.name == "approx-0001" and approx.forget_receipt.method == "masc"
    assert approx.forget_receipt.source == str(work.path / "batches" / "batch-0002" / "model")  # the served model
    provisional = json.loads(approx.receipts[req.id].read_text())
    assert provisional["kind"] == "approximate" and provisional["provisional"] is True
    assert provisional["guarantee"].startswith("provisional: approximate (masc)") and "superseded" in \
        provisional["guarantee"]
    assert provisional["evaluation"]["after"]["forget"]["items"] == 2
    assert [r.state for r in work.requests() if r.id == req.id] == ["approximate"]
    assert work.served_model() == work.path / "provisional" / "approx-0001" / "model"
    assert work.serve_approximate(**QUIET) is None  # nothing new to serve approximately
    tok, _ = get_trace_data()
    exact = work.serve_exact(tokenizer=tok, now="2026-11-09", **QUIET)
    assert exact.forget_receipt.source == str(work.path / "batches" / "batch-0002" / "replay")
    final = json.loads(exact.receipts[req.id].read_text())
    assert final["supersedes"] == [provisional_path(work, approx, req)] and "supersedes the provisional" in \
        final["guarantee"]
    from hf_unlearn.deletion import verify_receipt

    assert verify_receipt(approx.receipts[req.id], public_key()).ok
    assert verify_receipt(exact.receipts[req.id], public_key(), model=work.served_model()).ok


def provisional_path(ledger, result, req) -> str:
    return os.path.relpath(result.receipts[req.id], ledger.path)


def test_serve_due_follows_the_policy_and_is_cron_safe(served, tmp_path, capsys):
    import shutil

    ledger, *_ = served
    work = ledger_at(tmp_path / "ledger")
    shutil.copytree(ledger.path, work.path, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("provisional"))
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"max_wait_days": 10, "max_replay_steps": 1}))
    code, out = cli(capsys, "requests", "serve", get_recorded(), "--ledger", work.path, "--due", "--policy", policy)
    assert code == 0 and "nothing due: no pending request" in out, out
    # a batch would replay 6 steps (> 1); the request repeats an id batch-0001 deleted already: only the new one goes
    repeated = ids_at_step(get_recorded(), 2)[:1]
    work.add(ids_at_step(get_recorded(), 3)[:1] + repeated, received="2026-11-10")
    out = work.serve_due(policy, now="2026-11-15", **QUIET)
    assert out["exact"] is None and out["message"].startswith("nothing due: 1 pending request(s)") and \
        "2026-11-20" in out["message"]
    tok, _ = get_trace_data()
    out = work.serve_due(policy, now="2026-11-21", tokenizer=tok, **QUIET)
    assert out["exact"].name == "batch-0003" and "waited 11.0 days" in out["reasons"][0]
    assert out["exact"].forget_receipt.evidence["redaction"]["rows_before"] - \
        out["exact"].forget_receipt.evidence["redaction"]["rows_after"] == 1
    # a request of only an id deleted already (the same person asking again): served, nothing replayed (the batch
    # failed "not in the store" and stayed started, so every later serve failed the same way)
    again = work.add(repeated, received="2026-11-22")
    batch = work.serve_exact(now="2026-11-23", tokenizer=tok, **QUIET)
    assert batch.forget_receipt.ok and batch.forget_receipt.evidence["redaction"]["rows_after"] == \
        out["exact"].forget_receipt.evidence["redaction"]["rows_after"]
    assert again.id in batch.receipts
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"max_wait": 3}))
    with pytest.raises(UnlearnError, match="unknown field.*max_wait.*max_wait_days"):
        work.serve_due(bad)


SERVE = """
import sys
from hf_unlearn.deletion import DeletionLedger
DeletionLedger(sys.argv[1], sys.argv[2]).serve_exact(tokenizer_path=sys.argv[3], progress=False)
"""


@pytest.mark.slow
def test_kill_9_during_a_batch_then_serve_again_completes_it_once(tmp_path):
    """A real process killed (SIGKILL) while its batch replays; a request added meanwhile waits for the next batch;
    the next serve redoes the interrupted batch with the same requests and records it once."""
    run = get_recorded()
    ledger = ledger_at(tmp_path / "ledger")
    ledger.add(ids_at_step(run, 0)[:2])  # step 0: a full replay, the longest there is
    ledger.add(ids_at_step(run, 3)[:1])
    tok, _ = get_trace_data()
    tok.save_pretrained(tmp_path / "tok")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", SERVE, str(run), str(ledger.path), str(tmp_path / "tok")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    replay = ledger.path / "batches" / "batch-0001" / "replay"
    deadline = time.time() + 300
    while not (replay / "checkpoints").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    late = ledger.add(ids_at_step(run, 5)[:1])  # added while the batch runs
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert ledger.unfinished_batch()["requests"] == ["r-0001", "r-0002"]
    assert ledger.status()["interrupted_batch"] == "batch-0001"
    result = ledger.serve_exact(tokenizer=tok, oracle=True, **QUIET)
    assert result.resumed and result.name == "batch-0001" and result.requests == ["r-0001", "r-0002"]
    assert result.forget_receipt.evidence["verified"] is True
    assert {r.id: r.state for r in ledger.requests()} == {"r-0001": "exact", "r-0002": "exact", late.id: "pending"}
    nxt = ledger.serve_exact(tokenizer=tok, **QUIET)
    assert nxt.name == "batch-0002" and nxt.requests == [late.id]
    kinds = [r["type"] for r in ledger.records()]
    assert kinds.count("batch_start") == 2 and kinds.count("batch_done") == 2
    assert ledger.serve_exact(**QUIET) is None


def test_repo_pushes_one_tag_per_batch_and_a_failed_push_keeps_the_deletion(tmp_path):
    from hf_unlearn.demo import local_hub

    run = get_recorded()
    tok, _ = get_trace_data()
    ledger = ledger_at(tmp_path / "ledger")
    ledger.add(ids_at_step(run, 6)[:1])
    ledger.add(ids_at_step(run, 7)[:1])
    with local_hub(tmp_path / "hub") as (server, token):
        hub = {"repo": "org/served", "endpoint": server.url, "token": token}
        first = ledger.serve_exact(tokenizer=tok, **hub, **QUIET)
        p = first.forget_receipt.published
        assert p["tag"] == "deletion-0001" and p["verify_ok"] and first.requests == ["r-0001", "r-0002"]
        assert json.loads(first.receipts["r-0002"].read_text())["published"]["tag"] == "deletion-0001"
        ledger.add(ids_at_step(run, 5)[:1])
        server.inject_fault("commit", times=10)
        with pytest.raises(UnlearnError, match="batch-0002 is done and recorded.*hf-unlearn hub push"):
            ledger.serve_exact(tokenizer=tok, **hub, **QUIET)
    assert [r.state for r in ledger.requests()] == ["exact"] * 3
    done = ledger.last("batch_done")
    assert done["batch"] == "batch-0002" and done["published"]["error"]
    assert (ledger.path / "batches" / "batch-0002" / "model" / "model.safetensors").is_file()


def test_a_ledger_path_that_is_a_file_is_named_in_one_line(tmp_path, capsys):
    """--ledger FILE used to fail deep inside with "[Errno 17] File exists"."""
    (tmp_path / "ledger.jsonl").write_text("")
    ids = tmp_path / "ids.jsonl"
    ids.write_text(f"{ids_at_step(get_recorded(), 3)[0]}\n")
    code, out = cli(capsys, "requests", "add", get_recorded(), "--ledger", tmp_path / "ledger.jsonl", "--ids", ids)
    assert code == 1 and "is a file: the ledger is a folder" in out and "File exists" not in out, out
