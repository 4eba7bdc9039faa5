"""Process-wide runtime defaults for the CLI: CPU threads that degrade gracefully on a shared machine, quiet logs.

Why threads: torch runs one OpenMP thread per core, and OpenMP threads that reach a barrier spin before they sleep.
When other processes hold the cores, a spinning thread burns the time slice its partner needs, and every parallel
region waits for the slowest thread: on a 2-core machine at a background load of about 14 the demo's fine-tune ran
10-16x slower with torch's default than with one thread (docs/benchmarks/threads.md, ``bench_threads.py``). So, unless the user chose:

* ``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP threads sleep at once), set before torch is imported;
* threads = the cores the other processes leave free (``cores - load average``, at least 1, at most torch's choice).

``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY`` or ``HF_UNLEARN_THREADS`` set by the user always win.
"""

from __future__ import annotations

import logging
import os
import sys

THREADS_ENV = "HF_UNLEARN_THREADS"


def available_cores() -> int:
    """CPUs this process may run on (the affinity mask, e.g. a container's CPU set)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def free_cores(cores: int | None = None, load: float | None = None) -> int:
    """Cores not taken by other runnable processes: ``cores - round(1-minute load average)``, at least 1."""
    cores = available_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # not available on this platform
            return cores
    return max(1, min(cores, cores - int(round(load))))


def prepare_environment() -> None:
    """Settings that must be in the environment before torch (libgomp) loads; a no-op once torch is imported."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warnings from the tokenizers' own threads
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # "Flattening the indices", "Saving the dataset"


def configure_threads(threads: int | None = None) -> int:
    """Set torch's intra-op threads: ``threads``, else ``$HF_UNLEARN_THREADS``, else the free cores.

    Returns the number in use. ``OMP_NUM_THREADS`` set by the user is respected (nothing is changed).
    """
    import torch

    if threads is None and os.environ.get(THREADS_ENV):
        try:
            threads = int(os.environ[THREADS_ENV])
        except ValueError:
            from .errors import UnlearnError

            raise UnlearnError(f"{THREADS_ENV} must be a whole number of threads, got "
                               f"{os.environ[THREADS_ENV]!r}") from None
    if threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        threads = min(torch.get_num_threads(), free_cores())
    if threads < 1:
        from .errors import UnlearnError

        raise UnlearnError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    return threads


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


# (logger, message prefix) of third-party notices printed at import that say nothing about the user's command: one
# list, read by quiet_optional_backends and by the test that imports every backend offline (tests/test_cli.py)
IMPORT_NOTICES = (
    # bitsandbytes' CPU backend asks the `kernels` package for a hub kernel at import and falls back to its own
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
    # `kernels` (0.19+) warns when HF_HUB_OFFLINE=1 that it cannot check the kernel's publisher (the load then fails
    # and bitsandbytes falls back, as above)
    ("kernels._internals.hf_hub", "Skipping publisher trust check"),
)


def quiet_optional_backends() -> None:
    """Drop the third-party notices of :data:`IMPORT_NOTICES`, printed when bitsandbytes is imported.

    peft imports bitsandbytes whenever it is installed, and transformers' Trainer imports peft, so every command
    printed them (two lines before a one-line error, with ``HF_HUB_OFFLINE=1``), though only ``eval quantized``
    uses bitsandbytes and its fallback kernel works. Idempotent: a filter is added to a logger once.
    """
    for name, prefix in IMPORT_NOTICES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropMessage(prefix))


def quiet_benchmark(threads: int) -> None:
    """A benchmark process: ``threads`` torch threads, and transformers' and datasets' info and progress output off,
    so the ratios it prints are the only output and both arms of a comparison run under the same settings."""
    import datasets
    import transformers

    configure_threads(threads)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def bench_output_dir(name: str) -> str:
    """Where a benchmark writes by default: ``$HF_UNLEARN_BENCH_DIR/name``, else ``~/.cache/hf_unlearn/bench/name``.

    Outside the repository, so runs never leave untracked files in the tree (and cached fine-tunes survive).
    """
    root = os.environ.get("HF_UNLEARN_BENCH_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "hf_unlearn",
                                                                    "bench")
    return os.path.join(root, name)


def init_processes(announce: bool = True):
    """The processes of this launch, joined: ``accelerate.PartialState`` over gloo on CPUs, NCCL on GPUs.

    A launch of several processes on a machine without CUDA (``torchrun --nproc_per_node 2``, or ``accelerate launch
    --config_file examples/accelerate/cpu_2proc.yaml``, which starts them through torchrun) sets
    ``ACCELERATE_USE_CPU=true`` unless the user set it: ``TrainingArguments`` and ``Accelerator`` read it, and
    without it each process would train alone (``DistributedType.NO``, world size 1) on the same rows.
    With ``announce``, every process prints ``process RANK of WORLD_SIZE (TYPE)``: the processes that really ran.
    """
    import torch
    from accelerate import PartialState

    cpu = not torch.cuda.is_available()
    if cpu and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    state = PartialState(cpu=cpu)
    if announce:
        # one write (print's separate "\n" lets two processes' lines run together in a shared pipe)
        sys.stdout.write(f"process {state.process_index} of {state.num_processes} ({state.distributed_type.value})\n")
        sys.stdout.flush()
    return state
