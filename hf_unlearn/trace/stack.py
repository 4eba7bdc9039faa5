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


# torch >= 2.9 sets float32 precision per backend and operation (``torch.backends.<path>.fp32_precision``:
# "ieee", "tf32", "bf16" or "none", which follows its parent). Once one is set, the legacy getters
# (``torch.get_float32_matmul_precision()``, ``allow_tf32``) raise instead of answering: TrainingArguments(tf32=...)
# on an Ampere GPU sets the new ones, so both are read here, the legacy ones where they still answer.
FP32_PRECISION = ("fp32_precision", "mkldnn.fp32_precision", "mkldnn.matmul.fp32_precision", "mkldnn.conv.fp32_precision",
                  "mkldnn.rnn.fp32_precision", "cuda.matmul.fp32_precision", "cudnn.fp32_precision",
                  "cudnn.conv.fp32_precision", "cudnn.rnn.fp32_precision")
PER_BACKEND = "per backend"  # what a legacy getter reads once the per-backend settings are in use


def _owner(path: str):
    owner = torch.backends
    for part in path.split(".")[:-1]:
        owner = getattr(owner, part, None)
    return owner if owner is not None and hasattr(owner, path.rsplit(".", 1)[-1]) else None


def fp32_precision() -> dict:
    """The per-backend float32 precision settings this torch has (:data:`FP32_PRECISION`)."""
    owners = {p: _owner(p) for p in FP32_PRECISION}  # read at every guard snapshot: each path walked once
    return {p: getattr(o, p.rsplit(".", 1)[-1]) for p, o in owners.items() if o is not None}


def _legacy(read):
    try:
        return read()
    except RuntimeError:  # the per-backend settings are in use (see FP32_PRECISION)
        return PER_BACKEND


def float32_matmul_precision() -> str:
    return _legacy(torch.get_float32_matmul_precision)


def matmul_allow_tf32():
    return _legacy(lambda: bool(torch.backends.cuda.matmul.allow_tf32))


def cudnn_allow_tf32():
    return _legacy(lambda: bool(torch.backends.cudnn.allow_tf32))


def flush_denormal() -> bool:
    """Whether this process flushes denormal floats to zero (``torch.set_flush_denormal``, which has no getter): a
    denormal times two reads back as zero. It changes the bits wherever a value falls below 1.2e-38 (Adam's second
    moment of a gradient under 1e-19, the probability of a token far below the top one)."""
    x = torch.tensor([torch.finfo(torch.float32).tiny / 4], dtype=torch.float32, device="cpu")  # whatever defaults
    return bool((x * 2.0).item() == 0.0)


def _call(path: str, *value):
    """``torch.backends.cuda.<path>(*value)``, looked up when called (an older torch lacks some: AttributeError)."""
    owner = torch.backends.cuda
    for part in path.split(".")[:-1]:
        owner = getattr(owner, part)
    found = getattr(owner, path.rsplit(".", 1)[-1])
    return found(*value) if callable(found) else found


def _assign(path: str):
    def write(value):
        owner, attr = path.rsplit(".", 1)
        setattr(_call(owner), attr, value)
    return write


def _library(name: str):
    return lambda: getattr(_call(name), "name", "").lower() or None


# switches that pick a kernel or its accumulation, each (key, read, set): which scaled-dot-product attention kernels
# may run (disabling the flash one changes a CPU SDPA's bits), reduced-precision reductions, the BLAS and linear
# algebra libraries a GPU dispatches to. Looked up when read: one this torch lacks is neither recorded nor set.
KERNEL_SWITCHES = (
    ("flash_sdp", lambda: _call("flash_sdp_enabled"), lambda v: _call("enable_flash_sdp", v)),
    ("mem_efficient_sdp", lambda: _call("mem_efficient_sdp_enabled"), lambda v: _call("enable_mem_efficient_sdp", v)),
    ("math_sdp", lambda: _call("math_sdp_enabled"), lambda v: _call("enable_math_sdp", v)),
    ("cudnn_sdp", lambda: _call("cudnn_sdp_enabled"), lambda v: _call("enable_cudnn_sdp", v)),
    ("math_sdp_fp16_bf16_reduction", lambda: _call("fp16_bf16_reduction_math_sdp_allowed"),
     lambda v: _call("allow_fp16_bf16_reduction_math_sdp", v)),
    ("cuda_fp16_reduced_precision_reduction", lambda: _call("matmul.allow_fp16_reduced_precision_reduction"),
     _assign("matmul.allow_fp16_reduced_precision_reduction")),
    ("cuda_bf16_reduced_precision_reduction", lambda: _call("matmul.allow_bf16_reduced_precision_reduction"),
     _assign("matmul.allow_bf16_reduced_precision_reduction")),
    ("cpu_fp16_reduced_precision_reduction", lambda: torch._C._get_cpu_allow_fp16_reduced_precision_reduction(),
     lambda v: torch._C._set_cpu_allow_fp16_reduced_precision_reduction(v)),
    ("blas_library", _library("preferred_blas_library"), lambda v: _call("preferred_blas_library", v)),
    ("linalg_library", _library("preferred_linalg_library"), lambda v: _call("preferred_linalg_library", v)),
)


def _read(read):
    try:
        return read()
    except (RuntimeError, AttributeError, TypeError):  # not in this build: not recorded, not set
        return None


def deterministic_settings() -> dict:
    """The process-wide switches that select kernels or round numbers (each one a replay sets to the recorded
    value)."""
    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
            "cudnn_allow_tf32": cudnn_allow_tf32(), "matmul_allow_tf32": matmul_allow_tf32(),
            "float32_matmul_precision": float32_matmul_precision(),
            "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
            "fp32_precision": fp32_precision(), "flush_denormal": flush_denormal(),
            "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
            **{key: _read(read) for key, read, _ in KERNEL_SWITCHES}}


def apply_deterministic_settings(settings: dict) -> None:
    """Set each recorded switch that differs here (one this process cannot read or set is left as it is: the
    environment probe compares what the steps compute)."""
    if "deterministic_algorithms" in settings:
        torch.use_deterministic_algorithms(settings["deterministic_algorithms"],
                                           warn_only=settings.get("deterministic_warn_only", False))
    for key, (owner, attr) in {"cudnn_deterministic": (torch.backends.cudnn, "deterministic"),
                               "cudnn_benchmark": (torch.backends.cudnn, "benchmark"),
                               "mkldnn_enabled": (torch.backends.mkldnn, "enabled")}.items():
        if key in settings:
            setattr(owner, attr, settings[key])
    for key, read, (owner, attr) in (("cudnn_allow_tf32", cudnn_allow_tf32, (torch.backends.cudnn, "allow_tf32")),
                                     ("matmul_allow_tf32", matmul_allow_tf32,
                                      (torch.backends.cuda.matmul, "allow_tf32"))):
        if settings.get(key, PER_BACKEND) != PER_BACKEND and read() not in (PER_BACKEND, settings[key]):
            setattr(owner, attr, settings[key])
    recorded = settings.get("float32_matmul_precision") or PER_BACKEND
    if recorded != PER_BACKEND and float32_matmul_precision() not in (PER_BACKEND, recorded):
        torch.set_float32_matmul_precision(recorded)
    here = fp32_precision()
    for path, value in (settings.get("fp32_precision") or {}).items():
        if path in here and here[path] != value:
            setattr(_owner(path), path.rsplit(".", 1)[-1], value)
    dtype = getattr(torch, settings.get("default_dtype") or "", None)
    if isinstance(dtype, torch.dtype) and dtype != torch.get_default_dtype():  # a model a replay builds is built so
        torch.set_default_dtype(dtype)
    if "flush_denormal" in settings and flush_denormal() != settings["flush_denormal"]:
        torch.set_flush_denormal(settings["flush_denormal"])
    for key, read, write in KERNEL_SWITCHES:
        if settings.get(key) is not None and _read(read) not in (None, settings[key]):
            try:
                write(settings[key])
            except (RuntimeError, ValueError, TypeError, AttributeError):  # this build cannot: the probe compares
                pass


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
    seed = (recorded.get("environment") or {}).get("PYTHONHASHSEED")
    if seed is not None and os.environ.get("PYTHONHASHSEED") != seed:  # recorded unset: random, unrepeatable
        raise UnlearnError(f"the run was recorded with PYTHONHASHSEED={seed} and this process has "
                           f"{os.environ.get('PYTHONHASHSEED', 'none')}: Python's string hashes, so the order of a set "
                           f"or dict of strings a loss or callback iterates, differ; run with PYTHONHASHSEED={seed}")
    if diff:
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


_WARNED: set = set()


@contextlib.contextmanager
def recorded_default_dtype(header: dict):
    """The run's recorded default dtype while the block runs (``torch.set_default_dtype`` also rebinds
    ``torch.Storage``, which the sealed code digests read)."""
    recorded = ((header.get(HEADER_KEY) or {}).get("deterministic") or {}).get("default_dtype")
    dtype, before = getattr(torch, recorded or "", None), torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or dtype == before:
        yield
        return
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def pinned_stack(header: dict):
    """Run a replay with the recorded thread count and deterministic settings; the caller's are restored after.
    Gradients are on whatever the caller's mode (a notebook's ``torch.set_grad_enabled(False)`` left over from an
    evaluation made every deletion crash in its first backward): a replay trains, as the recording did."""
    with torch.inference_mode(False), torch.enable_grad():
        yield from _pinned(header)


def _pinned(header: dict):
    recorded = header.get(HEADER_KEY)
    if not recorded:
        yield
        return
    threads, before, settings = int(recorded["threads"]), torch.get_num_threads(), deterministic_settings()
    asked = os.environ.get("HF_UNLEARN_THREADS")
    if asked and asked.strip() != str(threads) and (asked, threads) not in _WARNED:
        _WARNED.add((asked, threads))  # once per process: a replay pins the stack to build and again to train
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
            + f", deterministic algorithms {'on' if recorded.get('deterministic', {}).get('deterministic_algorithms') else 'off'}"
            + _precision_clause(recorded.get("deterministic") or {}))


def _precision_clause(settings: dict) -> str:
    """The float32 precision and denormal settings a replay pins, where they are not torch's defaults."""
    precision = settings.get("fp32_precision") or {}
    top = precision.get("fp32_precision")  # the backends read it where they set none of their own
    set_ = {p: v for p, v in precision.items() if v not in ("none", "ieee") and (p == "fp32_precision" or v != top)
            and not (p.startswith("cudnn.") and v == "tf32")}  # cuDNN's convolutions default to TF32
    return ((", float32 precision " + ", ".join(f"{p}={v}" for p, v in set_.items()) if set_ else "")
            + (", denormals flushed to zero" if settings.get("flush_denormal") else ""))
# environment variables known to change the bits of a CPU or GPU computation (recorded, and named when a probe
# fails; the probe is the guarantee, not this list)
NUMERIC_ENV = ("MKL_", "DNNL_", "ONEDNN_", "ATEN_CPU_CAPABILITY", "CUBLAS_", "CUBLASLT_", "CUDNN_", "NCCL_", "OMP_",
               "KMP_", "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "TORCH_BLAS_PREFER_CUBLASLT",
               "OPENBLAS_", "BLIS_", "PYTHONHASHSEED")


def numeric_environment() -> dict:
    """This process's environment variables that are known to change numbers (:data:`NUMERIC_ENV`)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(NUMERIC_ENV)}



# OpenMP settings of how idle threads wait and where threads run: they change timing, never what is computed, so a
# difference is not named as the cause of other numbers (the hf-unlearn command sets OMP_WAIT_POLICY=PASSIVE itself)
TIMING_ONLY_ENV = frozenset({"OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT", "OMP_DISPLAY_ENV", "KMP_SETTINGS",
                             "OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY"})


def environment_difference(recorded: dict | None, here: dict | None = None) -> str | None:
    """The numeric environment variables that differ from the recording's, in words (None: none, or not recorded);
    :data:`TIMING_ONLY_ENV` aside."""
    if recorded is None:
        return None
    here = numeric_environment() if here is None else here
    diff = [f"{k}={here.get(k)!r} (recorded {recorded.get(k)!r})" for k in sorted(set(recorded) | set(here))
            if recorded.get(k) != here.get(k) and k not in TIMING_ONLY_ENV]
    return ", ".join(diff) or None

