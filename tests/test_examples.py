"""examples/: one runnable example per trainer and editor, each with `python` and `accelerate launch`, all in docs/examples.md.

The fast checks read the files; ``pytest -m slow`` runs every example both ways (2 processes where supported).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import pytest

from .conftest import ROOT

EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py"))
ACCELERATE_CPU = ROOT / "examples" / "accelerate" / "cpu_2proc.yaml"
# short arguments for the runs (the defaults are sized for a demonstration, these for a test) and the number of
# processes under `accelerate launch` (two: DDP over gloo, recording and replay included)
RUNS = {
    "trace_deletion.py": (["--rows", "24", "--max-length", "64"], 2),
    "trace_sft.py": (["--rows", "24", "--max-length", "64"], 2),
    "trace_pipeline.py": (["--rows", "16", "--max-length", "64"], 1),  # forget replays a pipeline in one process
    "unlearn_tofu.py": (["--method", "grad_diff", "--max-steps", "2"], 2),
    "masc_tofu.py": (["--lora"], 2),
    "random_label_forgetting.py": (["--rows", "32", "--epochs", "1"], 2),
    "publish.py": (["--local-hub"], 2),
    "qr_erase.py": (["--rank", "2"], 2),
    "cud.py": (["--set-size", "2"], 1),  # single process: EAP-IG scores every sample in one process
}


def _docstring(path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def test_every_example_documents_python_and_accelerate_and_is_in_the_docs():
    readme = (ROOT / "docs" / "examples.md").read_text()
    for path in EXAMPLES:
        doc = _docstring(path)
        assert re.search(rf"python examples/{path.name}", doc), f"{path.name}: no `python examples/...` line"
        assert re.search(rf"accelerate launch .*examples/{path.name}", doc), f"{path.name}: no `accelerate launch` line"
        assert f"`examples/{path.name}`" in readme, f"{path.name} is not listed in docs/examples.md's table"


def test_every_trainer_has_an_example():
    """Each exported ``*Trainer`` is used by an example; registry methods all run through ``unlearn_tofu.py``."""
    import hf_unlearn
    from hf_unlearn.methods.registry import METHODS

    sources = "\n".join(p.read_text() for p in EXAMPLES)
    registry = {spec.trainer.split(":")[1] for spec in METHODS.values()}
    assert "METHODS" in (ROOT / "examples" / "unlearn_tofu.py").read_text()
    trainers = [n for n in hf_unlearn.__all__ if n.endswith("Trainer") and n not in ("UnlearningTrainer",)]
    missing = [n for n in trainers if n not in sources and n not in registry]
    assert missing == [], f"trainers without an example: {missing}"


def test_accelerate_configs_say_what_is_tested():
    folder = ROOT / "examples" / "accelerate"
    configs = sorted(folder.glob("*.yaml"))
    assert {c.name for c in configs} >= {"cpu_2proc.yaml", "ddp_2gpu.yaml", "fsdp_2gpu.yaml", "deepspeed_zero2.yaml"}
    for c in configs:
        head = c.read_text().split("\ncompute_environment")[0]
        assert ("Tested" in head) != ("Documented only" in head), c.name
    import yaml

    assert yaml.safe_load(ACCELERATE_CPU.read_text())["num_processes"] == 2
    for c in configs:  # every config names a runnable command of an existing example
        assert re.search(r"accelerate launch --config_file examples/accelerate/\S+ examples/(\w+\.py)", c.read_text())


def _run(cmd, tmp_path, timeout=900):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    shared = tmp_path.parent / "shared"
    if not shared.exists():  # the examples use ../shared, as from a checkout beside it
        shared.symlink_to(ROOT.parent / "shared")
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["python", "accelerate"])
@pytest.mark.parametrize("name", [p.name for p in EXAMPLES])
def test_example_runs(name, launcher, tmp_path):
    args, procs = RUNS.get(name, ([], 2))
    script = str(ROOT / "examples" / name)
    if launcher == "python":
        cmd = [sys.executable, script, *args]
    elif procs == 2:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CPU), script, *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1", script, *args]
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from hf_unlearn.runtime import IMPORT_NOTICES  # offline (conftest): no notice at import, examples included

    assert not [text for _, text in IMPORT_NOTICES if text in proc.stderr], proc.stderr[-3000:]
    expected = {"trace_deletion.py": "bit for bit: True", "trace_sft.py": "VERIFIED: the SFTTrainer replay",
                "trace_pipeline.py": "VERIFIED: 2 id(s) deleted from the SFT run and the DPO run", "unlearn_tofu.py": "grad_diff: 2 steps",
                "masc_tofu.py": "stopped at step", "random_label_forgetting.py": "unseen rows: accuracy",
                "publish.py": "OK:", "qr_erase.py": "answer loss forget", "cud.py": "hard   set (CUD"}.get(name)
    world = 2 if launcher == "accelerate" else 1
    if name in TWO_PROCESS_EXAMPLES:  # every process says who it is: as many distinct ranks as the world size
        assert processes_that_ran(proc.stdout) == {(rank, world) for rank in range(world)}, proc.stdout[-3000:]
    if name in RECORDING_EXAMPLES:  # and the recording's own header agrees
        from hf_unlearn.trace import open_run

        base = RECORDING_EXAMPLES[name]  # the default --out; with 2 processes BASE_2proc (no collision)
        header = open_run(tmp_path / (base if world == 1 else f"{base}_2proc") / "trace").header
        assert header["world_size"] == world, header["world_size"]
        assert header["distributed_type"] == ("MULTI_CPU" if world == 2 else "NO"), header["distributed_type"]
    if expected is None:
        return
    assert expected in proc.stdout, proc.stdout[-3000:]
    if launcher == "accelerate" and procs == 2:
        assert proc.stdout.count(expected) == 1  # printed by the main process only


def processes_that_ran(stdout: str) -> set[tuple[int, int]]:
    """(rank, world size) of every ``process R of N (TYPE)`` line (hf_unlearn.runtime.init_processes prints one per
    process)."""
    return {(int(r), int(n)) for r, n in re.findall(r"process (\d+) of (\d+) \(", stdout)}


TWO_PROCESS_EXAMPLES = [name for name, (_, procs) in RUNS.items() if procs == 2]
RECORDING_EXAMPLES = {"trace_deletion.py": "trace_example", "trace_sft.py": "trace_sft_example"}  # default --out


def test_every_data_parallel_example_announces_its_processes():
    """The slow runs above can check the ranks only if each data-parallel example calls init_processes."""
    for name in TWO_PROCESS_EXAMPLES:
        assert "init_processes()" in (ROOT / "examples" / name).read_text(), name


_WORLD_PROBE = """
from transformers import TrainingArguments
from hf_unlearn.runtime import init_processes
state = init_processes()
args = TrainingArguments(output_dir="probe_out", report_to=[])  # what every example's trainer builds
print(f"trainer: rank {args.process_index} of {args.world_size} ({args.distributed_state.distributed_type.value})")
"""


@pytest.mark.slow  # (the default suite stays under 15 minutes on 2 cores; `make test-slow`)
def test_cpu_2proc_config_starts_two_processes_that_join_over_gloo(tmp_path):
    """`accelerate launch --config_file examples/accelerate/cpu_2proc.yaml` on a machine without CUDA: two
    processes, ranks 0 and 1, world size 2 in the processes' own state and in TrainingArguments (accelerate 1.x's
    MULTI_CPU started one process: DistributedType.NO, world size 1)."""
    (tmp_path / "probe.py").write_text(_WORLD_PROBE)
    proc = _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CPU),
                 str(tmp_path / "probe.py")], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert processes_that_ran(proc.stdout) == {(0, 2), (1, 2)}, proc.stdout
    trainers = set(re.findall(r"trainer: rank (\d) of (\d) \((\w+)\)", proc.stdout))
    assert trainers == {("0", "2", "MULTI_CPU"), ("1", "2", "MULTI_CPU")}, proc.stdout
