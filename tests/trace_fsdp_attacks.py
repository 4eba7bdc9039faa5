"""Attacks on the FSDP2 verdicts, run by every process of ``torchrun --nproc_per_node 2`` (CPU, gloo, the test-only
CPU stand-in :mod:`tests.fsdp_cpu`), launched by ``tests/test_trace_fsdp_attacks.py`` through
``tests.trace_fsdp.launch(..., script=THIS)``:

    torchrun --nproc_per_node 2 tests/trace_fsdp_attacks.py OUT ARCH RESHARD PRECISION MODE

MODE ``construction``: settings accelerate's environment makes (what ``accelerate launch --config_file`` exports)
that the TrainingArguments do not say, FSDP1 built for real, processes given their own seed, model config or buffer,
average_tokens_across_devices=False, and the same variables set to their defaults (accepted).
MODE ``rank_local:buffer`` / ``rank_local:normaliser``: see :func:`rank_local`.
MODE ``replay``: a clean FSDP2 run recorded, then replays that cannot reproduce it: launched with an
``FSDP_IGNORED_MODULES`` environment (lm_head unsharded, its gradient never reduced across processes), given another
run's checkpoint with the same shapes, bf16 autocast from ``ACCELERATE_MIXED_PRECISION``, processes given different
ids to forget, and ``forget --repo`` under the launch; each outcome is written. Process 0 writes OUT/result.json.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# accelerate's FSDP_* variables a config file exports, and what each attack sets
ENVIRONMENT_ATTACKS = {
    "offload_from_environment": {"FSDP_OFFLOAD_PARAMS": "true"},
    "activation_checkpointing_from_environment": {"FSDP_ACTIVATION_CHECKPOINTING": "true"},
    "ignored_modules_from_environment": {"FSDP_IGNORED_MODULES": "lm_head"},
    "wrapping_from_environment": {"FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaMLP"},
}
DEFAULTS = {"FSDP_OFFLOAD_PARAMS": "false", "FSDP_ACTIVATION_CHECKPOINTING": "false", "FSDP_VERSION": "2",
            "FSDP_RESHARD_AFTER_FORWARD": "true", "ACCELERATE_USE_FSDP": "true"}


@contextlib.contextmanager
def environment(values: dict):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def outcome(fn) -> str:
    """``accepted``, or the refusal's message."""
    from hf_unlearn.errors import UnlearnError

    try:
        fn()
        return "accepted"
    except UnlearnError as e:
        return f"refused: {e}"


def setup():
    import torch

    from hf_unlearn.runtime import init_processes
    from tests import fsdp_cpu
    from tests.test_trace_common import get_trace_data

    faulthandler.dump_traceback_later(600, exit=True)
    fsdp_cpu.enable()
    torch.set_num_threads(1)
    tok, data = get_trace_data()
    return init_processes(announce=False), tok, data.select(range(32))


def rank_local_buffer(model, rank: int):
    """``model`` with its rotary ``inv_freq`` buffer scaled on process 1 only (a rank-local edit)."""
    import torch

    if rank == 1:
        with torch.no_grad():
            dict(model.named_buffers())["model.rotary_emb.inv_freq"].mul_(1.01)
    return model


def _callback_class():
    from transformers import TrainerCallback

    class HalveLearningRateOnProcess1(TrainerCallback):
        """A callback that acts on process 1 only: it halves the learning rate there at every step's start."""

        def __init__(self, rank: int):
            self.rank = rank

        def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
            if self.rank == 1:
                for g in optimizer.param_groups:
                    g["lr"] *= 0.5

    return HalveLearningRateOnProcess1


def _late_buffer_class():
    from transformers import TrainerCallback

    class EditBufferOnProcess1AfterStep1(TrainerCallback):
        """A callback that scales the rotary ``inv_freq`` buffer on process 1 only, at the end of step 1 (the default
        self-check covers steps 0..1; FSDP2 never synchronises buffers)."""

        def __init__(self, rank: int):
            self.rank = rank

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if self.rank == 1 and state.global_step == 2:
                import torch

                with torch.no_grad():
                    dict(model.named_buffers())["model.rotary_emb.inv_freq"].mul_(1.01)

    return EditBufferOnProcess1AfterStep1


def _read_on_process1_class():
    from transformers import TrainerCallback

    class HalveUnexpectedGradientsOnProcess1(TrainerCallback):
        """On process 1 only: notes its gradient shard's total at each step the first time it runs (the recording), and
        halves the shard when a later run of the program (a plain Trainer's counterfactual in this process) meets
        another total there: a no-op on every recorded step, a change on a deletion's."""

        seen: dict = {}

        def __init__(self, rank: int):
            self.rank = rank

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if self.rank != 1:
                return
            local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                     for p in model.parameters() if p.grad is not None]
            total = float(sum(g.double().sum() for g in local))
            if self.seen.setdefault(state.global_step, total) != total:
                for g in local:
                    g.mul_(0.5)

    return HalveUnexpectedGradientsOnProcess1


def rank_local(out: Path, arch: str, reshard: bool, precision: str, attack: str) -> None:
    """A run whose processes differ in what the plan does not record, deleted at step 0 (nothing left to compare with
    the recording): is the replay VERIFIED, and is its oracle the counterfactual (the same run, labels -100)?
    ATTACK ``buffer``: process 1 alone edits a buffer; ``normaliser``: average_tokens_across_devices=False, so each
    process divides its loss by its own token count (the plan records one normaliser per step); ``callback``: a
    callback halves the learning rate on process 1 only (the plan records the main process's)."""
    HalveLearningRateOnProcess1 = _callback_class()
    import torch

    from hf_unlearn.cli import main as cli
    from hf_unlearn.data import QACollator
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import ReplayTrainer, TraceRecordingTrainer, open_run, redact_store
    from hf_unlearn.trace.run import load_checkpoint
    from hf_unlearn.trace.verification import verify
    from tests.trace_fsdp import build_model, counterfactual, fsdp_args

    state, tok, data = setup()
    rank = state.process_index if attack == "buffer" else 0
    kw = {"average_tokens_across_devices": False} if attack == "normaliser" else {}
    result = {"recording": outcome(lambda: TraceRecordingTrainer(
        model=rank_local_buffer(build_model(arch, tok), rank), train_dataset=data,
        callbacks=[HalveLearningRateOnProcess1(state.process_index)] if attack == "callback" else
        [_late_buffer_class()(state.process_index)] if attack == "late_buffer" else
        [_read_on_process1_class()(state.process_index)] if attack == "rank_read" else [],
        args=fsdp_args(out / "ft", reshard, precision, **kw), data_collator=QACollator.from_tokenizer(tok),
        trace_dir=out / "trace", trace_checkpoint_steps=1).train())}
    if result["recording"] == "accepted":
        run = open_run(out / "trace")
        forget = run.ids_at_steps([0])[:1]
        if state.is_main_process:
            write_ids(out / "forget.jsonl", forget)
            redact_store(run.store_path, forget, out / "store", run.key)
        state.wait_for_everyone()
        f = str(out / "forget.jsonl")
        result["full_replay_without_deletion"] = outcome(lambda: ReplayTrainer(out / "trace", start="full").train())
        result["codes"] = [cli(["trace", "replay", str(out / "trace"), "--store", str(out / "store"), "--forget", f,
                                "--out", str(out / "replay")]),
                           cli(["trace", "oracle", str(out / "trace"), "--forget", f, "--out", str(out / "oracle")])]
        # (the normaliser attack has no counterfactual of this kind: process 1's own normalisers are not recorded;
        # the full replay's refusal at step 0 shows the engine does not reproduce the recording)
        cf = counterfactual(tok, data, rank_local_buffer(build_model(arch, tok), rank), out / "trace", forget,
                            out / "cf", reshard, precision) if attack == "buffer" else None
        if state.is_main_process and result["codes"] == [0, 0]:
            result["verified"] = verify(out / "replay", out / "oracle")["verified"]
            oracle = load_checkpoint(open_run(out / "oracle").final_checkpoint())["model"]
            if cf is not None:
                result["counterfactual_equals_oracle"] = all(torch.equal(oracle[n], cf[n]) for n in oracle)
    state.wait_for_everyone()
    if state.is_main_process:
        (out / "result.json").write_text(json.dumps(result))


def construction(out: Path, arch: str, reshard: bool, precision: str) -> None:
    import torch

    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer
    from tests.test_trace_common import tiny, train_args
    from tests.trace_fsdp import build_model, fsdp_args

    state, tok, data = setup()

    def build(args):
        return lambda: TraceRecordingTrainer(model=build_model(arch, tok), args=args, train_dataset=data,
                                             data_collator=QACollator.from_tokenizer(tok), trace_dir=out / "t")

    result = {}
    for name, values in ENVIRONMENT_ATTACKS.items():
        with environment(values):
            result[name] = outcome(build(fsdp_args(out / name, reshard, precision)))
    # each process its own seed (its microbatch seeds, under dropout its masks): the header holds the main one's
    result["seed_per_process"] = outcome(build(fsdp_args(out / "seed", reshard, precision, seed=state.process_index)))
    # each process divides its loss by its own token count (the plan records one normaliser per step)
    result["normaliser_per_process"] = outcome(build(fsdp_args(out / "norm", reshard, precision,
                                                               average_tokens_across_devices=False)))
    # process 1 alone builds its model otherwise (dropout) or edits a buffer (FSDP2 never synchronises buffers)
    result["model_config_per_process"] = outcome(lambda: TraceRecordingTrainer(
        model=tiny(tok, dropout=0.1 * state.process_index), args=fsdp_args(out / "cfg", reshard, precision),
        train_dataset=data, data_collator=QACollator.from_tokenizer(tok), trace_dir=out / "t"))
    result["buffer_per_process"] = outcome(lambda: TraceRecordingTrainer(
        model=rank_local_buffer(build_model(arch, tok), state.process_index), train_dataset=data,
        args=fsdp_args(out / "buf", reshard, precision), data_collator=QACollator.from_tokenizer(tok),
        trace_dir=out / "t"))
    torch.set_num_threads(1 + state.process_index)  # process 1 alone computes with 2 threads
    result["threads_per_process"] = outcome(build(fsdp_args(out / "threads", reshard, precision)))
    torch.set_num_threads(1)
    with environment({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}):  # a config file, no fsdp= argument
        result["fsdp_from_environment_only"] = outcome(build(train_args(out / "env", per_device_train_batch_size=2,
                                                                        max_steps=4)))
    with environment(DEFAULTS):  # what accelerate launch exports for a default FSDP2 config: nothing differs
        result["environment_at_defaults"] = outcome(build(fsdp_args(out / "defaults", reshard, precision)))
    # FSDP1 for real (sync_module_states off: accelerate would look for a GPU to broadcast from)
    result["fsdp1"] = outcome(build(train_args(out / "fsdp1", per_device_train_batch_size=2, max_steps=4, fsdp=True,
                                               fsdp_config={"version": 1, "sync_module_states": False})))
    result["clean"] = outcome(build(fsdp_args(out / "clean", reshard, precision)))
    state.wait_for_everyone()
    if state.is_main_process:
        (out / "result.json").write_text(json.dumps(result))


def replay(out: Path, arch: str, reshard: bool, precision: str) -> None:
    import shutil

    import torch

    from hf_unlearn.cli import main as cli
    from hf_unlearn.data import QACollator
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.deletion import forget as forget_request
    from hf_unlearn.trace import OracleReplayTrainer, ReplayTrainer, TraceRecordingTrainer, open_run, redact_store
    from tests.trace_fsdp import build_model, fsdp_args

    state, tok, data = setup()
    result = {}
    for name, seed in (("trace", 0), ("other", 1)):  # "other": the same shapes, another initialisation
        torch.manual_seed(seed)
        model = build_model(arch, tok)
        if seed:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
        TraceRecordingTrainer(model=model, args=fsdp_args(out / f"ft-{name}", reshard, precision), train_dataset=data,
                              data_collator=QACollator.from_tokenizer(tok), trace_dir=out / name,
                              trace_checkpoint_steps=1).train()
    state.wait_for_everyone()
    run = open_run(out / "trace")
    forget = run.ids_at_steps([3])[:1]  # the last step: a suffix replay from the checkpoint at step 3
    if state.is_main_process:
        write_ids(out / "forget.jsonl", forget)
        redact_store(run.store_path, forget, out / "store", run.key)
    state.wait_for_everyone()
    f = str(out / "forget.jsonl")
    # 1. the replay and the oracle launched with FSDP_IGNORED_MODULES (lm_head unsharded, its gradient unreduced;
    # before: accepted, then a crash in the optimizer step), or with bf16 autocast from accelerate's environment
    with environment(ENVIRONMENT_ATTACKS["ignored_modules_from_environment"]):
        result["ignored_modules_at_replay"] = {
            "codes": [cli(["trace", "replay", str(out / "trace"), "--store", str(out / "store"), "--forget", f,
                           "--out", str(out / "replay")]),
                      cli(["trace", "oracle", str(out / "trace"), "--forget", f, "--out", str(out / "oracle")])],
            "replay": outcome(lambda: ReplayTrainer(out / "trace", start="full"))}
    with environment({"ACCELERATE_MIXED_PRECISION": "bf16"}):
        result["bf16_from_environment_at_replay"] = outcome(lambda: ReplayTrainer(out / "trace", start="full"))
    # 2. the replay given another run's checkpoints (same shapes; hashes files and all)
    other = open_run(out / "other").checkpoints()
    if state.is_main_process:
        shutil.copytree(run.path, out / "swapped")
        for step, path in run.checkpoints().items():
            target = out / "swapped" / path.relative_to(run.path)
            shutil.rmtree(target)
            shutil.copytree(other[step], target)
    state.wait_for_everyone()
    result["another_runs_checkpoints"] = outcome(lambda: ReplayTrainer(out / "swapped", start="full").train())
    # 3. process 1 alone asked to forget another row (the Python API: each process passes its own list)
    other_ids = run.ids_at_steps([2])[:1]
    result["forget_ids_per_process"] = outcome(lambda: OracleReplayTrainer(
        out / "trace", forget if state.is_main_process else other_ids, out_dir=out / "oracle-mixed"))
    # 4. forget --repo under the launch
    result["forget_repo_under_launch"] = outcome(lambda: forget_request(
        str(out / "trace"), forget, out / "forget", oracle=True, repo="someone/model", progress=False,
        log=lambda line: None))
    state.wait_for_everyone()
    if state.is_main_process:
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    mode, _, attack = sys.argv[5].partition(":")  # rank_local:buffer, rank_local:normaliser
    {"construction": construction, "replay": replay, "rank_local": rank_local}[mode](
        Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4], *([attack] if attack else []))
