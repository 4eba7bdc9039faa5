"""A probe's outcome handed to a replay (`proven_start=`, `environment_probe=`) is believed only as issued in this
process for that run: each ATTACK below would have made the replay or the oracle skip a check nobody ran."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hf_unlearn.errors import UnlearnError

from .test_trace_common import copy_run, get_recorded, ids_at_step, rsqrt_other_bits


@pytest.fixture(scope="module")
def deletion(tmp_path_factory):
    """A copy of the shared recording, a deletion at step 6 (a fresh start at kept checkpoint 6 whose first step is
    affected) and its redacted store."""
    from hf_unlearn.trace import open_run, redact_store

    d = tmp_path_factory.mktemp("issued")
    run_dir = copy_run(get_recorded(), d / "run")
    forget = ids_at_step(run_dir, 6)[:2]
    redact_store(open_run(run_dir).store_path, forget, d / "store", open_run(run_dir).key)
    return run_dir, forget, d


def test_hand_written_outcomes_are_refused_before_any_compute(deletion, tmp_path):
    """ATTACK: a careless user copies the dicts from the docs: `proven_start={"checkpoint": 6, "proven_by": "probe"}`
    made the redacted replay treat its fresh start as probed, and any `environment_probe=` dict made an oracle with an
    affected first step skip its own probe; now both are refused in one line at construction, nothing written."""
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer

    run_dir, forget, d = deletion
    with pytest.raises(UnlearnError, match=r"proven_start= was not issued .* written by hand") as e:
        RedactedReplayTrainer(run_dir, d / "store", forget, tmp_path / "replay",
                              proven_start={"checkpoint": 6, "proven_by": "probe"})
    assert "prove_fresh_start" in str(e.value) and "\n" not in str(e.value)
    first = ids_at_step(run_dir, 0)[:1]
    with pytest.raises(UnlearnError, match=r"environment_probe= was not issued .* written by hand") as e:
        OracleReplayTrainer(run_dir, first, out_dir=tmp_path / "oracle", environment_probe={"steps": [0], "seconds": 1.0})
    assert "probe_environment(RUN)" in str(e.value)
    with pytest.raises(UnlearnError, match="it is not a dict"):
        OracleReplayTrainer(run_dir, first, out_dir=tmp_path / "oracle", environment_probe=True)
    assert not (tmp_path / "replay").exists() and not (tmp_path / "oracle").exists()


def test_an_edited_or_another_runs_outcome_is_refused_and_the_issued_one_is_believed(deletion, tmp_path):
    """ATTACK: the outcome of a probe of one run given to the replay of a copy of it (the same run id, another folder:
    other checkpoint files), or edited to name another checkpoint. The outcome as issued is believed."""
    from hf_unlearn.trace import RedactedReplayTrainer
    from hf_unlearn.trace.proof import prove_fresh_start

    run_dir, forget, d = deletion
    issued = prove_fresh_start(run_dir, forget)
    assert {k: v for k, v in issued.items() if k != "issued"} == {"checkpoint": 6, "proven_by": "probe"}
    other = copy_run(run_dir, tmp_path / "copy")
    with pytest.raises(UnlearnError, match="issued for another run or folder"):
        RedactedReplayTrainer(other, d / "store", forget, tmp_path / "replay", proven_start=issued)
    with pytest.raises(UnlearnError, match="it was edited"):
        RedactedReplayTrainer(run_dir, d / "store", forget, tmp_path / "replay", proven_start={**issued, "checkpoint": 4})
    with pytest.raises(UnlearnError, match=r"environment_probe= was not issued"):  # a start proof is not a probe
        RedactedReplayTrainer(run_dir, d / "store", forget, tmp_path / "replay", environment_probe=issued)
    replay = RedactedReplayTrainer(run_dir, d / "store", forget, tmp_path / "replay", proven_start=dict(issued))
    assert replay._proven_start == {"checkpoint": 6, "proven_by": "probe"}  # a copy of the dict in this process


def test_an_outcome_issued_in_another_process_is_refused(deletion, tmp_path):
    """ATTACK: an outcome saved as JSON by another process (an earlier session, another machine's probe) and loaded
    here: nothing was probed in this process, so it proves nothing here."""
    from hf_unlearn.trace import OracleReplayTrainer

    run_dir, _, _ = deletion
    code = ("import json, sys; from hf_unlearn.trace.run import open_run; from hf_unlearn.trace.issued import issue; "
            "print(json.dumps(issue('environment', open_run(sys.argv[1]), {'steps': [0], 'seconds': 0.5})))")
    out = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, check=True)
    foreign = json.loads(out.stdout.strip().splitlines()[-1])
    assert foreign["issued"]
    with pytest.raises(UnlearnError, match="or in another process"):
        OracleReplayTrainer(run_dir, ids_at_step(run_dir, 0)[:1], out_dir=tmp_path / "oracle", environment_probe=foreign)


def test_a_hand_written_probe_no_longer_hides_another_environment(deletion, tmp_path, monkeypatch):
    """ATTACK, end to end: in a process whose RMSNorm computes other bits than the recording's (``torch.rsqrt`` patched, its code entry hidden: a numeric change no code digest shows), a step-0 deletion with
    hand-written outcomes skipped every comparison with the recording (the replay's fresh start "probed", the oracle's
    own probe skipped): replay and oracle were equally wrong and agreed. Now refused before compute; the outcome
    `before_deletion` issues in this environment is a refusal naming step 0."""
    from hf_unlearn.trace import OracleReplayTrainer, open_run
    from hf_unlearn.trace.proof import ProofError, before_deletion

    run_dir, _, _ = deletion
    first = ids_at_step(run_dir, 0)[:1]
    monkeypatch.setattr(torch, "rsqrt", rsqrt_other_bits(monkeypatch))
    with pytest.raises(UnlearnError, match="environment_probe= was not issued"):
        OracleReplayTrainer(run_dir, first, out_dir=tmp_path / "oracle", environment_probe={"steps": [0], "seconds": 0})
    with pytest.raises(ProofError, match="optimizer step 0"):
        before_deletion(open_run(run_dir), 0, True, False)
    assert not (tmp_path / "oracle").exists()
