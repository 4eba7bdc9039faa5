"""Attacks on the pipeline verdict (issue #35): each test tries to get VERIFIED (``forget --oracle`` over a pipeline,
``trace verify OUT``) for a deletion whose final model is not the counterfactual pipeline, or a lineage that names a
wrong parent; the outcome is asserted (refused before compute naming the stage, or NOT VERIFIED)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hf_unlearn.errors import UnlearnError

from .test_trace_common import ids_at_step, record
from .test_trace_pipeline import KW, _from, shared_pipeline


def _three_stages_dpo_referencing_stage_1(tmp: Path):
    """SFT on rows 0..15 (stage 1), a second SFT from its saved model on rows 16..31 (stage 2), then DPO from stage
    2's saved model whose ``ref_model`` is stage 1's output (not the policy's parent)."""
    from trl import DPOTrainer

    from hf_unlearn.data import tokenize_qa
    from hf_unlearn.trace import trace_recording

    from .test_trace_dpo import dpo_config, pairs, saved_model
    from .test_trace_sft import _rows_and_tokenizer

    rows, tok = _rows_and_tokenizer()
    t1 = record(tok, tokenize_qa(rows.select(range(16)), tok, max_length=128), tmp / "s1",
                model=saved_model(tmp / "base", tok), **KW)
    t1.save_model(str(tmp / "s1"))
    t2 = record(tok, tokenize_qa(rows.select(range(16, 32)), tok, max_length=128), tmp / "s2",
                model=_from(tmp / "s1"), **KW)
    t2.save_model(str(tmp / "s2"))
    _, dpo_data = pairs(n=16)
    edited = _from(tmp / "s2")
    with torch.no_grad():
        next(edited.parameters()).view(-1)[0] += 1e-3  # stage 2's output, edited: derived from a changed stage
    for name, ref in (("dpo", _from(tmp / "s1")), ("dpo-edited-ref", edited)):
        trace_recording(DPOTrainer)(model=_from(tmp / "s2"), ref_model=ref, args=dpo_config(tmp / name, max_steps=2),
                                    train_dataset=dpo_data, processing_class=tok, trace_checkpoint_steps=2).train()
    return [tmp / name / "trace" for name in ("s1", "s2", "dpo", "dpo-edited-ref")]


@pytest.mark.slow  # three recorded stages: about 35-55 s
def test_a_dpo_reference_that_is_an_earlier_stage_than_its_parent_is_refused(tmp_path):
    """Attack: stage 3 (DPO) starts from stage 2's output but its reference is stage 1's output (or stage 2's output
    edited in memory). A stage-1 deletion
    changes that reference; replaying stage 3 with the recorded (old) reference gave replay == oracle, VERIFIED, for a
    model that is not the counterfactual pipeline (whose stage-3 reference is stage 1's counterfactual). Now refused
    before compute, naming the stage."""
    pytest.importorskip("trl")
    from hf_unlearn.deletion import forget

    runs = _three_stages_dpo_referencing_stage_1(tmp_path)
    h3 = json.loads((runs[2] / "header.json").read_text())
    h1 = json.loads((runs[0] / "header.json").read_text())
    assert h3["lineage"]["parent"]["run_id"] == json.loads((runs[1] / "header.json").read_text())["run_id"]
    assert h3["reference_model"]["params_root"] == h1["lineage"]["output_root"]  # the reference is stage 1's output
    ids = ids_at_step(runs[0], 1)[:1]
    with pytest.raises(UnlearnError, match=r"stage 3 \(.*\): its reference model .* is not its parent but stage 1's"):
        forget([str(r) for r in runs[:3]], ids, tmp_path / "out", oracle=True, progress=False)
    # the reference is stage 2's output edited in memory (its root is no stage's): refused too
    with pytest.raises(UnlearnError, match=r"stage 3 \(.*\): its reference model .* none of the weights stages 1\.\.1"):
        forget([str(r) for r in (*runs[:2], runs[3])], ids, tmp_path / "out", oracle=True, progress=False)
    assert not (tmp_path / "out").exists()
    # the deletion as it ran before the refusal (the old reference kept): `trace verify OUT` does not verify it either
    import hf_unlearn.deletion.pipeline as pipeline
    from hf_unlearn.deletion.pipeline import verify_pipeline

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_refuse_stale_reference", lambda *a: None)
        assert forget([str(r) for r in runs[:3]], ids, tmp_path / "old", oracle=True, progress=False).ok
    report = verify_pipeline(tmp_path / "old")
    assert not report["verified"] and any("stage 3: the replay's reference model" in p and "stale reference" in p
                                          for p in report["problems"]), report["problems"]
    # a deletion that leaves the reference unchanged is allowed: stage 2's ids (the reference is stage 1's)
    from hf_unlearn.deletion.pipeline import validate_pipeline

    plan = validate_pipeline([str(r) for r in runs[:3]], ids_at_step(runs[1], 0)[:1], oracle=True)
    assert plan["pipeline_cost"]["first_affected_stage"] == 2
    with pytest.raises(UnlearnError, match=r"stage 3 .* none of the weights stages 1\.\.2 started from"):
        validate_pipeline([str(r) for r in (*runs[:2], runs[3])], ids_at_step(runs[1], 0)[:1], oracle=True)


def test_a_receipt_relabelled_with_ids_the_deletion_did_not_touch_is_not_verified(tmp_path):
    """Attack: a stage-2-only deletion (stage 1 unchanged, its replay == oracle) whose receipt's request is edited to
    also name a stage-1 id (or whose request is another deletion's): the chain holds, so `trace verify OUT` said
    VERIFIED for a model that still holds the stage-1 row. Now NOT VERIFIED: the request is checked against the
    replayed stages' deletion logs."""
    from hf_unlearn.deletion import forget
    from hf_unlearn.deletion.pipeline import verify_pipeline
    from hf_unlearn.hub.cards import forget_request
    from hf_unlearn.keys import load_key

    s1, s2 = shared_pipeline()
    a, b = ids_at_step(s1, 2)[:1], ids_at_step(s2, 1)[:1]
    out = tmp_path / "stage2-only"
    forget([str(s1), str(s2)], b, out, oracle=True, progress=False)
    assert verify_pipeline(out)["verified"]
    for name, claimed in (("plus-stage-1", a + b), ("other", a)):
        edited = shutil.copytree(out, tmp_path / name)
        receipt = json.loads((edited / "receipt.json").read_text())
        receipt["request"] = forget_request(claimed, load_key())
        (edited / "receipt.json").write_text(json.dumps(receipt))
        report = verify_pipeline(edited)
        assert not report["verified"], name
        assert any("deleted by no replayed stage" in p or "not in the receipt's request" in p
                   for p in report["problems"]), (name, report["problems"])
    # the request put under another key (its fingerprint edited): not comparable, so not verified
    receipt["request"] = forget_request(a + b, b"another key" * 3)
    (edited / "receipt.json").write_text(json.dumps(receipt))
    assert any("cannot be shown" in p for p in verify_pipeline(edited)["problems"])


@pytest.mark.slow  # a stage-2-only deletion, then a stage-1 request from its output, with oracles: about 90 s
def test_a_stage_1_request_after_a_stage_2_only_deletion_equals_the_counterfactual_chain(tmp_path):
    """The later request targets stage 1 after a deletion that replayed stage 2 only (its replay is a suffix replay
    whose parent is the recorded stage 1): found from the replayed stage 2, it replays stage 1 and then stage 2 in
    full from the new stage 1, stage 2's earlier deletion kept; equal to the engine-free chain with both deletions."""
    from hf_unlearn.cli import main
    from hf_unlearn.deletion import forget

    from .test_trace_pipeline import _final, _same, counterfactual_chain

    s1, s2 = shared_pipeline()
    a, b = ids_at_step(s1, 2)[:1], ids_at_step(s2, 1)[:1]
    first = tmp_path / "first"
    forget([str(s1), str(s2)], b, first, oracle=True, progress=False)
    receipt = forget(str(first / "stage-2" / "replay"), a, tmp_path / "second", oracle=True, progress=False)
    assert receipt.evidence["verified"] is True
    assert [s["replayed"] for s in receipt.evidence["pipeline"]] == [True, True]
    assert main(["trace", "verify", str(tmp_path / "second")]) == 0
    # the receipt edited to hide stage 1's replay (stage 1 "unchanged", the roots made consistent): NOT VERIFIED
    from hf_unlearn.deletion.pipeline import verify_pipeline

    hidden = shutil.copytree(tmp_path / "second", tmp_path / "hidden")
    r = json.loads((hidden / "receipt.json").read_text())
    st1, st2 = r["evidence"]["pipeline"]
    st1.update(replayed=False, why="no id of the request in this stage (unchanged)", output_root=st2["new_start_root"])
    st2["start_root"] = st2["new_start_root"]
    (hidden / "receipt.json").write_text(json.dumps(r))
    report = verify_pipeline(hidden)
    assert not report["verified"] and any("stage 2: the replay starts from run" in p for p in report["problems"])
    cfs = counterfactual_chain(tmp_path / "cf", "llama", (s1, s2), a, b)
    for k, cf in enumerate(cfs, start=1):
        for role in ("replay", "oracle"):
            assert not _same(_final(tmp_path / "second" / f"stage-{k}" / role), cf), (k, role)


@pytest.mark.slow  # a recording and its refusals: about 35 s alone
def test_a_stage_modified_in_memory_after_loading_its_parent_is_no_stage_of_that_pipeline(tmp_path):
    """Attack: stage 2 loaded from stage 1's saved model and then changed in memory before training (one weight
    edited; the token embeddings resized for added tokens). Its weights are not stage 1's output, so the lineage names
    no parent (an external base), a trace_parent= hint naming stage 1 is refused before the first step, and a
    pipeline deletion over [stage 1, stage 2] is refused before compute naming stage 2 (the counterfactual of an
    in-memory edit is not defined). Ids in no stage are refused too."""

    from hf_unlearn.deletion import forget

    from .test_trace_common import get_trace_data

    s1, s2 = shared_pipeline()
    tok, data = get_trace_data()

    def edit(m):
        with torch.no_grad():
            next(m.parameters()).view(-1)[0] += 1e-3

    def resize(m):
        m.resize_token_embeddings(m.config.vocab_size + 8)

    for name, change in (("edited", edit), ("resized", resize)):
        model = _from(s1.parent)
        change(model)
        with pytest.raises(UnlearnError, match="trace_parent=.*is not that run's output"):
            record(tok, data.select(range(16, 24)), tmp_path / f"{name}-hint", model=model, max_steps=1,
                   trainer_kwargs={"trace_parent": s1})
        if name == "resized":  # recorded like the edited one (an external base); the hint's refusal is what differs
            continue
        record(tok, data.select(range(16, 24)), tmp_path / name, model=model, max_steps=1)
        run = tmp_path / name / "trace"
        lineage = json.loads((run / "header.json").read_text())["lineage"]
        assert lineage["parent"] is None and lineage["external"]["source"] == "safetensors", name
        with pytest.raises(UnlearnError, match=r"stage 2 \(.*\) starts from an external base, not from stage 1's"):
            forget([str(s1), str(run)], ids_at_step(s1, 0)[:1], tmp_path / f"{name}-out", progress=False)
        with pytest.raises(UnlearnError, match="never appear in the recorded plan"):  # stage 2 alone: no stage 1
            forget(str(run), ids_at_step(s1, 0)[:1], tmp_path / f"{name}-out", progress=False)
    with pytest.raises(UnlearnError, match="appear in no stage"):
        forget([str(s1), str(s2)], [10**9], tmp_path / "neither", progress=False)
    assert not any(p.name.endswith("-out") or p.name == "neither" for p in tmp_path.iterdir())


@pytest.mark.slow  # two service batches with their oracles and the engine-free chain: about 60-90 s
def test_the_service_serves_a_stage_1_request_after_a_stage_2_only_batch(tmp_path):
    """The deletion service over a pipeline: a first batch deletes a stage-2 id only (stage 1 unchanged), a later
    batch a stage-1 id. The second batch goes through the replayed stage 2 back to the recorded stage 1, replays both
    stages (stage 2 in full from the new stage 1, its earlier deletion kept), VERIFIED, and equals the engine-free
    chain with both deletions; `trace verify` on the batch folder agrees."""
    from hf_unlearn.deletion import DeletionLedger
    from hf_unlearn.deletion.pipeline import verify_pipeline

    from .test_trace_pipeline import _final, _same, counterfactual_chain

    s1, s2 = shared_pipeline()
    a, b = ids_at_step(s1, 1)[:1], ids_at_step(s2, 2)[:1]
    ledger = DeletionLedger(s2, tmp_path / "ledger")
    quiet = {"progress": False, "log": lambda m: None}
    ledger.add(b, received="2026-11-01")
    first = ledger.serve_exact(oracle=True, now="2026-11-02", **quiet)
    assert [s["replayed"] for s in first.forget_receipt.evidence["pipeline"]] == [False, True]
    ledger.add(a, received="2026-11-03")
    second = ledger.serve_exact(oracle=True, now="2026-11-04", **quiet)
    assert second.forget_receipt.evidence["verified"] is True
    assert [s["replayed"] for s in second.forget_receipt.evidence["pipeline"]] == [True, True]
    out = tmp_path / "ledger" / "batches" / "batch-0002"
    assert verify_pipeline(out)["verified"]
    fp = json.loads((out / "receipt.json").read_text())["request"]["key_fingerprint"]  # the request check ran
    assert all(json.loads((out / f"stage-{k}" / "replay" / "header.json").read_text())["key_fingerprint"] == fp
               for k in (1, 2))
    cfs = counterfactual_chain(tmp_path / "cf", "llama", (s1, s2), a, b)
    for k, cf in enumerate(cfs, start=1):
        assert not _same(_final(out / f"stage-{k}" / "replay"), cf), k


@pytest.mark.slow  # a single-run deletion, a recording from its output, a pipeline deletion with oracles: about 60 s
def test_a_stage_recorded_from_a_forget_output_is_deleted_through_exactly(tmp_path):
    """Stage 1 deleted-from earlier (a single-run forget), stage 2 then trained from that forget's model: the lineage
    names the forget's replay (via forget), a new request through stage 2 replays the replayed stage 1 (its earlier
    deletion kept) and stage 2 from the new output, VERIFIED, equal to the engine-free chain with every deletion."""
    from hf_unlearn.deletion import forget
    from hf_unlearn.deletion.pipeline import verify_pipeline

    from .test_trace_common import get_trace_data
    from .test_trace_pipeline import _final, _same, counterfactual_chain

    s1, _ = shared_pipeline()
    a, c = ids_at_step(s1, 1)[:1], ids_at_step(s1, 3)[:1]
    forget(str(s1), a, tmp_path / "out1", progress=False)
    tok, data = get_trace_data()
    record(tok, data.select(range(16, 32)), tmp_path / "s2", model=_from(tmp_path / "out1" / "model"), **KW)
    s2 = tmp_path / "s2" / "trace"
    parent = json.loads((s2 / "header.json").read_text())["lineage"]["parent"]
    assert parent["via"] == "forget"
    assert parent["run_id"] == json.loads((tmp_path / "out1" / "replay" / "header.json").read_text())["run_id"]
    d = ids_at_step(s2, 2)[:1]
    receipt = forget(str(s2), c + d, tmp_path / "out2", oracle=True, progress=False)
    assert receipt.evidence["verified"] is True and verify_pipeline(tmp_path / "out2")["verified"]
    cfs = counterfactual_chain(tmp_path / "cf", "llama", (s1, s2), a + c, d)
    for k, cf in enumerate(cfs, start=1):
        for role in ("replay", "oracle"):
            assert not _same(_final(tmp_path / "out2" / f"stage-{k}" / role), cf), (k, role)


def test_a_lora_stage_with_modules_to_save_after_a_changed_parent_is_refused(tmp_path):
    """Attack: stage 2 is a LoRA on stage 1's output with ``modules_to_save=["lm_head"]`` (or DoRA, whose magnitude
    vectors are the base's weight norms) (tied embeddings: its start
    root is stage 1's output, the parent is found). The lm_head copy is an adapter tensor initialised from the old
    stage 1; a stage-1 deletion replaced the base but kept the copy, replay == oracle, VERIFIED, not the
    counterfactual (whose copy starts from the new stage 1). Now refused before compute naming stage 2; a deletion
    in stage 2 only (its parent unchanged) is still served."""
    from peft import LoraConfig, get_peft_model

    from hf_unlearn.deletion import forget
    from hf_unlearn.deletion.pipeline import validate_pipeline

    from .test_trace_common import get_trace_data

    s1, _ = shared_pipeline()
    tok, data = get_trace_data()
    for name, extra, why in (("copies", {"modules_to_save": ["lm_head"]}, "trains full copies of .*lm_head"),
                             ("dora", {"use_dora": True}, "is DoRA")):
        torch.manual_seed(1)
        model = get_peft_model(_from(s1.parent), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                             target_modules=["q_proj"], **extra))
        record(tok, data.select(range(16, 24)), tmp_path / name, model=model, max_steps=1)
        s2 = tmp_path / name / "trace"
        assert json.loads((s2 / "header.json").read_text())["lineage"]["parent"] is not None, name
        with pytest.raises(UnlearnError, match=rf"stage 2 \(.*\): its adapter {why}"):
            forget([str(s1), str(s2)], ids_at_step(s1, 1)[:1], tmp_path / "out", oracle=True, progress=False)
        assert not (tmp_path / "out").exists()
        cost = validate_pipeline([str(s1), str(s2)], ids_at_step(s2, 0)[:1])["pipeline_cost"]
        assert cost["first_affected_stage"] == 2, name
    # the deletion as it ran before the refusal (the DoRA magnitudes kept): `trace verify OUT` does not verify it
    import hf_unlearn.deletion.pipeline as pipeline
    from hf_unlearn.deletion.pipeline import verify_pipeline

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_refuse_copied_modules", lambda *a: None)
        assert forget([str(s1), str(s2)], ids_at_step(s1, 1)[:1], tmp_path / "old", oracle=True, progress=False).ok
    report = verify_pipeline(tmp_path / "old")
    assert not report["verified"] and any("stage 2: the replay" in p and "DoRA" in p for p in report["problems"])
