"""The proof, the environment probe and the per-step process comparison on multi-process runs (issue #41), run by
every process of ``torchrun --nproc_per_node 2`` (CPU, gloo), launched by ``tests/test_trace_multiprocess.py``
through ``tests.trace_fsdp.launch(..., script=THIS)``:

    torchrun --nproc_per_node 2 tests/trace_multiprocess.py OUT llama 1 no ENGINE:MODE[:RUN]

ENGINE ``ddp`` (plain data parallel) or ``fsdp`` (FSDP2 through the test-only CPU stand-in :mod:`tests.fsdp_cpu`);
the model is a tiny Llama with grouped-query attention (2 heads, 1 key-value head).

MODE ``prove``: a clean run recorded without the end-of-recording proof, then ``hf-unlearn trace prove`` under the
launch, a deletion of it (replay and oracle), and the same deletion with ``torch.nn.functional.silu`` replaced on
process 1 only in the deleting process (the sealed code digests must refuse it), and with ``torch.rsqrt`` replaced
there (its code entry hidden: the environment probe must refuse it). MODE ``attacks``: runs whose process 1 alone edits its program after optimizer step 1 (see
:data:`ATTACKS`), each recorded as a user's script would (the default self-check), then a step-0 and a mid-run
deletion (replay and oracle under the launch); where both succeed, the engine-free counterfactual (a plain Trainer,
the same callback, the deleted row's labels -100, the recorded normalisers and seeds). MODE ``probe:RUN``: the
deletion of RUN (recorded and proven by a ``prove`` launch) with ``MKL_CBWR=COMPATIBLE`` in process 1's environment
only (set before torch starts: MKL's reproducibility mode changes a matmul's bits on this CPU). MODE ``fresh``: a
deletion whose replay starts afresh at checkpoint 2 with step 2 affected (its start probed), and the same start made
to differ on process 1 alone (:func:`fresh_mode`).
Process 0 writes OUT/result.json.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import os
import sys
import warnings
from pathlib import Path

if len(sys.argv) > 5 and ":probe" in sys.argv[5] and os.environ.get("RANK") == "1":
    os.environ["MKL_CBWR"] = "COMPATIBLE"  # process 1 only, before MKL reads it
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import TrainerCallback  # noqa: E402

STEPS = 4  # optimizer steps; kept checkpoints every 2 (0, 2, 4)
DELETIONS = (0, 3)  # a step-0 and a mid-run deletion (its replay starts at checkpoint 2)


def _edit_step(state) -> bool:
    """After optimizer step 1 (its on_step_end), on process 1 only (what a replay carries of the state decides)."""
    return state.global_step == 2 and not state.is_world_process_zero


class EditBufferOnProcess1(TrainerCallback):
    """Scales the rotary ``inv_freq`` buffer on process 1 only, after optimizer step 1 (issue #41's attack); an
    importable class with JSON attributes: a replay runs it again."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if _edit_step(state):
            import torch

            with torch.no_grad():
                dict(model.named_buffers())["model.rotary_emb.inv_freq"].mul_(1.01)


class EditParameterOnProcess1(TrainerCallback):
    """Adds to one parameter on process 1 only, after optimizer step 1 (its local shard under FSDP2)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if _edit_step(state):
            import torch

            p = dict(model.named_parameters())["model.norm.weight"]
            with torch.no_grad():
                (p.to_local() if hasattr(p, "to_local") else p).add_(1e-2)


class ScaleLearningRateOnProcess1(TrainerCallback):
    """Scales every param group's learning rate on process 1 only, from optimizer step 2 on."""

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step >= 2 and not state.is_world_process_zero:
            for g in optimizer.param_groups:
                g["lr"] *= 0.5


def _unreplayable(cls):
    """The same callback as a class a replay cannot import (defined inside a function): watched, never replayed."""
    return type(cls.__name__ + "Local", (cls,), {"__module__": "__main__", "__qualname__": "f.<locals>.x"})


def attacks() -> dict:
    """name -> the callback class process 1 uses (every process is given the same callback: it acts on process 1)."""
    from tests import trace_multiprocess as me  # the importable module (this file runs as __main__)

    return {"buffer": _unreplayable(me.EditBufferOnProcess1), "parameter": _unreplayable(me.EditParameterOnProcess1),
            "lr": _unreplayable(me.ScaleLearningRateOnProcess1),
            "buffer_replayed": me.EditBufferOnProcess1, "parameter_replayed": me.EditParameterOnProcess1}


def cli(argv: list[str]) -> tuple[int, str]:
    """The CLI's exit code and what it wrote to stderr (its one-line refusal)."""
    from hf_unlearn.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue().strip()


def outcome(fn) -> str:
    """``accepted``, or the refusal's message (the FSDP2 attacks' helper)."""
    from tests.trace_fsdp_attacks import outcome as fsdp_outcome

    return fsdp_outcome(fn)


def arguments(engine: str, out, **kw):
    from tests.test_trace_common import train_args
    from tests.trace_fsdp import fsdp_args

    if engine == "fsdp":
        return fsdp_args(out, True, "no", **kw)  # max_steps=4 (STEPS)
    return train_args(out, per_device_train_batch_size=2, max_steps=STEPS, **kw)


def build(tok):
    from tests.test_trace_common import config_model

    return config_model("llama", tok)  # num_key_value_heads=1 < num_attention_heads=2


def full_state(trainer, engine: str) -> dict:
    from tests.trace_fsdp import full_state as gathered

    if engine == "fsdp":
        return gathered(trainer.model)
    return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}


def record(engine: str, tok, data, out: Path, callbacks=(), self_check=True, retention: str | None = None) -> str:
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer

    def go():
        TraceRecordingTrainer(model=build(tok), args=arguments(engine, out / "ft"), train_dataset=data,
                              data_collator=QACollator.from_tokenizer(tok), trace_dir=out / "trace",
                              trace_checkpoint_steps=2, trace_self_check=self_check,
                              **({"trace_checkpoint_retention": retention} if retention else {}),
                              callbacks=[c() for c in callbacks]).train()

    return outcome(go)


def delete(state, run_dir: Path, step: int, out: Path) -> dict:
    """Replay and oracle (the CLI, under this launch) of the deletion of the first row of ``step``."""
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run, redact_store
    from hf_unlearn.trace.verification import verify

    run = open_run(run_dir)
    forget = run.ids_at_steps([step])[:1]
    if state.is_main_process:
        out.mkdir(parents=True)
        write_ids(out / "forget.jsonl", forget)
        redact_store(run.store_path, forget, out / "store", run.key)
    state.wait_for_everyone()
    f = str(out / "forget.jsonl")
    replay = cli(["trace", "replay", str(run_dir), "--store", str(out / "store"), "--forget", f, "--out",
                  str(out / "replay")])
    oracle = cli(["trace", "oracle", str(run_dir), "--forget", f, "--out", str(out / "oracle")])
    from accelerate.utils import gather_object

    everyone = gather_object([[replay, oracle]])  # each process's exit codes and refusals
    result = {"step": step, "forget": forget, "codes": [replay[0], oracle[0]], "errors": [replay[1], oracle[1]],
              "processes": everyone}
    if state.is_main_process and result["codes"] == [0, 0]:
        result["verified"] = verify(out / "replay", out / "oracle")["verified"]
    return result


def counterfactual(engine: str, tok, data, run_dir, forget, out, callbacks) -> dict:
    """A plain Trainer (no replay engine): the same callbacks, the deleted rows' labels -100, the recorded
    normalisers and per-process microbatch seeds. Its full state (on process 0)."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from tests.test_trace_common import labels_masked, recorded_normalisers_trainer

    trainer = recorded_normalisers_trainer(run_dir)(
        model=build(tok), args=arguments(engine, out), train_dataset=labels_masked(data, forget),
        data_collator=_DropIds(QACollator.from_tokenizer(tok)), callbacks=[c() for c in callbacks])
    trainer.train()
    return full_state(trainer, engine)


def equal_to_oracle(oracle_dir: Path, cf: dict) -> bool:
    import torch

    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    oracle = load_checkpoint(open_run(oracle_dir).final_checkpoint())
    model = {**oracle["model"], **{a: oracle["model"][n] for a, n in oracle["tied"].items()}}
    return sorted(model) == sorted(cf) and all(
        torch.equal(model[n].reshape(-1).view(torch.uint8), cf[n].contiguous().reshape(-1).view(torch.uint8))
        for n in model)


def setup(engine: str):
    import torch

    from hf_unlearn.runtime import init_processes
    from tests import fsdp_cpu
    from tests.test_trace_common import get_trace_data

    faulthandler.dump_traceback_later(600, exit=True)  # a hung collective says where, then the test fails
    if engine == "fsdp":
        fsdp_cpu.enable()
    torch.set_num_threads(1)
    tok, data = get_trace_data()
    return init_processes(announce=False), tok, data.select(range(32))


def prove_mode(engine: str, out: Path) -> dict:
    from hf_unlearn.trace import open_run

    state, tok, data = setup(engine)
    result = {"recording": record(engine, tok, data, out, self_check=False)}
    state.wait_for_everyone()
    result["prove"] = cli(["trace", "prove", str(out / "trace")])
    state.wait_for_everyone()
    header = open_run(out / "trace").header
    result["proof"] = header["fidelity"].get("proof")
    result["recording_check"] = header["fidelity"].get("recording")
    result["world_size"] = header.get("world_size")
    result["clean_deletion"] = delete(state, out / "trace", 3, out / "clean")
    # process 1 alone computes SiLU otherwise in the deleting process (x * sigmoid(x): other bits than torch's kernel)
    import torch
    import torch.nn.functional as F

    silu = F.silu
    if state.process_index == 1:
        F.silu = lambda x, inplace=False: x * torch.sigmoid(x)
    try:  # refused by the sealed code digests (hf_unlearn.trace.program_code), before the probe
        result["patched_deletion"] = delete(state, out / "trace", 3, out / "patched")
    finally:
        F.silu = silu
    # process 1 alone computes RMSNorm otherwise (torch.rsqrt as 1 / sqrt, its code entry hidden): the probe's
    from tests.test_trace_common import rsqrt_other_bits

    rsqrt = torch.rsqrt
    if state.process_index == 1:
        torch.rsqrt = rsqrt_other_bits()  # and the code comparison told to ignore it, for this process
    try:
        result["rsqrt_deletion"] = delete(state, out / "trace", 3, out / "rsqrt")
    finally:
        torch.rsqrt = rsqrt
    return state, result


def attacks_mode(engine: str, out: Path) -> dict:
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.guards import program_changes

    state, tok, data = setup(engine)
    result = {}
    for name, cls in attacks().items():
        d = out / name
        entry = result[name] = {"recording": record(engine, tok, data, d, callbacks=[cls])}
        state.wait_for_everyone()
        if entry["recording"] != "accepted":
            continue
        run = open_run(d / "trace")
        entry["changes"] = program_changes(run.plan, run.header)
        entry["proof"] = {k: v for k, v in ((run.header.get("fidelity") or {}).get("proof") or {}).items()
                          if k in ("proven", "steps", "diverged", "processes", "world_size")}
        entry["deletions"] = []
        for step in DELETIONS:
            done = delete(state, d / "trace", step, d / f"delete-{step}")
            if done["codes"] == [0, 0]:  # both ran: the oracle must be the counterfactual of the program that ran
                cf = counterfactual(engine, tok, data, d / "trace", done["forget"], d / f"cf-{step}", [cls])
                if state.is_main_process:
                    done["counterfactual_equals_oracle"] = equal_to_oracle(d / f"delete-{step}" / "oracle", cf)
            entry["deletions"].append(done)
            state.wait_for_everyone()
    return state, result


def probe_mode(engine: str, out: Path, run_dir: str) -> dict:
    state, tok, data = setup(engine)
    result = {"mkl_cbwr": os.environ.get("MKL_CBWR")}
    result["deletion"] = delete(state, Path(run_dir), 3, out / "delete")
    return state, result


def _perturbed_at(step: int, rank: int):
    """``load_checkpoint`` as the replay engine calls it, except that on process ``rank`` the state loaded from the
    checkpoint of ``step`` (after its hashes were checked) has one Adam moment nudged: a process whose start differs
    from the others' (a loader or library that reads the same bytes otherwise there), no other step touched."""
    import torch

    from hf_unlearn.trace import replay

    real = replay.load_checkpoint

    def first_moment(obj):
        if isinstance(obj, dict):
            if isinstance(obj.get("exp_avg"), torch.Tensor) and obj["exp_avg"].is_floating_point():
                return obj
            return next((m for v in obj.values() if (m := first_moment(v)) is not None), None)
        if isinstance(obj, (list, tuple)):
            return next((m for v in obj if (m := first_moment(v)) is not None), None)
        return None

    def loaded(path, *a, **k):
        state = real(path, *a, **k)
        if Path(path).name == f"step-{step:08d}" and int(os.environ.get("RANK", "0")) == rank:
            moment = first_moment(state["optimizer"])
            moment["exp_avg"] = moment["exp_avg"] + 1e-3
        return state

    return replay, real, loaded


def fresh_mode(engine: str, out: Path) -> dict:
    """A run recorded as a user's script would (the default end-of-recording proof: step 0's start only). (b) A row
    of step 2: the replay starts afresh at checkpoint 2 with that step affected, so the deletion probes the start
    (one step from checkpoint 2 with no deletion, every process) before any compute; compared with the engine-free
    counterfactual. Then the same deletion, and one of a row of step 3 (case a: the replay's own first step), with
    process 1 alone starting from another state at checkpoint 2 (:func:`_perturbed_at`): refused, naming process 1."""
    from hf_unlearn.trace import open_run

    state, tok, data = setup(engine)
    result = {"recording": record(engine, tok, data, out, retention="even")}  # checkpoints 0, 2, 4 kept
    state.wait_for_everyone()
    run = out / "trace"
    header = open_run(run).header
    result["proof"] = {k: v for k, v in (header["fidelity"].get("proof") or {}).items()
                       if k in ("proven", "steps", "starts", "processes", "world_size")}
    done = delete(state, run, 2, out / "b")
    if done["codes"] == [0, 0]:
        cf = counterfactual(engine, tok, data, run, done["forget"], out / "cf-b", [])
        if state.is_main_process:
            done["counterfactual_equals_oracle"] = equal_to_oracle(out / "b" / "oracle", cf)
            done["start"] = (open_run(out / "b" / "replay").header.get("fidelity") or {}).get("start")
    result["b"] = done
    state.wait_for_everyone()
    module, real, perturbed = _perturbed_at(2, 1)
    module.load_checkpoint = perturbed
    try:
        for step in (2, 3):
            result[f"diverged_{step}"] = delete(state, run, step, out / f"diverged-{step}")
            result[f"diverged_{step}"]["outputs"] = sorted(p.name for p in (out / f"diverged-{step}").iterdir())
            state.wait_for_everyone()
    finally:
        module.load_checkpoint = real
    if engine == "fsdp":  # process 1's own optimizer shard file of checkpoint 2 edited (only process 1 reads it)
        if state.is_main_process:
            _edit_shard(run / "checkpoints" / "step-00000002", 1)
        state.wait_for_everyone()
        for step in (2, 3):
            result[f"shard_{step}"] = delete(state, run, step, out / f"shard-{step}")
            result[f"shard_{step}"]["outputs"] = sorted(p.name for p in (out / f"shard-{step}").iterdir())
            state.wait_for_everyone()
    return state, result


def _edit_shard(checkpoint: Path, rank: int) -> None:
    """Nudge one tensor of process ``rank``'s optimizer shard file (its hashes.json left as saved)."""
    from safetensors.torch import load_file, save_file

    meta = json.loads((checkpoint / "checkpoint.json").read_text())
    f = checkpoint / meta["sharding"]["files"]["optimizer"][rank]
    tensors = load_file(f)
    name = next(n for n, t in tensors.items() if t.is_floating_point() and t.numel())
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, f)


if __name__ == "__main__":
    out, (engine, mode, *rest) = Path(sys.argv[1]), sys.argv[5].split(":", 2)
    modes = {"prove": prove_mode, "attacks": attacks_mode, "probe": probe_mode, "fresh": fresh_mode}
    state, result = modes[mode](engine, out, *rest)
    from accelerate.utils import gather_object

    result["per_process"] = gather_object([{"rank": state.process_index, "mkl_cbwr": os.environ.get("MKL_CBWR")}])
    state.wait_for_everyone()
    if state.is_main_process:
        (out / "result.json").write_text(json.dumps(result, default=str))
