"""Run by every process of ``torchrun --nproc_per_node 2`` (CPU, gloo) in the FSDP2 trace tests.

    torchrun --nproc_per_node 2 tests/trace_fsdp.py OUT ARCH RESHARD PRECISION STEPS
    (or launch(...) from Python: tests/test_trace_fsdp.py, benchmarks/device_suite.py --fsdp on GPUs)

Records an FSDP2 ``Trainer`` run (``fsdp_config={"fsdp_version": 2, "reshard_after_forward": RESHARD}``, mixed
precision PRECISION: ``no`` or ``bf16``) with TraceRecordingTrainer through the test-only CPU stand-in
(:mod:`tests.fsdp_cpu`), checks its parameters are DTensor shards, then for each deletion step in STEPS (comma
separated: the optimizer step whose first row is deleted) honours the deletion with the CLI's replay and oracle (both
under this launch), and builds the engine-free counterfactual: the same FSDP2 ``Trainer`` run with the deleted rows'
labels -100 and the recorded normalisers and seeds. It tries a replay with another sharding.
Process 0 writes what happened to OUT/result.json for the test to check.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
DUMP_AFTER_S = 600
DEVICE_ENV = "HF_UNLEARN_FSDP_TEST_DEVICE"  # cpu (gloo, the CPU stand-in) or cuda (benchmarks/device_suite.py --fsdp)


def fsdp_args(out, reshard: bool, precision: str, **kw):
    import os

    from tests.test_trace_common import train_args

    return train_args(out, per_device_train_batch_size=2, max_steps=4, fsdp=True, bf16=precision == "bf16",
                      fsdp_config={"fsdp_version": 2, "reshard_after_forward": reshard},
                      use_cpu=os.environ.get(DEVICE_ENV, "cpu") == "cpu", **kw)


def launch(out: Path, arch: str, reshard: bool, precision: str, steps: str = "0,3", processes: int = 2,
           device: str = "cpu", timeout: int = 900, script: Path | None = None) -> dict:
    """Run this script (or ``script``, taking the same arguments: tests/trace_fsdp_attacks.py) under ``torchrun
    --nproc_per_node PROCESSES`` (a free port) and return its result.json."""
    import os

    from tests.conftest import free_port, run_launch

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", DEVICE_ENV: device,
           "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # CUDA: set before the processes initialise it

    def cmd():  # a free port for each attempt
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port",
                str(free_port()), str(script or Path(__file__).resolve()), str(out), arch, "1" if reshard else "0",
                precision, steps]

    proc = run_launch(cmd, out, cwd=str(root), env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((Path(out) / "result.json").read_text())


def build_model(arch: str, tok):
    """A tiny model: ``build_tiny_model``'s families, or ``qwen2`` from its config (as test_trace_fidelity builds it)."""
    from hf_unlearn.models import build_tiny_model
    from tests.test_trace_common import config_model

    if arch == "qwen2":
        return config_model("qwen2", tok)
    return build_tiny_model(arch, tok, hidden_size=32, num_layers=2, num_heads=2, seed=0)


def full_state(model) -> dict:
    """The full logical model state, gathered by torch.distributed.checkpoint (not by the library's code)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def counterfactual(tok, data, model, run_dir, forget, out, reshard, precision) -> dict:
    """A plain FSDP2 ``Trainer`` run (no replay engine): the deleted rows' labels -100, the recorded loss normalisers
    and per-process microbatch seeds. Returns the full state (on process 0)."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from tests.test_trace_common import labels_masked, recorded_normalisers_trainer

    masked = labels_masked(data, forget)
    RecordedNormalisers = recorded_normalisers_trainer(run_dir)
    trainer = RecordedNormalisers(model=model, args=fsdp_args(out, reshard, precision), train_dataset=masked,
                                  data_collator=_DropIds(QACollator.from_tokenizer(tok)))
    trainer.train()
    return full_state(trainer.model)


def shard_files(run) -> dict:
    """What each kept checkpoint holds on disk: its files, and per process the bytes of the model and optimizer
    tensors it wrote against the full state's (from the loaded full checkpoint)."""
    from safetensors import safe_open

    from hf_unlearn.trace.run import load_checkpoint

    out = {}
    for step, d in run.checkpoints().items():
        full = load_checkpoint(d)  # assembled from every process's shards, every hash checked
        total = sum(t.nbytes for t in full["model"].values()) + sum(
            v.nbytes for st in full["optimizer"]["state"].values() for v in st.values() if hasattr(v, "nbytes"))
        written = {}
        for f in sorted(d.glob("*-rank*.safetensors")):
            rank = f.name.split("-rank")[1].split("-")[0]
            with safe_open(str(f), framework="pt") as h:
                written[rank] = written.get(rank, 0) + sum(h.get_tensor(k).nbytes for k in h.keys())
        out[str(step)] = {"files": sorted(f.name for f in d.iterdir()), "written": written, "full": total}
    return out


def tamper(run) -> str | None:
    """Flip one byte of process 1's model shard in a middle checkpoint: a load and a deep check must refuse it."""
    import shutil

    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace.checkpoints import verify_checkpoint_files
    from hf_unlearn.trace.run import load_checkpoint

    d = run.checkpoints()[sorted(run.checkpoints())[1]]
    f = d / "model-rank1-of-2.safetensors"
    shutil.copy2(f, f.with_name("kept"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    errors = []
    for check in (lambda: load_checkpoint(d), lambda: load_checkpoint(d, rank=1), lambda: verify_checkpoint_files(d)):
        try:
            check()
        except UnlearnError as e:
            errors.append(str(e))
    f.with_name("kept").replace(f)
    return " | ".join(errors) if len(errors) == 3 else None


def main(out: Path, arch: str, reshard: bool, precision: str, steps: list[int]) -> None:
    import torch
    from transformers import TrainerCallback

    from hf_unlearn.cli import main as cli
    from hf_unlearn.data import QACollator
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.runtime import init_processes
    from hf_unlearn.trace import ReplayTrainer, TraceRecordingTrainer, open_run, redact_store
    from hf_unlearn.trace.hashing import root_hash, tensor_hash
    from hf_unlearn.trace.run import load_checkpoint
    from hf_unlearn.trace.verification import verify
    from tests import fsdp_cpu
    from tests.test_trace_common import get_trace_data

    faulthandler.dump_traceback_later(DUMP_AFTER_S, exit=True)  # a hung collective says where, then the test fails
    fsdp_cpu.enable()
    torch.set_num_threads(1)
    state = init_processes(announce=False)
    tok, data = get_trace_data()
    data = data.select(range(32))
    trace = out / "trace"
    sharded = []

    class Sharded(TrainerCallback):  # during training, not after: the model the optimizer steps is the sharded one
        def on_step_end(self, args, st, control, model=None, **kwargs):
            sharded.append(fsdp_cpu.assert_sharded(model))

    trainer = TraceRecordingTrainer(model=build_model(arch, tok), args=fsdp_args(out / "ft", reshard, precision),
                                    train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
                                    trace_dir=trace, trace_checkpoint_steps=1, callbacks=[Sharded()])
    assert trainer.is_fsdp_enabled
    trainer.train()
    gathered = full_state(trainer.model)  # torch's own gather of the recorded final state
    state.wait_for_everyone()
    run = open_run(trace)
    result = {"sharded_params_per_step": sharded, "model_class": run.header["model"]["class"], "header_world_size": run.header["world_size"],
              "sharding": run.header.get("sharding"), "kept": sorted(run.checkpoints()),
              "retention": run.header["checkpoint_retention"], "deletions": [],
              "self_check": run.header["fidelity"]["recording"]}
    if state.is_main_process:
        final = json.loads((run.final_checkpoint() / "hashes.json").read_text())
        names = list(final["params"])
        result["root_is_unsharded_root"] = root_hash({n: tensor_hash(n, gathered[n]) for n in names}) == \
            final["params_root"]
        from hf_unlearn.trace.lineage import weights_root  # lineage over full logical tensors, as a next stage sees

        lineage = run.header["lineage"]
        result["lineage"] = {"start_is_unsharded_root": lineage["start_root"] == weights_root(
            build_model(arch, tok).state_dict()), "output_is_final_root": lineage["output_root"] == final["params_root"]}
        result["checkpoint_files"] = shard_files(run)
    recorded = load_checkpoint(run.final_checkpoint())["model"]
    for step in steps:
        d = out / f"delete-{step}"
        forget = run.ids_at_steps([step])[:1]
        if state.is_main_process:
            d.mkdir()
            write_ids(d / "forget.jsonl", forget)
            redact_store(run.store_path, forget, d / "store", run.key)  # a one-process command
        state.wait_for_everyone()
        f = str(d / "forget.jsonl")
        codes = [cli(["trace", "replay", str(trace), "--store", str(d / "store"), "--forget", f, "--out",
                      str(d / "replay"), "--save-model", str(d / "model")]),
                 cli(["trace", "oracle", str(trace), "--forget", f, "--out", str(d / "oracle")])]
        cf = counterfactual(tok, data, build_model(arch, tok), trace, forget, d / "cf", reshard, precision)
        state.wait_for_everyone()
        if state.is_main_process:
            report = verify(d / "replay", d / "oracle")
            oracle = load_checkpoint(open_run(d / "oracle").final_checkpoint())
            model = {**oracle["model"], **{a: oracle["model"][n] for a, n in oracle["tied"].items()}}
            same = sorted(model) == sorted(cf) and all(torch.equal(model[n].view(torch.uint8).reshape(-1),
                                                                   cf[n].contiguous().view(torch.uint8).reshape(-1))
                                                       for n in model)
            replay_header = open_run(d / "replay").header
            saved = type(build_model(arch, tok)).from_pretrained(d / "model").state_dict()  # one consolidated folder
            final = load_checkpoint(open_run(d / "replay").final_checkpoint())["model"]
            result["deletions"].append({
                "step": step, "codes": codes, "verified": report["verified"], "elements": report["params"]["elements"],
                "start_step": json.loads((d / "replay" / "deletion_log.jsonl").read_text().splitlines()[-1])[
                    "start_step"],
                "counterfactual_equals_oracle": same,
                "replay_checkpoints_sharded": all((c / "model-rank1-of-2.safetensors").exists() and not (
                    c / "model.safetensors").exists() for c in open_run(d / "replay").checkpoints().values()),
                "saved_model_is_replay": all(torch.equal(saved[n], t) for n, t in final.items()), "replay_sharding": replay_header.get("sharding"),
                "oracle_differs_from_recording": not all(torch.equal(oracle["model"][n], recorded[n])
                                                         for n in oracle["model"]),
            })
    # `forget` under this launch (the Python API of `torchrun ... -m hf_unlearn.cli forget RUN`): the late deletion
    from hf_unlearn.deletion import forget as forget_request

    ids = run.ids_at_steps([steps[-1]])[:1]
    receipt = forget_request(str(trace), ids, out / "forget", oracle=True, progress=False, log=lambda line: None)
    if state.is_main_process:
        saved = type(build_model(arch, tok)).from_pretrained(out / "forget" / "model").state_dict()
        oracle = load_checkpoint(open_run(out / "forget" / "oracle").final_checkpoint())["model"]
        result["forget"] = {"ok": receipt.ok, "verified": receipt.evidence.get("verified"),
                            "model_is_oracle": all(torch.equal(saved[n], t) for n, t in oracle.items())}
    else:
        assert receipt is None  # the main process writes and returns the receipt
    # a step-0 deletion with its oracle: the oracle's first step is affected, so each process's oracle takes the
    # environment probe its own process ran before compute (a peer that probed again alone would hang the launch)
    first = run.ids_at_steps([0])[:1]
    receipt = forget_request(str(trace), first, out / "forget0", oracle=True, progress=False, log=lambda line: None)
    if state.is_main_process:
        result["forget"]["step0_verified"] = bool(receipt.ok and receipt.evidence.get("verified"))
    refused = {}
    if state.is_main_process:
        refused["tampered_shard"] = tamper(run)
    try:  # another sharding: reshard_after_forward flipped
        ReplayTrainer(trace, start="full", args=fsdp_args(out / "other", not reshard, precision))
    except UnlearnError as e:
        refused["other_sharding"] = str(e)
    state.wait_for_everyone()
    if state.is_main_process:
        result["refused"] = refused
        (out / "result.json").write_text(json.dumps(result))


def attack(out: Path, arch: str, reshard: bool, precision: str) -> None:
    """A hook on process 1 only edits its shard of one parameter after optimizer step 1 (code a replay does not run,
    which the main process's guard cannot see): the per-step digest, gathered from every process, must differ from
    the replay's at step 1 on every process (so all of them refuse, none waits in a collective). The recording's own
    self-check (``trace_self_check=2``: both processes replay steps 0..2) finds it first, and every later replay is
    refused before any compute, on every process."""
    import torch

    from hf_unlearn.data import QACollator
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.runtime import init_processes
    from hf_unlearn.trace import ReplayTrainer, TraceRecordingTrainer
    from tests import fsdp_cpu
    from tests.test_trace_common import get_trace_data

    faulthandler.dump_traceback_later(DUMP_AFTER_S, exit=True)
    fsdp_cpu.enable()
    torch.set_num_threads(1)
    state = init_processes(announce=False)
    tok, data = get_trace_data()
    trainer = TraceRecordingTrainer(model=build_model(arch, tok), args=fsdp_args(out / "ft", reshard, precision),
                                    train_dataset=data.select(range(32)), data_collator=QACollator.from_tokenizer(tok),
                                    trace_dir=out / "trace", trace_checkpoint_steps=4, trace_self_check=2)
    steps = []

    def edit(optimizer, args, kwargs):
        steps.append(len(steps))
        if state.process_index == 1 and len(steps) == 2:  # after optimizer step 1
            with torch.no_grad():
                next(trainer.model.parameters()).to_local().add_(1e-3)

    trainer.create_optimizer()  # the Trainer keeps it (FSDP2 prepares the model and this optimizer together)
    trainer.optimizer.register_step_post_hook(edit)
    trainer.train()
    state.wait_for_everyone()
    try:
        ReplayTrainer(out / "trace", start="full").train()
        refused = None
    except UnlearnError as e:  # the self-check's verdict, sealed in the header: refused before any compute
        refused = str(e)
    from accelerate.utils import gather_object

    everyone = gather_object([refused])
    if state.is_main_process:
        from hf_unlearn.trace import open_run

        (out / "result.json").write_text(json.dumps({"refused": everyone, "self_check": open_run(
            out / "trace").header["fidelity"]["recording"]}))


if __name__ == "__main__":
    if sys.argv[5] == "attack":
        attack(Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4])
        sys.exit(0)
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4], [int(s) for s in sys.argv[5].split(",")])
