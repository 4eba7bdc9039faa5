"""The first hour on a fresh clone: every CLI path fails in one line, fast, naming what to set; no stray warnings,
no empty folders; thread defaults that hold up on a busy machine; the embedded TOFU subset."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from hf_unlearn.errors import UnlearnError

from .conftest import ROOT, TOFU_DIR, run_cli

NOISE = ("Traceback", "gemm_4bit_forward", "FutureWarning", "UserWarning", "Retrying in")


def _one_line_error(proc) -> str:
    assert proc.returncode == 1, proc.stderr[-2000:]
    for noise in NOISE:
        assert noise not in proc.stderr, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hf-unlearn: error: "), proc.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("argv, expect", [
    (["eval", "tofu", "{tmp}/no-model", "--out", "{tmp}/o"], "does not exist"),
    (["demo", "--model", "{tmp}/no-model", "--out", "{tmp}/o"], "does not exist"),
    (["forget", "{tmp}/no-model", "--ids", "{tmp}/ids.jsonl", "--out", "{tmp}/o"], "does not exist"),
    (["forget", "{tmp}/run", "--ids", "{tmp}/missing.jsonl", "--out", "{tmp}/o"], "id file"),
    (["unlearn", "masc", "org/model", "--out", "{tmp}/o", "--max-forget-rows", "2"], "HF_HUB_OFFLINE"),
    (["hub", "push", "{tmp}/no-model", "--repo", "a/b"], ""),
    (["forget", "{tmp}/ft", "--ids", "{tmp}/ids.jsonl", "--out", "{tmp}/o"], "holding the recorded run"),
    (["demo", "--out", "{tmp}/busy"], "is not an earlier output of this command"),
])
def test_cli_errors_are_one_line_and_leave_no_folder(argv, expect, tmp_path, capsys):
    from hf_unlearn.cli import main

    (tmp_path / "ids.jsonl").write_text("3600\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "ft" / "trace").mkdir(parents=True)  # runs/ft given where runs/ft/trace is meant
    for name in ("header.json", "plan.jsonl", "wal.bin"):
        (tmp_path / "ft" / "trace" / name).write_text("")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    assert main([a.format(tmp=tmp_path) for a in argv]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hf-unlearn: error: ") and expect in lines[0], err
    assert "--overwrite" not in lines[0] or argv[0] == "forget"  # the demo has no such option to suggest
    assert not (tmp_path / "o").exists() and (tmp_path / "busy" / "notes.txt").is_file()


FAST_FAIL = r"""
import json, sys
from hf_unlearn.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    out.append([main(argv), [m for m in ("torch", "transformers", "datasets") if m in sys.modules]])
print(json.dumps(out))
"""


def fail_in_one_process(cases: list) -> list[tuple[list, str, int, list, str]]:
    """Run each ``(argv, expected text)`` with ``hf-unlearn``'s main in one fresh interpreter: ``(argv, expected,
    exit code, heavy modules imported by then, its stderr line)`` per case."""
    proc = subprocess.run([sys.executable, "-c", FAST_FAIL, json.dumps([argv for argv, _ in cases])],
                          capture_output=True, text=True, cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == len(cases), proc.stderr
    return [(argv, expect, rc, loaded, line) for (argv, expect), (rc, loaded), line in zip(cases, results, lines)]


def test_bad_options_fail_in_one_line_before_torch_is_imported(tmp_path):
    """A typo in --method, a missing id file and every numeric option out of range are refused before torch is
    imported (it costs about 2 s), each in one line; --max-steps 0 used to save the input unchanged as 'ok'."""
    (tmp_path / "ids.jsonl").write_text("3600\n")
    forget = ["forget", str(tmp_path), "--out", str(tmp_path / "o")]
    cases = [
        (forget + ["--ids", str(tmp_path / "ids.jsonl"), "--method", "mascc"], "unknown --method 'mascc'"),
        (forget + ["--ids", str(tmp_path / "missing.jsonl")], "the id file"),
        (forget + ["--ids", str(tmp_path / "ids.jsonl"), "--max-steps", "0"], "--max-steps must be > 0"),
        (forget + ["--ids", str(tmp_path / "ids.jsonl"), "--max-steps", "-5"], "--max-steps must be > 0"),
        (forget + ["--ids", str(tmp_path / "ids.jsonl"), "--lr", "-1"], "--learning-rate must be > 0"),
        (forget + ["--ids", str(tmp_path / "ids.jsonl"), "--eval-rows", "-1"], "--eval-rows must be >= 0"),
        (["unlearn", "masc", str(tmp_path), "--out", str(tmp_path / "o"), "--rho", "1.5"], "--rho must be in (0, 1)"),
        (["unlearn", "npo", str(tmp_path), "--out", str(tmp_path / "o"), "--epochs", "nan"], "--epochs must be > 0"),
        (["edit", "qr-erase", str(tmp_path), "--task-matrices", str(tmp_path), "--out", str(tmp_path / "o"),
          "--energy", "1.5"], "--energy must be in (0, 1]"),
        (["hub", "serve", "--root", str(tmp_path), "--token", "t", "--port", "70000"], "--port must be in [0, 65535]"),
    ]
    for argv, expect, rc, loaded, line in fail_in_one_process(cases):
        assert rc == 1 and "torch" not in loaded, (argv, rc, loaded)
        assert line.startswith("hf-unlearn: error: ") and expect in line, (argv, line)
    assert not (tmp_path / "o").exists()


def test_a_run_given_as_a_model_and_ids_not_in_the_run_are_refused_before_anything_loads(tmp_path):
    """The training folder instead of its trace/ got a message about approximate methods; `--oracle` on a checkpoint
    ran an approximate method and exited 0; ids not in the run were named only after the model loaded. Each is one
    line now, before transformers or datasets is imported (a run is read: its header, plan and deletion log)."""
    from .test_trace_common import get_recorded

    run = get_recorded()
    (tmp_path / "ft").mkdir()
    (tmp_path / "ft" / "trace").symlink_to(run, target_is_directory=True)  # runs/ft: the Trainer's output_dir
    (tmp_path / "ft" / "checkpoint-8").mkdir()
    (tmp_path / "ft" / "checkpoint-8" / "config.json").write_text("{}")
    (tmp_path / "ids.jsonl").write_text("9999\n")  # the run's ids are 0..63
    ids = ["--ids", str(tmp_path / "ids.jsonl"), "--out", str(tmp_path / "o")]
    cases = [
        (["forget", str(tmp_path / "ft"), *ids, "--oracle"],
         f"'{tmp_path / 'ft'}' is a training output folder holding the recorded run '{tmp_path / 'ft' / 'trace'}'"),
        (["forget", str(tmp_path / "ft" / "checkpoint-8"), *ids, "--oracle"], "--oracle is for exact deletion"),
        (["forget", str(tmp_path / "ft" / "checkpoint-8"), *ids, "--method", "npo", "--oracle", "--tokenizer",
          str(tmp_path)], "--tokenizer and --oracle are for exact deletion"),
        (["forget", str(run), *ids], "1 id(s) to forget never appear in the recorded plan"),
    ]
    for argv, expect, rc, loaded, line in fail_in_one_process(cases):
        assert rc == 1 and not {"transformers", "datasets"} & set(loaded), (argv, rc, loaded)
        assert line.startswith("hf-unlearn: error: ") and expect in line, (argv, line)
    assert not (tmp_path / "o").exists()
    # an approximate method named on purpose still takes the model in the training folder (no refusal there)
    from hf_unlearn.deletion.checks import ForgetConfig, _refuse_a_run_in_disguise

    _refuse_a_run_in_disguise(str(tmp_path / "ft"), ForgetConfig(output_dir=str(tmp_path / "o"), method="npo"), None)


def test_a_deletion_output_given_as_a_run_points_to_its_replay_not_its_oracle(tmp_path, capsys):
    """`forget OUT` on a deletion output named `OUT/oracle` ("oracle" sorts before "replay"), which keeps no token
    store and so failed next; the hint names `OUT/replay`, the run a next deletion starts from."""
    from hf_unlearn.cli import main
    from hf_unlearn.validation import recorded_run_inside

    out = tmp_path / "out"
    for name in ("oracle", "replay"):
        (out / name).mkdir(parents=True)
        for f in ("header.json", "plan.bin", "wal.bin"):
            (out / name / f).write_text("")
    (out / "replay" / "private" / "store").mkdir(parents=True)
    (out / "model").mkdir()
    assert recorded_run_inside(out) == str(out / "replay")
    (tmp_path / "ids.jsonl").write_text("3600\n")
    assert main(["forget", str(out), "--ids", str(tmp_path / "ids.jsonl"), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert f"pass `{out / 'replay'}` for exact deletion" in err and "oracle" not in err, err
    # without a store in either, the name decides: still the replay
    shutil.rmtree(out / "replay" / "private")
    assert recorded_run_inside(out) == str(out / "replay")


def test_every_numeric_option_default_lies_in_its_range():
    """The one table of ranges (validation.OPTION_RANGES, > 0 for an option it does not list) admits every
    option's own default: a wrong entry would refuse a command run as documented."""
    from hf_unlearn.cli import build_parser
    from hf_unlearn.validation import range_error

    checked = 0
    stack = [build_parser()]
    while stack:
        parser = stack.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack += list(action.choices.values())
            elif action.type in (int, float) and action.default is not None:
                assert range_error(action.option_strings[0], action.dest, action.default) is None, action
                checked += 1
    assert checked > 100


def test_files_honour_the_umask_and_only_private_files_are_owner_only(tmp_path):
    """mkstemp made every atomically written file 0600 (weights' cards, receipts, hub_pushes.jsonl): a colleague or
    a serving account got "Permission denied". Now a file gets what open() gives it; raw ids and keys stay 0600."""
    import stat

    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.hub.publish import save_card_info
    from hf_unlearn.utils import atomic_write_text

    def mode(path):
        return stat.S_IMODE(path.stat().st_mode)

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "README.md", "card")
        assert mode(tmp_path / "README.md") == 0o644
        save_card_info(tmp_path, {"method": "MASC", "hyperparameters": {}, "forget_ids": [3600], "citation": "",
                                  "paper": ""})
        assert mode(tmp_path / "unlearning_info.json") == 0o600  # raw forget ids
        write_ids(tmp_path / "ids.jsonl", [3600])
        assert mode(tmp_path / "ids.jsonl") == 0o600
        atomic_write_text(tmp_path / "key", "k", private=True)
        assert mode(tmp_path / "key") == 0o600
        os.umask(0o027)
        atomic_write_text(tmp_path / "receipt.json", "{}")
        assert mode(tmp_path / "receipt.json") == 0o640
    finally:
        os.umask(old)


def test_a_fresh_process_prints_one_line_and_no_library_noise(tmp_path):
    """In a new interpreter (import-time messages included): no traceback, no bitsandbytes notice, no FutureWarning,
    no Hub retries; the missing folder is named and the output folder is not created."""
    proc = run_cli("unlearn", "masc", tmp_path / "no-model", "--out", tmp_path / "o", "--max-forget-rows", "2",
                   env={"HF_HUB_OFFLINE": "0"})
    assert "does not exist" in _one_line_error(proc)
    assert not (tmp_path / "o").exists()


def test_an_unreachable_hub_is_one_line_that_says_what_to_set(tmp_path):
    """HF_ENDPOINT on a closed port: no retries, one line naming HF_ENDPOINT / HF_HUB_OFFLINE."""
    proc = run_cli("eval", "tofu", "org/some-model", "--out", tmp_path / "o",
                   env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")})
    line = _one_line_error(proc)
    assert "cannot be reached" in line and "HF_ENDPOINT" in line and "HF_HUB_OFFLINE=1" in line


def test_tofu_from_the_hub_offline_says_what_to_set(monkeypatch):
    from hf_unlearn.data import load_tofu

    monkeypatch.delenv("HF_UNLEARN_DATA_DIR", raising=False)
    with pytest.raises(UnlearnError, match="HF_UNLEARN_DATA_DIR"):
        load_tofu("forget01")


def test_any_unexpected_error_is_still_one_line(monkeypatch, capsys):
    from hf_unlearn import cli
    from hf_unlearn.commands import demo

    def boom(args):
        raise RuntimeError("something broke\nsecond line")

    monkeypatch.setattr(demo, "run", boom)
    monkeypatch.setattr(cli, "NO_TORCH", {("demo", None)})
    assert cli.main(["demo"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "hf-unlearn: error: RuntimeError: something broke (HF_UNLEARN_DEBUG=1 shows the traceback)"


def test_a_failed_command_removes_the_empty_output_folder_it_created(monkeypatch, tmp_path):
    from hf_unlearn import cli
    from hf_unlearn.commands import demo

    def creates_then_fails(args):
        os.makedirs(os.path.join(args.out, "sub", "deeper"))
        raise UnlearnError("failed")

    monkeypatch.setattr(demo, "run", creates_then_fails)
    monkeypatch.setattr(cli, "NO_TORCH", {("demo", None)})
    assert cli.main(["demo", "--out", str(tmp_path / "new")]) == 1
    assert not (tmp_path / "new").exists()


def test_overwrite_keeps_the_earlier_output_until_the_new_one_is_done(tmp_path, monkeypatch):
    """--overwrite replaces an earlier output only when the new command succeeds; a failure puts it back intact."""
    from hf_unlearn.validation import output_folder

    monkeypatch.delenv("HF_UNLEARN_DEBUG", raising=False)
    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "receipt.json").write_text("earlier")
    (out / "model" / "weights").write_text("earlier weights")
    with pytest.raises(RuntimeError), output_folder(out, marker="receipt.json", overwrite=True) as p:
        assert not any(p.iterdir())  # the command starts from an empty folder
        (p / "receipt.json").write_text("half")
        raise RuntimeError("interrupted")
    assert (out / "receipt.json").read_text() == "earlier"
    assert (out / "model" / "weights").read_text() == "earlier weights"
    with output_folder(out, marker="receipt.json", overwrite=True) as p:
        (p / "receipt.json").write_text("new")
    assert sorted(f.name for f in out.iterdir()) == ["receipt.json"] and (out / "receipt.json").read_text() == "new"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["out"]  # nothing moved aside is left behind


def test_an_earlier_output_stranded_by_a_killed_overwrite_is_named_not_forgotten(tmp_path, monkeypatch):
    """SIGKILL (or a power cut) while ``--overwrite`` replaces an output leaves the earlier one moved aside in
    ``.OUT.previous-*`` and the new one half-written in OUT. The next command on OUT refuses in one line naming
    both and the commands that keep or discard the earlier output (which would otherwise be forgotten there); an
    empty leftover (killed as it was made) is removed."""
    from hf_unlearn.validation import check_new_output, output_folder

    monkeypatch.delenv("HF_UNLEARN_DEBUG", raising=False)
    out = tmp_path / "out"
    aside = tmp_path / ".out.previous-abc123"
    (aside / "out").mkdir(parents=True)
    (aside / "out" / "receipt.json").write_text("earlier")
    (out / "model").mkdir(parents=True)  # what the killed command wrote
    for overwrite in (True, False):
        with pytest.raises(UnlearnError) as e:
            check_new_output(out, overwrite_marker="receipt.json", overwrite=overwrite)
        msg = str(e.value)
        assert "\n" not in msg and "was killed" in msg and str(aside / "out") in msg and f"rm -r {out}" in msg, msg
    assert (aside / "out" / "receipt.json").read_text() == "earlier"  # nothing touched
    shutil.rmtree(out)
    os.rename(aside / "out", out)  # the user keeps the earlier output, as the message says
    aside.rmdir()
    (tmp_path / ".out.previous-empty1").mkdir()
    with output_folder(out, marker="receipt.json", overwrite=True) as p:
        (p / "receipt.json").write_text("new")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["out"]


def test_every_option_of_every_command_has_help():
    from hf_unlearn.cli import build_parser

    missing = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
            elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)) and not action.help:
                missing.append(f"{' '.join(path)} {action.option_strings or action.dest}")

    walk(build_parser(), ())
    assert missing == []


def test_masc_config_from_the_cli_path_raises_no_future_warning(tmp_path):
    import warnings

    from hf_unlearn.methods.registry import get_method
    from hf_unlearn.utils import activation_checkpointing_kwargs

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = get_method("masc").make_config(output_dir=str(tmp_path), report_to=[],
                                                **activation_checkpointing_kwargs(True))
    assert config.gradient_checkpointing is True


def test_import_of_the_cli_does_not_load_bitsandbytes():
    code = "import sys, hf_unlearn.cli; hf_unlearn.cli.build_parser(); print('bitsandbytes' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False" and "gemm_4bit" not in out.stderr


def test_bitsandbytes_import_is_silent_offline_whatever_kernels_prints():
    """peft imports bitsandbytes, which asks `kernels` for a hub kernel: with HF_HUB_OFFLINE=1 (tests, docs) kernels
    0.19 warns about the publisher check and bitsandbytes about the fallback. Neither may reach a CLI's stderr,
    where every error is one line (CI was red on a fresh machine from exactly this)."""
    pytest.importorskip("bitsandbytes")
    code = "import hf_unlearn, peft, bitsandbytes; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert out.stdout.strip() == "ok" and out.stderr.strip() == "", out.stderr


# -- threads -----------------------------------------------------------------------------------------------------
def test_free_cores_follows_the_load():
    from hf_unlearn.runtime import free_cores

    assert free_cores(cores=2, load=0.1) == 2
    assert free_cores(cores=2, load=1.2) == 1
    assert free_cores(cores=2, load=12.0) == 1  # never 0
    assert free_cores(cores=16, load=3.4) == 13


def _thread_probe(env: dict, load: float) -> dict:
    code = (f"import os, json; os.getloadavg = lambda: ({load}, 0.0, 0.0)\n"
            "from hf_unlearn.runtime import prepare_environment, configure_threads\n"
            "prepare_environment(); n = configure_threads()\n"
            "import torch; print(json.dumps({'n': n, 'torch': torch.get_num_threads(), "
            "'policy': os.environ.get('OMP_WAIT_POLICY')}))")
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "HF_UNLEARN_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**base, "PYTHONPATH": str(ROOT), **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # several fresh processes under a simulated load (~12 s)
def test_thread_defaults_degrade_with_load_and_respect_the_user(monkeypatch):
    busy = _thread_probe({}, load=50.0)
    assert busy == {"n": 1, "torch": 1, "policy": "PASSIVE"}
    user = _thread_probe({"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "ACTIVE"}, load=50.0)
    assert user == {"n": 2, "torch": 2, "policy": "ACTIVE"}
    import torch

    from hf_unlearn.runtime import configure_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("HF_UNLEARN_THREADS", "1")
        assert configure_threads() == 1 == torch.get_num_threads()
        monkeypatch.setenv("HF_UNLEARN_THREADS", "many")
        with pytest.raises(UnlearnError, match="whole number"):
            configure_threads()
    finally:
        torch.set_num_threads(before)


# -- the embedded TOFU subset -------------------------------------------------------------------------------------
def test_embedded_tofu_is_the_first_ten_authors_of_full_with_their_ids():
    from hf_unlearn.data.embedded import EMBEDDED_TOFU_FILE, author_ids, load_embedded_tofu

    rows = load_embedded_tofu()
    full = [json.loads(line) for line in (TOFU_DIR / "full.jsonl").read_text().splitlines()[:200]]
    assert rows["id"] == list(range(200))
    assert rows["question"] == [r["question"] for r in full] and rows["answer"] == [r["answer"] for r in full]
    assert load_embedded_tofu(3)["id"] == list(range(60)) and author_ids(2) == list(range(40, 60))
    license_text = (EMBEDDED_TOFU_FILE.parent / "LICENSE").read_text()
    assert "MIT License" in license_text and "locuslab/TOFU" in license_text
    with pytest.raises(UnlearnError, match="10 authors"):
        load_embedded_tofu(11)


def test_the_embedded_subset_ships_in_the_package():
    import ast
    import fnmatch
    import re

    text = (ROOT / "pyproject.toml").read_text()  # (tomllib is 3.11+; the project supports 3.10)
    line = re.search(r"^\[tool\.setuptools\.package-data\]\nhf_unlearn = (\[.*?\])$", text, re.M | re.S).group(1)
    patterns = ast.literal_eval(line)
    for name in ("data/tofu_subset/tofu_10_authors.jsonl", "data/tofu_subset/LICENSE"):
        assert any(fnmatch.fnmatch(name, p) for p in patterns), name


def test_make_skips_the_reinstall_when_this_checkout_is_already_installed_editable(tmp_path):
    """`make demo` ran `pip install -e .[all]` on every run (about 30 s); tools/installed_here.py lets it skip that
    when the package is installed editable from this checkout and pyproject.toml has not changed since."""
    site, checkout = tmp_path / "site", tmp_path / "checkout"
    dist = site / "hf_unlearn-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hf_unlearn\nVersion: 0.1.0\n")
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text("[project]\n")

    def installed_here(url: str, editable: bool = True) -> int:
        (dist / "direct_url.json").write_text(json.dumps({"url": url, "dir_info": {"editable": editable}}))
        os.utime(dist, (2e9, 2e9))
        return subprocess.run([sys.executable, str(ROOT / "tools" / "installed_here.py"), str(checkout)],
                              env={**os.environ, "PYTHONPATH": str(site)}).returncode

    os.utime(checkout / "pyproject.toml", (1e9, 1e9))  # unchanged since the install
    assert installed_here(checkout.as_uri()) == 0
    assert installed_here((tmp_path / "elsewhere").as_uri()) == 1  # installed from another checkout
    assert installed_here(checkout.as_uri(), editable=False) == 1  # a copy: code changes need a reinstall
    os.utime(checkout / "pyproject.toml", (3e9, 3e9))  # dependencies may have changed
    assert installed_here(checkout.as_uri()) == 1
    clean = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "PYTHON")}
    # `make test PYTHON=...` (CI's) passes its PYTHON to every process below it: this checks the default
    dry = subprocess.run(["make", "-n", "install", "install-dev"], capture_output=True, text=True, cwd=str(ROOT),
                         env=clean)
    assert dry.stdout.count("tools/installed_here.py . ") == 2 and "|| python3 -m pip install" in dry.stdout
    # an extra's requirement that is not installed (make demo, then make test): that extra installs, the core not
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hf_unlearn\nVersion: 0.1.0\n"
                                   "Requires-Dist: hf-unlearn-no-such-dist>=1; extra == \"dev\"\n")
    os.utime(checkout / "pyproject.toml", (1e9, 1e9))

    def here(*extras: str) -> int:
        return subprocess.run([sys.executable, str(ROOT / "tools" / "installed_here.py"), str(checkout), *extras],
                              env={**os.environ, "PYTHONPATH": str(site)}).returncode

    assert installed_here(checkout.as_uri()) == 0 and here("all") == 0 and here("dev") == 1


def test_ci_builds_a_new_environment_and_runs_the_readme_test_command_in_it():
    """.ci/run never reuses the Python it starts from: a new venv in a folder it creates, torch pinned first, the
    project from its own files, then `make test` with that venv's Python for the install and the run alike."""
    script = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in script and 'mktemp -d' in script and '-m venv "$VENV"' in script
    project = script.index('pip install -q "${CONSTRAINTS[@]}" -e ".[dev]"')  # versions known to pass together
    assert script.index('pip install -q "torch==$TORCH_VERSION"') < project and "CONSTRAINTS=(-c constraints.txt)" in script
    assert 'make test PYTHON="$PY"' in script
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^make test +# ", readme, re.M)  # the README's test command is the one CI runs
    dry = subprocess.run(["make", "-n", "test", "PYTHON=/ci/venv/bin/python"], capture_output=True, text=True,
                         cwd=str(ROOT)).stdout
    commands = [line for line in dry.splitlines() if "pip install" in line or "pytest" in line]
    assert len(commands) == 3 and all(line.lstrip("@").startswith("/ci/venv/bin/python") or
                                      "|| /ci/venv/bin/python -m pip" in line for line in commands), dry


def test_an_attention_registered_by_the_training_script_is_named_before_any_compute(tmp_path, capsys):
    """A model trained with an attention function its script registered by name (AttentionInterface.register +
    set_attn_implementation) recorded and proved, but every `forget` failed with transformers' one line
    'Specified attn_implementation="my_sdpa" is not supported'; it is refused before any compute now, saying the
    deleting process lacks that registration and what to do, and goes on once it is registered."""
    from transformers import AttentionInterface

    from hf_unlearn.cli import main
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run_model import model_from_run

    from .test_trace_common import copy_run, get_recorded, ids_at_step, write_sealed_header

    run = copy_run(get_recorded(), tmp_path / "run")
    header = json.loads((run / "header.json").read_text())
    header["model"]["attn_implementation"] = "my_sdpa"
    write_sealed_header(run, header)
    (tmp_path / "ids.jsonl").write_text(json.dumps(ids_at_step(run, 6)[0]) + "\n")
    capsys.readouterr()
    assert main(["forget", str(run), "--ids", str(tmp_path / "ids.jsonl"), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "registered as 'my_sdpa' (AttentionInterface.register)" in lines[0], err
    assert "register it before the deletion" in lines[0] and "not supported" not in lines[0]
    assert not (tmp_path / "o").exists()
    with pytest.raises(UnlearnError, match="registered as 'my_sdpa'"):
        model_from_run(open_run(run))  # any rebuild of the model says the same
    sdpa = AttentionInterface._global_mapping["sdpa"]
    AttentionInterface.register("my_sdpa", sdpa)
    try:
        from hf_unlearn.trace.run_model import check_attention

        check_attention(open_run(run))  # registered in this process: accepted
        assert model_from_run(open_run(run)).config._attn_implementation == "my_sdpa"
    finally:
        AttentionInterface._global_mapping.pop("my_sdpa", None)
