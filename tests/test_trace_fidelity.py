"""Engine fidelity is evidence (issue #22): cast models replay exactly and equal a counterfactual built without the
replay engine; every replay checks the recorded checkpoints it passes; the recording proves its first interval and a
run the engine does not reproduce is refused."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from hf_unlearn.errors import UnlearnError

from .test_trace_common import config_model, delete, get_recorded, get_trace_data, record, train_args


def _cast_model(family: str, cast: str, tok):
    """A tiny model of ``family`` cast the way a training script does it (non-persistent rotary buffers included)."""
    model = config_model(family, tok, **({"rotary_pct": 0.5} if family == "gpt_neox" else {}))
    model = {"bfloat16()": model.bfloat16, "half()": model.half,
             "to(torch.bfloat16)": lambda: model.to(torch.bfloat16)}[cast]()
    assert any(b.dtype != torch.float32 for _, b in model.named_buffers())  # the cast reached the rotary buffers
    return model


def independent_counterfactual(tok, data, model, run_dir, forget, out, stop_at=None, callbacks=(), **kw):
    """A plain ``Trainer`` run (no replay engine): the deleted rows' labels all -100, the recorded loss normalisers
    and microbatch seeds (dropout draws), the same ``callbacks``; with ``stop_at`` it stops after that many optimizer
    steps (the model a user kept)."""
    from transformers import TrainerCallback

    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds

    from .test_trace_common import labels_masked, recorded_normalisers_trainer

    masked = labels_masked(data, forget)
    RecordedNormalisers = recorded_normalisers_trainer(run_dir)

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if stop_at is not None and state.global_step >= stop_at:  # never False: that would undo max_steps' stop
                control.should_training_stop = True

    RecordedNormalisers(model=model, args=train_args(out, **kw), train_dataset=masked, callbacks=[Stop(), *callbacks],
                        data_collator=_DropIds(QACollator.from_tokenizer(tok))).train()
    return model.state_dict()


CASES = [("mistral", "bfloat16()"), ("gpt_neox", "half()"), ("llama", "to(torch.bfloat16)"), ("qwen2", "bfloat16()")]


@pytest.mark.parametrize("family,cast", [CASES[0], *[pytest.param(*c, marks=pytest.mark.slow) for c in CASES[1:]]])
def test_cast_models_replay_exactly_and_equal_an_independent_counterfactual(tmp_path, family, cast):
    """Early (step 0) and late deletions from a cast model: VERIFIED, and the oracle equals a plain Trainer run."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    tok, data = get_trace_data()
    data = data.select(range(16))
    kw = dict(gradient_accumulation_steps=1, max_steps=4)
    record(tok, data, tmp_path / "rec", model=_cast_model(family, cast, tok), every=2, **kw)
    run = tmp_path / "rec" / "trace"
    header = json.loads((run / "header.json").read_text())
    assert header["fidelity"]["recording"] == {**header["fidelity"]["recording"], "checked": True, "reproduced": True,
                                               "steps": [0, 4], "by": "proof"}  # a short run: proven whole
    assert header["model"]["layout"]["buffers"]  # the rotary buffers were recorded
    for when, step in (("early", 0), ("late", 3)):
        forget = open_run(run).ids_at_steps([step])[:1]
        replay, report = delete(run, forget, tmp_path / when)
        assert report["verified"], (when, report["params"]["mismatched_tensors"][:3])
        oracle = load_checkpoint(open_run(tmp_path / when / "oracle").final_checkpoint())
        counterfactual = independent_counterfactual(tok, data, _cast_model(family, cast, tok), run, forget,
                                                    tmp_path / when / "plain", **kw)
        differ = [n for n, t in oracle["model"].items() if not torch.equal(t, counterfactual[n])]
        assert not differ, (when, differ[:3])
        assert "engine reproduced recorded steps 0..3, the whole run" in report["fidelity"]


def test_engine_that_does_not_reproduce_the_run_is_refused(tmp_path, monkeypatch, capsys):
    """Today's engine (no buffer restore) on a bf16-cast model: a step-0 deletion was VERIFIED against an oracle that
    is not the run's counterfactual. Now the recording's self-check catches it, names step and tensor, and every
    replay, oracle and forget refuses before any compute."""
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import OracleReplayTrainer, open_run
    from hf_unlearn.trace import replay as replay_module

    tok, data = get_trace_data()
    monkeypatch.setattr(replay_module, "restore_layout", lambda *a, **k: None)  # the engine before this change
    record(tok, data.select(range(8)), tmp_path / "rec", model=_cast_model("mistral", "bfloat16()", tok), every=2,
           max_steps=2, gradient_accumulation_steps=1)
    monkeypatch.undo()
    run = tmp_path / "rec" / "trace"
    assert sorted(open_run(run).checkpoints()) == [0, 2]  # no checkpoint file at step 1: compared in memory
    rec = json.loads((run / "header.json").read_text())["fidelity"]["recording"]
    # a short run: the default self-check is the whole run's proof (every step's state fingerprint)
    assert rec["checked"] and not rec["reproduced"] and rec["steps"] == [0, 2] and rec["by"] == "proof"
    # the per-step fingerprints (issue #31) catch it at the first step, before the in-memory hashes of step 1
    assert re.search(r"at optimizer step 0: the proof's state after the optimizer step", rec["why"]), rec["why"]
    forget = open_run(run).ids_at_steps([0])[:1]
    with pytest.raises(UnlearnError, match="does not reproduce this run.*refusing before any compute"):
        OracleReplayTrainer(run, forget, out_dir=tmp_path / "oracle")
    assert not (tmp_path / "oracle").exists()
    ids = write_ids(tmp_path / "f.jsonl", forget)
    capsys.readouterr()
    assert main(["trace", "oracle", str(run), "--forget", str(ids), "--out", str(tmp_path / "o2")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not reproduce" in err[0] and "at optimizer step 0" in err[0]
    main(["trace", "inspect", str(run)])
    assert "ENGINE DID NOT REPRODUCE" in capsys.readouterr().out
    # the failed outcome forged into a pass (sidecar rewritten, no run key): the keyed seal refuses the run
    from hf_unlearn.trace.run import write_sidecar

    header = json.loads((run / "header.json").read_text())
    header["fidelity"]["recording"].update(reproduced=True, why=None)
    (run / "header.json").write_text(json.dumps(header))
    write_sidecar(run / "header.json")
    with pytest.raises(UnlearnError, match="controls_mac does not match the run key"):
        OracleReplayTrainer(run, forget, out_dir=tmp_path / "oracle3")


def test_verify_refuses_a_run_whose_engine_did_not_reproduce_it(tmp_path, capsys):
    """A replay and oracle that agree bit for bit are not VERIFIED when the run's fidelity evidence says the engine
    failed (a header sealed by a recording whose self-check failed)."""
    from hf_unlearn.cli import main
    from hf_unlearn.trace import verify
    from hf_unlearn.trace.run import write_sidecar

    from .test_trace_common import copy_run, ids_at_step

    run = copy_run(get_recorded(), tmp_path / "run")
    forget = ids_at_step(run, 7)[:1]
    _, report = delete(run, forget, tmp_path)
    assert report["verified"]
    for folder in ("replay", "oracle"):
        header_file = tmp_path / folder / "header.json"
        header = json.loads(header_file.read_text())
        header["fidelity"]["recording"] = {"checked": True, "reproduced": False, "steps": [0, 2],
                                           "why": "at checkpoint step 2 parameter lm_head.weight differs"}
        header_file.write_text(json.dumps(header))
        write_sidecar(header_file)
    report = verify(tmp_path / "replay", tmp_path / "oracle")
    assert report["identical"] and not report["verified"]
    assert any("does not reproduce" in p for p in report["provenance"]["problems"])
    assert main(["trace", "verify", str(tmp_path / "replay"), str(tmp_path / "oracle")]) == 1
    assert "NOT VERIFIED" in capsys.readouterr().err


def test_oracle_stops_at_the_first_recorded_checkpoint_it_does_not_reproduce(tmp_path):
    """A middle checkpoint replaced by a consistent-looking foreign state (its own hashes.json matches it, and it
    is even re-indexed under the run key, as a diverging engine of the run's owner would leave it): the oracle of a late deletion stops there, naming the step and the first differing tensor, and leaves no output."""
    from hf_unlearn.trace import OracleReplayTrainer, open_run
    from hf_unlearn.trace.hashing import checkpoint_hashes
    from hf_unlearn.trace.run import checkpoint_dir, load_checkpoint, write_sidecar
    from hf_unlearn.utils import atomic_write_text

    from .test_trace_common import copy_run, ids_at_step

    run = copy_run(get_recorded(), tmp_path / "run")
    d = checkpoint_dir(run, 4)
    state = load_checkpoint(d)
    name = next(iter(state["model"]))
    state["model"][name] = state["model"][name] + 1e-3
    torch.save(state, d / "state.pt")
    atomic_write_text(d / "hashes.json", json.dumps(checkpoint_hashes(state), indent=1, sort_keys=True))
    write_sidecar(d / "hashes.json")
    # re-indexed under the run's own key, so the checkpoint binding passes: what is left to catch it is the engine
    from hf_unlearn.trace.checkpoints import CheckpointIndex
    from hf_unlearn.trace.tags import run_key

    CheckpointIndex.load(run, json.loads((run / "header.json").read_text())["run_id"], run_key(run)).add(4)
    forget = ids_at_step(run, 7)[:1]
    with pytest.raises(UnlearnError, match=f"step.{{0,10}}4.*{name}|{name}.*step.{{0,10}}4") as e:
        OracleReplayTrainer(open_run(run), forget, out_dir=tmp_path / "oracle").train()
    assert "\n" not in str(e.value)
    assert not (tmp_path / "oracle").exists()


def test_self_check_is_sealed_stated_and_can_be_turned_off(tmp_path, capsys):
    from hf_unlearn.cli import main
    from hf_unlearn.trace import open_run

    run = get_recorded()
    header = open_run(run).header
    total = header["optimizer_steps"]  # a short run: the default self-check proves it whole
    assert header["fidelity"]["recording"]["reproduced"] and header["fidelity"]["recording"]["steps"] == [0, total]
    assert main(["trace", "inspect", str(run)]) == 0
    assert f"fidelity: engine reproduced recorded steps 0..{total - 1}, the whole run" in capsys.readouterr().out
    tok, data = get_trace_data()
    record(tok, data.select(range(8)), tmp_path, every=1, max_steps=2, trainer_kwargs={"trace_self_check": False})
    rec = open_run(tmp_path / "trace").header["fidelity"]["recording"]
    assert rec == {"checked": False, "why": "trace_self_check=False"}
    # an int N: steps 0..N (a run of N steps: up to its final checkpoint)
    record(tok, data.select(range(8)), tmp_path / "n", every=4, max_steps=2, trainer_kwargs={"trace_self_check": 2})
    rec = open_run(tmp_path / "n" / "trace").header["fidelity"]["recording"]
    assert rec["reproduced"] and rec["steps"] == [0, 2], rec
    with pytest.raises(UnlearnError, match="trace_self_check must be"):
        record(tok, data.select(range(8)), tmp_path / "bad", trainer_kwargs={"trace_self_check": 0})


def test_oracle_records_the_checkpoints_it_matched(tmp_path):
    from hf_unlearn.trace import OracleReplayTrainer, open_run

    from .test_trace_common import ids_at_step

    run = get_recorded()
    OracleReplayTrainer(open_run(run), ids_at_step(run, 5)[:1], out_dir=tmp_path / "oracle").train()
    header = open_run(tmp_path / "oracle").header
    assert header["fidelity"]["checkpoints_matched"] == [2, 4]


def test_a_buffer_the_run_changed_is_refused(tmp_path):
    """A non-persistent buffer that changes during training (checkpoints cannot follow it) fails the fidelity
    evidence, naming the buffer."""
    from transformers import TrainerCallback

    from hf_unlearn.trace import open_run

    from .test_trace_common import tiny

    tok, data = get_trace_data()
    model = tiny(tok)

    class Drift(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            model.model.rotary_emb.inv_freq.mul_(1.01)

    record(tok, data.select(range(8)), tmp_path, model=model, every=1, max_steps=2,
           trainer_kwargs={"callbacks": [Drift()]})
    rec = open_run(tmp_path / "trace").header["fidelity"]["recording"]
    assert not rec["reproduced"] and "model.rotary_emb.inv_freq" in rec["why"]
    shutil.rmtree(tmp_path / "trace")


EVAL_KW = dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, save_total_limit=2,
               load_best_model_at_end=True, metric_for_best_model="eval_loss", greater_is_better=True)


def _record_with_evaluation(tmp_path, rows: int, **kw):
    """eval every step, saving with save_total_limit, EarlyStoppingCallback, load_best_model_at_end; greater_is_better
    on a falling loss keeps the first evaluation best, so early stopping ends the run at step 3 with step 1 kept."""
    from transformers import EarlyStoppingCallback

    tok, data = get_trace_data()
    held_out = data.select(range(48, 56)).remove_columns("id")
    trainer = record(tok, data.select(range(rows)), tmp_path / "rec", every=2, **kw, **EVAL_KW,
                     trainer_kwargs={"eval_dataset": held_out,
                                     "callbacks": [EarlyStoppingCallback(early_stopping_patience=2)]})
    return trainer, tmp_path / "rec" / "trace"


def test_a_run_that_evaluated_replays_to_the_model_the_user_kept(tmp_path, capsys):
    """The replay (evaluation, saving and best-model loading off) reproduces the best checkpoint's model the
    Trainer loaded, not the last step's; the oracle runs from the CLI."""
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import ReplayTrainer, open_run

    trainer, run = _record_with_evaluation(tmp_path, 16, gradient_accumulation_steps=1, max_steps=4)
    kept = open_run(run).header["kept_model"]
    assert kept["step"] == 1 and kept["recorded_steps"] == trainer.state.global_step == 3
    state = ReplayTrainer(run, start="full").train()
    held = trainer.model.state_dict()
    assert state["step"] == 1 and all(torch.equal(t, held[n]) for n, t in state["model"].items())
    last = ReplayTrainer(run, start="full", stop_step=3).train()  # the last step's state is another model
    assert not all(torch.equal(t, held[n]) for n, t in last["model"].items())
    ids = write_ids(tmp_path / "f.jsonl", open_run(run).ids_at_steps([2])[:1])  # served after the kept step
    capsys.readouterr()
    assert main(["trace", "oracle", str(run), "--forget", str(ids), "--out", str(tmp_path / "oracle")]) == 0
    out = capsys.readouterr().out
    assert "kept model: load_best_model_at_end" in out and "after 1 of 3 optimizer steps" in out
    assert "fidelity: engine reproduced recorded steps 0..0, the whole run" in out  # the kept run: 1 step
    assert open_run(tmp_path / "oracle").total_steps == 1


@pytest.mark.slow
def test_runs_that_evaluated_and_kept_the_best_model_replay_to_the_kept_step(tmp_path, capsys):
    """eval every step, saving with save_total_limit, EarlyStoppingCallback, load_best_model_at_end: trace replay,
    trace oracle and forget --oracle run (evaluation and saving off); the kept model is the best step's, the deletion
    is its counterfactual (equal to a plain Trainer stopped there), and the receipt names the step."""
    from hf_unlearn import forget
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import ReplayTrainer, open_run
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_common import tiny

    tok, data = get_trace_data()
    train = data.select(range(24))
    kw = dict(gradient_accumulation_steps=1, max_steps=6)
    trainer, run = _record_with_evaluation(tmp_path, 24, **kw)
    kept = open_run(run).header["kept_model"]
    assert kept["step"] == 1 and kept["recorded_steps"] == 3 and trainer.state.global_step == 3
    # a replay without deletions reproduces the model the user holds (the best checkpoint), not the last step
    state = ReplayTrainer(run, start="full").train()
    held = trainer.model.state_dict()
    assert state["step"] == 1 and all(torch.equal(t, held[n]) for n, t in state["model"].items())
    forget_ids = open_run(run).ids_at_steps([0])[:1]
    ids = write_ids(tmp_path / "f.jsonl", forget_ids)
    assert main(["trace", "redact", str(run), "--forget", str(ids), "--out", str(tmp_path / "store")]) == 0
    assert main(["trace", "replay", str(run), "--store", str(tmp_path / "store"), "--forget", str(ids),
                 "--out", str(tmp_path / "replay")]) == 0
    assert main(["trace", "oracle", str(run), "--forget", str(ids), "--out", str(tmp_path / "oracle")]) == 0
    capsys.readouterr()
    assert main(["trace", "verify", str(tmp_path / "replay"), str(tmp_path / "oracle")]) == 0
    assert "VERIFIED" in capsys.readouterr().out
    oracle = load_checkpoint(open_run(tmp_path / "oracle").final_checkpoint())
    counterfactual = independent_counterfactual(tok, train, tiny(tok), run, forget_ids, tmp_path / "plain", stop_at=1,
                                                **kw)
    assert all(torch.equal(t, counterfactual[n]) for n, t in oracle["model"].items())
    receipt = forget(run, forget_ids, tmp_path / "forget", oracle=True, tokenizer=tok, progress=False)
    assert receipt.evidence["verified"] and receipt.evidence["kept_model"]["step"] == 1
    assert receipt.evidence["fidelity"].startswith("engine reproduced recorded steps 0..")
    # a row trained only after the kept step: the kept model never saw it, and forget says so (it said "deleted by an
    # earlier request"); VERIFIED, the model unchanged (a kept step at a kept checkpoint: tests/test_real_configs.py)
    lines = []
    late = forget(run, open_run(run).ids_at_steps([2])[:1], tmp_path / "late", oracle=True, progress=False,
                  log=lines.append)
    assert late.ok and late.evidence["verified"] is True, late.evidence["oracle"]["problems"]
    unchanged = load_checkpoint(open_run(tmp_path / "late" / "replay").final_checkpoint())["model"]
    assert all(torch.equal(t, held[n]) for n, t in unchanged.items())  # the model the user kept
    assert any("trained only after the kept model" in line for line in lines), lines


@pytest.mark.parametrize("hook,logged,completed", [("on_step_end", 4, 5)])  # on_step_begin: test_crash_mid_step
def test_crash_report_names_the_step_that_did_not_complete(tmp_path, capsys, hook, logged, completed):
    """A crash right after step 4's optimizer step (a callback failing in on_step_end) was reported as "step 4 logged
    but never completed": inspect now says step 4 completed, and the completed steps are kept."""
    from transformers import TrainerCallback

    from hf_unlearn.cli import main
    from hf_unlearn.trace import open_run

    from .test_trace_common import tiny

    tok, data = get_trace_data()

    class Crash(TrainerCallback):
        pass

    def crash(self, args, state, control, **kwargs):
        if state.global_step == 5:
            raise RuntimeError("power cut")

    setattr(Crash, hook, crash)
    with pytest.raises(RuntimeError, match="power cut"):
        record(tok, data, tmp_path, model=tiny(tok), trainer_kwargs={"callbacks": [Crash()]})
    capsys.readouterr()
    assert main(["trace", "inspect", str(tmp_path / "trace")]) == 0
    out = capsys.readouterr().out
    assert f"{completed} optimizer steps" in out
    if logged == completed:
        assert f"optimizer step {logged} was logged but never completed" in out
    else:
        assert f"the run stopped after optimizer step {logged} completed" in out and "never completed" not in out
    with pytest.warns(UserWarning):
        assert open_run(tmp_path / "trace").total_steps == completed


def test_replay_on_other_hardware_is_refused(tmp_path, capsys):
    """A run recorded on a GPU (faked header: an H200 with CUDA 12.8) is refused on this CPU, naming what differs."""
    from hf_unlearn.cli import main
    from hf_unlearn.trace import ReplayTrainer
    from hf_unlearn.trace.run import write_sidecar

    from .test_trace_common import copy_run

    run = copy_run(get_recorded(), tmp_path / "run")
    header = json.loads((run / "header.json").read_text())
    assert header["determinism"]["device_info"] == {"type": "cpu"}
    header["determinism"]["device_info"] = {"type": "cuda", "name": "NVIDIA H200", "capability": "9.0",
                                            "cuda": "12.8", "cudnn": 91002}
    (run / "header.json").write_text(json.dumps(header))
    write_sidecar(run / "header.json")
    with pytest.raises(UnlearnError, match="other hardware.*type 'cpu' \\(recorded 'cuda'\\).*NVIDIA H200"):
        ReplayTrainer(run, start="full")
    from hf_unlearn.data.ids import write_ids

    from .test_trace_common import ids_at_step

    ids = write_ids(tmp_path / "f.jsonl", ids_at_step(run, 7)[:1])
    capsys.readouterr()
    assert main(["trace", "oracle", str(run), "--forget", str(ids), "--out", str(tmp_path / "out")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other hardware" in err[0] and not (tmp_path / "out").exists()


def test_cuda_determinism_is_turned_on_or_refused_with_the_lines_to_add(monkeypatch):
    from hf_unlearn.trace.fidelity import CUDA_LINES, prepare_cuda_determinism

    was = torch.are_deterministic_algorithms_enabled()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(UnlearnError) as e:
        prepare_cuda_determinism(None)
    assert all(line in str(e.value) for line in CUDA_LINES) and "\n" not in str(e.value)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    try:
        assert prepare_cuda_determinism(None)
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(was)
    from types import SimpleNamespace

    assert not prepare_cuda_determinism(SimpleNamespace(use_cpu=True))


@pytest.mark.slow
def test_device_suite_tiny_mode_runs_on_cpu(tmp_path, capsys):
    """benchmarks/device_suite.py --tiny: the GPU suite's checks on CPU (fp32 and bf16 autocast, MASC benchmark)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "device_suite.py"
    spec = importlib.util.spec_from_file_location("device_suite", path)
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    assert suite.main(["--tiny", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for precision in ("fp32", "bf16"):
        line = next(x for x in out.splitlines() if x.startswith(f"{precision} on cpu"))
        assert "early (step 0) VERIFIED" in line and "late (step 3) VERIFIED" in line and "self-check" in line
    results = json.loads((tmp_path / "device_suite.json").read_text())
    assert all(r["fidelity"]["reproduced"] for r in results)
    assert "MASC fair benchmark" in out and (tmp_path / "masc" / "bench_methods.json").is_file()


def test_edited_buffers_file_is_refused_before_compute(tmp_path):
    """model/buffers.safetensors rewritten with other values (a consistent file, its digest in the header unchanged):
    every replay refuses it at construction, naming the file."""
    from safetensors.torch import load_file, save_file

    from hf_unlearn.trace import ReplayTrainer

    from .test_trace_common import copy_run

    run = copy_run(get_recorded(), tmp_path / "run")
    path = run / "model" / "buffers.safetensors"
    buffers = load_file(str(path))
    assert "model.rotary_emb.inv_freq" in buffers
    save_file({n: t * 1.01 for n, t in buffers.items()}, str(path))
    with pytest.raises(UnlearnError, match="buffers.safetensors is missing or does not match the digest"):
        ReplayTrainer(run, start="full")
