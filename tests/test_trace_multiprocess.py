"""The proof, the environment probe and the per-step process comparison on multi-process runs (issue #41: "on every
process"). Each launch runs ``tests/trace_multiprocess.py`` under ``torchrun --nproc_per_node 2`` on CPU (gloo),
plain data parallel or FSDP2 (the test-only CPU stand-in ``tests/fsdp_cpu.py``), a tiny Llama with grouped-query
attention; every VERIFIED deletion is compared with an engine-free counterfactual the launch builds (a plain
Trainer, the same callbacks, the deleted row's labels -100, the recorded normalisers and seeds). The launches are
slow; the refusals that need no launch run in the default suite.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_unlearn.errors import UnlearnError

SCRIPT = Path(__file__).resolve().parent / "trace_multiprocess.py"
COMMAND = "torchrun --nproc_per_node 2 -m hf_unlearn.cli trace prove"


def launch(tmp_path, mode: str) -> dict:
    from .trace_fsdp import launch as run

    return run(tmp_path, "llama", True, "no", steps=mode, script=SCRIPT)


def _refusals(deletion: dict) -> list[str]:
    """Every process's refusals of a deletion's replay and oracle (one line each)."""
    return [err for proc in deletion["processes"] for code, err in proc if code != 0]


def _refused_or_counterfactual(deletion: dict) -> None:
    """A deletion is refused before compute on every process, or VERIFIED with its oracle equal to the engine-free
    counterfactual of the program that ran; never VERIFIED and different."""
    if deletion["codes"] == [0, 0]:
        assert deletion["verified"] and deletion["counterfactual_equals_oracle"], deletion
        return
    assert "verified" not in deletion, deletion
    assert all(code != 0 for proc in deletion["processes"] for code, _ in proc), deletion  # every process refused
    assert all(err.startswith("hf-unlearn: error:") and "Traceback" not in err for err in _refusals(deletion)), deletion


# ---- no launch: a multi-process run proven at another world size, the processes' differences in words -------------
def test_prove_at_another_world_size_is_refused_before_compute_naming_the_command(tmp_path, capsys):
    """A run recorded by 2 processes (its sealed header says so) proven in one: refused before any replay is built,
    naming the command that proves it at the recorded world size; nothing sealed."""
    from hf_unlearn.cli import main
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.proof import prove

    from .test_trace_common import copy_run, get_recorded, write_sealed_header

    run = copy_run(get_recorded(), tmp_path / "run")
    header = json.loads((run / "header.json").read_text())
    write_sealed_header(run, {**header, "world_size": 2})
    before = (header.get("fidelity") or {}).get("proof")
    with pytest.raises(UnlearnError, match=r"recorded by 2 process\(es\) and this trace prove runs 1") as e:
        prove(run, progress=False)
    assert f"`{COMMAND} {run}`" in str(e.value) and "\n" not in str(e.value)
    assert main(["trace", "prove", str(run), "--no-progress"]) != 0
    assert COMMAND in capsys.readouterr().err
    assert (open_run(run).header.get("fidelity") or {}).get("proof") == before  # nothing sealed


def test_process_differences_name_the_process_and_the_values():
    """What a refusal of processes given different settings says: the part and its fields (as before), and which
    process holds which value, one dict level deep (the numeric stack's environment variables)."""
    from hf_unlearn.trace.proof import process_causes
    from hf_unlearn.trace.sharding import process_differences

    main = {"numeric stack": {"threads": 1, "environment": {"OMP_NUM_THREADS": "1"}}, "seed": 0}
    other = {"numeric stack": {"threads": 1, "environment": {"OMP_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE"}},
             "seed": 0}
    assert process_differences([main, main]) == ([], [])
    parts, where = process_differences([main, other])
    assert parts == ["numeric stack (environment)"]
    assert where == ["process 1 has numeric stack environment.MKL_CBWR='COMPATIBLE' (process 0: absent)"]
    numerics = {"environment": {"OMP_NUM_THREADS": "1"}, "torch": {"torch threads": "1"},
                "code": {"torch.nn.functional.silu": "silu:aaaa"}}
    patched = {**numerics, "environment": {"OMP_NUM_THREADS": "1", "MKL_CBWR": "COMPATIBLE"},
               "code": {"torch.nn.functional.silu": "<lambda>:bbbb"}}
    causes = process_causes({"OMP_NUM_THREADS": "1"}, [numerics, patched])
    assert causes == ["process 1's numeric environment differs from the recording's: MKL_CBWR='COMPATIBLE' "
                      "(recorded None)", "process 1's functions differ from process 0's: torch.nn.functional.silu"]
    assert process_causes({"OMP_NUM_THREADS": "1"}, [numerics, numerics]) == []


# ---- launches ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_multi_process_run_is_proven_on_every_process_and_probed_on_every_process(tmp_path, engine):
    """(a) a DDP and an FSDP2 run recorded without the end-of-recording proof, then `trace prove` under their launch:
    every step proven, the proof names the processes it covered (every process replayed its slots and compared its
    own state at every step) and a deletion is VERIFIED and equal to the counterfactual. (b) `trace prove` in one
    process: refused before compute naming the command. (d) the deleting environment differing on process 1 only:
    ``torch.nn.functional.silu`` replaced there is refused by the sealed code digests before compute, naming the
    module and process 1; ``torch.rsqrt`` replaced there (other bits, its code entry hidden: a numeric change no code digest shows) by the probe, naming
    the step; ``MKL_CBWR=COMPATIBLE`` in process 1's environment only (other matmul
    bits on this CPU) is refused when the replay is built, naming process 1 and the variable."""
    from hf_unlearn.cli import main

    result = launch(tmp_path, f"{engine}:prove")
    assert result["recording"] == "accepted" and result["world_size"] == 2
    assert result["prove"][0] == 0, result["prove"]
    proof = result["proof"]
    assert proof["proven"] and proof["steps"] == [0, 3] and proof["world_size"] == 2
    assert proof["processes"] == [0, 1]
    clean = result["clean_deletion"]
    assert clean["codes"] == [0, 0] and clean["verified"], clean
    # (b) the same run proven in one process
    assert main(["trace", "prove", str(tmp_path / "trace"), "--no-progress"]) != 0
    # (d) a torch.nn.functional function replaced on process 1 only in the deleting process: the sealed code
    # digests' refusal (hf_unlearn.trace.program_code), on every process, before any compute
    patched = result["patched_deletion"]
    assert patched["codes"] != [0, 0] and "verified" not in patched, patched
    refusals = _refusals(patched)
    assert len(refusals) == 4, patched  # the replay and the oracle, on both processes
    for text in refusals:
        assert "other code than the recorded run did: module torch.nn.functional" in text, text
        assert "(on process(es) 1 of 2)" in text and "refusing before any compute" in text, text
    assert not (tmp_path / "patched" / "replay").exists() and not (tmp_path / "patched" / "oracle").exists()
    # (d) torch.rsqrt replaced on process 1 only (its code entry hidden): the probe's refusal, on every process
    patched = result["rsqrt_deletion"]
    assert patched["codes"] != [0, 0] and "verified" not in patched, patched
    refusals = _refusals(patched)
    assert len(refusals) == 4, patched
    for text in refusals:  # the oracle's probe, or the replay's own step 0 (before its first affected step 3)
        assert ("the deleting environment does not reproduce the recorded run" in text and "refusing before any "
                "compute" in text) or "the replay engine does not reproduce the recorded run" in text, text
        assert "optimizer step 0" in text, text
    assert not (tmp_path / "rsqrt" / "replay").exists() and not (tmp_path / "rsqrt" / "oracle").exists()
    # (d) MKL_CBWR=COMPATIBLE in process 1's environment only, from the start of the deleting launch
    probe = launch(tmp_path / "probe", f"{engine}:probe:{tmp_path / 'trace'}")
    assert [p["mkl_cbwr"] for p in probe["per_process"]] == [None, "COMPATIBLE"]
    deletion = probe["deletion"]
    assert deletion["codes"] != [0, 0] and "verified" not in deletion, deletion
    refusals = _refusals(deletion)
    assert len(refusals) == 4, deletion
    assert all("process 1 has numeric stack environment.MKL_CBWR='COMPATIBLE'" in t for t in refusals), refusals


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_program_edited_on_one_process_after_step_1_is_never_verified_otherwise(tmp_path, engine):
    """(c) the issue's attack and its kin: a callback that, on process 1 only, after optimizer step 1, scales the
    rotary buffer, adds to a parameter (its shard under FSDP2) or halves the learning rate. Recorded as a user's
    script would (the default end-of-recording proof). Where process 1's tensors then differ from process 0's, the
    recording names the change at optimizer step 2 (the processes are compared after every step). A step-0 and a
    mid-run deletion are each refused before compute on every process, or VERIFIED with the oracle equal to the
    engine-free counterfactual (a replayed callback reproduces the program); never VERIFIED and different."""
    result = launch(tmp_path, f"{engine}:attacks")
    seen = {}
    for name in ("buffer", "parameter", "lr", "buffer_replayed", "parameter_replayed"):
        entry = result[name]
        if entry["recording"] != "accepted":  # refused while recording, naming process 1
            assert entry["recording"].startswith("refused:") and "process" in entry["recording"], entry
            seen[name] = "recording refused"
            continue
        named = [c for c in entry["changes"] if "process 1" in c["what"]]
        assert all(c["step"] == 2 for c in named), named  # the step it happens
        for deletion in entry["deletions"]:
            _refused_or_counterfactual(deletion)
        # named by the recording, or changed nothing a deletion reproduces otherwise (DDP rewrites a buffer from the
        # main process at every forward): then VERIFIED and equal to the counterfactual
        assert named or all(d["codes"] == [0, 0] for d in entry["deletions"]), entry
        seen[name] = [("VERIFIED" if d["codes"] == [0, 0] else "refused") for d in entry["deletions"]]
    # the case under FSDP2 (a watched callback, not replayed; buffers never synchronised): refused
    if engine == "fsdp":
        assert seen["buffer"] == ["refused", "refused"] and seen["parameter"] == ["refused", "refused"], seen
    assert seen["lr"] == "recording refused", seen


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_fresh_start_probed_on_every_process_and_a_rank_local_start_refused(tmp_path, engine):
    """Case (b) at world size 2: a row of step 2 (its replay starts afresh at checkpoint 2, that step affected; the
    proof covers step 0's start only) is VERIFIED after a probe step from checkpoint 2 on every process, its start
    sealed as ``proven_by: probe``, and the oracle equals the engine-free counterfactual. ATTACK: process 1 alone
    starts from another state at checkpoint 2 (one Adam moment nudged after its hashes were checked), and under FSDP2
    process 1's own optimizer shard file of checkpoint 2 edited: case (a) (a row of step 3: the replay's own first
    step) and case (b) are each refused on every process (none left waiting in a collective), naming the processes
    that found it, and leave no replay output."""
    result = launch(tmp_path, f"{engine}:fresh")
    assert result["recording"] == "accepted", result["recording"]
    assert result["proof"]["proven"] and result["proof"]["starts"] == [0] and result["proof"]["processes"] == [0, 1]
    b = result["b"]
    assert b["codes"] == [0, 0], b
    assert b["verified"] and b["counterfactual_equals_oracle"], b
    assert b["start"]["checkpoint"] == 2 and b["start"]["proven_by"] == "probe", b["start"]
    # under FSDP2 the fingerprint is every process's shards gathered: each process sees the difference; a shard
    # file only process 1 reads is named by process 1's check of its SHA-256
    attacks = {"diverged": "on process(es) 1 of 2" if engine == "ddp" else "on process(es) 0, 1 of 2",
               **({"shard": "on process(es) 1 of 2"} if engine == "fsdp" else {})}
    for attack, named in attacks.items():
        for step in (2, 3):
            deletion = result[f"{attack}_{step}"]
            assert deletion["codes"][0] != 0 and "verified" not in deletion, deletion
            assert "replay" not in deletion["outputs"], deletion["outputs"]
            replays = [proc[0] for proc in deletion["processes"]]  # the replay's exit code and refusal, per process
            assert all(code != 0 for code, _ in replays), deletion
            for _, text in replays:
                assert text.startswith("hf-unlearn: error:") and "Traceback" not in text, text
                assert "checkpoint 2" in text or "step-00000002" in text, text
                assert text.count(named) == 1, (named, text)  # named once


def test_a_launch_is_run_once_more_only_when_a_worker_died_by_a_signal(tmp_path):
    """The tests' launch helper: a worker killed by SIGSEGV/SIGABRT (torchrun reports ``exitcode : -11``) gets one more
    launch, in an emptied output folder, the crashed worker's Python stack in the warning; a failure of the code under test (exit 1, a worker stopped by torchrun's
    SIGTERM) is returned as it is, never launched again."""
    import sys

    from .conftest import run_launch

    out, count = tmp_path / "out", tmp_path / "attempts"

    def fake(stderr: str) -> list:  # the first attempt leaves a file in out and fails with stderr; later ones succeed
        code = ("import pathlib, sys; out, count = map(pathlib.Path, sys.argv[1:3]); n = len(count.read_text()) if "
                "count.exists() else 0; count.write_text('x' * (n + 1)); assert not (out / 'partial').exists(); "
                "(out / 'partial').write_text('x'); sys.stderr.write(sys.argv[3] if n == 0 else ''); sys.exit(1 if n == "
                "0 else 0)")
        return [sys.executable, "-c", code, str(out), str(count), stderr]

    out.mkdir()
    crash = ("Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n  File \"w.py\", "
             "line 3 in step\n" + "torchrun's summary\n" * 200 + "failed (exitcode: -11) local_rank: 1 ... exitcode  : -11")
    with pytest.warns(UserWarning, match=r"(?s)died by a signal; launched once more. Its stack: Fatal Python error: "
                                         r"Segmentation fault.*line 3 in step.*exitcode  : -11"):
        proc = run_launch(fake(crash), out)
    assert proc.returncode == 0 and count.read_text() == "xx"  # the second attempt found out emptied
    for stderr in ("failed (exitcode: 1) local_rank: 0", "exitcode  : -15 (pid: 7)"):
        count.unlink()
        (out / "partial").unlink()
        assert run_launch(fake(stderr), out).returncode == 1 and count.read_text() == "x"  # not launched again
