"""Exact deletion through a training pipeline (issue #35): lineage recorded from the weights, one request through
every stage, each stage's replay == oracle == an engine-free counterfactual built stage by stage (plain Trainer runs,
the deleted rows' labels -100, the recorded normalisers, stage 2 starting from the stage-1 counterfactual), bad
pipelines refused before compute naming the stage, and the pipeline verdict attacked."""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from hf_unlearn.errors import UnlearnError

from .test_trace_common import config_model, get_trace_data, ids_at_step, record, rsqrt_other_bits, tiny
from .test_trace_fidelity import independent_counterfactual

KW = dict(gradient_accumulation_steps=1, max_steps=4)


def _model(family: str, tok):
    if family == "llama":
        return tiny(tok)
    return config_model("gpt_neox", tok, rotary_pct=0.5)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # the adapter's initialisation: the counterfactual builds the same one
    target = ["q_proj", "v_proj"] if model.config.model_type == "llama" else ["query_key_value"]
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=target))


def _from(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


def record_pipeline(root: Path, family: str = "llama", lora: bool = False) -> tuple[Path, Path]:
    """Stage 1: a full fine-tune on rows 0..15, saved with save_model; stage 2: loaded from that folder with
    from_pretrained (a LoRA on it with ``lora``), trained on rows 16..31. Returns the two trace folders."""
    tok, data = get_trace_data()
    t1 = record(tok, data.select(range(16)), root / "s1", model=_model(family, tok), **KW)
    t1.save_model(str(root / "s1"))
    model = _from(root / "s1")
    record(tok, data.select(range(16, 32)), root / "s2", model=_lora(model) if lora else model, **KW)
    return root / "s1" / "trace", root / "s2" / "trace"


@functools.cache
def shared_pipeline() -> tuple[Path, Path]:
    root = Path(tempfile.mkdtemp(prefix="trace_pipeline_"))
    atexit.register(shutil.rmtree, root, True)
    return record_pipeline(root)


def counterfactual_chain(tmp: Path, family: str, runs, ids1, ids2, lora: bool = False) -> list[dict]:
    """The engine-free counterfactual, stage by stage: plain Trainer runs (deleted rows' labels -100, recorded
    normalisers and seeds); stage 2 starts from the stage-1 counterfactual's saved model."""
    tok, data = get_trace_data()
    m1 = _model(family, tok)
    cf1 = independent_counterfactual(tok, data.select(range(16)), m1, runs[0], ids1, tmp / "cf1", **KW)
    m1.save_pretrained(tmp / "cf1-model")
    m2 = _from(tmp / "cf1-model")
    m2 = _lora(m2) if lora else m2
    cf2 = independent_counterfactual(tok, data.select(range(16, 32)), m2, runs[1], ids2, tmp / "cf2", **KW)
    return [cf1, cf2]


def _final(folder: Path) -> dict:
    from hf_unlearn.trace.checkpoints import full_model_state, load_checkpoint
    from hf_unlearn.trace.run import list_checkpoints

    cps = list_checkpoints(folder)
    return full_model_state(load_checkpoint(cps[max(cps)]))


def _same(a: dict, b: dict) -> list[str]:
    return [n for n in b if not torch.equal(a[n], b[n])]


def _check_cases(tmp_path, family: str, runs, cases, lora: bool = False):
    from hf_unlearn.deletion import forget
    from hf_unlearn.deletion.pipeline import verify_pipeline

    for name, ids1, ids2 in cases:
        out = tmp_path / name
        receipt = forget(list(runs), ids1 + ids2, out, oracle=True, progress=False)
        assert receipt.ok and receipt.evidence["verified"] is True, name
        stages = receipt.evidence["pipeline"]
        assert [s["replayed"] for s in stages] == [bool(ids1), True], name
        if ids1:  # the later stage replayed in full from the new parent
            assert stages[1]["start_step"] == 0 and stages[1]["steps_replayed"] == KW["max_steps"]
        cfs = counterfactual_chain(tmp_path / f"cf-{name}", family, runs, ids1, ids2, lora=lora)
        for k, cf in enumerate(cfs, start=1):
            if not stages[k - 1]["replayed"]:
                continue
            for role in ("replay", "oracle"):
                differ = _same(_final(out / f"stage-{k}" / role), cf)
                assert not differ, (name, k, role, differ[:3])
        assert verify_pipeline(out)["verified"], name


@pytest.mark.slow  # two SFT stages, three deletions and their counterfactual chains (~20 s); SFT then DPO stays default
def test_sft_then_sft_deletions_in_stage_1_stage_2_and_both_equal_the_counterfactual_chain(tmp_path):
    """Llama: stage 1 only, stage 2 only, both: each stage's replay == oracle == the engine-free counterfactual."""
    runs = shared_pipeline()
    a, b = ids_at_step(runs[0], 1)[:1], ids_at_step(runs[1], 2)[:1]
    _check_cases(tmp_path, "llama", runs, [("stage1", a, []), ("stage2", [], b), ("both", a, b)])


@pytest.mark.slow
def test_gpt_neox_sft_then_sft_equals_the_counterfactual_chain(tmp_path):
    runs = record_pipeline(tmp_path / "rec", family="gpt_neox")
    a, b = ids_at_step(runs[0], 0)[:1], ids_at_step(runs[1], 3)[:1]
    _check_cases(tmp_path, "gpt_neox", runs, [("stage1", a, []), ("both", a, b)])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_lora_on_a_fully_fine_tuned_base_replays_on_the_new_base(tmp_path, family):
    """Stage 2 is a LoRA whose frozen base is stage 1's output: a stage-1 deletion replays the adapter on the new
    base (the parent), equal to a plain Trainer LoRA on the stage-1 counterfactual."""
    runs = record_pipeline(tmp_path / "rec", family=family, lora=True)
    header = json.loads((runs[1] / "header.json").read_text())
    assert header["lineage"]["parent"]["run_id"] == json.loads((runs[0] / "header.json").read_text())["run_id"]
    a, b = ids_at_step(runs[0], 2)[:1], ids_at_step(runs[1], 1)[:1]
    _check_cases(tmp_path, family, runs, [("stage1", a, []), ("both", a, b)], lora=True)


def test_lineage_is_recorded_from_the_weights_and_a_declared_parent_is_checked(tmp_path):
    """Stage 1 from a config in memory is an external base; stage 2 loaded from stage 1's saved model names it by run
    id and root; a trace_parent= hint whose output is not the model's weights is refused before training."""
    from hf_unlearn.cli import main
    from hf_unlearn.trace.lineage import output_root
    from hf_unlearn.trace.run import open_run

    s1, s2 = shared_pipeline()
    h1, h2 = (json.loads((r / "header.json").read_text()) for r in (s1, s2))
    assert h1["lineage"]["parent"] is None and h1["lineage"]["external"] == {"source": "memory"}
    assert h2["lineage"]["parent"]["run_id"] == h1["run_id"]
    assert h2["lineage"]["start_root"] == h2["lineage"]["parent"]["output_root"] == output_root(open_run(s1)) \
        == h1["lineage"]["output_root"]  # sealed when stage 1 finished, recomputed here from its final checkpoint
    assert str(s1.parent) not in (s2 / "header.json").read_text()  # the parent's folder is private
    tok, data = get_trace_data()
    with pytest.raises(UnlearnError, match="trace_parent=.*is not that run's output"):
        record(tok, data.select(range(8)), tmp_path / "x", max_steps=1, trainer_kwargs={"trace_parent": s1})
    assert main(["trace", "lineage", str(s2)]) == 0


def test_bad_pipelines_are_refused_before_compute_naming_the_stage(tmp_path):
    """Out of order, a missing stage, a stage from another pipeline, a parent changed after the child recorded."""
    from hf_unlearn.deletion import forget

    s1, s2 = shared_pipeline()
    ids = ids_at_step(s1, 1)[:1]
    with pytest.raises(UnlearnError, match="out of order: stage 1"):
        forget([str(s2), str(s1)], ids, tmp_path / "o1", oracle=True, progress=False)
    # a missing stage: stage 2 alone, its parent's folder moved away; or the pipeline given from stage 2 on
    moved = shutil.copytree(s1.parent, tmp_path / "moved" / "s1")
    s2_copy = shutil.copytree(s2, tmp_path / "c" / "trace")
    (s2_copy / "private" / "lineage.json").write_text(json.dumps({"parent_path": str(tmp_path / "gone")}))
    with pytest.raises(UnlearnError, match="a stage of the pipeline is missing"):
        forget(str(s2_copy), ids, tmp_path / "o2", progress=False)
    other = record_pipeline(tmp_path / "other")
    with pytest.raises(UnlearnError, match=r"stage 1 \(.*\) starts from the output of recorded run .* not given"):
        forget([str(s2), str(other[1])], ids, tmp_path / "o2", progress=False)
    # a stage from another pipeline: stage 2 of this pipeline after another pipeline's stage 1
    with pytest.raises(UnlearnError, match=r"stage 2 \(.*\) starts from recorded run .* not from stage 1's output"):
        forget([str(other[0]), str(s2)], ids, tmp_path / "o3", progress=False)
    # the parent changed after the child recorded (an editor with the run key rewrote stage 1's final checkpoint)
    _rewrite_final_checkpoint(moved / "trace")
    (s2_copy / "private" / "lineage.json").write_text(json.dumps({"parent_path": str(moved / "trace")}))
    with pytest.raises(UnlearnError, match=r"stage 2 \(.*\) started from stage 1's output .* the parent changed after"):
        forget(str(s2_copy), ids, tmp_path / "o4", progress=False)
    assert not any((tmp_path / f"o{k}").exists() for k in ("1", "2", "3", "4"))


def test_a_pipeline_deletion_needs_every_stage_it_replays_proven(tmp_path):
    """A pipeline deletion is VERIFIED stage by stage, so a stage recorded without a proof (``trace_self_check=1``:
    its first step self-checked only) is refused before any compute, naming the stage and the command that proves it;
    --accept-unproven is not offered for a pipeline; once the stage is proven, the same deletion is VERIFIED and
    `trace verify OUT` agrees."""
    from hf_unlearn.deletion import forget
    from hf_unlearn.deletion.pipeline import verify_pipeline
    from hf_unlearn.trace.proof import ProofError, prove

    tok, data = get_trace_data()
    t1 = record(tok, data.select(range(16)), tmp_path / "s1", model=_model("llama", tok), **KW)
    t1.save_model(str(tmp_path / "s1"))
    record(tok, data.select(range(16, 32)), tmp_path / "s2", model=_from(tmp_path / "s1"),
           trainer_kwargs={"trace_self_check": 1}, **KW)
    runs = [str(tmp_path / "s1" / "trace"), str(tmp_path / "s2" / "trace")]
    ids = ids_at_step(runs[0], 1)[:1]  # a stage-1 row: stage 2 is replayed in full from the new parent
    with pytest.raises(ProofError, match=r"^stage 2: .*: steps 1\.\.3 .* not proven") as e:
        forget(runs, ids, tmp_path / "refused", oracle=True, progress=False)
    assert "\n" not in str(e.value) and f"trace prove {runs[1]}" in str(e.value)
    with pytest.raises(UnlearnError, match="--accept-unproven is for one recorded run"):
        forget(runs, ids, tmp_path / "accepted", oracle=True, progress=False, accept_unproven=True)
    assert not (tmp_path / "refused").exists() and not (tmp_path / "accepted").exists()
    assert prove(runs[1], progress=False)["proven"]
    receipt = forget(runs, ids, tmp_path / "ok", oracle=True, progress=False)
    assert receipt.ok and receipt.evidence["verified"] is True and verify_pipeline(tmp_path / "ok")["verified"]


def _rewrite_final_checkpoint(run: Path) -> None:
    """Edit one weight of the final checkpoint and re-bind it with the run key (only the key holder can)."""
    from safetensors.torch import load_file, save_file

    from hf_unlearn.trace.checkpoints import CheckpointIndex, load_checkpoint
    from hf_unlearn.trace.hashing import checkpoint_hashes
    from hf_unlearn.trace.run import list_checkpoints, read_header, write_sidecar
    from hf_unlearn.trace.tags import run_key

    cps = list_checkpoints(run)
    d = cps[max(cps)]
    tensors = load_file(d / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, d / "model.safetensors")
    state = load_checkpoint(d, verify=False)
    (d / "hashes.json").write_text(json.dumps(checkpoint_hashes(state), indent=1, sort_keys=True))
    write_sidecar(d / "hashes.json")
    header = read_header(run)
    index = CheckpointIndex.load(run, header["run_id"], run_key(run))
    index.add(max(cps))
    index.save()


def test_pipeline_verdict_attacked(tmp_path):
    """A receipt whose chain is edited, a swapped parent (stage 2's folders from another deletion), a stage folder
    replaced: `trace verify OUT` says NOT VERIFIED naming the stage; the untouched deletion verifies."""
    from hf_unlearn.cli import main
    from hf_unlearn.deletion import forget
    from hf_unlearn.deletion.pipeline import verify_pipeline

    s1, s2 = shared_pipeline()
    a, b = ids_at_step(s1, 3)[:1], ids_at_step(s2, 0)[:1]
    good = tmp_path / "good"
    forget([str(s1), str(s2)], a + b, good, oracle=True, progress=False)
    assert main(["trace", "verify", str(good)]) == 0
    # 1. the receipt's chain edited: stages reordered, a root changed
    edited = shutil.copytree(good, tmp_path / "edited")
    receipt = json.loads((edited / "receipt.json").read_text())
    receipt["evidence"]["pipeline"][1]["replay"]["output_root"] = "0" * 64
    (edited / "receipt.json").write_text(json.dumps(receipt))
    report = verify_pipeline(edited)
    assert not report["verified"] and any("stage 2: the replay's output root" in p for p in report["problems"])
    receipt["evidence"]["pipeline"].reverse()
    (edited / "receipt.json").write_text(json.dumps(receipt))
    assert not verify_pipeline(edited)["verified"]
    # 2. a swapped parent: stage 2's replay and oracle from a deletion of stage 2's ids only (their parent is the
    # recorded stage 1, not this deletion's stage 1): bit-identical to each other, and still refused
    other = tmp_path / "stage2-only"
    forget([str(s1), str(s2)], b, other, oracle=True, progress=False)
    swapped = shutil.copytree(good, tmp_path / "swapped")
    for role in ("replay", "oracle"):
        shutil.rmtree(swapped / "stage-2" / role)
        shutil.copytree(other / "stage-2" / role, swapped / "stage-2" / role)
    report = verify_pipeline(swapped)
    assert not report["verified"]
    assert any("stage 2" in p and ("swapped parent" in p or "not the receipt's" in p) for p in report["problems"])
    assert main(["trace", "verify", str(swapped)]) == 1


def test_sft_then_dpo_with_the_sft_model_as_reference_deletes_through_both_stages(tmp_path):
    """SFT (plain Trainer) on rows 0..15, then trl.DPOTrainer from its saved model with ref_model=None (TRL reloads
    the SFT model: the reference is the parent) on pairs of rows 0..15. One id in both stages: deleted in each; the
    DPO stage is replayed from the new SFT output with the new SFT output as its reference. Replay == oracle == a
    plain Trainer then a plain DPOTrainer (deleted rows' labels -100, deleted pairs without completion tokens)."""
    pytest.importorskip("trl")
    from trl import DPOTrainer

    from hf_unlearn.data import tokenize_qa
    from hf_unlearn.deletion import forget
    from hf_unlearn.deletion.pipeline import verify_pipeline
    from hf_unlearn.trace import trace_recording

    from .test_trace_dpo import counterfactual, dpo_config, pairs, saved_model
    from .test_trace_sft import _rows_and_tokenizer

    rows, tok = _rows_and_tokenizer()
    sft_data = tokenize_qa(rows.select(range(16)), tok, max_length=128)
    _, dpo_data = pairs(n=16)
    t1 = record(tok, sft_data, tmp_path / "sft", model=saved_model(tmp_path / "base", tok), **KW)
    t1.save_model(str(tmp_path / "sft"))
    dpo = trace_recording(DPOTrainer)(model=_from(tmp_path / "sft"), args=dpo_config(tmp_path / "dpo"),
                                      train_dataset=dpo_data, processing_class=tok, trace_checkpoint_steps=2,
                                      trace_checkpoint_retention="even")
    dpo.train()
    s1, s2 = tmp_path / "sft" / "trace", tmp_path / "dpo" / "trace"
    h2 = json.loads((s2 / "header.json").read_text())
    assert h2["lineage"]["parent"]["run_id"] == json.loads((s1 / "header.json").read_text())["run_id"]
    assert h2["reference_model"]["params_root"] == h2["lineage"]["start_root"]  # the reference is the parent
    first = ids_at_step(s1, 1)[:1]  # an early SFT row, also a DPO pair
    ids = first + [i for i in ids_at_step(s2, 0) if i not in first][:1]
    receipt = forget(str(s2), ids, tmp_path / "out", oracle=True, progress=False)  # the lineage found from DPO
    assert receipt.ok and receipt.evidence["verified"] is True
    st = receipt.evidence["pipeline"]
    assert [s["ids"] for s in st] == [2, 2] and st[1]["reference_replaced"] and st[1]["start_step"] == 0
    assert verify_pipeline(tmp_path / "out")["verified"]
    # the engine-free chain: a plain Trainer, then a plain DPOTrainer started from (and referencing) its output
    m1 = saved_model(tmp_path / "base", tok)
    cf1 = independent_counterfactual(tok, sft_data, m1, s1, ids, tmp_path / "cf1", **KW)
    assert not _same(_final(tmp_path / "out" / "stage-1" / "oracle"), cf1)
    m1.save_pretrained(tmp_path / "cf1-model")
    cf2 = counterfactual(tmp_path, tok, dpo_data, tmp_path / "cf1-model", ids)
    for role in ("replay", "oracle"):
        assert not _same(_final(tmp_path / "out" / "stage-2" / role), cf2["model"]), role
    assert _same(_final(tmp_path / "out" / "stage-2" / "replay"), _final(s2))  # and the deletion changed DPO's output


def test_a_later_request_goes_through_the_replayed_pipeline(tmp_path, capsys):
    """After a pipeline deletion, the next request starts from the replayed last stage: the pipeline of replayed
    stages is found from it (each remembers its parent folder), checked (run ids and roots) and deleted from again; an
    id the first request deleted, repeated, is already absent (it failed "not in the store" after the probe)."""
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.deletion import forget

    s1, s2 = shared_pipeline()
    first = tmp_path / "first"
    write_ids(tmp_path / "ids.jsonl", ids_at_step(s1, 3)[:1])
    assert main(["trace", "cost", str(s1), str(s2), "--forget", str(tmp_path / "ids.jsonl")]) == 0
    assert main(["forget", str(s1), str(s2), "--ids", str(tmp_path / "ids.jsonl"), "--out", str(first), "--oracle",
                 "--no-progress"]) == 0  # the command over the stages, in training order
    later = ids_at_step(s1, 3)[:1] + ids_at_step(s1, 2)[:1] + ids_at_step(s2, 3)[:1]
    receipt = forget(str(first / "stage-2" / "replay"), later, tmp_path / "second", oracle=True, progress=False)
    assert receipt.evidence["verified"] is True
    assert [s["origin_run_id"] for s in receipt.evidence["pipeline"]] == \
        [json.loads((s / "header.json").read_text())["run_id"] for s in (s1, s2)]
    assert main(["trace", "verify", str(tmp_path / "second")]) == 0
    out = capsys.readouterr().out
    assert "a deletion in stage 1 replays every later stage in full (4 steps of 1 stage(s))" in out
    assert "stage 2: replay == oracle VERIFIED, starts from stage 1's replayed output" in out


@pytest.mark.slow  # two batches with their oracles: about 40 s
def test_the_deletion_service_serves_a_pipeline_from_a_ledger_over_its_last_run(tmp_path):
    """A ledger over the pipeline's last run accepts ids of any stage (ids in no stage refused), prices the pending set
    over every stage, serves it in one batch that replays each affected stage once, signs receipts that verify with the
    public key and the served model, and the next batch deletes from the replayed pipeline."""
    from hf_unlearn.deletion import DeletionLedger, verify_receipt
    from hf_unlearn.deletion.pipeline import verify_pipeline
    from hf_unlearn.keys import load_signing_key

    s1, s2 = shared_pipeline()
    ledger = DeletionLedger(s2, tmp_path / "ledger")
    with pytest.raises(UnlearnError, match="appear in no stage of the pipeline"):
        ledger.add([10_000])
    ledger.add(ids_at_step(s1, 2)[:1], received="2026-11-01")
    ledger.add(ids_at_step(s2, 1)[:1], received="2026-11-01")
    plan = ledger.plan(now="2026-11-02")
    assert plan["total_steps"] == 8 and plan["batch_now"] == 2 + 4 and plan["batch_start_checkpoint"] == "2 of stage 1"
    quiet = {"progress": False, "log": lambda m: None}
    first = ledger.serve_exact(oracle=True, now="2026-11-02", **quiet)
    out = tmp_path / "ledger" / "batches" / "batch-0001"
    assert first.forget_receipt.evidence["verified"] is True and verify_pipeline(out)["verified"]
    public = load_signing_key().public_key()
    for path in [*first.receipts.values(), first.batch_receipt]:
        assert verify_receipt(path, public, model=out / "model").ok
    assert ledger.current_run() == (out / "stage-2" / "replay").resolve() or \
        ledger.current_run() == out / "stage-2" / "replay"
    ledger.add(ids_at_step(s1, 0)[:1], received="2026-11-03")
    second = ledger.serve_exact(oracle=True, now="2026-11-04", **quiet)
    assert second.forget_receipt.evidence["verified"] is True
    assert [s["steps_replayed"] for s in second.forget_receipt.evidence["pipeline"]] == [4, 4]


def test_a_pipeline_deletion_probes_the_deleting_environment(tmp_path, monkeypatch):
    """ATTACK: the deleting process computes RMSNorm otherwise than the recording (``torch.rsqrt`` replaced by
    ``1 / sqrt(x)``: other bits; a patched ``torch.nn.functional`` is refused earlier, by the sealed code digests). A single run's deletion is refused by its environment probe; a pipeline
    deletion ran no probe, so a row of stage 1's step 0 (every step of both stages affected, none compared with the
    recording) had its replays and oracles equally wrong and was VERIFIED, each stage off the engine-free
    counterfactual chain. Now every stage it replays is probed before any compute, the refusal naming the stage."""
    from hf_unlearn.deletion import forget
    from hf_unlearn.trace.proof import ProofError

    runs = [str(r) for r in shared_pipeline()]
    ids = ids_at_step(runs[0], 0)[:1]
    monkeypatch.setattr(torch, "rsqrt", rsqrt_other_bits(monkeypatch))
    with pytest.raises(ProofError, match="the deleting environment does not reproduce") as e:
        forget(runs[0], ids, tmp_path / "single", oracle=True, progress=False)
    with pytest.raises(ProofError, match=r"^stage 1: .*the deleting environment does not reproduce") as e:
        forget(runs, ids, tmp_path / "pipeline", oracle=True, progress=False)
    assert "\n" not in str(e.value) and "refusing before any compute" in str(e.value)
    assert not (tmp_path / "single").exists() and not (tmp_path / "pipeline").exists()


def test_rows_a_stage_never_reached_are_answered_never_trained_not_unknown(tmp_path):
    """Stage 1 trains 2 steps of 4 rows on its 16 rows (``max_steps`` shorter than an epoch): the 8 rows it never
    reached are in its token store and in no step. With a stage-2 row, the pipeline deletion replays stage 2 alone,
    says why stage 1 is unchanged, and equals the engine-free counterfactual (stage 2's plain Trainer run from the
    unchanged stage-1 model); alone, it is refused before any compute naming the stage and why (both were refused as
    ids "in no stage of the pipeline", which a single run answers "never trained on")."""
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.deletion import forget

    tok, data = get_trace_data()
    t1 = record(tok, data.select(range(16)), tmp_path / "s1", model=_model("llama", tok), **{**KW, "max_steps": 2})
    t1.save_model(str(tmp_path / "s1"))
    record(tok, data.select(range(16, 32)), tmp_path / "s2", model=_from(tmp_path / "s1"), **KW)
    s1, s2 = tmp_path / "s1" / "trace", tmp_path / "s2" / "trace"
    reached = set(ids_at_step(s1, 0) + ids_at_step(s1, 1))
    unreached = [i for i in data.select(range(16))["id"] if i not in reached]
    assert len(unreached) == 8
    ids2 = ids_at_step(s2, 2)[:1]

    write_ids(tmp_path / "ids.jsonl", unreached[:1] + ids2)
    assert main(["trace", "cost", str(s1), str(s2), "--forget", str(tmp_path / "ids.jsonl")]) == 0
    receipt = forget([str(s1), str(s2)], unreached[:1] + ids2, tmp_path / "out", oracle=True, progress=False)
    assert receipt.evidence["verified"] is True
    stages = receipt.evidence["pipeline"]
    assert [s["replayed"] for s in stages] == [False, True] and "never trained on" in stages[0]["why"]
    cf = independent_counterfactual(tok, data.select(range(16, 32)), _from(tmp_path / "s1"), s2, ids2,
                                    tmp_path / "cf2", **KW)
    for role in ("replay", "oracle"):
        assert not _same(_final(tmp_path / "out" / "stage-2" / role), cf), role
    from hf_unlearn.deletion.remains import still_holding

    held = dict(still_holding(receipt))["still holds"]  # stage 1's store alone holds the row there
    assert "the token store of stage(s) 1 (rows never trained on there)" in held and "from stage 2 on" in held
    assert main(["trace", "verify", str(tmp_path / "out")]) == 0  # the unreached id is answered, not missing

    with pytest.raises(UnlearnError, match=r"^id '14' is str but the pipeline \(.*\) uses int ids"):
        forget([str(s1), str(s2)], ["14"] + ids2, tmp_path / "typed", progress=False)

    with pytest.raises(UnlearnError, match=r"^nothing to replay, no model of the pipeline changes: stage 1: .*"
                                           r"1 never trained on .*max_steps shorter than an epoch.*"
                                           r"stay only in the token store of their stage .*s1/trace/private/store"):
        forget([str(s1), str(s2)], unreached[:2][1:], tmp_path / "alone", oracle=True, progress=False)
    assert not (tmp_path / "alone").exists()
