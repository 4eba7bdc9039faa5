"""Stores bound to their run, strict integrity in sealed runs, checkpoints checked against their hashes.

Each test tries to fool a verdict (a store accepted, `inspect` OK, `verify` VERIFIED) and expects a refusal
before any compute.
"""

from __future__ import annotations

import json
import shutil

import pytest

from .test_trace_common import copy_run, delete, get_recorded, ids_at_step


def _cli(*args):
    from hf_unlearn.cli import main

    return main([str(a) for a in args])


def _resave(store_dir, dst, edit):
    """A copy of a store with ``edit(row_index, row) -> row`` applied (fresh Arrow files), receipt kept."""
    from hf_unlearn.trace.store import RECEIPT_NAME, load_store, save_store

    store = load_store(store_dir)
    edited = store.map(lambda r, n: edit(n, r), with_indices=True, keep_in_memory=True)
    save_store(edited, dst)
    if (store_dir / RECEIPT_NAME).exists():
        shutil.copy2(store_dir / RECEIPT_NAME, dst / RECEIPT_NAME)
    return dst


def test_foreign_store_with_the_same_ids_and_lengths_is_refused(tmp_path):
    """Another store (same ids, same lengths, other tokens) redacted with a valid receipt: not this run's."""
    recorded = get_recorded()
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import RedactedReplayTrainer, open_run, redact_store

    run = open_run(recorded)
    forget = ids_at_step(recorded, 7)[:1]
    foreign = _resave(run.store_path, tmp_path / "foreign",
                      lambda n, r: {**r, "input_ids": [(t + 1) % 1024 for t in r["input_ids"]]})
    redact_store(foreign, forget, tmp_path / "foreign_redacted", run.key)  # same key, so the receipt verifies
    with pytest.raises(UnlearnError, match="was redacted from another store"):
        RedactedReplayTrainer(run, tmp_path / "foreign_redacted", forget, tmp_path / "out")
    (tmp_path / "foreign_redacted" / "redaction_receipt.json").unlink()
    with pytest.raises(UnlearnError, match="neither the run's own store .* nor a redaction of it"):
        RedactedReplayTrainer(run, tmp_path / "foreign_redacted", forget, tmp_path / "out")
    redact_store(run.store_path, forget, tmp_path / "other_key", b"x" * 32)  # this run's store, another key
    with pytest.raises(UnlearnError, match="does not verify under this run's key"):
        RedactedReplayTrainer(run, tmp_path / "other_key", forget, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_store_edited_after_redaction_is_refused(tmp_path):
    recorded = get_recorded()
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import RedactedReplayTrainer, open_run, redact_store
    from hf_unlearn.trace.store import RECEIPT_NAME, receipt_mac, store_sha256

    run = open_run(recorded)
    forget = ids_at_step(recorded, 7)[:1]
    redact_store(run.store_path, forget, tmp_path / "s", run.key)
    retained_in_suffix = ids_at_step(recorded, 6)[0]

    def edit(n, r):  # one token of a row the suffix replay reads, same length
        return {**r, "input_ids": r["input_ids"][:-1] + [(r["input_ids"][-1] + 1) % 1024]} \
            if r["id"] == retained_in_suffix else r

    edited = _resave(tmp_path / "s", tmp_path / "edited", edit)
    with pytest.raises(UnlearnError, match="was changed after redaction"):
        RedactedReplayTrainer(run, edited, forget, tmp_path / "out")
    receipt = json.loads((edited / RECEIPT_NAME).read_text())
    receipt["store_sha256"] = store_sha256(edited)  # an editor without the key rewrites the receipt too
    (edited / RECEIPT_NAME).write_text(json.dumps(receipt))
    with pytest.raises(UnlearnError, match="does not verify under this run's key"):
        RedactedReplayTrainer(run, edited, forget, tmp_path / "out")
    receipt["mac"] = receipt_mac(run.key, receipt)  # even the key holder: the row no longer collates as recorded
    (edited / RECEIPT_NAME).write_text(json.dumps(receipt))
    with pytest.raises(UnlearnError, match=r"microbatch \d+ \(optimizer step 6\) does not collate to the batch"):
        RedactedReplayTrainer(run, edited, forget, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_oracle_refuses_a_redacted_store(tmp_path):
    recorded = get_recorded()
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import OracleReplayTrainer, open_run, redact_store

    run = open_run(recorded)
    forget = ids_at_step(recorded, 7)[:1]
    redact_store(run.store_path, forget, tmp_path / "s", run.key)
    with pytest.raises(UnlearnError, match="the oracle reads the run's original store"):
        OracleReplayTrainer(run, forget, out_dir=tmp_path / "o", store=tmp_path / "s")


def test_sealed_run_needs_every_checkpoint_sidecar(tmp_path, capsys):
    recorded = get_recorded()
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import open_run

    run = copy_run(recorded, tmp_path / "run")
    (run / "checkpoints" / "step-00000004" / "hashes.json.sha256").unlink()
    assert _cli("trace", "inspect", run) == 1
    assert "checkpoint step 4 has no hashes.json.sha256 sidecar in a sealed run" in capsys.readouterr().out
    with pytest.raises(UnlearnError, match="refusing to use it"):
        open_run(run)


def test_checkpoint_checked_against_its_hashes(tmp_path, capsys):
    """A tensor changed in model.safetensors (hashes.json untouched): inspect --deep names it, a replay from it
    refuses."""
    recorded = get_recorded()
    from safetensors.torch import load_file, save_file

    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import RedactedReplayTrainer, open_run, redact_store
    from hf_unlearn.trace.run import load_checkpoint

    run_dir = copy_run(recorded, tmp_path / "run")
    ck_file = run_dir / "checkpoints" / "step-00000006" / "model.safetensors"
    tensors = load_file(ck_file)
    tensors["model.norm.weight"][0] += 1e-3
    save_file(tensors, ck_file)
    state = load_checkpoint(ck_file.parent, verify=False)
    assert _cli("trace", "inspect", run_dir) == 0  # the cheap check reads hashes.json's sidecar only ...
    capsys.readouterr()
    assert _cli("trace", "inspect", run_dir, "--deep") == 1  # ... the deep one reads every state
    assert "step-00000006 does not match its hashes.json (it differs in model.norm.weight)" in capsys.readouterr().out
    run = open_run(run_dir)
    forget = ids_at_step(run_dir, 7)[:1]
    redact_store(run.store_path, forget, tmp_path / "s", run.key)
    with pytest.raises(UnlearnError, match=r"step-00000006 does not match its hashes.json .*model.norm.weight"):
        RedactedReplayTrainer(run, tmp_path / "s", forget, tmp_path / "out")
    # hashes.json rewritten to match, without its sidecar: caught by the sidecar
    from hf_unlearn.trace.hashing import checkpoint_hashes

    (ck_file.parent / "hashes.json").write_text(json.dumps(checkpoint_hashes(state)))
    assert _cli("trace", "inspect", run_dir) == 1
    assert "checkpoint step 6 is not this run's: its parameter root" in capsys.readouterr().out
    # ... and its sidecar rewritten as well: the run's checkpoint index still holds the recorded roots
    from hf_unlearn.trace.run import write_sidecar

    write_sidecar(ck_file.parent / "hashes.json")
    assert _cli("trace", "inspect", run_dir) == 1
    assert "checkpoint step 6 is not this run's: its parameter root" in capsys.readouterr().out


def test_verify_checks_what_it_compares(tmp_path, capsys):
    """VERIFIED needs a replay and an oracle of one run for the same ids: a folder against itself is not enough."""
    recorded = get_recorded()
    forget = ids_at_step(recorded, 7)[:1]
    _, report = delete(recorded, forget, tmp_path)
    assert report["verified"]
    assert _cli("trace", "verify", tmp_path / "replay", tmp_path / "replay") == 1
    err = capsys.readouterr().err
    assert "NOT VERIFIED: the states are bit-identical" in err and "same folder" in err
    other = ids_at_step(recorded, 7)[1:2]  # an oracle of another request ending in a different state
    from hf_unlearn.trace import OracleReplayTrainer

    OracleReplayTrainer(recorded, other, out_dir=tmp_path / "oracle2").train()
    assert _cli("trace", "verify", tmp_path / "replay", tmp_path / "oracle2") == 1
    assert "deleted different ids" in capsys.readouterr().err
    ck = tmp_path / "replay" / "checkpoints" / "step-00000008"
    assert _cli("trace", "verify", ck, tmp_path / "oracle") == 1  # a bare checkpoint: provenance unknown
    assert "is not a run folder" in capsys.readouterr().err
