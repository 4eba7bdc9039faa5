"""The deletion service, round 3: each attack of an insider without the key (or a careless operator) is first
reproduced on a served ledger, then refused, naming what, with no file changed, or answered correctly: purge decides
only from signed records and what is on disk, a rollback to a bundle's own head is noticed from the service's
evidence, kill points (real processes) are finished once, every bad input is one line."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_unlearn.errors import UnlearnError

from .conftest import ROOT
from .test_requests import QUIET, cli, public_key
from .test_trace_common import get_recorded, get_trace_data, ids_at_step


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A copy of the recorded run and a ledger beside it: r-0001 (a row of step 5) served as batch-0001, r-0002 (a
    row of step 3) as batch-0002, deleting from batch-0001's replay (so the recorded run is clean up to step 2)."""
    from hf_unlearn.deletion import DeletionLedger

    root = tmp_path_factory.mktemp("round3")
    run = root / "run"
    shutil.copytree(get_recorded(), run)
    ledger = DeletionLedger(run, root / "ledger")
    tok, _ = get_trace_data()
    ledger.add(ids_at_step(run, 5)[:1], received="2026-11-01")
    ledger.serve_exact(tokenizer=tok, now="2026-11-02", **QUIET)
    ledger.add(ids_at_step(run, 3)[:1], received="2026-11-03")
    ledger.serve_exact(tokenizer=tok, now="2026-11-04", **QUIET)
    return root


@pytest.fixture
def world(base, tmp_path):
    """A fresh copy of ``base`` (run and ledger) for one test; returns (ledger, run)."""
    from hf_unlearn.deletion import DeletionLedger

    shutil.copytree(base, tmp_path / "w", symlinks=True)
    return DeletionLedger(tmp_path / "w" / "run", tmp_path / "w" / "ledger"), tmp_path / "w" / "run"


def snapshot(*folders) -> dict:
    """Every file under the folders with its hash (what "no file changed" is checked against)."""
    out = {}
    for folder in folders:
        for p in sorted(Path(folder).rglob("*")):
            if p.is_file() and p.name not in (".lock", ".serve.lock"):
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def steps(run) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))


# -- 1. purge decides from signed facts and from everything on disk ------------------------------------------------
def test_an_edited_batch_receipt_no_longer_moves_the_checkpoint_limit(world, capsys):
    """Round 2: purge read ``cost.start_checkpoint`` from receipts/batch-NNNN.json unchecked; set to 20 it kept the
    checkpoints trained on the deleted rows and said no deleted row reached them. Now the receipt must be the one its
    signed batch_done record binds: refused, naming it, nothing removed."""
    ledger, run = world
    for name in ("batch-0001", "batch-0002"):
        path = ledger.path / "receipts" / f"{name}.json"
        body = json.loads(path.read_text())
        body["cost"]["start_checkpoint"] = 20
        path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    before = snapshot(ledger.path, run)
    code, out = cli(capsys, "requests", "purge", run, "--ledger", ledger.path)
    assert code == 1 and "receipts/batch-0001.json" in out and "is not the batch receipt record" in out, out
    assert len(out.strip().splitlines()) == 1 and snapshot(ledger.path, run) == before


def test_purge_sees_unindexed_incomplete_and_oddly_named_checkpoints(world, capsys):
    """A checkpoint whose index entry is gone, one without hashes.json, an operator's step-00000005.bak copy, a
    store copied elsewhere in the run and a note: the first four are erased (no crash on the odd name), the note is
    named; the signed purge record lists both."""
    ledger, run = world
    index = run / "checkpoints" / "index.json"
    data = json.loads(index.read_text())
    data["checkpoints"].pop("6")
    from hf_unlearn.trace.checkpoints import _mac
    from hf_unlearn.trace.tags import run_key

    data["mac"] = _mac(run_key(run), data)  # re-MAC'd (as a thinning would): the entry is simply gone
    index.write_text(json.dumps(data))
    (run / "checkpoints" / "step-00000008" / "hashes.json").unlink()
    shutil.copytree(run / "checkpoints" / "step-00000004", run / "checkpoints" / "step-00000005.bak")
    shutil.copytree(run / "private" / "store", run / "store-copy")
    shutil.copytree(ledger.path / "batches" / "batch-0001" / "store", ledger.path / "batches" / "old-store")
    (run / "NOTES.txt").write_text("operator notes\n")
    code, out = cli(capsys, "requests", "purge", run, "--ledger", ledger.path)
    assert code == 0, out
    assert steps(run) == ["step-00000000", "step-00000002"]  # limit: batch-0002 replayed from step 2
    assert not (run / "store-copy").exists() and not (run / "private" / "store").exists()
    assert not (ledger.path / "batches" / "old-store").exists()
    record = ledger.last("purge")
    removed = {r["path"] for r in record["removed"]}
    assert {"../run/checkpoints/step-00000005.bak", "../run/checkpoints/step-00000006",
            "../run/checkpoints/step-00000008", "../run/store-copy", "batches/old-store"} <= removed
    assert record["unclassified"] == ["../run/NOTES.txt"] and "NOT CLASSIFIED (kept, check it): ../run/NOTES.txt" \
        in out
    assert (run / "NOTES.txt").exists()


PURGE_DIES = """
import os, shutil, sys
from hf_unlearn.deletion import DeletionLedger
from hf_unlearn.deletion import erasure
run, folder = sys.argv[1:3]
count = [0]
real = erasure._remove
def remove(path):
    real(path)
    count[0] += 1
    if count[0] == 2:  # killed after two removals
        os._exit(137)
erasure._remove = remove
erasure.purge(DeletionLedger(run, folder), log=lambda m: None)
"""


def test_a_purge_killed_midway_is_finished_and_recorded_by_the_next(world):
    ledger, run = world
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", PURGE_DIES, str(run), str(ledger.path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 137, proc.stderr[-2000:]
    start = ledger.last("purge_start")
    assert start is not None and ledger.last("purge") is None
    planned = {e["path"] for e in start["planned"]}
    gone = {p for p in planned if not (ledger.path / p).exists()}
    assert len(gone) == 2
    assert ledger.status()["interrupted_purge"] == start["seq"]
    from hf_unlearn.deletion.erasure import purge

    result = purge(ledger, log=lambda m: None)
    record = ledger.last("purge")
    assert record["resumes"] == start["seq"] and {r["path"] for r in record["removed"]} == planned
    assert gone <= {r["path"] for r in result.removed}
    assert not any((ledger.path / p).exists() for p in planned)
    assert ledger.status()["interrupted_purge"] is None


# -- 2. a rollback is refused from the service's own evidence -------------------------------------------------------
def rollback_to(ledger, bundle: str) -> dict:
    """What an insider without a backup does: truncate ledger.jsonl to the head an older bundle holds, copy it."""
    head = json.loads((ledger.path / "receipts" / bundle).read_text())["head"]
    lines = (ledger.path / "ledger.jsonl").read_text().splitlines()
    (ledger.path / "ledger.jsonl").write_text("\n".join(lines[: head["seq"]]) + "\n")
    (ledger.path / "head.json").write_text(json.dumps(head, indent=1) + "\n")
    return head


def test_a_rollback_to_an_older_bundles_head_is_refused_by_every_command(world, capsys):
    ledger, run = world
    newest = json.loads((ledger.path / "receipts" / "r-0002.exact.bundle.json").read_text())["head"]["seq"]
    head = rollback_to(ledger, "r-0001.ack.bundle.json")
    from hf_unlearn.deletion.chain import check_chain
    from hf_unlearn.deletion.ledger import read_head, read_records

    assert check_chain(read_records(ledger.path)[0], read_head(ledger.path), public_key()).ok  # a valid ledger
    before = snapshot(ledger.path, run)
    ids = ledger.path.parent / "ids.jsonl"
    ids.write_text(json.dumps(ids_at_step(run, 6)[0]) + "\n")
    common = [run, "--ledger", ledger.path]
    for args in (["list", *common], ["status", *common], ["plan", *common], ["serve", *common, "--exact"],
                 ["add", *common, "--ids", ids], ["purge", *common], ["recover", *common],
                 ["bundle", *common, ledger.path / "receipts" / "r-0001.ack.json", "--out", ledger.path.parent / "b"]):
        code, out = cli(capsys, "requests", *args)
        assert code == 1 and "older than the service's own evidence" in out and \
            f"the newest head found: record {newest}" in out and f"covers record {head['seq']}" in out, (args, out)
        assert len(out.strip().splitlines()) == 1
    assert snapshot(ledger.path, run) == before  # no request number reused, no receipt or batch folder overwritten


def test_the_auditor_holding_a_bundle_notices_the_rollback_with_ledger(world, capsys, tmp_path):
    """`verify BUNDLE --ledger DIR` checks the operator's current ledger still holds the bundle's records under a
    head at least as new (round 2 ignored --ledger). The insider who also deletes every newer receipt, bundle and
    batch folder leaves the service no evidence; the auditor's bundle still catches it."""
    ledger, run = world
    key = tmp_path / "issuer.pub"
    assert cli(capsys, "requests", "public-key", "--out", key)[0] == 0
    held = tmp_path / "r-0002.bundle.json"
    shutil.copy(ledger.path / "receipts" / "r-0002.exact.bundle.json", held)
    code, out = cli(capsys, "requests", "verify", held, "--public-key", key, "--ledger", ledger.path)
    assert code == 0 and "ledger now" in out and "unchanged under its signed head" in out, out
    rollback_to(ledger, "batch-0001.bundle.json")
    for p in (ledger.path / "receipts").glob("*0002*"):
        p.unlink()
    shutil.rmtree(ledger.path / "batches" / "batch-0002")
    assert ledger.requests()  # the service itself has nothing left to notice it by
    code, out = cli(capsys, "requests", "verify", held, "--public-key", key, "--ledger", ledger.path)
    assert code == 1 and "older than the bundle's head" in out and "rolled back" in out, out
    code, out = cli(capsys, "requests", "verify", held, "--public-key", key)  # the bundle alone still verifies
    assert code == 0, out


def test_a_batch_folder_without_its_record_is_never_reused(world, capsys):
    ledger, run = world
    rollback_to(ledger, "batch-0001.bundle.json")
    for p in (ledger.path / "receipts").glob("*0002*"):
        p.unlink()
    code, out = cli(capsys, "requests", "status", run, "--ledger", ledger.path)
    assert code == 1 and "batches/batch-0002 exists but no record starts batch-0002" in out, out


# -- 3. kill points of `serve --exact --repo`: no tag, or exactly one the ledger names ------------------------------
SERVE_DIES = """
import os, sys
from hf_unlearn.deletion import DeletionLedger, forgetting, publishing, service
run, folder, tok, url, token, point = sys.argv[1:7]
def die(*a, **k):
    os._exit(137)
if point == "before-push":
    publishing._push_and_verify = die
elif point == "after-push":  # pushed and tagged, killed before the forget receipt is written
    forgetting._write_receipt = die
elif point == "before-batch-done":  # the forget receipt says published; batch_done not written
    service._record_batch = die
DeletionLedger(run, folder).serve_exact(tokenizer_path=tok, repo="org/served", endpoint=url, token=token,
                                        progress=False, log=lambda m: None)
"""


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before-push", "after-push", "before-batch-done"])
def test_serve_repo_killed_at_each_point_publishes_the_batch_once(tmp_path, point):
    """Round 2: killed after the push and before batch_done, the redo published the batch again (deletion-0002 and
    -0003, the first in no record). Now the redo adopts the tag whose weights are this batch's."""
    from huggingface_hub import HfApi

    from hf_unlearn.deletion import DeletionLedger
    from hf_unlearn.demo import local_hub

    run = get_recorded()
    ledger = DeletionLedger(run, tmp_path / "ledger")
    ledger.add(ids_at_step(run, 7)[:1])
    tok, _ = get_trace_data()
    tok.save_pretrained(tmp_path / "tok")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}
    with local_hub(tmp_path / "hub") as (server, token):
        proc = subprocess.run([sys.executable, "-c", SERVE_DIES, str(run), str(ledger.path), str(tmp_path / "tok"),
                               server.url, token, point], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 137, proc.stderr[-3000:]
        assert ledger.unfinished_batch()["batch"] == "batch-0001"
        result = ledger.serve_exact(tokenizer=tok, repo="org/served", endpoint=server.url, token=token, **QUIET)
        tags = sorted(t.name for t in HfApi(endpoint=server.url, token=token).list_repo_refs("org/served").tags)
    assert result.resumed and tags == ["deletion-0001"], tags
    done = ledger.last("batch_done")
    assert done["published"]["tag"] == "deletion-0001" and done["published"]["verify_ok"], done["published"]
    assert [r["type"] for r in ledger.records()].count("batch_done") == 1


# -- 4. the leak scanner reads tokenizer vocabularies and rules -----------------------------------------------------
def test_tokenizer_vocabulary_and_rules_are_scanned_for_forget_ids(tmp_path):
    """Round 2 published a string forget id as a tokenizer.json vocabulary entry and integer ids inside the
    normalizer and post-processor. A vocabulary may hold any number (token "3600", token ids) but no string id;
    the rules' numbers are matched except the post-processor's token and segment ids."""
    from hf_unlearn.hub.leaks import IdScanner
    from hf_unlearn.hub.publish import scan_files

    from .conftest import TOKENIZERS

    source = json.loads((TOKENIZERS / "gpt-neox-20b" / "tokenizer.json").read_text())

    def hits(forget, edit=None, name="tokenizer.json", data=None) -> list[str]:
        folder = tmp_path / f"s{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        body = json.loads(json.dumps(source)) if data is None else data
        if edit:
            edit(body)
        (folder / name).write_text(json.dumps(body) if not isinstance(body, str) else body)
        return [str(h) for h in scan_files(folder, IdScanner(forget))]

    assert hits(["piqa-17", 3600, *range(0, 50)]) == []  # a real tokenizer.json: no false positive
    gpt2 = json.loads((TOKENIZERS / "gpt2" / "vocab.json").read_text())
    assert hits(["piqa-17", 3600, *range(0, 50)], data=gpt2, name="vocab.json") == []
    source["model"]["vocab"] = dict(list(source["model"]["vocab"].items())[:500])  # the rest: a small copy
    source["model"]["merges"] = []

    def vocab(b):
        b["model"]["vocab"]["piqa-17"] = len(b["model"]["vocab"])
        b["model"]["vocab"]["3600"] = len(b["model"]["vocab"])

    assert hits(["piqa-17"], vocab) == ["tokenizer.json:model.vocab (id 'piqa-17')"]
    assert hits([3600], vocab) == []  # a number in a vocabulary is a token, not a sample id
    assert hits(["abc-17"], lambda b: b["model"]["vocab"].update({"abc": 1, "-17": 2})) == []  # never across tokens

    def normalizer(b):
        b["normalizer"] = {"type": "Replace", "pattern": {"String": "row 3600"}, "content": ""}

    assert hits([3600], normalizer) == ["tokenizer.json:normalizer.pattern.String (number 3600)"]

    def post(b):
        b["post_processor"] = {"type": "TemplateProcessing", "single": [
            {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<row 4100>", "type_id": 0}}],
            "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [3600], "tokens": ["<s>"]}}}

    assert hits([3600, 0], post) == []  # the token id 3600 and segment id 0 are not sample ids
    assert hits([4100], post) == ["tokenizer.json:post_processor.single[2].SpecialToken.id (number 4100)"]
    assert hits(["piqa-17"], data={"piqa-17": 5, "a": 1}, name="vocab.json") == ["vocab.json (id 'piqa-17')"]
    assert hits(["piqa-17"], data="a\npiqa-17\nb\n", name="vocab.txt") == ["vocab.txt (id 'piqa-17')"]


# -- further attacks of an insider without the key, or a careless operator ------------------------------------------
def test_a_rolled_back_ledger_fails_verify_of_a_plain_receipt_too(world, tmp_path, capsys):
    """Attack: the rollback, then the auditor checks a receipt (not a bundle) against the operator's ledger."""
    ledger, run = world
    key = tmp_path / "issuer.pub"
    assert cli(capsys, "requests", "public-key", "--out", key)[0] == 0
    rollback_to(ledger, "batch-0001.bundle.json")
    code, out = cli(capsys, "requests", "verify", ledger.path / "receipts" / "r-0001.exact.json", "--public-key", key)
    assert code == 1 and "older than the service's own evidence" in out, out


def test_rollback_evidence_is_the_services_own_and_survives_partial_cleanup(world, capsys):
    """Attacks: (a) a forged bundle with a later head signed by another key, and junk files in receipts/, do not lock
    the service (not its evidence); (b) the rollback with every newer bundle deleted is still refused by a newer
    signed receipt; (c) with every newer receipt deleted too, by the batch folder."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from hf_unlearn.deletion.chain import sign_head

    ledger, run = world
    receipts = ledger.path / "receipts"
    bundle = json.loads((receipts / "r-0002.exact.bundle.json").read_text())
    forged = {**bundle, "head": sign_head({**{k: v for k, v in bundle["head"].items() if k != "signature"},
                                           "seq": 99}, Ed25519PrivateKey.generate())}
    (receipts / "zz-forged.bundle.json").write_text(json.dumps(forged))
    (receipts / "deep.json").write_text("[" * 100000 + "]" * 100000)
    (receipts / "list.json").write_text("[1, 2]")
    (receipts / "bad-refs.json").write_text(json.dumps({**bundle["receipt"], "ledger_records": [1]}))
    assert cli(capsys, "requests", "status", run, "--ledger", ledger.path)[0] == 0
    rollback_to(ledger, "batch-0001.bundle.json")
    for p in receipts.glob("*.bundle.json"):
        p.unlink()
    code, out = cli(capsys, "requests", "list", run, "--ledger", ledger.path)
    assert code == 1 and "receipts/batch-0002.json (batch_start record)" in out, out
    for p in receipts.glob("*0002*"):
        p.unlink()
    code, out = cli(capsys, "requests", "list", run, "--ledger", ledger.path)
    assert code == 1 and "batches/batch-0002 exists" in out, out


def test_purge_is_not_fooled_by_links_files_or_planted_copies(world, tmp_path, capsys):
    """Attacks on purge: a dirty checkpoint replaced by a symlink to a folder outside (the link goes, the target is
    not followed), a plain file named like a checkpoint, a provisional folder no record names holding a store, a
    batch receipt deleted (refused, nothing removed), a dry run (nothing changes, no record)."""
    ledger, run = world
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the service's")
    shutil.rmtree(run / "checkpoints" / "step-00000006")
    (run / "checkpoints" / "step-00000006").symlink_to(outside)
    (run / "checkpoints" / "step-00000003").write_text("junk")
    shutil.copytree(run / "private" / "store", ledger.path / "provisional" / "approx-0007" / "store")
    current = ledger.path / "batches" / "batch-0002" / "replay"
    shutil.copytree(run / "private" / "store", current / "private" / "old-store")  # inside the current exact run
    shutil.copytree(run / "checkpoints" / "step-00000008", current / "checkpoints" / "step-00000008.orig")
    before = snapshot(ledger.path, run)
    code, out = cli(capsys, "requests", "purge", run, "--ledger", ledger.path, "--dry-run")
    assert code == 0 and "would remove" not in out and "dry run" in out
    assert snapshot(ledger.path, run) == before and ledger.last("purge_start") is None
    receipt = ledger.path / "receipts" / "batch-0002.json"
    saved = receipt.read_bytes()
    receipt.unlink()
    code, out = cli(capsys, "requests", "purge", run, "--ledger", ledger.path)
    assert code == 1 and "receipts/batch-0002.json is missing" in out
    receipt.write_bytes(saved)
    assert cli(capsys, "requests", "purge", run, "--ledger", ledger.path)[0] == 0
    removed = {r["path"] for r in ledger.last("purge")["removed"]}
    assert {"../run/checkpoints/step-00000006", "../run/checkpoints/step-00000003",
            "provisional/approx-0007", "batches/batch-0002/replay/private/old-store",
            "batches/batch-0002/replay/checkpoints/step-00000008.orig"} <= removed
    assert (current / "private" / "store").is_dir() and (current / "checkpoints" / "step-00000008").is_dir()
    assert (outside / "keep.txt").exists() and not (run / "checkpoints" / "step-00000006").is_symlink()


def test_forget_on_a_purged_run_names_the_run_that_replaced_it(world, capsys):
    """Operator error: `forget` on the recorded run after purge retired it (its store is gone)."""
    from hf_unlearn.deletion import forget
    from hf_unlearn.deletion.erasure import purge

    ledger, run = world
    target = ids_at_step(run, 7)[:1]
    purge(ledger, log=lambda m: None)
    current = ledger.path / "batches" / "batch-0002" / "replay"
    with pytest.raises(UnlearnError, match="was retired by `hf-unlearn requests purge`") as e:
        forget(run, target, ledger.path.parent / "out", progress=False, log=lambda m: None)
    assert str(current) in str(e.value) and "\n" not in str(e.value)
    assert not (ledger.path.parent / "out").exists()


def test_bad_receipts_bundles_and_inputs_are_one_line(world, tmp_path, capsys):
    """Round 2 found raw AttributeError, TypeError and RecursionError (deep JSON) and a FIFO called missing."""
    ledger, run = world
    key = tmp_path / "issuer.pub"
    assert cli(capsys, "requests", "public-key", "--out", key)[0] == 0
    bundle = json.loads((ledger.path / "receipts" / "r-0001.exact.bundle.json").read_text())
    receipt = bundle["receipt"]
    cases = {"deep": "[" * 100000 + "]" * 100000, "record signature a string": {**bundle, "records": [
        {**bundle["records"][0], "signature": "x"}]}, "head signature a string": {**bundle, "head": {
            **bundle["head"], "signature": "x"}}, "receipt signature a list": {**bundle, "receipt": {
                **receipt, "signature": [1]}}, "ledger_records a list": {**bundle, "receipt": {
                    **receipt, "ledger_records": [1]}}, "records not objects": {**bundle, "records": [1, 2]},
             "receipt a string": {**bundle, "receipt": "x"}, "head seq a string": {**bundle, "head": {
                 **bundle["head"], "seq": "3"}}}
    before = snapshot(ledger.path)
    for name, body in cases.items():
        path = tmp_path / "case.json"
        path.write_text(body if isinstance(body, str) else json.dumps(body))
        for extra in ([], ["--ledger", ledger.path]):
            code, out = cli(capsys, "requests", "verify", path, "--public-key", key, *extra)
            assert code == 1 and "Error" not in out and "Traceback" not in out, (name, out)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    os.mkfifo(tmp_path / "fifo")
    for args, match in ((["add", run, "--ledger", ledger.path, "--ids", deep], "nested too deeply"),
                        (["add", run, "--ledger", ledger.path, "--ids", tmp_path / "fifo"], "is not a regular file"),
                        (["add", run, "--ledger", ledger.path, "--ids", tmp_path], "is not a regular file"),
                        (["serve", run, "--ledger", ledger.path, "--due", "--policy", deep], "nested too deeply")):
        code, out = cli(capsys, "requests", *args)
        assert code == 1 and match in out and len(out.strip().splitlines()) == 1, (args, out)
    assert snapshot(ledger.path) == before


def test_recover_writes_the_bundles_an_interrupted_serve_left_out(world, capsys):
    """A serve killed after batch_done and its head, before its bundles (a real kill at that point:
    test_deletion_integrity's kill-point test), and an add killed before its acknowledgement: recover makes them."""
    ledger, run = world
    receipts = ledger.path / "receipts"
    gone = [receipts / "r-0002.exact.bundle.json", receipts / "batch-0002.bundle.json", receipts / "r-0002.ack.json",
            receipts / "r-0002.ack.bundle.json"]
    for p in gone:
        p.unlink()
    code, out = cli(capsys, "requests", "recover", run, "--ledger", ledger.path)
    assert code == 0 and "wrote the missing bundle r-0002.exact.bundle.json" in out, out
    assert all(p.exists() for p in gone)
    from hf_unlearn.deletion import verify_receipt

    assert verify_receipt(receipts / "r-0002.exact.bundle.json", public_key()).ok


def test_numbers_and_batch_folders_are_never_reused_even_without_signed_evidence(world, capsys):
    """Attack: the rollback with every signed receipt and bundle made unreadable (the service cannot use them as
    evidence) but their files left: add would reuse r-0002 and overwrite its receipts; serve would reuse
    batch-0002. Both refuse, naming the file, and record nothing."""
    ledger, run = world
    rollback_to(ledger, "r-0001.exact.bundle.json")  # after batch-0001: r-0002 not added yet
    for p in (ledger.path / "receipts").glob("*.json"):
        if "0002" in p.name:
            p.write_text("{}")  # no longer signed evidence
    shutil.move(ledger.path / "batches" / "batch-0002", ledger.path.parent / "moved")
    before = snapshot(ledger.path)
    ids = ledger.path.parent / "ids.jsonl"
    ids.write_text(json.dumps(ids_at_step(run, 6)[0]) + "\n")
    code, out = cli(capsys, "requests", "add", run, "--ledger", ledger.path, "--ids", ids)
    assert code == 1 and "receipts/r-0002.ack" in out and "was used before" in out, out
    assert snapshot(ledger.path) == before


def test_a_dirty_checkpoint_under_a_clean_name_or_an_edited_index_is_not_kept(world, capsys):
    """Attacks: step-8's folder (trained on both deleted rows) copied over the clean step-2, and its index entry
    copied too (the index MAC no longer holds): purge keeps no checkpoint it cannot verify as the run's own."""
    ledger, run = world
    shutil.rmtree(run / "checkpoints" / "step-00000002")
    shutil.copytree(run / "checkpoints" / "step-00000008", run / "checkpoints" / "step-00000002")
    assert cli(capsys, "requests", "purge", run, "--ledger", ledger.path)[0] == 0
    assert steps(run) == ["step-00000000"]  # the impostor is erased, the intact step 0 kept
    index = run / "checkpoints" / "index.json"
    data = json.loads(index.read_text())
    data["checkpoints"]["0"]["params_root"] = "0" * 64  # an edited index vouches for nothing
    index.write_text(json.dumps(data))
    from hf_unlearn.deletion.erasure import purge

    purge(ledger, log=lambda m: None)
    assert steps(run) == []
