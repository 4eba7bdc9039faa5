"""A late deletion's cost: the environment probe's step that the deletion's own replay re-runs with no deletion (from
its start checkpoint up to the first affected step, each state compared with the recording's fingerprint) is not run
twice; the check it makes stays, as the replay's (benchmarks/bench_real_configs.py measures the cost)."""

from __future__ import annotations

import pytest
import torch

from hf_unlearn.errors import UnlearnError

from .test_trace_common import config_model, get_trace_data, record
from .test_trace_fidelity import independent_counterfactual

KW = dict(gradient_accumulation_steps=1, max_steps=6)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A proven 6-step run (checkpoints every 2 steps, all kept) and the probe's step at a kept checkpoint."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.proof import probe_steps, unproven_steps

    tok, data = get_trace_data()
    data = data.select(range(24))
    out = tmp_path_factory.mktemp("late")
    record(tok, data, out / "rec", model=config_model("llama", tok), every=2, **KW)
    run = open_run(out / "rec" / "trace")
    assert not unproven_steps(run.header, 0, run.total_steps)  # a short run proves itself at the end of recording
    return tok, data, run, probe_steps(run)[-1]


def test_the_probe_step_a_late_deletion_replays_is_run_once_and_the_deletion_equals_the_counterfactual(
        recorded, tmp_path):
    """A row of step s + 1 deleted (s: the probe's kept-checkpoint step): the replay starts at checkpoint s and re-runs
    step s with no deletion, so the probe leaves step s to it (`by_the_replay`) and runs only the others; VERIFIED,
    and the oracle equals a plain Trainer counterfactual."""
    from hf_unlearn import forget
    from hf_unlearn.trace.verification import load_state

    tok, data, run, s = recorded
    ids = run.ids_at_steps([s + 1])[:1]
    lines = []
    receipt = forget(run.path, ids, tmp_path / "out", oracle=True, progress=False, log=lines.append)
    probe = receipt.evidence["environment_probe"]
    assert receipt.evidence["cost"]["start_checkpoint"] == s and receipt.evidence["verified"] is True
    assert probe["by_the_replay"] == [s] and s not in probe["steps"]
    assert any(f"optimizer step(s) {s} re-run by the replay itself" in line for line in lines)
    oracle = load_state(tmp_path / "out" / "oracle")["model"]
    plain = independent_counterfactual(tok, data, config_model("llama", tok), run.path, ids, tmp_path / "plain",
                                       **KW)
    assert all(torch.equal(t, plain[n]) for n, t in oracle.items())


def test_a_probe_step_left_to_the_replay_is_still_checked_before_a_deleted_row_trains(recorded, tmp_path,
                                                                                      monkeypatch):
    """An environment whose optimizer steps do not reproduce the recording's (every optimizer step nudged after the
    recording, by a global step pre-hook: outside the sealed code digests, which refuse a patched ``AdamW.step``
    before the probe), with the probe's every step left to the replay: the deletion is refused at the replay's first
    step, the probe's step s, in one line, before the deleted row (step s + 1) is trained on, and leaves no output."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from hf_unlearn import forget
    from hf_unlearn.trace import proof

    _, _, run, s = recorded
    ids = run.ids_at_steps([s + 1])[:1]

    def nudged(optimizer, args, kwargs):
        with torch.no_grad():
            optimizer.param_groups[0]["params"][0].add_(1e-6)

    monkeypatch.setattr(proof, "probe_steps", lambda r: [s])
    monkeypatch.setattr(proof.longest_microbatch, "check", lambda *a, **k: None)  # it would refuse first
    handle = register_optimizer_step_pre_hook(nudged)
    try:
        with pytest.raises(UnlearnError) as e:
            forget(run.path, ids, tmp_path / "out", progress=False, log=lambda m: None)
    finally:
        handle.remove()
    assert f"optimizer step {s}:" in str(e.value) and "state after the optimizer step" in str(e.value)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
