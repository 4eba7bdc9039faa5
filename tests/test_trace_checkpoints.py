"""Checkpoints bound to their run, checkpoints of what trains, safetensors, and retention (issues #22.3, #24).

The tampering tests swap in a checkpoint folder from another run of the same architecture (other init) whose own
``hashes.json`` is consistent with it: every consumer must refuse it, naming the step, before any compute.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from hf_unlearn.errors import UnlearnError

from .test_trace_common import copy_run, delete, get_recorded, get_trace_data, ids_at_step, record, write_sealed_header


def _cli(*args):
    from hf_unlearn.cli import main

    return main([str(a) for a in args])


@functools.cache
def get_foreign() -> Path:
    """The shared run's twin: same architecture, data and cadence, another initialisation (seed 1)."""
    import atexit

    from hf_unlearn.models import build_tiny_model

    tok, data = get_trace_data()
    out = Path(tempfile.mkdtemp(prefix="trace_foreign_"))
    atexit.register(shutil.rmtree, out, True)
    model = build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2, seed=1)
    record(tok, data, out, model=model)
    return out / "trace"


def _swap(run: Path, step: int) -> None:
    d = run / "checkpoints" / f"step-{step:08d}"
    shutil.rmtree(d)
    shutil.copytree(get_foreign() / "checkpoints" / d.name, d)


def _forge_index(run: Path, step: int) -> None:
    """Also rewrite the run's index entry to the foreign checkpoint's roots (an editor without the run key)."""
    from hf_unlearn.trace.checkpoints import _entry

    f = run / "checkpoints" / "index.json"
    index = json.loads(f.read_text())
    index["checkpoints"][str(step)] = _entry(run / "checkpoints" / f"step-{step:08d}")
    f.write_text(json.dumps(index))


@pytest.mark.parametrize("step", [0, 4])
@pytest.mark.parametrize("forged_index", [False, True], ids=["folder", "folder+index"])
def test_checkpoint_from_another_run_is_refused_by_name(tmp_path, capsys, step, forged_index):
    from hf_unlearn import forget
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, check_run, open_run, redact_store
    from hf_unlearn.trace.tags import run_key

    run = copy_run(get_recorded(), tmp_path / "run")
    forget_ids = ids_at_step(run, 5)[:1]
    redact_store(run / "private" / "store", forget_ids, tmp_path / "store", run_key(run))
    _swap(run, step)
    # the foreign folder is consistent with its own hashes.json: today's deep check alone would pass it
    from hf_unlearn.trace.checkpoints import check_checkpoint_state, load_checkpoint

    check_checkpoint_state(run / "checkpoints" / f"step-{step:08d}",
                           load_checkpoint(run / "checkpoints" / f"step-{step:08d}", verify=False))
    if forged_index:
        _forge_index(run, step)
    why = (r"checkpoints/index.json does not verify under the run key" if forged_index
           else rf"checkpoint step {step} is not this run's: its parameter root")
    rep, _, _ = check_run(run, key=run_key(run))
    assert not rep.ok and any(__import__("re").search(why, e) for e in rep.errors)
    for deep in ((), ("--deep",)):
        assert _cli("trace", "inspect", run, *deep) == 1
        out = capsys.readouterr().out
        assert "integrity: FAILED" in out and __import__("re").search(why, out)
    for build in (lambda: OracleReplayTrainer(run, forget_ids, out_dir=tmp_path / "oracle"),
                  lambda: RedactedReplayTrainer(run, tmp_path / "store", forget_ids, tmp_path / "replay"),
                  lambda: forget(run, forget_ids, tmp_path / "forget", oracle=True, progress=False)):
        with pytest.raises(UnlearnError, match=why):
            build()
    assert not any((tmp_path / n).exists() for n in ("oracle", "replay", "forget"))
    if not forged_index:  # a checkpoint folder loaded directly (verify, load_state) is refused too
        from hf_unlearn.trace.verification import load_state

        with pytest.raises(UnlearnError, match=rf"checkpoint step {step} is not this run's"):
            load_state(run / "checkpoints" / f"step-{step:08d}")
    with pytest.raises(UnlearnError, match=why):
        open_run(run)


@pytest.mark.parametrize("step", [4, 8], ids=["middle", "final"])
def test_missing_checkpoint_is_reported(tmp_path, capsys, step):
    run = copy_run(get_recorded(), tmp_path / "run")
    shutil.rmtree(run / "checkpoints" / f"step-{step:08d}")
    assert _cli("trace", "inspect", run) == 1
    assert f"checkpoint step {step} is listed in the run's checkpoint index but missing" in capsys.readouterr().out


def _as_old_format(run: Path) -> Path:
    """Rewrite a run as runs were recorded before the index: ``state.pt`` checkpoints, no index, no header key."""
    from hf_unlearn.trace.checkpoints import load_checkpoint

    for d in sorted((run / "checkpoints").glob("step-*")):
        state = load_checkpoint(d)
        state.pop("frozen", None)
        for f in ("model.safetensors", "optimizer.safetensors", "checkpoint.json"):
            (d / f).unlink()
        torch.save(state, d / "state.pt")
    shutil.rmtree(run / "checkpoints" / "frozen", ignore_errors=True)
    (run / "checkpoints" / "index.json").unlink()
    header = json.loads((run / "header.json").read_text())
    header.pop("checkpoint_index")
    write_sealed_header(run, header)  # the key holder's rewrite: without the key, dropping the index is refused
    return run


def test_dropping_the_index_without_the_key_is_refused(tmp_path, capsys):
    """The header's checkpoint-index entry is under the keyed seal: a run rewritten to look older than the index
    (index removed, header edited, sidecar recomputed, no key) is refused (the note it also prints does not save it)."""
    from hf_unlearn.trace.run import write_sidecar

    run = copy_run(get_recorded(), tmp_path / "run")
    (run / "checkpoints" / "index.json").unlink()
    header = json.loads((run / "header.json").read_text())
    header.pop("checkpoint_index")
    (run / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True))
    write_sidecar(run / "header.json")
    assert _cli("trace", "inspect", run) == 1
    out = capsys.readouterr().out
    assert "controls_mac does not match the run key" in out and "integrity: FAILED" in out


def test_old_format_run_replays_with_a_note_and_cadence_checked(tmp_path, capsys):
    run = _as_old_format(copy_run(get_recorded(), tmp_path / "run"))
    assert _cli("trace", "inspect", run, "--deep") == 0
    out = capsys.readouterr().out
    assert "no checkpoint index (recorded by an older hf_unlearn)" in out and "integrity: OK" in out
    forget_ids = ids_at_step(run, 5)[:1]
    replay, report = delete(run, forget_ids, tmp_path)
    assert report["verified"] and replay.start_step == 4
    # the output run is in the new format and bound: it inspects clean without the note
    assert (tmp_path / "replay" / "checkpoints" / "index.json").exists()
    assert _cli("trace", "inspect", tmp_path / "replay", "--deep") == 0
    assert "no checkpoint index" not in capsys.readouterr().out
    shutil.rmtree(run / "checkpoints" / "step-00000004")  # the header's cadence says it exists
    assert _cli("trace", "inspect", run) == 1
    assert "checkpoint step(s) [4] are missing: the header's cadence (every 2 steps)" in capsys.readouterr().out


def _freeze(model, kind: str):
    from peft import LoraConfig, get_peft_model

    if kind == "frozen-layers":  # a partly frozen full model: embeddings and the first decoder layer do not train
        for n, p in model.named_parameters():
            if n.startswith(("model.embed_tokens", "model.layers.0.")):
                p.requires_grad_(False)
        return model
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                        modules_to_save=["norm"] if kind == "lora+modules_to_save" else None)
    return get_peft_model(model, config)


@pytest.mark.parametrize("kind", ["lora", pytest.param("lora+modules_to_save", marks=pytest.mark.slow), "frozen-layers"])
def test_only_what_trains_is_checkpointed(tmp_path, capsys, kind):
    """Checkpoints hold the trainable tensors (and their optimizer state); frozen ones are saved once and checked
    by their hashes at every load; replay == oracle, VERIFIED."""
    from safetensors import safe_open

    from hf_unlearn.trace.checkpoints import checkpoint_bytes, list_checkpoints, load_checkpoint
    from hf_unlearn.trace.verification import compare_states

    from .test_trace_common import tiny

    tok, data = get_trace_data()
    model = _freeze(tiny(tok), kind)
    trainer = record(tok, data, tmp_path / "rec", model=model)
    run = tmp_path / "rec" / "trace"
    from hf_unlearn.trace.checkpoints import tied_aliases

    params = dict(model.named_parameters(remove_duplicate=False))
    stored = set(model.state_dict()) - set(tied_aliases(model.state_dict()))  # each tied tensor once
    trainable = {n for n in stored if n in params and params[n].requires_grad}
    frozen = {n for n in stored if n in params and not params[n].requires_grad}
    assert trainable and frozen
    with safe_open(str(run / "checkpoints" / "frozen" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == frozen
    cps = list_checkpoints(run)
    assert sorted(cps) == [0, 2, 4, 6, 8]
    for d in cps.values():
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            assert set(f.keys()) == stored - frozen  # trainable (+ buffers), nothing frozen
        assert json.loads((d / "checkpoint.json").read_text())["frozen"] == sorted(frozen)
    final = load_checkpoint(cps[8])  # the full state again, checked against hashes.json (frozen tensors included)
    from hf_unlearn.trace.checkpoints import capture_state

    assert compare_states(final, capture_state(model, trainer.optimizer, 8))["identical"]
    if kind == "lora":  # a LoRA checkpoint is a fraction of the full state
        assert checkpoint_bytes(cps[8]) * 5 < checkpoint_bytes(cps[8], with_frozen=True)
    _, report = delete(run, ids_at_step(run, 5)[:1], tmp_path)
    assert report["verified"]
    if kind != "frozen-layers":
        return
    # a frozen tensor edited on disk: the deep check and every load refuse, naming it
    from safetensors.torch import load_file, save_file

    f = run / "checkpoints" / "frozen" / "model.safetensors"
    tensors = load_file(f)
    tensors["model.embed_tokens.weight"][0, 0] += 1.0
    save_file(tensors, f)
    assert _cli("trace", "inspect", run, "--deep") == 1
    assert "does not match its hashes.json (it differs in model.embed_tokens.weight" in capsys.readouterr().out
    with pytest.raises(UnlearnError, match="differs in model.embed_tokens.weight"):
        load_checkpoint(cps[4])


# ---- retention --------------------------------------------------------------------------------------------
def test_geometric_retention_bound_and_count_property():
    """Over many run lengths T and spacings K: every step s has a kept c <= s with T - c <= 2 (T - s) + K, at most
    11 checkpoints for T / K up to 1,000, and thinning online (after every write) keeps the bound for the run as
    if it ended then, never needs a deleted checkpoint back, and ends in the planned set."""
    import random

    from hf_unlearn.trace.retention import dense_steps, final_keep, geometric_keep, thin, worst_excess

    rng = random.Random(0)
    cases = [(t, k) for t in range(1, 80) for k in (1, 2, 3, 5)] + [
        (t, max(1, t // d)) for t in (rng.randint(80, 60000) for _ in range(150)) for d in (32, 100, 1000, 7)]
    for total, every in cases:
        dense = dense_steps(total, every)
        kept = geometric_keep(total, dense, every)
        assert kept[0] == 0 and kept[-1] == total and worst_excess(total, kept, every) <= 0, (total, every)
        if total / every <= 1000:
            assert len(kept) <= 11, (total, every, kept)
        if total <= 400:
            have: set[int] = set()
            for now in dense:
                before = set(have)
                have = set(thin(now, have | {now}, total, every))
                assert have <= before | {now}
                assert worst_excess(now, have, every) <= 0, (total, every, now)
            assert final_keep(total, have, every) == kept


@functools.cache
def get_geometric() -> Path:
    """48 optimizer steps of one row each, dense every 2 steps, geometric retention (the library default)."""
    import atexit

    tok, data = get_trace_data()
    out = Path(tempfile.mkdtemp(prefix="trace_geometric_"))
    atexit.register(shutil.rmtree, out, True)
    record(tok, data, out, every=2, retention="geometric", per_device_train_batch_size=1,
           gradient_accumulation_steps=1, max_steps=48, warmup_steps=0)
    return out / "trace"


def test_geometric_run_keeps_the_planned_set_and_bounds_every_deletion(tmp_path, capsys):
    from hf_unlearn.trace import open_run, replay_cost
    from hf_unlearn.trace.retention import dense_steps, geometric_keep

    run = get_geometric()
    kept = geometric_keep(48, dense_steps(48, 2), 2)
    assert sorted(open_run(run).checkpoints()) == kept == [0, 20, 36, 44, 48]
    index = json.loads((run / "checkpoints" / "index.json").read_text())
    header = json.loads((run / "header.json").read_text())
    assert index["retention"]["kept"] == header["checkpoint_retention"]["kept"] == kept  # the sealed run lists them
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["index.json"] + [f"step-{c:08d}" for c in kept]
    r = open_run(run)
    for s in (0, 5, 20, 33, 40, 45, 47):
        cost = replay_cost(r, r.ids_at_steps([s])[:1])
        assert cost["minimum_steps"] == 48 - s and cost["steps_to_replay"] <= 2 * (48 - s) + 2
    assert _cli("trace", "inspect", run) == 0
    assert "geometric retention: dense every 2 steps, thinned" in capsys.readouterr().out
    replay, report = delete(run, r.ids_at_steps([45])[:1], tmp_path)  # a late deletion, replayed from step 44
    assert report["verified"] and replay.start_step == 44
    assert sorted(open_run(tmp_path / "replay").checkpoints()) == kept  # the output keeps what its parent kept


@pytest.mark.parametrize("stage", ["after the index", "after the rename"])
def test_interrupted_thinning_leaves_a_run_that_inspects_clean(tmp_path, capsys, monkeypatch, stage):
    """A kill while an old checkpoint is deleted (simulated: the deletion stops after the index was rewritten, or
    after the folder was renamed out of step-*): the run still inspects clean and replays from what is listed."""
    import os

    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.checkpoints import CheckpointIndex
    from hf_unlearn.trace.tags import run_key

    run = copy_run(get_geometric(), tmp_path / "run")
    header = json.loads((run / "header.json").read_text())
    index = CheckpointIndex.load(run, header["run_id"], run_key(run))

    class Killed(BaseException):
        pass

    def kill(*a, **k):
        raise Killed

    import hf_unlearn.trace.checkpoints as checkpoints

    if stage == "after the index":  # killed before the folder was renamed
        monkeypatch.setattr(checkpoints, "remove_checkpoint_dir", kill)
    else:  # killed while the renamed folder was being deleted
        monkeypatch.setattr(shutil, "rmtree", kill)
    with pytest.raises(Killed):
        index.thin([0, 20, 44, 48])  # drop step 36
    monkeypatch.undo()
    assert _cli("trace", "inspect", run, "--deep") == 0
    out = capsys.readouterr().out
    assert "integrity: OK" in out and ("not in the run's checkpoint index" in out or "interrupted checkpoint thinning"
                                       in out)
    assert sorted(open_run(run).checkpoints()) == [0, 20, 44, 48]
    assert os.path.exists(run / "checkpoints" / ("step-00000036" if stage == "after the index"
                                                 else ".thinned-step-00000036"))


def test_checkpoint_budget_caps_what_is_kept_and_says_what_it_costs(tmp_path, capsys):
    from hf_unlearn.trace import open_run, replay_cost
    from hf_unlearn.trace.checkpoints import checkpoint_bytes
    from hf_unlearn.trace.retention import worst_excess

    tok, data = get_trace_data()
    each = checkpoint_bytes(get_geometric() / "checkpoints" / "step-00000020")  # with optimizer state
    kw = dict(every=2, retention="geometric", per_device_train_batch_size=1, gradient_accumulation_steps=1,
              max_steps=48, warmup_steps=0)
    with pytest.raises(UnlearnError, match=r"trace_checkpoint_budget=.* a run needs at least 2"):
        record(tok, data, tmp_path / "small", trainer_kwargs={"trace_checkpoint_budget": each}, **kw)
    record(tok, data, tmp_path / "capped", trainer_kwargs={"trace_checkpoint_budget": int(3.5 * each)}, **kw)
    run = open_run(tmp_path / "capped" / "trace")
    kept = sorted(run.checkpoints())
    retention = run.header["checkpoint_retention"]
    assert len(kept) <= 3 and retention["factor"] > 2 and retention["max_kept"] == 3
    assert sum(checkpoint_bytes(d) for d in run.checkpoints().values()) <= 3.5 * each
    assert worst_excess(48, kept, 2, retention["factor"]) <= 0  # the stated, larger bound holds
    cost = replay_cost(run, run.ids_at_steps([47])[:1])
    assert cost["bound_steps"] == retention["factor"] * 1 + 2
    assert _cli("trace", "inspect", run.path) == 0
    assert f"capped by trace_checkpoint_budget={int(3.5 * each)} bytes" in capsys.readouterr().out


def test_frozen_base_referenced_in_its_model_folder(tmp_path):
    """With trace_frozen_source, a LoRA run stores no copy of the base: its tensors are referenced in the model
    folder by their hashes; replay == oracle; an edited base is refused at load, naming the file."""
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from hf_unlearn.trace.checkpoints import checkpoint_bytes, list_checkpoints, load_checkpoint

    from .test_trace_common import tiny

    tok, data = get_trace_data()
    tiny(tok).save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    record(tok, data, tmp_path / "rec", model=model, trainer_kwargs={"trace_frozen_source": tmp_path / "base"})
    run = tmp_path / "rec" / "trace"
    frozen = json.loads((run / "checkpoints" / "frozen" / "hashes.json").read_text())
    assert set(frozen["source"]["tensors"]) == set(frozen["params"])  # every frozen tensor found in the folder
    with safe_open(str(run / "checkpoints" / "frozen" / "model.safetensors"), framework="pt") as f:
        assert list(f.keys()) == []
    cps = list_checkpoints(run)
    assert checkpoint_bytes(cps[8], with_frozen=True) * 5 < sum(
        f.stat().st_size for f in (tmp_path / "base").glob("*.safetensors"))
    _, report = delete(run, ids_at_step(run, 5)[:1], tmp_path)
    assert report["verified"]
    weights = tmp_path / "base" / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] += 1.0
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(UnlearnError, match="model.safetensors has changed since the run was recorded"):
        load_checkpoint(cps[4])  # the file's recorded SHA-256 refuses it before any tensor is read


def test_cost_names_minimum_ratio_and_first_epoch(tmp_path, capsys):
    """Before any compute, `trace cost` prints the minimum T - s, the steps it replays, their ratio and, in a
    multi-epoch run, that the first epoch's occurrence sets the start."""
    from hf_unlearn.trace import open_run, replay_cost

    tok, data = get_trace_data()
    record(tok, data.select(range(16)), tmp_path, num_train_epochs=3, warmup_steps=0)  # 2 steps an epoch, 6 steps
    run = open_run(tmp_path / "trace")
    late = run.ids_at_steps([5])[:1]  # served in every epoch: first at step 0 or 1
    cost = replay_cost(run, late)
    assert cost["epochs"] == [0, 1, 2] and cost["first_affected_step"] in (0, 1)
    assert cost["minimum_steps"] == 6 - cost["first_affected_step"]
    assert cost["ratio_to_minimum"] == cost["steps_to_replay"] / cost["minimum_steps"]
    (tmp_path / "ids.json").write_text(json.dumps(late))
    assert _cli("trace", "cost", run.path, "--forget", tmp_path / "ids.json") == 0
    out = capsys.readouterr().out
    assert f"the minimum is {cost['minimum_steps']} steps (T - s, first affected step s = " in out and "ratio" in out
    assert "the ids occur in epochs [0, 1, 2]: their first occurrence (epoch 0" in out


@pytest.mark.slow  # a fresh interpreter and a 48-step recording (the simulated interruption above is the fast check)
def test_kill_9_during_thinning_leaves_a_run_that_inspects_clean(tmp_path, capsys):
    """A real SIGKILL in the middle of deleting a thinned checkpoint (a recording in a subprocess kills itself once
    the first old checkpoint has been renamed out of step-*): the unsealed run inspects with integrity OK."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import os, signal, shutil
        import hf_unlearn.trace.checkpoints as ck
        real = shutil.rmtree
        def rmtree(path, *a, **k):
            if os.path.basename(str(path)).startswith(ck.TRASH_PREFIX):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(path, *a, **k)
        ck.shutil.rmtree = rmtree
        from tests.test_trace_common import get_trace_data, record
        tok, data = get_trace_data()
        record(tok, data, {str(tmp_path)!r}, every=2, retention="geometric", per_device_train_batch_size=1,
               gradient_accumulation_steps=1, max_steps=48, warmup_steps=0)
    """)
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == -9, proc.stderr[-2000:]
    run = tmp_path / "trace"
    assert list((run / "checkpoints").glob(".thinned-step-*"))  # killed mid-deletion
    assert _cli("trace", "inspect", run, "--deep") == 0
    out = capsys.readouterr().out
    assert "integrity: OK" in out and "interrupted checkpoint thinning" in out and "NOT sealed" in out
