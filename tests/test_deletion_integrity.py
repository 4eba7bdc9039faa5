"""The deletion service under attack: an insider without the signing key who rewrites the ledger, a crash between a
record and its signed head, bad policy and request input, third-party checks of receipt bundles, signing-key
rotation, and erasure (`requests purge`) of the deleted rows everywhere the service keeps them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from hf_unlearn.errors import UnlearnError

from .conftest import ROOT
from .test_requests import QUIET, cli, ledger_at, public_key
from .test_trace_common import get_recorded, get_trace_data, ids_at_step


def rechain(path, edit) -> None:
    """What an insider without the key can do: edit the records (``edit(list) -> list``), then renumber them and
    recompute every ``sha256`` and ``prev`` so the hash chain is intact again (the signatures cannot be redone)."""
    from hf_unlearn.deletion.chain import GENESIS, record_hash

    records = edit([json.loads(line) for line in path.read_text().splitlines()])
    prev = GENESIS
    for n, r in enumerate(records, 1):
        r["seq"], r["prev"] = n, prev
        r["sha256"] = record_hash(r)
        prev = r["sha256"]
    path.write_text("".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in records))


def three_requests(tmp_path):
    ledger = ledger_at(tmp_path / "ledger")
    run = get_recorded()
    for step in (1, 2, 3):
        ledger.add(ids_at_step(run, step)[:1], ref=f"T-{step}", received="2026-11-01")
    return ledger


def every_command_refuses(capsys, ledger, match: str) -> None:
    """list, status, plan, serve and add all refuse, naming the problem; nothing is appended and the head is not
    re-signed."""
    head = (ledger.path / "head.json").read_bytes()
    records = (ledger.path / "ledger.jsonl").read_bytes()
    private = (ledger.path / "private" / "ids.jsonl").read_bytes()
    ids = ledger.path.parent / "ids.jsonl"
    ids.write_text(json.dumps(ids_at_step(get_recorded(), 4)[0]) + "\n")
    common = [get_recorded(), "--ledger", ledger.path]
    for args in (["list", *common], ["status", *common], ["plan", *common], ["serve", *common, "--exact"],
                 ["add", *common, "--ids", ids], ["purge", *common]):
        code, out = cli(capsys, "requests", *args)
        assert code == 1 and match in out and "nothing was done" in out, (args, out)
    assert (ledger.path / "head.json").read_bytes() == head
    assert (ledger.path / "ledger.jsonl").read_bytes() == records
    assert (ledger.path / "private" / "ids.jsonl").read_bytes() == private


def test_removing_a_request_and_rechaining_is_refused_by_every_command(tmp_path, capsys):
    ledger = three_requests(tmp_path)
    ack = ledger.path / "receipts" / "r-0001.ack.json"
    from hf_unlearn.deletion import verify_receipt

    assert verify_receipt(ack, public_key()).ok
    original = (ledger.path / "ledger.jsonl").read_bytes()
    # r-0002 (record 3) vanishes; records 3.. are renumbered and rehashed: the chain is intact, no signature fits
    rechain(ledger.path / "ledger.jsonl", lambda rs: rs[:2] + rs[3:])
    every_command_refuses(capsys, ledger, "record 3 (request) is not signed by the ledger's key")
    with pytest.raises(UnlearnError, match="record 3"):
        ledger.recover()
    report = verify_receipt(ack, public_key())  # an earlier receipt no longer verifies against the laundered ledger
    assert not report.ok and "record 3" in report.summary()
    # r-0002 edited (one id fewer), every signature and the opening's key stripped to pass as a v1 ledger (whose
    # records carry none): record 1 changes with it, and the signed head refuses the chain
    (ledger.path / "ledger.jsonl").write_bytes(original)
    rechain(ledger.path / "ledger.jsonl", lambda rs: [
        {k: v for k, v in r.items() if k not in ("signature", "public_key")} | ({"count": 0} if r["seq"] == 3 else {})
        for r in rs])
    every_command_refuses(capsys, ledger, "a record at or before")


def test_a_copied_or_truncated_record_and_a_reused_number_are_refused(tmp_path, capsys):
    ledger = three_requests(tmp_path)
    path = ledger.path / "ledger.jsonl"
    good = path.read_text()
    # a copy of r-0001's request record appended as a new record (number reused): unsigned tail, named
    rechain(path, lambda rs: rs + [json.loads(json.dumps(rs[1]))])
    every_command_refuses(capsys, ledger, "record 5 (request) is not signed")
    # the same, with the head moved along by an attacker who copies the old head's signature: refused too
    head = json.loads((ledger.path / "head.json").read_text())
    records = [json.loads(line) for line in path.read_text().splitlines()]
    forged = {**head, "seq": 5, "sha256": records[-1]["sha256"]}
    (ledger.path / "head.json").write_text(json.dumps(forged))
    with pytest.raises(UnlearnError, match="record 5 \\(request\\) is not signed"):
        ledger.requests()
    (ledger.path / "head.json").write_text(json.dumps(head))
    # the last record removed (no rechaining needed): the signed head names it
    path.write_text("".join(line + "\n" for line in good.splitlines()[:-1]))
    every_command_refuses(capsys, ledger, "records 4..4 were removed")
    # a genuine, signed request record appended twice (a replay of the same line): its seq/prev no longer fit
    path.write_text(good + good.splitlines()[-1] + "\n")
    with pytest.raises(UnlearnError, match="record 5 .*does not chain"):
        ledger.requests()
    # the fold refuses a number used twice even if every hash and signature were right
    from hf_unlearn.deletion.ledger import fold

    records = [json.loads(line) for line in good.splitlines()]
    dup = {**records[2], "request": records[1]["request"]}
    with pytest.raises(UnlearnError, match="adds request r-0001 a second time"):
        fold([*records[:2], dup])
    path.write_text(good)
    assert [r.id for r in ledger.requests()] == ["r-0001", "r-0002", "r-0003"]


DIE_AT = """
import os, sys
from hf_unlearn.deletion import DeletionLedger, journal as mod, service
run, folder, what, point, arg = sys.argv[1:6]
real = os.replace
def replace(src, dst, *a, **k):  # killed after the record of that kind, before its head (the ledger is read only
    # then: a file this script read while a replay runs would be a read the recorded program never made)
    if str(dst).endswith("head.json") and point.startswith("head:") and f'"type":"{point[5:]}"' in open(
            os.path.join(folder, "ledger.jsonl")).read().splitlines()[-1]:
        os._exit(137)
    return real(src, dst, *a, **k)
mod.os.replace = replace
def die(*a, **k):
    os._exit(137)
if point == "receipts":  # the replay is done, no receipt written yet
    service.write_receipt = die
if point == "bundles":  # batch_done and its head are written, the bundles not
    service.write_bundle = die
ledger = DeletionLedger(run, folder)
if what == "add":
    ledger.add([int(arg)], received="2026-11-02")
else:
    ledger.serve_exact(tokenizer_path=arg, progress=False)
"""


def _die_at(ledger, what: str, point: str, arg) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", DIE_AT, str(get_recorded()), str(ledger.path), what, point,
                           str(arg)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 137, proc.stderr[-2000:]


@pytest.mark.slow  # crashes simulated in child processes (~12 s)
def test_a_crash_between_a_record_and_its_head_is_visible_and_recovered_only_when_it_is_ours(tmp_path, capsys):
    ledger = three_requests(tmp_path)
    run = get_recorded()
    _die_at(ledger, "add", "head:request", ids_at_step(run, 5)[0])
    common = [get_recorded(), "--ledger", ledger.path]
    code, out = cli(capsys, "requests", "status", *common)
    assert code == 1 and "record(s) 5..5 are not covered by the signed head" in out and "requests recover" in out
    code, out = cli(capsys, "requests", "serve", *common, "--exact")
    assert code == 1 and "not covered by the signed head" in out
    code, out = cli(capsys, "requests", "recover", *common)
    assert code == 0 and "re-signed the head over record(s) 5..5 (request)" in out, out
    assert [r.id for r in ledger.requests()] == ["r-0001", "r-0002", "r-0003", "r-0004"]
    assert cli(capsys, "requests", "recover", *common)[1].startswith("nothing to recover")
    # a whole new ledger an attacker wrote and signed with their own key, without a head (as if the first append
    # crashed): recover does not re-sign it with ours
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from hf_unlearn.deletion import DeletionLedger

    fake = DeletionLedger(get_recorded(), tmp_path / "fake", signing_key=Ed25519PrivateKey.generate())
    fake.add(ids_at_step(run, 1)[:1])
    (fake.path / "head.json").unlink()
    with pytest.raises(UnlearnError, match="not this machine's"):
        ledger_at(fake.path).recover()
    assert not (fake.path / "head.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("point", ["head:batch_start", "receipts", "head:batch_done", "bundles"])
def test_kill_9_at_every_write_of_a_batch_then_recover_and_serve_completes_it_once(tmp_path, capsys, point):
    from hf_unlearn.deletion import verify_receipt
    from hf_unlearn.deletion.receipts import write_bundle

    ledger = ledger_at(tmp_path / "ledger")
    ledger.add(ids_at_step(get_recorded(), 6)[:1])
    tok, _ = get_trace_data()
    tok.save_pretrained(tmp_path / "tok")
    _die_at(ledger, "serve", point, tmp_path / "tok")
    receipt = ledger.path / "receipts" / "r-0001.exact.json"
    common = [get_recorded(), "--ledger", ledger.path]
    code, out = cli(capsys, "requests", "status", *common)
    interrupted = out.split("interrupted_batch", 1)[-1].splitlines()[0].strip() if "interrupted_batch" in out else ""
    if point == "bundles":  # batch_done and its head are in: consistent; recover (or the next serve) writes them
        assert code == 0 and interrupted == "None", out
        assert not receipt.with_name("r-0001.exact.bundle.json").exists()
        assert cli(capsys, "requests", "recover", *common)[0] == 0
        assert verify_receipt(receipt.with_name("r-0001.exact.bundle.json"), public_key()).ok
    elif point == "receipts":  # started, not done: status says so and exits 1
        assert code == 1 and interrupted == "batch-0001", out
    if point.startswith("head:"):  # a tail: every command refuses, naming it, until recover
        assert code == 1
        assert "not covered by the signed head" in out
        if point == "head:batch_done":
            assert not verify_receipt(receipt, public_key()).ok  # its serving record is not under the head yet
            # a tail whose receipt was altered is not what serve writes: refused
            original = receipt.read_text()
            body = json.loads(original)
            body["request"]["count"] += 1
            receipt.write_text(json.dumps(body))
            with pytest.raises(UnlearnError, match="lists a receipt for r-0001 that is missing or differs"):
                ledger.recover()
            receipt.write_text(original)
        assert cli(capsys, "requests", "recover", *common)[0] == 0
    result = ledger.serve_exact(tokenizer=tok, **QUIET)
    assert (result is None) == (point in ("head:batch_done", "bundles"))
    kinds = [r["type"] for r in ledger.records()]
    assert kinds.count("batch_start") == 1 and kinds.count("batch_done") == 1  # served once
    assert [r.state for r in ledger.requests()] == ["exact"]
    assert verify_receipt(receipt, public_key(), model=ledger.served_model()).ok
    assert verify_receipt(write_bundle(ledger, receipt, tmp_path / "b.json"), public_key()).ok


def test_appends_are_all_or_nothing(tmp_path, monkeypatch):
    from hf_unlearn.deletion import journal as mod

    ledger = three_requests(tmp_path)
    files = {n: (ledger.path / n).read_bytes() for n in ("ledger.jsonl", "head.json", "private/ids.jsonl")}
    real = mod._append_bytes

    def failing(path, data, mode, private=False):
        if path.name == "ledger.jsonl":
            raise OSError(28, "No space left on device")
        return real(path, data, mode, private)

    monkeypatch.setattr(mod, "_append_bytes", failing)
    with pytest.raises(UnlearnError, match="No space left on device; nothing was recorded"):
        ledger.add(ids_at_step(get_recorded(), 4)[:1])
    monkeypatch.undo()
    # an unwritable ledger folder (root ignores modes, so the temporary head's creation fails as it would)
    import tempfile

    def no_temp(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", no_temp)
    with pytest.raises(UnlearnError, match="Permission denied"):
        ledger.add(ids_at_step(get_recorded(), 4)[:1])
    monkeypatch.undo()
    assert {n: (ledger.path / n).read_bytes() for n in files} == files  # no record, no orphan private line
    assert ledger.add(ids_at_step(get_recorded(), 4)[:1]).id == "r-0004"  # and the number was not burnt


@pytest.mark.parametrize("policy, match", [
    ({"approximate_first": "no"}, "approximate_first must be true or false, got 'no'"),
    ({"oracle": 1}, "oracle must be true or false, got 1"),
    ({"max_replay_steps": True}, "max_replay_steps must be an integer >= 0"),
    ({"max_replay_steps": 2.5}, "max_replay_steps must be an integer >= 0"),
    ({"max_wait_days": "3"}, "max_wait_days must be a number >= 0"),
    ({"max_wait_days": float("nan")}, "max_wait_days must be a number >= 0"),
    ({"approximate_method": "nope"}, "unknown unlearning method 'nope'"),
    ([1, 2], "must be a JSON object"),
    ({"purge_after_batch": "yes"}, "purge_after_batch must be true or false"),
])
def test_policy_fields_are_type_checked_when_loaded(tmp_path, policy, match):
    from hf_unlearn.deletion import Policy

    path = tmp_path / "policy.json"
    path.write_text(json.dumps(policy))
    with pytest.raises(UnlearnError, match=match) as e:
        Policy.load(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_bad_request_input_is_one_line_and_records_nothing(tmp_path, capsys):
    ledger = three_requests(tmp_path)
    before = (ledger.path / "ledger.jsonl").read_bytes()
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps(ids_at_step(get_recorded(), 4)[0]) + "\n")
    common = [get_recorded(), "--ledger", ledger.path, "--ids", ids]
    for extra, match in ((["--deadline-days", "1e9"], "--deadline-days must be a number of days > 0 and <= 3650"),
                         (["--deadline-days", "inf"], "--deadline-days must be"),
                         (["--deadline-days", "nan"], "--deadline-days must be"),
                         (["--received", "2031-01-01"], "is in the future")):
        code, out = cli(capsys, "requests", "add", *common, *extra)
        assert code == 1 and match in out and len(out.strip().splitlines()) == 1, out
    assert (ledger.path / "ledger.jsonl").read_bytes() == before


def test_a_bundle_is_checked_alone_and_names_the_request_and_its_kind(tmp_path, capsys):
    """A third party with the bundle and the public key only (no ledger, no run), and the ways to fool it."""
    ledger = three_requests(tmp_path)
    key = tmp_path / "issuer.pub"
    assert cli(capsys, "requests", "public-key", "--out", key)[0] == 0
    alone = tmp_path / "auditor"
    alone.mkdir()
    written = json.loads((ledger.path / "receipts" / "r-0002.ack.bundle.json").read_text())  # by `add` itself
    assert [r["seq"] for r in written["records"]] == [3] and written["head"]["seq"] == 3
    bundle = alone / "r-0002.json"  # a fresh one, under today's head
    code, out = cli(capsys, "requests", "bundle", get_recorded(), "--ledger", ledger.path,
                    ledger.path / "receipts" / "r-0002.ack.json", "--out", bundle)
    assert code == 0 and str(bundle) in out
    code, out = cli(capsys, "requests", "verify", bundle, "--public-key", key)
    assert code == 0 and "verify OK: r-0002: acknowledgement, not yet served exactly" in out, out
    data = json.loads(open(bundle).read())
    assert [r["seq"] for r in data["records"]] == [3, 4] and data["head"]["seq"] == 4

    def fooled(edit) -> str:
        forged = json.loads(json.dumps(data))
        edit(forged)
        path = alone / "forged.json"
        path.write_text(json.dumps(forged))
        code, out = cli(capsys, "requests", "verify", path, "--public-key", key)
        assert code == 1 and "verify FAILED" in out, out
        return out

    def edit_record(b):
        b["records"][0]["count"] = 2

    assert "record 3 fails its checksum" in fooled(edit_record)

    def drop_middle(b):
        b["records"] = b["records"][1:]

    assert "is not in this ledger" in fooled(drop_middle)

    def stale_head(b):
        b["head"]["seq"] = 3

    assert "not signed" in fooled(stale_head)

    def rechained(b):  # an edited record with its hash recomputed, and the next record's prev too: unsigned
        from hf_unlearn.deletion.chain import record_hash

        b["records"][0]["received"] = "2026-11-20T00:00:00Z"
        b["records"][0]["sha256"] = record_hash(b["records"][0])
        b["records"][1]["prev"] = b["records"][0]["sha256"]
        b["records"][1]["sha256"] = record_hash(b["records"][1])

    assert "not signed by the ledger's key" in fooled(rechained)
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from hf_unlearn.deletion.chain import head_body, sign_head

    def resigned(b):  # a whole bundle re-signed by another key: not the issuer's
        other = Ed25519PrivateKey.generate()
        b["head"] = sign_head(head_body(b["head"]["ledger"], b["records"][-1]), other)

    assert "not signed" in fooled(resigned)


@pytest.mark.slow
def test_provisional_receipts_say_so_and_are_superseded(tmp_path, capsys):
    from hf_unlearn.deletion import verify_receipt
    from hf_unlearn.deletion.receipts import write_bundle

    ledger = ledger_at(tmp_path / "ledger")
    tok, _ = get_trace_data()
    ledger.add(ids_at_step(get_recorded(), 6)[:1], received="2026-11-01")
    ledger.serve_exact(tokenizer=tok, **QUIET)
    req = ledger.add(ids_at_step(get_recorded(), 7)[:1], received="2026-11-02")
    approx = ledger.serve_approximate(max_steps=1, eval_rows=1, max_length=64, **QUIET)
    provisional = approx.receipts[req.id]
    report = verify_receipt(provisional.with_name(provisional.name.replace(".json", ".bundle.json")), public_key())
    assert report.ok and "r-0002: provisional (approximate, masc), not yet superseded" in report.summary()
    assert "not that the rows are gone" in report.summary()
    # with its own model: says what that proves, never "excludes the request's rows" (round 2 said both)
    report = verify_receipt(provisional, public_key(), model=ledger.path / "provisional" / approx.name / "model")
    assert report.ok and "the model is the provisional model this receipt names" in report.summary()
    assert "excludes" not in report.summary(), report.summary()
    # no raw id outside private/: the card facts of every served model moved to private/card_info (0600)
    assert not list(ledger.path.glob("*/*/model/unlearning_info.json"))
    info = ledger.path / "private" / "card_info" / f"{approx.name}.json"
    assert info.stat().st_mode & 0o077 == 0 and (ledger.path / "private" / "card_info" / "batch-0001.json").is_file()
    exact = ledger.serve_exact(tokenizer=tok, **QUIET)
    later = write_bundle(ledger, provisional, tmp_path / "later.json")
    report = verify_receipt(later, public_key(), model=ledger.served_model())
    assert report.ok and f"superseded by exact {exact.name}" in report.summary(), report.summary()
    assert f"excludes the request's rows via {exact.name}" in report.summary()
    # the approximate model does not pass for the first request's exact receipt
    report = verify_receipt(ledger.path / "receipts" / "r-0001.exact.json", public_key(),
                            model=ledger.path / "provisional" / approx.name / "model")
    assert not report.ok


def test_signing_key_rotation_keeps_old_signatures_verifiable(tmp_path, monkeypatch, capsys):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from hf_unlearn.deletion import DeletionLedger, verify_receipt
    from hf_unlearn.deletion.chain import record_hash, sign_record
    from hf_unlearn.keys import load_signing_key, rotate_signing_key

    monkeypatch.setenv("HF_UNLEARN_SIGNING_KEY_FILE", str(tmp_path / "keys" / "signing_ed25519.pem"))
    old = load_signing_key()
    ledger = DeletionLedger(get_recorded(), tmp_path / "ledger")
    ledger.add(ids_at_step(get_recorded(), 1)[:1])
    ack = ledger.path / "receipts" / "r-0001.ack.json"
    rotate_signing_key()
    new = load_signing_key()
    ledger = DeletionLedger(get_recorded(), tmp_path / "ledger")
    ledger.add(ids_at_step(get_recorded(), 2)[:1])
    kinds = [json.loads(line)["type"] for line in (ledger.path / "ledger.jsonl").read_text().splitlines()]
    assert kinds == ["open", "request", "key", "request"]
    for key in (old.public_key(), new.public_key()):
        assert verify_receipt(ack, key).ok  # signed by the old key, checkable with either
    bundles = [ledger.path / "receipts" / f"r-000{n}.ack.bundle.json" for n in (1, 2)]
    assert verify_receipt(bundles[1], new.public_key()).ok  # a bundle made after the rotation: the new key
    assert verify_receipt(bundles[0], old.public_key()).ok  # ... one made before it: the old key
    # ... which, checked with the new key, names the key that signed it (round 2: a bare "signature FAIL")
    from hf_unlearn.keys import public_key_fingerprint

    report = verify_receipt(bundles[0], new.public_key())
    assert not report.ok and f"signed by key {public_key_fingerprint(old.public_key())}, not by the given key" in \
        report.summary(), report.summary()
    from hf_unlearn.deletion.receipts import write_bundle

    fresh = write_bundle(ledger, ack, tmp_path / "fresh.json")  # a fresh bundle carries the key hand-over
    assert verify_receipt(fresh, new.public_key()).ok and verify_receipt(fresh, old.public_key()).ok
    # a key record an attacker appends, handing the ledger to their own key: not signed by the ledger's key
    path = ledger.path / "ledger.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    attacker = Ed25519PrivateKey.generate()
    from hf_unlearn.keys import public_key_hex

    forged = {"type": "key", "public_key": public_key_hex(attacker.public_key()), "seq": 5,
              "prev": records[-1]["sha256"], "time": records[-1]["time"]}
    forged["sha256"] = record_hash(forged)
    forged["signature"] = sign_record(forged, attacker)
    path.write_text(path.read_text() + json.dumps(forged) + "\n")
    with pytest.raises(UnlearnError, match="record 5 \\(key\\) is not signed by the ledger's key"):
        ledger.requests()


def _stores(*folders) -> dict:
    """Every token store (a save_to_disk folder) under the folders, with the ids it holds."""
    import datasets

    out = {}
    for folder in folders:
        for info in folder.rglob("dataset_info.json"):
            rows = datasets.load_from_disk(str(info.parent))
            column = "id" if "id" in rows.column_names else rows.column_names[0]
            out[info.parent] = set(rows[column])
    return out


@pytest.mark.slow
def test_purge_erases_the_served_rows_everywhere_the_service_keeps_them(tmp_path, capsys):
    from hf_unlearn.deletion import DeletionLedger, verify_receipt
    from hf_unlearn.trace.run import list_checkpoints

    run = tmp_path / "run"
    shutil.copytree(get_recorded(), run)  # purge retires the recorded run: never the shared one
    ledger = DeletionLedger(run, tmp_path / "ledger")
    tok, _ = get_trace_data()
    gone = [ids_at_step(run, 5)[0], ids_at_step(run, 3)[0]]
    later = ids_at_step(run, 6)[:1]  # (read now: the retired run cannot be opened after the purge)
    ledger.add(gone[:1], received="2026-11-01")
    ledger.serve_exact(tokenizer=tok, **QUIET)
    ledger.add(gone[1:], received="2026-11-02")
    ledger.serve_exact(tokenizer=tok, **QUIET)
    with pytest.raises(UnlearnError, match="nothing to purge"):
        from hf_unlearn.deletion.erasure import purge

        purge(ledger_at(tmp_path / "empty"))
    assert any(gone[0] in ids for ids in _stores(ledger.path, run).values())  # before: the rows are still kept
    stash = tmp_path / "stash"
    shutil.copytree(ledger.path / "batches" / "batch-0001" / "store", stash)
    code, out = cli(capsys, "requests", "purge", run, "--ledger", ledger.path, "--dry-run")
    assert code == 0 and "dry run" in out and (ledger.path / "batches" / "batch-0001" / "replay").is_dir()
    code, out = cli(capsys, "requests", "purge", run, "--ledger", ledger.path)
    assert code == 0, out
    stores = _stores(ledger.path, run)
    assert stores and not any(set(gone) & ids for ids in stores.values()), stores  # no store holds a deleted row
    assert list(stores) == [ledger.path / "batches" / "batch-0002" / "replay" / "private" / "store"]
    # the recorded run is retired: no store, no checkpoint a deleted row reached; provenance and key stay
    limit = json.loads((ledger.path / "receipts" / "batch-0002.json").read_text())["cost"]["start_checkpoint"]
    assert not (run / "private" / "store").exists() and max(list_checkpoints(run)) <= limit
    assert json.loads((run / "retired.json").read_text())["current_exact_run"].endswith("batch-0002/replay")
    assert sorted(p.name for p in (ledger.path / "batches" / "batch-0001").iterdir()) == ["receipt.json"]
    assert [p.parent.name for p in ledger.path.rglob("model.safetensors") if p.parent.name == "model"] == ["model"]
    # a signed purge record lists every removed path (relative: no local path leaks) and what it cannot erase
    record = ledger.last("purge")
    removed = {r["path"] for r in record["removed"]}
    assert {"../run/private/store", "batches/batch-0001/replay", "batches/batch-0001/model",
            "batches/batch-0002/store"} <= removed
    assert "NOT ERASED (outside the service): the recorded run's training output folder" in out
    assert not any(os.path.isabs(p) for p in removed)
    # the old receipt checks against the current model (which also excludes its rows); its own model is gone
    report = verify_receipt(ledger.path / "receipts" / "r-0001.exact.json", public_key(), model=ledger.served_model())
    assert report.ok and "via batch-0001 -> batch-0002" in report.summary(), report.summary()
    # what later deletions need is kept: a third request is served (with the oracle) after the purge
    ledger.add(later, received="2026-11-03")
    from hf_unlearn.deletion import Policy

    due = ledger.serve_due(Policy(max_wait_days=0, oracle=True, purge_after_batch=True), tokenizer=tok, **QUIET)
    assert due["exact"].forget_receipt.evidence["verified"] is True and "; purged " in due["message"]
    assert {"batches/batch-0002/replay", "batches/batch-0002/model"} <= {r["path"] for r in due["purge"].removed}
    # a copy left behind (a purge that crashed midway, or an insider's re-planted store) is found again and removed
    shutil.copytree(stash, ledger.path / "batches" / "batch-0001" / "store")
    result = purge(ledger, log=lambda m: None)
    assert [r["path"] for r in result.removed] == ["batches/batch-0001/store"]
    assert not any(set(gone) & ids for ids in _stores(ledger.path, run).values())
    assert purge(ledger, log=lambda m: None).record is None  # nothing left: nothing recorded
    assert [r["type"] for r in ledger.records()].count("purge") == 3


def test_forget_repo_never_takes_a_deleted_row_back(tmp_path):
    """`forget RUN --repo` twice from the original recorded run would publish deletion-0002 without the first
    deletion's rows: refused before compute, naming deletion-0001; starting from the first output is accepted."""
    from huggingface_hub import hf_hub_download

    from hf_unlearn.deletion import forget
    from hf_unlearn.demo import local_hub
    from hf_unlearn.hub.verify import expected_from

    run = get_recorded()
    tok, _ = get_trace_data()
    first_ids, second_ids = ids_at_step(run, 7)[:2], ids_at_step(run, 6)[:1]
    with local_hub(tmp_path / "hub") as (server, token):
        hub = {"repo": "org/tiny", "endpoint": server.url, "token": token, "tokenizer": tok, "progress": False,
               "log": lambda m: None}
        forget(run, first_ids, tmp_path / "first", **hub)
        with pytest.raises(UnlearnError, match="deletion-0001 already published a deletion of 2 id.*start from its "
                                               "output.*nothing was done"):
            forget(run, second_ids, tmp_path / "again", **hub)
        assert not (tmp_path / "again").exists()  # refused before any compute
        named = tmp_path / f"forget-{second_ids[0]}"
        with pytest.raises(UnlearnError, match="named after the ids it deletes") as e:
            forget(tmp_path / "first" / "replay", second_ids, named, **hub)
        assert "--not-id" not in str(e.value) and not named.exists()
        second = forget(tmp_path / "first" / "replay", second_ids, tmp_path / "second", **hub)
        assert second.published["tag"] == "deletion-0002" and second.published["verify_ok"]
        card = hf_hub_download("org/tiny", "README.md", revision="deletion-0002", endpoint=server.url, token=token,
                               cache_dir=tmp_path / "cache")
        assert str(tmp_path) not in open(card).read()  # no local path in anything published
        assert expected_from(tmp_path / "second", "org/tiny", "deletion-0002")["expect_commit"] == \
            second.published["commit"]  # --expect-from OUT: the forget output folder itself
