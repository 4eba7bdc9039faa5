"""The numeric stack is part of the record: what decides the bits of a CPU or GPU computation besides the program.

CPU matmuls and reductions split their work by torch's intra-op thread count, so the same step on 1 and on 2
threads gives different floats; the CPU capability torch dispatches to (AVX2, AVX512, ...), the torch, CUDA, cuDNN,
oneDNN and MKL versions and the deterministic settings change them too. The recorder writes all of them into
``header.json`` (``numeric_stack``, under the run's keyed seal). Replays and the oracle then:

* **run with the recorded thread count and deterministic settings** (set for the replay, restored after it), never
  with the CLI's free-cores default or ``HF_UNLEARN_THREADS``: a deletion's result does not depend on how busy the
  machine is;
* **refuse, before any compute, a different capability or version**, naming it: those cannot be set.

Runs recorded before this (no ``numeric_stack``) are accepted with a stated gap (:func:`stack_statement`): the replay
runs with the process's own settings and only the recorded checkpoints it passes check them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

import torch

from ..errors import UnlearnError

HEADER_KEY = "numeric_stack"
# versions and dispatch a replay cannot change: a difference is refused
FIXED = ("torch", "cpu_capability", "onednn", "mkl", "cuda", "cudnn")
FIXED_ON_CUDA = ("torch", "cuda", "cudnn")  # a GPU run computes on the GPU: the host CPU's kernels do not decide it


def _library_version(pattern: str) -> str | None:
    found = re.search(pattern, torch.__config__.parallel_info() + "\n" + torch.__config__.show())
    return found.group(1) if found else None


def deterministic_settings() -> dict:
    """The process-wide switches that select kernels (each one a replay sets to the recorded value)."""
    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "mkldnn_enabled": bool(torch.backends.mkldnn.enabled)}


def apply_deterministic_settings(settings: dict) -> None:
    if "deterministic_algorithms" in settings:
        torch.use_deterministic_algorithms(settings["deterministic_algorithms"],
                                           warn_only=settings.get("deterministic_warn_only", False))
    for key, (owner, attr) in {"cudnn_deterministic": (torch.backends.cudnn, "deterministic"),
                               "cudnn_benchmark": (torch.backends.cudnn, "benchmark"),
                               "cudnn_allow_tf32": (torch.backends.cudnn, "allow_tf32"),
                               "matmul_allow_tf32": (torch.backends.cuda.matmul, "allow_tf32"),
                               "mkldnn_enabled": (torch.backends.mkldnn, "enabled")}.items():
        if key in settings:
            setattr(owner, attr, settings[key])
    if settings.get("float32_matmul_precision"):
        torch.set_float32_matmul_precision(settings["float32_matmul_precision"])


def numeric_stack(device=None) -> dict:
    """What this process computes with: threads, CPU capability, library versions, deterministic settings."""
    return {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "device_type": torch.device(device).type if device is not None else "cpu",
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
            "onednn": _library_version(r"(?:MKL-DNN|oneDNN) v([\d.]+)"),
            "mkl": _library_version(r"Math Kernel Library Version ([\w.\-]+)"),
            "deterministic": deterministic_settings(), "environment": _numeric_environment()}


def _numeric_environment() -> dict:
    from .proven import numeric_environment  # named when the deleting environment's probe fails

    return numeric_environment()


def check_stack(header: dict, device=None) -> None:
    """Refuse (before any compute) a replay whose CPU capability or torch/CUDA/cuDNN/oneDNN/MKL version differs from
    the recorded run's, naming each; runs recorded without a numeric stack are not checked (see module doc)."""
    recorded = header.get(HEADER_KEY)
    if not recorded:
        return
    here = numeric_stack(device)
    keys = FIXED_ON_CUDA if recorded.get("device_type") == "cuda" else FIXED
    diff = [f"{k} {here.get(k)!r} (recorded {recorded.get(k)!r})" for k in keys if recorded.get(k) != here.get(k)]
    if diff:
        from .proven import environment_difference

        env = environment_difference(recorded.get("environment")) if "environment" in recorded else None
        diff += [f"the numeric environment ({env})"] if env else []
        raise UnlearnError("this replay's numeric stack is not the recorded run's: " + ", ".join(diff) + "; its "
                           "kernels compute other bits, so it would not reproduce the run: replay with the recorded "
                           "versions on a machine that dispatches to the same CPU capability")


def stack_change(before: dict | None, after: dict | None) -> str | None:
    """What differs between two recorded stacks that changes results (threads, versions, settings), or None."""
    if not before or not after:
        return None
    diff = [f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in ("threads", *FIXED) if before.get(k) != after.get(k)]
    diff += [f"{k} {v!r} -> {after.get('deterministic', {}).get(k)!r}" for k, v in (before.get("deterministic") or {}).items()
             if (after.get("deterministic") or {}).get(k) != v]
    return ", ".join(diff) or None


@contextlib.contextmanager
def pinned_stack(header: dict):
    """Run a replay with the recorded thread count and deterministic settings; the caller's are restored after."""
    recorded = header.get(HEADER_KEY)
    if not recorded:
        yield
        return
    threads, before, settings = int(recorded["threads"]), torch.get_num_threads(), deterministic_settings()
    asked = os.environ.get("HF_UNLEARN_THREADS")
    if asked and asked.strip() != str(threads):
        logging.getLogger(__name__).warning(
            "HF_UNLEARN_THREADS=%s does not apply to this replay: the run was recorded with %d torch threads, and CPU "
            "results depend on the thread count, so the replay runs with %d", asked, threads, threads)
    torch.set_num_threads(threads)
    apply_deterministic_settings(recorded.get("deterministic") or {})
    try:
        yield
    finally:
        torch.set_num_threads(before)
        apply_deterministic_settings(settings)


def stack_statement(header: dict) -> str:
    """One sentence on the numeric stack a deletion of this run replays with (for receipts and inspect)."""
    recorded = header.get(HEADER_KEY)
    if not recorded:
        return (f"the run records no numeric stack (recorded before hf_unlearn pinned it): replays run with this "
                f"process's {torch.get_num_threads()} torch thread(s) and settings, which the run cannot confirm; only "
                "the recorded checkpoints a replay passes check them (record the run again to pin them)")
    return (f"replays run with the recorded numeric stack: {recorded['threads']} torch thread(s), CPU capability "
            f"{recorded.get('cpu_capability')}, torch {recorded.get('torch')}"
            + (f", CUDA {recorded['cuda']}" if recorded.get("cuda") else "")
            + (f", oneDNN {recorded['onednn']}" if recorded.get("onednn") else "")
            + (f", MKL {recorded['mkl']}" if recorded.get("mkl") else "")
            + f", deterministic algorithms {'on' if recorded.get('deterministic', {}).get('deterministic_algorithms') else 'off'}")
