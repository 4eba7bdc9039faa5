import subprocess
import sys

import pytest

from hf_unlearn import __version__
from hf_unlearn.cli import GROUPS, main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and __version__ in capsys.readouterr().out


def test_help_lists_every_group(capsys):
    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(group in out for group in GROUPS)


def test_console_script_is_installed():
    out = subprocess.run(["hf-unlearn", "--help"], capture_output=True, text=True, check=True).stdout
    assert "trace" in out and "demo" in out


def test_import_is_light():
    code = "import sys, hf_unlearn; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_bad_input_is_one_line_not_a_traceback(tmp_path, capsys):
    """The entry point's own handling (in this process: a fresh process's stderr is tested in test_first_hour)."""
    assert main(["demo", "--tofu", str(tmp_path), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("hf-unlearn: error:")]
    assert len(lines) == 1 and "full.jsonl" in lines[0]


def _help(capsys, *args) -> str:
    with pytest.raises(SystemExit):
        main([*args, "--help"])
    return capsys.readouterr().out


def test_help_says_where_to_start(capsys):
    """`hf-unlearn --help` names the first command (the demo) and the record -> forget -> publish path."""
    text = _help(capsys)
    assert "hf-unlearn demo" in text and "TraceRecordingTrainer instead of Trainer" in text
    record, forget, publish = (text.index(s) for s in ("1. record", "2. forget", "3. publish"))
    assert record < forget < publish and "hf-unlearn forget RUN --ids FILE --out OUT --oracle" in text
    assert "hub push OUT/model --repo ORG/NAME" in text


def test_group_help_gives_the_order_of_use(capsys):
    requests = _help(capsys, "requests")
    assert requests.index("`requests add") < requests.index("`requests serve")
    trace = _help(capsys, "trace")
    listed = [line.split()[0] for line in trace.splitlines() if line[:4] == "    " and line[4:5] != " "
              and line.split()[0] in {"inspect", "cost", "prove", "redact", "replay", "oracle", "verify", "compact"}]
    assert listed == ["inspect", "cost", "prove", "redact", "replay", "oracle", "verify", "compact"], listed


def test_hub_push_on_a_recorded_run_says_what_to_push(tmp_path, capsys):
    """It asked for a card-info file; it now says the folder is a run and gives the command that publishes one."""
    from .test_trace_common import get_recorded

    run = str(get_recorded())
    capsys.readouterr()  # the recording's own output, when this test is the first to record it
    assert main(["hub", "push", run, "--repo", "org/m"]) == 1
    err = capsys.readouterr().err
    assert "is a recorded run (a trace), not a model folder" in err and f"hf-unlearn forget {run}" in err, err
    assert "card-info" not in err and err.count("\n") == 1


def test_trace_verify_of_a_single_run_deletion_folder_is_checked_as_a_deletion_folder(tmp_path, capsys):
    """`trace verify OUT` on a single run's `forget --oracle` output (OUT/replay, OUT/oracle, a receipt without
    evidence.pipeline) said only "is not a pipeline deletion's receipt"; it checks such a folder whole now
    (tests/test_forget.py), and one that is not a deletion's output is refused in one line naming what is wrong."""
    import json

    for sub in ("replay", "oracle", "model"):
        (tmp_path / sub).mkdir()
    (tmp_path / "receipt.json").write_text(json.dumps({"mode": "exact", "evidence": {"verified": True}}))
    assert main(["trace", "verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "receipt.json is not an hf_unlearn forget receipt" in err and err.count("\n") == 1


@pytest.mark.slow  # a forget killed mid-run in a child process (~16 s)
def test_a_forget_stopped_by_sigterm_removes_its_output_and_puts_back_the_one_it_replaced(tmp_path):
    """SIGTERM (a scheduler's preemption, ``timeout``, torchrun stopping the other processes when one failed) ended
    ``hf-unlearn forget --overwrite`` at once: its new output half-written and the earlier one left hidden in a
    ``.out.previous-*`` folder. It unwinds like Ctrl-C now: exit 143, one line, the earlier output back as it was."""
    import os
    import signal
    import time
    from pathlib import Path

    from hf_unlearn import forget
    from hf_unlearn.data.ids import write_ids

    from .conftest import ROOT
    from .test_trace_common import copy_run, get_recorded, ids_at_step

    run = copy_run(get_recorded(), tmp_path / "run")
    out = tmp_path / "out"
    forget(run, ids_at_step(run, 6)[:1], out, progress=False, log=lambda m: None)  # the earlier output
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    write_ids(tmp_path / "ids.jsonl", ids_at_step(run, 2)[:1])
    proc = subprocess.Popen([sys.executable, "-m", "hf_unlearn", "forget", str(run), "--ids", str(tmp_path / "ids.jsonl"),
                             "--out", str(out), "--overwrite", "--oracle", "--no-progress"],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (list(tmp_path.glob(".out.previous-*")) and out.is_dir()):  # the earlier output moved aside
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "forget never started writing"
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err, err
    assert not list(tmp_path.glob(".out.*"))
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert Path(out / "receipt.json").is_file()
