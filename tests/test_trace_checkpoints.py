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

from .test_trace_common import copy_run, delete, get_recorded, get_trace_data, ids_at_step, record


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
    from hf_unlearn.trace.run import write_sidecar

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
    (run / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True))
    write_sidecar(run / "header.json")
    return run


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
