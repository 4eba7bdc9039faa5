"""The run key under a 2-process launch (torchrun, CPU, gloo): created once on a machine that has none, held by every
process, and a process that cannot find it told to every process the same way (tests/trace_fresh_key.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from .conftest import ROOT, free_port, run_launch


def _launch(tmp_path, *mode: str) -> list[dict]:
    """One recording launch of tests/trace_fresh_key.py with ``$HF_UNLEARN_KEY_FILE`` naming a file that does not
    exist yet; each process's outcome (both must end: a hang is the timeout's failure)."""
    key_file = tmp_path / "keys" / "id_tag.key"
    assert not key_file.parent.exists()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_UNLEARN_KEY_FILE": str(key_file)}
    env.pop("HF_UNLEARN_TAG_KEY", None)

    def cmd():
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), str(ROOT / "tests" / "trace_fresh_key.py"), str(tmp_path), *mode]

    proc = run_launch(cmd, tmp_path, cwd=str(ROOT), timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "AttributeError" not in proc.stderr
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow  # one 2-process recording with its proof (about 40 s)
def test_a_launch_on_a_machine_without_a_key_creates_one_and_every_process_proves_with_it(tmp_path):
    """Before: process 1 could not match the run's key when train() ended, skipped the proof alone, and process 0
    died inside the proof's next collective (AttributeError in process_differences). Now the main process creates
    the key once, process 1 finds it before the first step, and both prove the run with it."""
    from hf_unlearn.keys import key_fingerprint

    results = _launch(tmp_path)
    key = (tmp_path / "keys" / "id_tag.key").read_bytes()
    assert (tmp_path / "keys" / "id_tag.key").stat().st_mode & 0o777 == 0o600
    header = json.loads((tmp_path / "trace" / "header.json").read_text())
    assert header["key_fingerprint"] == key_fingerprint(key)
    assert results == [{"trained": True, "fingerprint": key_fingerprint(key), "warnings": []}] * 2, results
    recording = header["fidelity"]["recording"]
    assert recording["by"] == "proof" and recording["reproduced"] is True and recording["steps"] == [0, 4], recording
    assert header["fidelity"]["proof"]["proven"] is True and header["fidelity"]["proof"]["world_size"] == 2


@pytest.mark.slow  # one 2-process recording; the proof refused on both processes, then the self-check (about 40 s)
def test_a_process_that_loses_the_key_before_the_proof_is_reported_the_same_way_by_every_process(tmp_path):
    """Process 1 alone cannot find the key when the end-of-recording proof opens the run. Both processes say so in
    the same warning naming process 1, neither hangs nor crashes, and the run records it was not checked and why."""
    results = _launch(tmp_path, "proof", "1")
    assert [r["trained"] for r in results] == [True, True], results
    warnings = [r["warnings"] for r in results]
    assert warnings[0] == warnings[1] and len(warnings[0]) == 1, warnings
    assert "was not proven at the end of recording" in warnings[0][0]
    assert "neither the current key nor an archived one" in warnings[0][0]
    assert "(on process(es) 1 of 2)" in warnings[0][0]
    header = json.loads((tmp_path / "trace" / "header.json").read_text())
    assert header["sealed"] and header["fidelity"]["recording"]["checked"] is False
    assert "neither the current key" in header["fidelity"]["recording"]["why"]
    assert "proof" not in header["fidelity"]


@pytest.mark.slow  # one 2-process launch refused before its first step (about 20 s)
def test_a_process_given_another_key_refuses_the_recording_on_every_process_before_any_step(tmp_path):
    results = _launch(tmp_path, "key", "1")
    errors = [r.get("error") for r in results]
    assert errors[0] and errors[0] == errors[1] and "\n" not in errors[0], results
    assert "cannot find the key the main process records with" in errors[0]
    assert str(tmp_path / "other-1" / "id_tag.key") in errors[0] and errors[0].endswith("(on process(es) 1 of 2)")
    assert not (tmp_path / "trace" / "header.json").exists()  # refused before anything was recorded
