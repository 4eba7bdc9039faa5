import subprocess
import sys

import pytest

from hf_unlearn import __version__
from hf_unlearn.cli import GROUPS, main

from .conftest import run_cli


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


def test_bad_input_is_one_line_not_a_traceback(tmp_path):
    proc = run_cli("demo", "--tofu", tmp_path, "--out", tmp_path / "o")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hf-unlearn: error:")]
    assert len(lines) == 1 and "full.jsonl" in lines[0]
