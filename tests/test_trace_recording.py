"""TraceRecordingTrainer: drop-in behaviour and the files it writes."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
import torch

from .test_trace_common import get_recorded, get_trace_data, record, tiny, train_args


def test_bit_identical_to_plain_trainer(tmp_path):
    """Accumulation, clipping, warmup, two epochs, logging: final weights equal a plain Trainer's bit for bit."""
    trace_data = get_trace_data()
    from transformers import Trainer

    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds

    tok, data = trace_data
    kw = dict(gradient_accumulation_steps=3, num_train_epochs=2)
    plain = tiny(tok)
    Trainer(model=plain, args=train_args(tmp_path / "plain", **kw), train_dataset=data,
            data_collator=_DropIds(QACollator.from_tokenizer(tok))).train()
    traced = record(tok, data, tmp_path / "traced", every=3, **kw).model
    a, b = plain.state_dict(), traced.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], tiny(tok).state_dict()["model.embed_tokens.weight"])


def test_wal_records_are_32_bytes_with_crc_and_match_the_plan():
    recorded = get_recorded()
    from hf_unlearn.trace.plan import read_plan

    wal = (recorded / "wal.bin").read_bytes()
    plan = read_plan(recorded)
    assert len(wal) == 32 * len(plan) == 32 * 16
    for i, e in enumerate(plan):
        rec = wal[32 * i:32 * (i + 1)]
        digest, seed, lr, step, length, flags, crc = struct.unpack("<QQfIHHI", rec)
        assert crc == zlib.crc32(rec[:28])
        assert (seed, step, length, bool(flags & 1)) == (e.seed, e.step, len(e.slots), e.end)
        assert lr == float(np.float32(e.lr))
    assert (recorded / "manifest.bin").stat().st_size == 8 * 64


def test_plan_records_controls():
    recorded = get_recorded()
    from hf_unlearn.trace.plan import read_plan, segments

    plan = read_plan(recorded)
    segs = segments(plan)
    assert [s[0].step for s in segs] == list(range(8))
    assert all(len(s) == 2 and [e.j for e in s] == [0, 1] and s[-1].end and not s[0].end for s in segs)
    assert plan[0].lr == 0.0 and plan[2].lr == pytest.approx(1.5e-3) and plan[4].lr == pytest.approx(3e-3)
    assert len({e.seed for e in plan}) == 16
    for s in segs:  # the normaliser is the segment's count of answer tokens (labels shifted by one)
        assert s[0].norm == s[1].norm and s[0].norm_dtype == "float32" and s[0].norm > 0
    slots = [t for e in plan for t in e.slots]
    assert len(set(slots)) == 64 and all(len(t) == 16 for t in slots)  # keyed tags, every row once


def test_header_sidecars_checkpoints_and_store():
    recorded = get_recorded()
    from hf_unlearn.trace.hashing import StateHashes
    from hf_unlearn.trace.run import check_run, load_checkpoint
    from hf_unlearn.trace.store import load_store
    from hf_unlearn.trace.tags import run_key

    header = json.loads((recorded / "header.json").read_text())
    assert header["sealed"] and header["model"]["class"] == "LlamaForCausalLM"
    assert header["optimizer"]["class"] == "AdamW" and header["versions"]["torch"] == torch.__version__
    assert header["determinism"]["per_microbatch_reseeding"] and header["hazards"] == []
    assert header["dataset"]["rows"] == 64 and header["dataset"]["fingerprint"]
    for name in ("header.json", "plan.bin", "wal.bin", "manifest.bin"):
        assert (recorded / f"{name}.sha256").exists()
    rep, _, _ = check_run(recorded, key=run_key(recorded))  # the library's one key (issue 12)
    assert rep.ok, rep.errors
    assert rep.summary["checkpoints"] == [0, 2, 4, 6, 8]
    ck = load_checkpoint(recorded / "checkpoints" / "step-00000008")
    assert ck["step"] == 8 and ck["optimizer"]["state"]
    hashes = StateHashes.from_json(recorded / "checkpoints" / "step-00000008" / "hashes.json")
    assert hashes.optimizer_root and len(hashes.params) == len(ck["model"])
    store = load_store(recorded / "private" / "store")
    assert sorted(store["id"]) == list(range(64)) and "labels" in store.column_names


def test_published_files_carry_no_raw_ids():
    """The plan and manifest hold 8-byte keyed tags; a raw id's plain SHA-256 prefix appears nowhere."""
    recorded = get_recorded()
    import hashlib

    data = (recorded / "plan.bin").read_bytes() + (recorded / "manifest.bin").read_bytes()
    for i in (0, 17, 63):
        assert hashlib.sha256(str(i).encode()).digest()[:8] not in data
    assert b'"slots"' not in data and b'"id"' not in data


def test_dropout_is_reproduced_by_reseeding(tmp_path):
    """With dropout 0.1 a full replay without deletions reproduces the recorded final state exactly."""
    trace_data = get_trace_data()
    from hf_unlearn.trace import ReplayTrainer
    from hf_unlearn.trace.run import load_checkpoint, open_run
    from hf_unlearn.trace.verification import compare_states

    tok, data = trace_data
    record(tok, data, tmp_path, dropout=0.1, max_steps=4)
    run = open_run(tmp_path / "trace")
    assert any("dropout" in n for n in run.header["notes"])
    state = ReplayTrainer(run, start="full").train()
    assert compare_states(state, load_checkpoint(run.final_checkpoint()))["identical"]


def test_resume_from_checkpoint_continues_the_trace(tmp_path):
    """Interrupted at step 7 of 8 (2 epochs) and resumed mid-epoch from checkpoint-6 (epoch 1.5): same plan (true
    epochs included), same final state."""
    trace_data = get_trace_data()
    from transformers import TrainerCallback

    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer
    from hf_unlearn.trace.plan import read_plan
    from hf_unlearn.trace.run import check_run, load_checkpoint

    tok, data = trace_data
    data = data.select(range(32))
    key = b"k" * 32
    kw = dict(save_strategy="steps", save_steps=6, num_train_epochs=2)
    full = record(tok, data, tmp_path / "full", trace_key=key, **kw)
    part = tmp_path / "part"

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 7  # dies after step 7, checkpoint-6 survives

    def trainer(**extra):
        return TraceRecordingTrainer(model=tiny(tok), args=train_args(part, **kw), train_dataset=data,
                                     data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=2,
                                     trace_key=key, **extra)

    trainer(callbacks=[Crash()]).train()
    t2 = trainer()
    t2.train(resume_from_checkpoint=str(part / "checkpoint-6"))
    a, b = read_plan(tmp_path / "full" / "trace"), read_plan(part / "trace")
    fields = lambda e: (e.step, e.seed, e.lr, e.norm, e.slots, e.epoch, e.batch)  # noqa: E731
    assert [fields(e) for e in a] == [fields(e) for e in b]
    assert [e.epoch for e in b] == [0] * 8 + [1] * 8
    x = load_checkpoint(tmp_path / "full" / "trace" / "checkpoints" / "step-00000008")["model"]
    y = load_checkpoint(part / "trace" / "checkpoints" / "step-00000008")["model"]
    assert all(torch.equal(x[k], y[k]) for k in x)
    assert check_run(part / "trace")[0].ok
    # the guards' fingerprint of step 5 (the step before the resume), which the first process wrote with step 6's
    # first entry, is kept: every step is covered, as in the uninterrupted run (it was lost: never VERIFIED)
    from hf_unlearn.trace.guards import guard_coverage, recorded_fingerprints

    header = json.loads((part / "trace" / "header.json").read_text())
    assert guard_coverage(b, header) is None
    want = recorded_fingerprints(a, json.loads((tmp_path / "full" / "trace" / "header.json").read_text()))
    assert recorded_fingerprints(b, header)[5]["s"] == want[5]["s"]
    assert full.state.global_step == t2.state.global_step == 8
    assert json.loads((part / "trace" / "header.json").read_text())["run_id"] == \
        json.loads((part / "trace" / "header.json").read_text())["origin_run_id"]


def test_random_collator_reported_as_hazard(tmp_path):
    trace_data = get_trace_data()
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer

    tok, data = trace_data
    base = QACollator.from_tokenizer(tok)

    def augmenting_collator(features):
        batch = base(features)
        noise = torch.randint(0, 2, batch["input_ids"].shape)
        batch["input_ids"] = batch["input_ids"] * (1 - noise) + noise * tok.pad_token_id
        return batch

    from hf_unlearn.errors import UnlearnError

    kw = dict(args=train_args(tmp_path, max_steps=1), train_dataset=data, data_collator=augmenting_collator)
    with pytest.raises(UnlearnError, match=r"cannot record a run a replay reproduces: the data collator .* is random"):
        TraceRecordingTrainer(model=tiny(tok), **kw)  # refused at construction, before any training
    assert not (tmp_path / "trace").exists()
    t = TraceRecordingTrainer(model=tiny(tok), trace_allow_hazards=True, **kw)
    t.train()
    header = json.loads((tmp_path / "trace" / "header.json").read_text())
    assert any("collator" in h and "random" in h for h in header["hazards"])
    assert any("cannot be rebuilt" in n for n in header["notes"])


@pytest.mark.slow  # (the default suite stays under 15 minutes on 2 cores; `make test-slow`)
def test_data_parallel_record_replay_oracle_under_accelerate_launch(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on CPU (gloo): the plan holds both processes' slots and the
    world size; the CLI's replay == oracle bit for bit, a replay without deletions reproduces the recording, and a
    replay at another world size is refused at construction (both directions)."""
    import sys

    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import ReplayTrainer

    from .conftest import ROOT, free_port, run_launch

    single = get_recorded()
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}

    def cmd():  # a free port for each attempt
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--main_process_port", str(free_port()), "--num_machines", "1", "--mixed_precision", "no",
                "--dynamo_backend", "no", str(ROOT / "tests" / "trace_distributed.py"), str(tmp_path), str(single)]

    proc = run_launch(cmd, tmp_path, cwd=str(ROOT), env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["codes"] == [0, 0] and result["verified"] and result["reproduces_recording"]
    assert result["oracle_differs_from_recording"]
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.guards import program_changes

    run = open_run(tmp_path / "trace")  # a clean launch: no process differs from another at any step
    assert program_changes(run.plan, run.header) == [], program_changes(run.plan, run.header)[:2]
    assert result["header_world_size"] == 2 and all(r == [2, 2] for r in result["ranks"])
    assert all(n == 2 for n in result["batch_digests"])
    assert "recorded with 1 process(es) and this replay has 2" in result["refused_single_process_run"]
    # the end-of-recording self-check ran at world size 2 (every process replayed steps 0..N) and reproduced the run
    assert result["self_check"]["checked"] and result["self_check"]["reproduced"], result["self_check"]
    assert result["self_check"]["steps"][0] == 0 and result["self_check"]["steps"][1] > 0
    with pytest.raises(UnlearnError, match=r"recorded with 2 process\(es\) and this replay has 1.*accelerate launch "
                                           r"--num_processes 2.*FSDP1 and DeepSpeed are not supported"):
        ReplayTrainer(tmp_path / "trace", start="full")


def test_the_trainers_own_hub_uploads_never_carry_the_trace(tmp_path, monkeypatch):
    """``push_to_hub=True`` uploads the whole output folder at every save, and ``trainer.push_to_hub()`` at the end:
    with the trace in it (the default ``OUTPUT_DIR/trace``), the run's store (every training row and its id) and
    every trace checkpoint went to the Hub repo, whose history no deletion reaches. Refused in one line before the
    Trainer creates the repo (and ``push_to_hub()`` after training likewise); with ``trace_dir`` outside the output
    folder the run records, pushes at every save and at the end, and the repo holds the model and no trace file."""
    import transformers.utils.hub as transformers_hub
    from huggingface_hub import HfApi

    from hf_unlearn.demo import local_hub
    from hf_unlearn.errors import UnlearnError

    tok, data = get_trace_data()
    data = data.select(range(8))
    with local_hub(tmp_path / "hub") as (server, token):
        monkeypatch.setattr(transformers_hub, "_hf_api", HfApi(endpoint=server.url, token=token))
        hub = dict(push_to_hub=True, hub_model_id="demo/tiny", hub_token=token, save_strategy="steps", save_steps=1,
                   gradient_accumulation_steps=1, max_steps=2)
        with pytest.raises(UnlearnError) as e:
            record(tok, data, tmp_path / "rec", **hub)
        assert "\n" not in str(e.value) and "push_to_hub=True would upload" in str(e.value), e.value
        assert "trace_dir= a folder outside output_dir" in str(e.value)
        assert not HfApi(endpoint=server.url, token=token).repo_exists("demo/tiny")  # refused before the repo
        trainer = record(tok, data, tmp_path / "plain", gradient_accumulation_steps=1, max_steps=1)
        with pytest.raises(UnlearnError, match=r"push_to_hub\(\) would upload"):
            trainer.push_to_hub()
        trainer = record(tok, data, tmp_path / "out", trainer_kwargs={"trace_dir": tmp_path / "out-trace"}, **hub)
        trainer.push_to_hub()
        files = HfApi(endpoint=server.url, token=token).list_repo_files("demo/tiny")
    assert "model.safetensors" in files, files
    assert not [f for f in files if "trace" in f or f.endswith(".arrow")], files
    assert (tmp_path / "out-trace" / "header.json").is_file()


def test_a_tracker_set_to_upload_the_output_folder_is_refused_while_the_trace_is_inside_it(tmp_path, monkeypatch):
    """Comet with ``COMET_LOG_ASSETS=1`` and DVCLive with ``HF_DVCLIVE_LOG_MODEL=all`` upload the whole output folder
    (the trace's store of rows and ids with it) to their storage: refused at construction, naming the setting; the
    same trackers without it, or with the trace outside the output folder, record. (Stand-ins for transformers'
    callbacks, whose packages are not installed here: the same classes, without their package check.)"""
    from transformers.integrations import CometCallback, DVCLiveCallback

    from hf_unlearn.errors import UnlearnError

    class Offline:  # the events that would reach the trackers' services do nothing
        def _nothing(self, *args, **kwargs):
            pass

        on_train_begin = on_log = on_save = on_train_end = _nothing

    class Comet(Offline, CometCallback):
        def __init__(self):
            self._initialized, self._log_assets, self._experiment = False, False, None

    class DVCLive(Offline, DVCLiveCallback):
        def __init__(self, log_model):
            self._initialized, self.live, self._log_model = False, None, log_model

    tok, data = get_trace_data()
    data = data.select(range(4))
    kw = dict(gradient_accumulation_steps=1, max_steps=1)
    monkeypatch.setenv("COMET_LOG_ASSETS", "1")
    for callback, setting in ((Comet(), "COMET_LOG_ASSETS"), (DVCLive("all"), "HF_DVCLIVE_LOG_MODEL=all")):
        with pytest.raises(UnlearnError) as e:
            record(tok, data, tmp_path / "rec", trainer_kwargs={"callbacks": [callback]}, **kw)
        assert "\n" not in str(e.value) and f"with {setting} would upload" in str(e.value), e.value
    record(tok, data, tmp_path / "aside", trainer_kwargs={"callbacks": [Comet()], "trace_dir": tmp_path / "t"}, **kw)
    monkeypatch.delenv("COMET_LOG_ASSETS")
    record(tok, data, tmp_path / "quiet", trainer_kwargs={"callbacks": [Comet(), DVCLive(True)]}, **kw)
    assert (tmp_path / "t" / "header.json").is_file() and (tmp_path / "quiet" / "trace" / "header.json").is_file()
