"""Sharded training engines in a recorded run: which are exact (FSDP2), which are refused (FSDP1, DeepSpeed), and
the full logical tensors a sharded state is checkpointed, hashed and verified over.

* **FSDP2** (``torch.distributed.fsdp.fully_shard``, ``fsdp_config={"fsdp_version": 2}``) records and replays at
  its recorded world size and sharding: every parameter is a ``DTensor`` sharded on dim 0 over the processes, and
  so is the optimizer state of each. A checkpoint's state hashes are over the *full logical tensors* (each gathered
  from its shards, one tensor at a time), so its roots and ``trace verify`` do not depend on how the run was sharded:
  the root of an FSDP2 run's checkpoint is the root of the same state held unsharded.
* **Recorded** in the header as ``sharding`` (engine, world size, ``reshard_after_forward``, mixed precision,
  wrapping, the ``fsdp_config``); a replay rebuilds the same ``fsdp_config`` and refuses another world size or
  sharding, naming what differs, before any compute.
* **Refused:** FSDP1 (flat parameters whose padding and flattening order is its own, and its own sharded optimizer
  state: a replay would need FSDP1's flat-parameter layout recorded and rebuilt) and DeepSpeed (ZeRO partitions the
  optimizer state and gradients in its own buckets and reduction order, with its own loss scaler: a replay would
  need DeepSpeed's engine state in the checkpoints and its bucketing reproduced).
* **Per-step fingerprints** (:mod:`hf_unlearn.trace.guards`): every process checksums its own shards
  (``DTensor.to_local()``) after each optimizer step and the checksums of all processes, in rank order, make the
  digest (:func:`all_shards`): it covers the whole state, every process of a replay computes the same one, and it is
  compared at the recorded world size and sharding (which a replay enforces).
* **Published model:** :func:`save_consolidated` writes a replay's final full state as one ``save_pretrained`` folder
  (``trace replay --save-model``, ``forget`` under the run's launch).
* **Checkpoints are sharded on disk** (:mod:`hf_unlearn.trace.shards`): every process writes its own shards, the
  hashes are the full logical tensors' (gathered one tensor at a time), so no process holds the full state to write
  one.
* **Not done:** resuming an FSDP2 recording is refused.
"""

from __future__ import annotations

import torch

from ..errors import UnlearnError
from .checkpoints import full_model_state
from .checksums import ShardPeerDigest  # noqa: F401 - re-exported: it lived here
from .dtensors import (  # noqa: F401 - re-exported: they lived here
    all_shards,
    full,
    full_optimizer_state,
    full_tensors,
    is_sharded,
    local,
    model_is_sharded,
)
from .run_model import model_from_run

ENGINE = "fsdp2"
SUPPORTED = ("supported: one process, data parallel with `accelerate launch --multi_gpu --num_processes N` (DDP), or "
             "FSDP2 (fsdp_config={'fsdp_version': 2}); replays run at the recorded number of processes and sharding")
REFUSED = {
    "FSDP1": "FSDP1 flattens and pads parameters into flat shards with its own sharded optimizer state; a replay would "
             "need that flat-parameter layout recorded and rebuilt: use fsdp_config={'fsdp_version': 2}",
    "DeepSpeed": "ZeRO partitions gradients and optimizer state in its own buckets, reduction order and loss scaler; "
                 "a replay would need DeepSpeed's engine state checkpointed and its bucketing reproduced",
}
# what a replay must share with the recording (a difference is named before any compute)
COMPARED = ("engine", "world_size", "reshard_after_forward", "mixed_precision", "auto_wrap_policy",
            "transformer_cls_names_to_wrap", "min_num_params", "cpu_offload", "activation_checkpointing")


def process_numerics() -> dict:
    """What this process's numbers depend on besides the model, the data and the plan, that a refusal can name: the
    numeric environment variables, torch's process-wide switches and the code of the functions a model's forward
    calls besides its own classes' (``torch.nn.functional``, ...: a patch on one process only)."""
    import sys

    from .digests import CODE_MODULES, PROCESS_LOCAL, code_digest, torch_state
    from .stack import numeric_environment

    code = {}
    for name in CODE_MODULES:
        for attr, value in sorted(vars(sys.modules[name]).items()) if name in sys.modules else ():
            body = getattr(value, "__code__", None)
            if body is not None:
                code[f"{name}.{attr}"] = f"{getattr(value, '__qualname__', attr)}:{code_digest(body)}"
    switches = {k: repr(v) for k, v in torch_state().items() if k not in PROCESS_LOCAL and not k.startswith("environ ")}
    return {"environment": numeric_environment(), "torch": switches, "code": code}


def process_causes(recorded_env: dict | None, everyone: list[dict]) -> list[str]:
    """Per process, what of :func:`process_numerics` differs from the recording's environment or from process 0's,
    in words (what a failed probe names; it is the probe, not this, that refuses)."""
    from .stack import environment_difference

    out = []
    for rank, mine in enumerate(everyone):
        who = f"process {rank}'s" if len(everyone) > 1 else "the"
        env = environment_difference(recorded_env, mine["environment"])
        if env:
            out.append(f"{who} numeric environment differs from the recording's: {env}")
        if rank == 0:
            continue
        for part, what in (("torch", "torch settings"), ("code", "functions")):
            keys = sorted(k for k in set(mine[part]) | set(everyone[0][part])
                          if mine[part].get(k) != everyone[0][part].get(k))
            if keys:
                more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
                out.append(f"{who} {what} differ from process 0's: {', '.join(keys[:3])}{more}")
    return out


def with_process_causes(error: Exception, recorded_env: dict | None) -> Exception:
    """``error`` with what :func:`process_causes` names appended (a collective: every process of the launch calls it,
    e.g. right after :func:`~hf_unlearn.trace.processes.agreed` raised the same error on each)."""
    from .processes import gathered

    causes = process_causes(recorded_env, gathered(process_numerics()))
    if causes:
        error.args = (f"{error}; {'; '.join(causes)}",)
    return error


def process_differences(everyone: list[dict]) -> tuple[list[str], list[str]]:
    """Each process's description (``what -> value``, in rank order, gathered) against process 0's: the parts that
    differ with their fields (``numeric stack (environment)``), and in words which process holds which value of each
    differing field (``process 1 has environment.MKL_CBWR='COMPATIBLE' (process 0: absent)``): what a refusal of
    processes given different settings names."""
    parts, where = [], []

    def show(value) -> str:
        text = "absent" if value is _ABSENT else repr(value)
        return text if len(text) <= 60 else text[:57] + "..."

    def leaves(a, b, path: str):  # the differing fields, one dict level deeper where both are dicts
        if isinstance(a, dict) and isinstance(b, dict):
            return [x for k in sorted(set(a) | set(b), key=str) if a.get(k, _ABSENT) != b.get(k, _ABSENT)
                    for x in leaves(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}.{k}" if path else str(k))]
        return [(path, a, b)]

    main = everyone[0]
    for what, value in main.items():
        others = [(rank, o.get(what, _ABSENT)) for rank, o in enumerate(everyone) if rank and o.get(what) != value]
        if not others:
            continue
        if isinstance(value, dict):  # name the fields
            keys = sorted({k for _, o in others if isinstance(o, dict) for k in set(value) | set(o)
                           if o.get(k) != value.get(k)}, key=str)
            parts.append(f"{what} ({', '.join(map(str, keys))})")
        else:
            parts.append(what)
        for rank, o in others:
            found = leaves(o, value, "")
            shown = ", ".join(f"{p}={show(a)}" if p else show(a) for p, a, _ in found[:2])
            before = ", ".join(show(b) for _, _, b in found[:2])
            more = f" and {len(found) - 2} more" if len(found) > 2 else ""
            where.append(f"process {rank} has {what} {shown}{more} (process 0: {before})")
    return parts, where


_ABSENT = type("Absent", (), {"__repr__": lambda self: "absent"})()


def unsharded_class(cls: type) -> type:
    """The model class FSDP2's ``fully_shard`` subclassed (``FSDPLlamaForCausalLM`` -> ``LlamaForCausalLM``), else
    ``cls``: what the header records and a replay rebuilds."""
    from torch.distributed.fsdp import FSDPModule

    if not issubclass(cls, FSDPModule):
        return cls
    return next(b for b in cls.__mro__[1:] if not issubclass(b, FSDPModule))


def engine_spec(trainer) -> dict | None:
    """The sharding of ``trainer``'s run (None without FSDP): what the header records and a replay must match.

    Taken from the FSDP plugin's arguments as the ``TrainingArguments`` give them (the plugin object rewrites some of
    its fields when it wraps the model) and the accelerator's mixed precision."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    plugin = dict(trainer.args.fsdp_plugin_args or {})
    live = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    version = int(plugin.get("fsdp_version", getattr(live, "fsdp_version", 1)))
    spec = {"engine": ENGINE if version == 2 else "fsdp1", "world_size": trainer.accelerator.num_processes,
            "mixed_precision": str(trainer.accelerator.state.mixed_precision)}
    spec.update({k: _plain(plugin.get(k)) for k in COMPARED if k not in spec})
    spec["cpu_offload"] = bool(spec["cpu_offload"])
    spec["activation_checkpointing"] = bool(spec["activation_checkpointing"])
    spec["fsdp_config"] = {k: _plain(v) for k, v in (trainer.args.fsdp_config or {}).items()}
    spec["checkpoints"] = "sharded: each process writes its shards; hashed as the full logical (unsharded) tensors"
    return spec


def _plain(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    return str(v)


def refusal(trainer) -> str | None:
    """Why ``trainer``'s engine cannot be recorded or replayed (None: one process, DDP or FSDP2)."""
    if getattr(trainer, "is_deepspeed_enabled", False):
        return f"exact deletion cannot replay a DeepSpeed run: {REFUSED['DeepSpeed']}; {SUPPORTED}"
    spec = engine_spec(trainer)
    if spec is not None and spec["engine"] != ENGINE:
        return f"exact deletion cannot replay an FSDP1 run: {REFUSED['FSDP1']}; {SUPPORTED}"
    return environment_refusal(trainer) if spec is not None else None


# FSDP2 plugin fields accelerate fills from FSDP_* environment variables (what `accelerate launch --config_file`
# exports) when the TrainingArguments leave them unset -> (environment variable, what the arguments imply)
ENVIRONMENT = {"cpu_offload": ("FSDP_OFFLOAD_PARAMS", False),
               "activation_checkpointing": ("FSDP_ACTIVATION_CHECKPOINTING", False),
               "activation_checkpointing_offload": ("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", False),
               "ignored_modules": ("FSDP_IGNORED_MODULES", None),
               "transformer_cls_names_to_wrap": ("FSDP_TRANSFORMER_CLS_TO_WRAP", None),
               "min_num_params": ("FSDP_MIN_NUM_PARAMS", 0)}


def environment_refusal(trainer) -> str | None:
    """Why the live FSDP plugin is not what the ``TrainingArguments`` say (None when it is): the run records and a
    replay rebuilds the arguments' ``fsdp_config``, so a setting only accelerate's environment made (FSDP turned on by
    ``ACCELERATE_USE_FSDP``, or a field the arguments leave unset filled from ``FSDP_*``) would be neither recorded
    nor reproduced. Checked at construction (recording and replay), before the model is wrapped."""
    args = trainer.args.fsdp_plugin_args
    if args is None:
        return ("FSDP is turned on by accelerate's environment (ACCELERATE_USE_FSDP, e.g. accelerate launch "
                "--config_file with an FSDP config), not by the TrainingArguments the run records and a replay "
                "rebuilds: pass TrainingArguments(fsdp=True, fsdp_config={'version': 2, ...}) with the same settings")
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = trainer.accelerator.state.fsdp_plugin
    names = getattr(plugin, "transformer_cls_names_to_wrap", None)
    live = {"cpu_offload": isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy),
            "activation_checkpointing": bool(getattr(plugin, "activation_checkpointing", False)),
            "activation_checkpointing_offload": bool(getattr(plugin, "activation_checkpointing_offload", False)),
            "ignored_modules": getattr(plugin, "ignored_modules", None) or None,
            "transformer_cls_names_to_wrap": ",".join(names) if isinstance(names, (list, tuple)) else names,
            "min_num_params": int(getattr(plugin, "min_num_params", 0) or 0)}
    diff = [f"{k} ({live[k]!r}, from {var} in the environment)" for k, (var, default) in ENVIRONMENT.items()
            if live[k] != _plain(args.get(k, default))]
    if diff:
        return (f"the FSDP plugin runs {', '.join(diff)}, which the TrainingArguments' fsdp_config does not say: the "
                "run records (and a replay rebuilds) only the fsdp_config; set it there or unset the variable")
    return None


def check_replay(header: dict, trainer) -> None:
    """Refuse a replay whose sharding is not the recorded one, naming what differs (before any compute)."""
    recorded, live = header.get("sharding"), engine_spec(trainer)
    if recorded is None and live is None:
        return
    if recorded is None or live is None:
        what = "an FSDP2 run" if recorded else "an unsharded run"
        now = "without FSDP" if recorded else f"with {live['engine']}"
        raise UnlearnError(f"the run is {what} and this replay runs {now}: a replay must run the recorded sharding "
                           "(omit args= so the replay rebuilds the recorded fsdp_config)")
    diff = [f"{k} ({live.get(k)!r} vs recorded {recorded.get(k)!r})" for k in COMPARED if live.get(k) != recorded.get(k)]
    if diff:
        raise UnlearnError(f"the replay's sharding differs from the recorded run's in {', '.join(diff)}: a replay "
                           "must run at the recorded world size and sharding")


def replay_arguments(header: dict) -> dict:
    """The TrainingArguments a replay of a sharded run adds: the recorded ``fsdp`` and ``fsdp_config``."""
    sharding = header.get("sharding")
    if not sharding:
        return {}
    import os

    world, launched = sharding["world_size"], int(os.environ.get("WORLD_SIZE", "1") or 1)
    if launched != world:  # before TrainingArguments refuses fsdp outside a distributed launch
        raise UnlearnError(f"the run was recorded with {world} process(es) (FSDP2) and this replay has {launched}: a "
                           f"replay must run at the recorded world size and sharding (run it with torchrun "
                           f"--nproc_per_node {world})")
    return {"fsdp": True, "fsdp_config": dict(sharding["fsdp_config"])}


def load_optimizer_state(optimizer, osd: dict) -> None:
    """Load a checkpoint's (full-tensor) optimizer state into an optimizer over sharded parameters: each state tensor
    shaped like its parameter becomes a DTensor with the parameter's mesh and placements (this process's shard).
    The entries ``osd["local_shards"]`` names (``[index, key]``, a sharded checkpoint read by this process) are
    already this process's shards: they become DTensors as they are (:mod:`hf_unlearn.trace.shards`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    mine = {(int(i), k) for i, k in osd.get("local_shards", ())}
    state = {}
    for i, st in osd["state"].items():
        p = params[int(i)]
        state[i] = {k: (DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, shape=p.shape,
                                           stride=p.stride()) if (int(i), k) in mine else
                        distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                        if is_sharded(p) and torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape) else v)
                    for k, v in st.items()}
    optimizer.load_state_dict({k: v for k, v in osd.items() if k != "local_shards"} | {"state": state})


def save_consolidated(run, state: dict, out) -> None:
    """Save a replay's final state (full tensors, as every checkpoint holds them) as one ``save_pretrained`` folder:
    the run's model rebuilt in this process, the state loaded strictly, saved (safetensors) for publishing."""

    model = model_from_run(run, weights_follow=True)
    model.load_state_dict(full_model_state(state), strict=True)
    model.save_pretrained(str(out))
