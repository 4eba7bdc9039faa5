"""What a multi-process launch must be for a replay to reproduce it: single process, DDP-style data parallel or FSDP2;
accelerate's mixed precision and compilation as the TrainingArguments say; every process given the same arguments."""

from __future__ import annotations

import os

from ...errors import UnlearnError
from ..hashing import tensor_hash
from ..model_info import frozen_parameters, peft_and_base
from ..sharding import SUPPORTED as supported
from ..sharding import process_differences, refusal
from ..stack import numeric_stack
from .optimizers import jsonable

# TrainingArguments that legitimately differ between the processes of one launch
PROCESS_LOCAL_ARGS = frozenset({"local_rank", "output_dir", "logging_dir", "run_name"})


def check_parallelism(trainer) -> None:
    """Only single-process, DDP-style data parallel and FSDP2 runs are replayable; refuse the rest here."""
    why = refusal(trainer)  # FSDP1, DeepSpeed (hf_unlearn.trace.sharding)
    if why:
        raise UnlearnError(why)
    if trainer.args.n_gpu > 1:
        raise UnlearnError(f"exact deletion cannot replay torch.nn.DataParallel over {trainer.args.n_gpu} GPUs in one "
                           f"process; {supported}")
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != trainer.accelerator.num_processes:
        raise UnlearnError(f"{launched} processes were launched but training runs {trainer.accelerator.num_processes} "
                           "(they are not connected: on CPU set TrainingArguments(use_cpu=True) so they use gloo); "
                           "they would all write the same trace")
    check_launch_settings(trainer)
    if trainer.accelerator.num_processes > 1:
        check_same_arguments(trainer)
        if not trainer.args.average_tokens_across_devices:
            raise UnlearnError("average_tokens_across_devices=False: each process would divide its loss by its "
                               "own token count, and the plan records one loss normaliser per step (the sum over "
                               "the processes): leave average_tokens_across_devices=True (the default)")
    cfg = trainer.accelerator.dataloader_config
    if getattr(cfg, "split_batches", False) or getattr(cfg, "dispatch_batches", False):
        raise UnlearnError(f"exact deletion does not record split_batches/dispatch_batches dataloaders; {supported}")


def check_launch_settings(trainer) -> None:
    """The mixed precision accelerate runs must be what the TrainingArguments say (bf16=/fp16=): the run records it
    and a replay rebuilds it, but accelerate takes ACCELERATE_MIXED_PRECISION (what ``accelerate launch
    --mixed_precision`` or a config file exports) when they say nothing. No compilation (``torch_compile=`` or
    ACCELERATE_DYNAMO_BACKEND): it replaces the model's code when training starts, a program change at step 0."""
    args = trainer.args
    if args.torch_compile:
        raise UnlearnError(f"torch_compile=True ({args.torch_compile_backend or 'inductor'}): compilation replaces the "
                           "model's code when training starts, which the recording's guards see as a program change "
                           "at step 0, so every deletion from the run would be refused; train with torch_compile=False")
    backend = str(getattr(getattr(trainer.accelerator.state, "dynamo_plugin", None), "backend", "NO")).split(".")[-1]
    if backend.upper() != "NO":
        raise UnlearnError(f"accelerate compiles the model with {backend} (ACCELERATE_DYNAMO_BACKEND="
                           f"{os.environ.get('ACCELERATE_DYNAMO_BACKEND')!r} in the environment: accelerate launch "
                           "--dynamo_backend or a config file): compilation replaces the model's code when training "
                           "starts, which the recording's guards see as a program change at step 0, so every deletion "
                           "would be refused; launch with --dynamo_backend no")
    said = "fp16" if args.fp16 else "bf16" if args.bf16 else "no"
    live = str(trainer.accelerator.mixed_precision)
    if live != said:
        raise UnlearnError(f"accelerate runs mixed precision {live!r} (ACCELERATE_MIXED_PRECISION="
                           f"{os.environ.get('ACCELERATE_MIXED_PRECISION')!r} in the environment: accelerate launch "
                           f"--mixed_precision or a config file) but the TrainingArguments say {said!r} (bf16="
                           f"{args.bf16}, fp16={args.fp16}), which is what the run records and a replay rebuilds: "
                           "set bf16=/fp16= in the TrainingArguments or launch without that mixed precision")


def check_same_arguments(trainer) -> None:
    """Every process must train with the main process's TrainingArguments and model description (a collective):
    the header records the main process's (its seed makes every process's microbatch seeds, its model config,
    buffers and numeric stack are what a replay rebuilds on every process), so a process given its own (seed=rank,
    another config, a buffer edited on one process: FSDP2 leaves buffers unsynchronised, another thread count or
    matmul precision) would train what no replay reproduces."""
    from accelerate.utils import gather_object

    base = peft_and_base(trainer.model)[1]
    config = getattr(base, "config", None)
    mine = {"TrainingArguments": {k: jsonable(v) for k, v in trainer.args.to_dict().items()
                                  if k not in PROCESS_LOCAL_ARGS},
            "model config": {k: jsonable(v) for k, v in (config.to_dict() if config is not None else {}).items()},
            "model dtype": str(next(base.parameters()).dtype),
            "frozen parameters": frozen_parameters(trainer.model),
            "buffers": {n: tensor_hash(n, b) for n, b in trainer.model.named_buffers()},
            "numeric stack": numeric_stack(trainer.args.device)}  # threads, kernels' switches: the header's are main's
    diff, where = process_differences(gather_object([mine]))
    if diff:
        raise UnlearnError(f"the processes were given different {'; '.join(diff)}: every process must train with "
                           "the same ones (the run records the main process's); build them the same way on every "
                           f"process ({'; '.join(where)})")

