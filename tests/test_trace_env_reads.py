"""Code a replay runs again (a recorded callback), whose behaviour follows an environment variable of the process
that runs it: the recording notes what the run's own code read (keyed digests of the values), and a deleting process
holding another value is refused before any compute. Before, a callback clipping gradients from step 5 on when a
variable was set in the deleting process only gave a VERIFIED deletion with every tensor off the counterfactual
(replay and oracle both clipped; the environment probe re-ran steps 0 and 2 only)."""

from __future__ import annotations

import json
import os

import pytest
from transformers import TrainerCallback

from .test_trace_neutral_attacks import _differs_from_counterfactual, _forget_outcome, _record

LATE = 5
SECRET = "s3cr3t-value-never-written"


class ClipWhenAsked(TrainerCallback):
    """A recorded callback: from optimizer step 5 on, clips gradients hard when ``HFU_TEST_CLIP`` is set (read three
    ways: ``os.environ.get``, ``in``, ``os.getenv``)."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step >= LATE and os.environ.get("HFU_TEST_CLIP") and "HFU_TEST_CLIP" in os.environ:
            args.max_grad_norm = float(os.getenv("HFU_TEST_CLIP_TO", "0.05"))


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A 6-step run of the tiny GQA Llama with the callback (and an observer replays do not run), recorded with
    HFU_TEST_CLIP unset."""
    tmp = tmp_path_factory.mktemp("env_reads")
    saved = {k: os.environ.pop(k, None) for k in ("HFU_TEST_CLIP", "HFU_TEST_CLIP_TO")}

    class Observer(TrainerCallback):  # defined here, not importable: replays never run it (its reads are not noted)
        def on_step_end(self, args, state, control, **kwargs):
            os.environ.get("HFU_TEST_OBSERVED")

        def on_log(self, args, state, control, **kwargs):
            os.environ.get("HFU_TEST_OBSERVED")

    try:
        tok, data, run = _record(tmp, "llama", [ClipWhenAsked(), Observer()])
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})
    return tok, data, run


def test_the_recording_notes_what_its_own_code_read_and_no_value(recorded):
    _, _, run = recorded
    text = (run / "header.json").read_text()
    reads = json.loads(text)["fidelity"]["environment_reads"]
    own = {k: v for k, v in reads.items() if not v.get("framework")}
    assert own == {"HFU_TEST_CLIP": {"value": None, "by": "tests.test_trace_env_reads"}}, reads  # not the observer's
    # the frameworks' reads during the steps (transformers at every attention call), none of this library's
    assert reads["TRANSFORMERS_SDPA_FORCE_GQA"] == {"value": None, "by": "transformers.integrations.sdpa_attention",
                                                    "framework": True}
    assert not [v for v in reads.values() if v["by"].startswith("hf_unlearn")], reads


def test_a_variable_a_framework_reads_at_every_step_set_otherwise_when_deleting_is_refused(tmp_path, monkeypatch):
    """Attack: ``TRANSFORMERS_SDPA_FORCE_GQA=1`` while recording a GQA model (transformers reads it at every attention
    call and lets SDPA repeat the key/value heads itself: on this CPU the same forward, a backward that differs past
    32 tokens), unset when deleting; with the first steps' rows cut short the probe's steps match. Before: a
    framework's read was not noted, and a step-0 deletion was VERIFIED with 36 entries off the counterfactual (a
    failing probe blamed OMP_WAIT_POLICY). Now the frameworks' reads during the steps are noted; the probe's replay
    reads the variable unset and refuses before the deletion's compute, naming it; with it set, VERIFIED and equal
    to a plain Trainer's counterfactual."""
    from hf_unlearn.trace import open_run

    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    tok, data, run = _record(tmp_path, "llama", [])
    assert json.loads((run / "header.json").read_text())["fidelity"]["environment_reads"][
        "TRANSFORMERS_SDPA_FORCE_GQA"]["value"] is not None
    ids = open_run(run).ids_at_steps([0])[:1]
    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA")
    kind, what = _forget_outcome(run, ids, tmp_path / "without")
    assert kind == "refused" and "\n" not in what, (kind, what)
    assert "TRANSFORMERS_SDPA_FORCE_GQA (read by transformers.integrations.sdpa_attention" in what, what
    assert not (tmp_path / "without").exists()
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    kind, receipt = _forget_outcome(run, ids, tmp_path / "with")
    assert kind == "verified", (kind, receipt)
    assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "with", [])


def test_a_value_is_never_written(tmp_path, monkeypatch):
    from hf_unlearn.trace.environment_reads import sealed, watching

    monkeypatch.setenv("HFU_TEST_SECRET", SECRET)
    with watching() as log:
        os.environ["HFU_TEST_SECRET"]
    assert log["HFU_TEST_SECRET"]["value"] == SECRET  # in memory only
    assert SECRET not in json.dumps(sealed(b"k" * 32, log))


def test_a_variable_the_runs_code_read_set_otherwise_refuses_before_any_compute(recorded, tmp_path, monkeypatch):
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run

    _, _, run = recorded
    monkeypatch.setenv("HFU_TEST_CLIP", "1")
    ids = open_run(run).ids_at_steps([LATE])[:1]
    kind, what = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "refused" and "\n" not in what, (kind, what)
    assert "HFU_TEST_CLIP (read by tests.test_trace_env_reads: unset while recording, set here)" in what
    assert "before any compute" in what and not (tmp_path / "del").exists()
    write_ids(tmp_path / "ids.jsonl", ids)
    assert main(["forget", str(run), "--ids", str(tmp_path / "ids.jsonl"), "--out", str(tmp_path / "cli"),
                 "--no-progress"]) != 0
    assert not (tmp_path / "cli").exists()


def test_the_same_environment_deletes_exactly(recorded, tmp_path, monkeypatch):
    """Unset as while recording: VERIFIED and equal to the engine-free counterfactual (a plain Trainer with the
    callback and the deleted row's labels -100); a variable the code never read may differ."""
    from hf_unlearn.trace import open_run

    tok, data, run = recorded
    monkeypatch.delenv("HFU_TEST_CLIP", raising=False)
    monkeypatch.setenv("HFU_TEST_UNREAD", "anything")
    ids = open_run(run).ids_at_steps([LATE])[:1]
    kind, receipt = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "verified", receipt
    assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "del", [ClipWhenAsked()])


def test_a_replay_reading_a_variable_the_recording_never_read_is_refused():
    """The replay side: a read of a variable the recording's code never read (its value then is unknown), or read
    with another value, is named; the same reads are not."""
    from hf_unlearn.trace.environment_reads import differences, sealed, unrecorded, watching

    key = b"k" * 32
    with watching() as log:
        os.environ.get("HFU_TEST_NEVER_SET_A")
    recorded = sealed(key, log)
    assert recorded == {"HFU_TEST_NEVER_SET_A": {"value": None, "by": __name__}}
    assert unrecorded(key, recorded, log) == [] and differences(key, recorded) == []
    with watching() as again:
        os.environ.get("HFU_TEST_NEVER_SET_A")
        os.getenv("HFU_TEST_NEVER_SET_B")
    assert unrecorded(key, recorded, again) == [
        f"HFU_TEST_NEVER_SET_B (read by {__name__}, which the recording's code never read)"]
    assert differences(key, recorded, {"HFU_TEST_NEVER_SET_A": "1"}) == [
        f"HFU_TEST_NEVER_SET_A (read by {__name__}: unset while recording, set here)"]
    assert differences(key, sealed(key, {"X": {"value": "a", "by": "m"}}), {"X": "b"}) == [
        "X (read by m: set while recording, set to another value here)"]
    import json as framework_like  # a read from a standard-library or framework module is not the program's

    framework = {"__name__": "logging.handlers_like"}  # a standard-library module's function copying the environment
    exec("import os\ndef copy_environment():\n    return {**os.environ, **os.environ.copy()}", framework)
    with watching() as quiet:
        framework_like.loads("1")
        os.path.expanduser("~")  # os.path reads HOME
        os.environ.get("LOCAL_RANK")  # a launcher's per-process variable (each process's fingerprints compare it)
        os.environ.get("MASTER_PORT")
        copied = framework["copy_environment"]()  # a whole copy, for a subprocess
    assert quiet == {} and copied["PATH"] == os.environ["PATH"]


@pytest.mark.parametrize("how", ["copy", "dict", "items", "unpack", "loop"])
def test_a_whole_read_of_the_environment_by_the_programs_code_notes_every_variable(how, monkeypatch):
    """Attack: ``os.environ.copy()`` (or ``dict(os.environ)``) in a recorded callback, acting from step 3 on a
    variable set in the deleting process only: a whole read was not noted (left to the environment probe, which re-ran
    step 2 only and compared the state before the callback acted), and the deletion was VERIFIED with every tensor
    off the counterfactual. A whole read by the program's code now notes every variable and their names: a deleting
    process holding any other value, or another variable, is refused; the same environment is not."""
    from hf_unlearn.trace.environment_reads import ENVIRON, differences, sealed, watching

    key = b"k" * 32
    monkeypatch.setenv("HFU_TEST_WHOLE", "a")
    read = {"copy": lambda: os.environ.copy(), "dict": lambda: dict(os.environ),
            "items": lambda: dict(os.environ.items()), "unpack": lambda: {**os.environ},
            "loop": lambda: {k: os.environ[k] for k in os.environ}}[how]
    with watching() as log:
        assert read()["HFU_TEST_WHOLE"] == "a"
        os.environ.get("HFU_TEST_NEVER_SET_C")  # a single read after it is noted too
    assert log["HFU_TEST_WHOLE"] == {"value": "a", "by": __name__} and "HFU_TEST_NEVER_SET_C" in log
    assert ENVIRON in log and "LOCAL_RANK" not in log
    recorded = sealed(key, log)
    here = dict(os.environ)
    assert differences(key, recorded, here) == []
    assert differences(key, recorded, {**here, "HFU_TEST_WHOLE": "b"}) == [
        f"HFU_TEST_WHOLE (read by {__name__}: set while recording, set to another value here)"]
    assert [d.split(",")[0] for d in differences(key, recorded, {**here, "HFU_TEST_NEW": "1"})] == [ENVIRON]
    assert differences(key, recorded, {**here, "LOCAL_RANK": "3"}) == []  # a launcher's variable: compared elsewhere


class ReadsTheEnvironment(TrainerCallback):
    """A recorded callback that reads ``HFU_TEST_STAGE_MODE`` at every step (and does nothing with it)."""

    def on_step_begin(self, args, state, control, **kwargs):
        os.environ.get("HFU_TEST_STAGE_MODE")


def test_a_pipeline_deletion_compares_every_stages_reads_before_any_compute(tmp_path, monkeypatch):
    """Stage 2 of a pipeline was recorded with a callback reading a variable (unset then); a pipeline deletion of a
    stage-1 row in a process where it is set is refused before any compute, naming stage 2."""
    from hf_unlearn.deletion import forget
    from hf_unlearn.trace.proof import ProofError

    from .test_trace_common import get_trace_data, ids_at_step, record, tiny
    from .test_trace_pipeline import KW, _from

    monkeypatch.delenv("HFU_TEST_STAGE_MODE", raising=False)
    tok, data = get_trace_data()
    t1 = record(tok, data.select(range(16)), tmp_path / "s1", model=tiny(tok), **KW)
    t1.save_model(str(tmp_path / "s1"))
    record(tok, data.select(range(16, 32)), tmp_path / "s2", model=_from(tmp_path / "s1"),
           trainer_kwargs={"callbacks": [ReadsTheEnvironment()]}, **KW)
    runs = [str(tmp_path / "s1" / "trace"), str(tmp_path / "s2" / "trace")]
    monkeypatch.setenv("HFU_TEST_STAGE_MODE", "fast")
    with pytest.raises(ProofError, match=r"^stage 2: the recorded run's code read the environment variable "
                                         r"HFU_TEST_STAGE_MODE") as e:
        forget(runs, ids_at_step(runs[0], 0)[:1], tmp_path / "pipeline", oracle=True, progress=False)
    assert "\n" not in str(e.value) and "before any compute" in str(e.value)
    assert not (tmp_path / "pipeline").exists()


CLIP_AT_IMPORT = os.environ.get("HFU_TEST_CLIP_AT_IMPORT")  # read when the module is imported, not while training


class ClipFromImport(TrainerCallback):
    """A recorded callback acting on a module constant read from the environment at import time (the deleting
    process imports the module again, to rebuild the callback)."""

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step >= LATE and CLIP_AT_IMPORT:
            args.max_grad_norm = 0.05


@pytest.mark.slow  # (the default suite stays under 15 minutes on 2 cores; `make test-slow`)
def test_a_callback_acting_on_a_constant_read_at_import_in_a_deleting_process(tmp_path):
    """ATTACK: the constant was None in the recording process; `hf-unlearn forget` in a process with the variable set
    imports the module again (to rebuild the callback) and the callback clips from step 5 on. It was VERIFIED with
    all 21 tensors off the counterfactual (replay and oracle both clipped). The recording seals keyed digests of the
    module globals the replayed code reads (fixed at import: plain values, functions): refused before any compute,
    naming the global; the same environment deletes exactly."""
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run

    from .conftest import run_cli

    assert CLIP_AT_IMPORT is None
    tok, data, run = _record(tmp_path, "llama", [ClipFromImport()])
    ids = open_run(run).ids_at_steps([LATE])[:1]
    write_ids(tmp_path / "ids.jsonl", ids)
    proc = run_cli("forget", run, "--ids", tmp_path / "ids.jsonl", "--out", tmp_path / "del", "--oracle",
                   "--no-progress", env={"HFU_TEST_CLIP_AT_IMPORT": "1"})
    assert proc.returncode != 0 and "VERIFIED" not in proc.stdout, proc.stdout[-2000:]
    assert "module global tests.test_trace_env_reads.CLIP_AT_IMPORT holds another value in this process" in proc.stderr
    assert "refusing before any compute" in proc.stderr and not (tmp_path / "del").exists()
    proc = run_cli("forget", run, "--ids", tmp_path / "ids.jsonl", "--out", tmp_path / "same", "--oracle",
                   "--no-progress")  # unset, as while recording ("" would be another value)
    assert proc.returncode == 0 and "VERIFIED" in proc.stdout, proc.stderr[-2000:]
    assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "same", [ClipFromImport()])


def test_the_globals_compared_are_those_a_module_fixes_at_import():
    """Plain values, tuples of them and functions are compared; objects (a logger, whose cache a process fills as it
    runs), mutable containers (a history the code appends to) and globals the code assigns (a counter) are not, nor
    are the frameworks' own modules."""
    import logging

    from hf_unlearn.trace.digests import replayed_globals

    entries = replayed_globals({"callback 0": _UsesGlobals})
    names = {k.rsplit(".", 1)[-1] for k in entries}
    assert names == {"LATE", "CLIP_AT_IMPORT", "_helper"}, names
    assert isinstance(_LOGGER, logging.Logger)


_LOGGER = __import__("logging").getLogger(__name__)


def _helper(x):
    return x


_HISTORY: list = []
_CALLS = 0


class _UsesGlobals(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        global _CALLS
        _CALLS += 1  # assigned by the code: running state
        _LOGGER.debug("step %s", state.global_step)
        _HISTORY.append(state.global_step)
        if state.global_step >= LATE and CLIP_AT_IMPORT:
            _helper(args)


def _launch(out, phase: str, **env):
    import os
    import sys
    from pathlib import Path

    from .conftest import ROOT, free_port, run_launch

    def cmd():
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), str(ROOT / "tests" / "trace_rank_reads.py"), str(out), phase]

    base = {k: v for k, v in os.environ.items() if k != "HFU_RANK1_SCALE"}
    proc = run_launch(cmd, out, cwd=str(ROOT), env={**base, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env},
                      timeout=900)
    assert proc.returncode == 0 or phase != "record", proc.stderr[-4000:]
    assert all((Path(out) / f"{phase}-{r}.json").is_file() for r in (0, 1)), proc.stderr[-4000:]
    return [json.loads((Path(out) / f"{phase}-{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow  # four 2-process launches (about two minutes)
def test_a_read_on_process_1_only_is_sealed_and_compared_in_process_1(tmp_path):
    """A user's ``compute_loss`` reads ``HFU_RANK1_SCALE`` on process 1 only (``if int(os.environ["RANK"]) == 1``),
    acting on it only where a deletion masks a row (the probe cannot see it). Before: only process 0's reads were
    sealed; nothing compared the variable before compute, and process 1's replay, reading a variable "the recording's
    code never read", stopped after its compute (process 0 then died in a collective), with the variable set as
    recorded too: every deletion of the run was refused, late. Now every process's reads
    are sealed (``fidelity.process_environment_reads`` for the processes that read otherwise than process 0), each
    process of a deleting launch is compared with its own, and a difference on any refuses on all before any compute,
    naming the variable and the process; with the variable set as recorded the deletion runs (VERIFIED)."""
    from hf_unlearn.trace import open_run

    _launch(tmp_path, "record", HFU_RANK1_SCALE="1")
    fidelity = open_run(tmp_path / "trace").header["fidelity"]
    assert "HFU_RANK1_SCALE" not in fidelity["environment_reads"]
    assert fidelity["process_environment_reads"]["1"]["HFU_RANK1_SCALE"]["value"] is not None
    refused = _launch(tmp_path, "without")
    assert all(r["code"] != 0 for r in refused), refused
    for r in refused:
        assert "HFU_RANK1_SCALE" in r["err"] and "on process 1 of 2" in r["err"] and "\n" not in r["err"], r
    assert not (tmp_path / "del-without").exists()
    done = _launch(tmp_path, "with", HFU_RANK1_SCALE="1")
    assert [r["code"] for r in done] == [0, 0], done
    assert json.loads((tmp_path / "del-with" / "receipt.json").read_text())["evidence"]["verified"] is True

    # the run as the previous release sealed it (process 0's reads only): the launch with the variable as recorded
    # was refused after its compute, by process 1's replay ("never read"), and process 0 died in the next collective
    from .test_trace_common import copy_run, write_sealed_header

    old = copy_run(tmp_path / "trace", tmp_path / "old" / "trace")
    header = json.loads((old / "header.json").read_text())
    del header["fidelity"]["process_environment_reads"]
    write_sealed_header(old, header)
    before = _launch(tmp_path / "old", "with", HFU_RANK1_SCALE="1")
    assert before[1]["code"] != 0 and "which the recording's code never read" in before[1]["err"], before


def test_each_process_is_compared_with_its_own_ranks_reads():
    """What is sealed per process (only the processes that read otherwise than process 0) and what each rank of a
    deleting launch is compared with; a resumed run keeps the earlier launch's reads."""
    from hf_unlearn.trace.environment_reads import process_reads, recorded_reads, sealed

    key = b"k" * 32
    zero = {"A": {"value": "1", "by": "cb"}}
    one = {**zero, "X": {"value": "2", "by": "cb"}}
    assert process_reads(key, [zero, zero]) == {}
    by_process = process_reads(key, [zero, one])
    assert list(by_process) == ["1"] and by_process["1"] == sealed(key, one)
    fidelity = {"environment_reads": sealed(key, zero), "process_environment_reads": by_process}
    assert recorded_reads(fidelity, 0) == sealed(key, zero) and recorded_reads(fidelity, 1) == sealed(key, one)
    assert recorded_reads(fidelity, 2) == sealed(key, zero) and recorded_reads({}, 1) is None
    earlier = {"1": sealed(key, {"Y": {"value": None, "by": "cb"}})}
    assert set(process_reads(key, [zero, one], earlier)["1"]) == {"A", "X", "Y"}


class ClipWhenTheCommandLineSays(TrainerCallback):
    """A recorded callback: from optimizer step 5 on, clips gradients hard when the command line holds ``--hfu-clip``
    (``in sys.argv``)."""

    def on_step_begin(self, args, state, control, **kwargs):
        import sys

        if state.global_step >= LATE and "--hfu-clip" in sys.argv:
            args.max_grad_norm = 0.05


def test_a_run_whose_code_read_the_command_line_is_refused_in_another_process(tmp_path, monkeypatch):
    """Attack: a recorded callback acting on ``sys.argv`` (the training launch's ``--hfu-clip``); ``hf-unlearn forget``
    runs with its own command line, so its replay and oracle agreed with each other and not with the run (a VERIFIED
    step-5 deletion with every tensor off the counterfactual). The recording notes the read (no value: a keyed
    digest of the arguments); a deleting process with another command line is refused before any compute, naming
    the read; the same command line (the training process itself) deletes exactly."""
    import sys

    from hf_unlearn.trace import open_run

    monkeypatch.setattr(sys, "argv", [*sys.argv, "--hfu-clip"])
    tok, data, run = _record(tmp_path, "llama", [ClipWhenTheCommandLineSays()])
    reads = json.loads((run / "header.json").read_text())["fidelity"]["environment_reads"]
    assert [k for k, v in reads.items() if not v.get("framework")] == ["sys.argv"]
    assert reads["sys.argv"]["by"] == "tests.test_trace_env_reads"
    assert "--hfu-clip" not in (run / "header.json").read_text()
    ids = open_run(run).ids_at_steps([LATE])[:1]
    kind, what = _forget_outcome(run, ids, tmp_path / "same")
    assert kind == "verified"
    assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "same",
                                            [ClipWhenTheCommandLineSays()])
    monkeypatch.setattr(sys, "argv", ["hf-unlearn", "forget", str(run)])
    kind, what = _forget_outcome(run, ids, tmp_path / "other")
    assert kind == "refused" and "read sys.argv, the command line (read by tests.test_trace_env_reads)" in what, what
    assert "before any compute" in what and not (tmp_path / "other").exists()


class ClipWhenArgparseSays(TrainerCallback):
    """A recorded callback: from optimizer step 5 on, clips gradients hard when ``argparse`` finds ``--hfu-clip`` on
    the command line (``parse_known_args()`` reads ``sys.argv`` inside the standard library)."""

    def on_step_begin(self, args, state, control, **kwargs):
        import argparse

        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--hfu-clip", action="store_true")
        if state.global_step >= LATE and parser.parse_known_args()[0].hfu_clip:
            args.max_grad_norm = 0.05


class ClipWhenTheWholeEnvironmentSays(TrainerCallback):
    """A recorded callback: from optimizer step 5 on, clips gradients hard when a copy of the whole environment holds
    ``HFU_TEST_WHOLE_CLIP`` (read after the optimizer step)."""

    def on_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step + 1 >= LATE and "HFU_TEST_WHOLE_CLIP" in os.environ.copy():
            args.max_grad_norm = 0.05


def test_a_read_of_the_command_line_through_argparse_is_the_programs():
    """``argparse`` reads ``sys.argv`` inside the standard library, on the program's behalf: noted as the program's
    read; the same parser run by a framework's code is not."""
    import argparse

    from hf_unlearn.trace.environment_reads import ARGV, watching

    framework = {"__name__": "installed_framework", "argparse": argparse}  # an installed package's module
    exec(compile("def parse():\n    return argparse.ArgumentParser(add_help=False).parse_known_args()",
                 "/venv/lib/python3.11/site-packages/installed_framework.py", "exec"), framework)
    with watching() as log:
        argparse.ArgumentParser(add_help=False).parse_known_args()
    assert log[ARGV]["by"] == __name__
    with watching() as quiet:
        framework["parse"]()
    assert quiet == {}


@pytest.mark.parametrize("how", [pytest.param("argparse", marks=pytest.mark.slow), "whole environment"])
def test_the_command_line_read_through_argparse_or_the_whole_environment_read_is_refused_elsewhere(
        tmp_path, monkeypatch, how):
    """Attack: the command line read through ``argparse`` (a read inside the standard library was not the
    program's, so it was not noted), and the environment read whole in ``on_optimizer_step``: a deleting process with
    ``--hfu-clip`` (or the variable) set gave a VERIFIED step-5 deletion with every tensor off the counterfactual.
    Both reads are noted now and the deleting process is refused before any compute, naming the read."""
    import sys

    from hf_unlearn.trace import open_run

    monkeypatch.delenv("HFU_TEST_WHOLE_CLIP", raising=False)
    callback = ClipWhenArgparseSays() if how == "argparse" else ClipWhenTheWholeEnvironmentSays()
    tok, data, run = _record(tmp_path, "llama", [callback])
    reads = json.loads((run / "header.json").read_text())["fidelity"]["environment_reads"]
    assert ("sys.argv" if how == "argparse" else "os.environ") in reads
    ids = open_run(run).ids_at_steps([LATE])[:1]
    if how == "whole environment":  # the same environment (the training process): deleted exactly
        kind, receipt = _forget_outcome(run, ids, tmp_path / "same")
        assert kind == "verified", receipt
        assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "same", [callback])
    if how == "argparse":
        monkeypatch.setattr(sys, "argv", [*sys.argv, "--hfu-clip"])
    else:
        monkeypatch.setenv("HFU_TEST_WHOLE_CLIP", "1")
    kind, what = _forget_outcome(run, ids, tmp_path / "other")
    named = "sys.argv, the command line" if how == "argparse" else "os.environ, the names of the variables"
    assert kind == "refused" and named in what and "before any compute" in what, what
