"""Every file a command writes gets the mode the umask gives it, weights included (safetensors writes its files 0600
itself); only private files are owner-only (files 0600, folders 0700) whatever the umask: the files named in PRIVATE,
everything under a run's or an output's ``private/`` (the token store with every row's raw id and token ids, the key,
local paths) and every token store (a redacted one: ``forget OUT/store``, a pipeline stage's, a service batch's).

Checked on every file and folder of a trace recording (full fine-tune and LoRA), an exact deletion published to a
local Hub (the output folder and the Hub's stored copy), an approximate deletion, a pipeline deletion and a service
batch, under a permissive umask (000: every file world-writable unless the library says otherwise) and 027."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from .test_trace_common import get_trace_data, ids_at_step, record, tiny

# owner-only on purpose, whatever the umask: raw ids, keys and what holds them
PRIVATE = {
    "unlearning_info.json",  # the card info with the raw forget ids (never published)
    "ids.jsonl",  # raw ids of a request
    "key",  # a run's tagging key, a signing key
    "signing_key.pem",
}


def is_private(path: Path, root: Path) -> bool:
    """Owner-only on purpose: a file named in PRIVATE, or anything in a ``private/`` folder or a token store (a
    folder with a redaction receipt) under ``root``, those folders included."""
    from hf_unlearn.trace.store import RECEIPT_NAME
    from hf_unlearn.utils import PRIVATE_DIR

    if path.is_file() and path.name in PRIVATE:
        return True
    for folder in [path, *path.parents]:
        if folder == root or root not in folder.parents:
            return False
        if folder.name == PRIVATE_DIR or (folder / RECEIPT_NAME).is_file():
            return True
    return False


def modes_that_differ(root: Path, mask: int) -> dict[str, str]:
    """``{relative path: mode}`` of every file under ``root`` whose mode is not what open() gives under ``mask``, and
    of every folder that is not what mkdir() gives (0777 minus the mask); private ones (:func:`is_private`): not
    0600 for a file, not 0700 for a folder."""
    wrong = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            continue
        private = is_private(path, root)
        if path.is_dir():
            expected = 0o700 if private else 0o777 & ~mask
        else:
            expected = 0o600 if private else 0o666 & ~mask
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode != expected:
            wrong[str(path.relative_to(root))] = oct(mode)
    return wrong


@pytest.fixture(params=[0o000, pytest.param(0o027, marks=pytest.mark.slow)], ids=["umask000", "umask027"])  # 027: slow
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def test_recording_and_exact_deletion_published_follow_the_umask(tmp_path, umask):
    from hf_unlearn import forget
    from hf_unlearn.demo import local_hub

    tok, data = get_trace_data()
    record(tok, data, tmp_path / "rec", max_steps=4)
    run = tmp_path / "rec" / "trace"
    weights = list(run.rglob("*.safetensors"))
    assert weights, "the recording wrote no weights"
    with local_hub(tmp_path / "hub") as (server, token):
        receipt = forget(run, ids_at_step(run, 3)[:1], tmp_path / "out", tokenizer=tok, repo="org/tiny",
                         endpoint=server.url, token=token, progress=False, log=lambda m: None)
    assert receipt.ok and receipt.published["verify_ok"]
    assert list((tmp_path / "out").rglob("*.safetensors"))
    for folder in ("rec", "out", "hub"):
        assert modes_that_differ(tmp_path / folder, umask) == {}, folder


def test_lora_recording_follows_the_umask(tmp_path, umask):
    from peft import LoraConfig, get_peft_model

    tok, data = get_trace_data()
    model = get_peft_model(tiny(tok), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    record(tok, data, tmp_path / "rec", max_steps=2, model=model)
    assert list((tmp_path / "rec").rglob("*.safetensors"))
    assert modes_that_differ(tmp_path / "rec", umask) == {}


def test_approximate_deletion_follows_the_umask(tmp_path, umask, tiny_llama_dir):
    from hf_unlearn import forget
    from hf_unlearn.data.embedded import load_embedded_tofu

    rows = load_embedded_tofu().select(range(24))
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": r["question"], "answer": r["answer"]}) + "\n"
                            for i, r in enumerate(rows)))
    request = tmp_path / "request.txt"
    request.write_text("q1\nq2\n")
    forget(tiny_llama_dir, request, tmp_path / "out", method="grad_ascent", data=str(data), max_steps=1,
           max_retain_rows=4, max_length=48, eval_rows=0, progress=False, log=lambda m: None)
    assert list((tmp_path / "out").rglob("*.safetensors"))
    assert modes_that_differ(tmp_path / "out", umask) == {}


@pytest.mark.slow  # a pipeline deletion and a service batch (~11 s)
def test_a_pipeline_deletion_and_a_service_batch_keep_every_private_file_owner_only(tmp_path):
    """Under umask 000: a two-stage pipeline recorded, deleted from (each stage's redacted store, replay and oracle),
    and a service batch on its first run (the ledger's private part, the batch's store, replay and oracle): every
    private file 0600 and folder 0700, every other file 0666 (what open() gives), none missed."""
    from hf_unlearn.deletion import DeletionLedger, forget

    from .test_trace_pipeline import record_pipeline

    old = os.umask(0o000)
    try:
        runs = record_pipeline(tmp_path / "rec")
        ids = ids_at_step(runs[0], 1)[:1] + ids_at_step(runs[1], 2)[:1]
        receipt = forget(list(runs), ids, tmp_path / "pipeline", oracle=True, progress=False, log=lambda m: None)
        assert receipt.ok and [s["replayed"] for s in receipt.evidence["pipeline"]] == [True, True]
        held, erase = receipt.summary_rows()[-2:]  # a pipeline's summary ends with what still holds the rows
        assert held[0] == "still holds" and "pipeline from stage 1 on" in held[1] and "stage-2/replay holds none" in \
            held[1] and erase[0] == "to erase"
        ledger = DeletionLedger(runs[0], tmp_path / "ledger")
        ledger.add([i for i in ids_at_step(runs[0], 2) if i > 9][:1], received="2026-11-01")  # (2: a step number)
        batch = ledger.serve_exact(tokenizer=get_trace_data()[0], oracle=True, now="2026-11-02", progress=False,
                                   log=lambda m: None)
        assert batch.forget_receipt.ok
    finally:
        os.umask(old)
    stores = [tmp_path / "pipeline" / f"stage-{k}" / "store" for k in (1, 2)]
    stores += [tmp_path / "ledger" / "batches" / "batch-0001" / "store"]
    stores += [p for p in tmp_path.rglob("store") if p.parent.name == "private"]
    assert len(stores) == 8 and all(any(s.glob("*.arrow")) for s in stores)  # recorded, redacted and replayed stores
    for folder in ("rec", "pipeline", "ledger"):
        assert modes_that_differ(tmp_path / folder, 0o000) == {}, folder
