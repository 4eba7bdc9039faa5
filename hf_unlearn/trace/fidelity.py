"""Engine fidelity as evidence: the replay engine proves, on the recorded run itself, that it reproduces it.

A verdict compares a replay with the oracle; both come from one engine, so they can agree while neither
reproduces what was trained (a cast buffer the checkpoints do not carry, a loss the engine does not run). Three
things close that gap:

* **the model's layout**: the dtype of every parameter and buffer, the values of the non-persistent buffers
  (rotary ``inv_freq``, ...) that ``state_dict`` checkpoints leave out, and the module attributes that disagree with
  the config they were copied from (:func:`config_attributes`) are recorded when training starts
  (``model/buffers.safetensors``, the header) and restored on every rebuilt model, so ``model.bfloat16()``,
  ``resize_token_embeddings`` and a config edited after loading replay exactly;
* **checkpoints passed**: every replay compares its state with each recorded checkpoint it reaches before the
  first affected step and stops at the first mismatch, naming the step and the tensor;
* **the recording's self-check** (:mod:`hf_unlearn.trace.self_check`): while training the recorder hashes its own
  state after the first optimizer step (in memory, no extra file); when ``train()`` ends it replays that step from
  the step-0 checkpoint with the replay engine (model rebuilt from the trace) and compares; the outcome is sealed
  into ``header.json`` (``fidelity``). A run the engine does not reproduce is refused by every replay and by
  ``verify``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UnlearnError
from ..utils import weights_follow_umask
from .files import BUFFERS_FILE, check_sidecar, file_sha256


class FidelityError(UnlearnError):
    """The replay engine's state differs from a recorded checkpoint of the run it replays."""


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _non_persistent_buffers(model) -> dict[str, torch.Tensor]:
    """Every buffer ``state_dict`` leaves out, under each name it is reachable by."""
    out = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name in getattr(module, "_non_persistent_buffers_set", ()):
            buf = module._buffers.get(name)
            if buf is not None:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def model_layout(model, rebuilt: dict | None = None) -> dict:
    """The dtype of every parameter and buffer that differs from the first parameter's, the non-persistent buffer
    names, and the module attributes a rebuilt model holds otherwise (``rebuilt``: those that differ from the model
    a replay builds, :func:`hf_unlearn.trace.model_info.rebuilt_attributes`, with :func:`config_attributes`); what
    :func:`restore_layout` needs besides a checkpoint. Refuses a buffer it could not restore."""
    default = _dtype_name(next(model.parameters()))
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    buffers = _non_persistent_buffers(model)
    for name, buf in buffers.items():
        if buf.layout != torch.strided or buf.device.type == "meta":
            raise UnlearnError(f"the model's non-persistent buffer {name!r} is {buf.layout} on {buf.device}: a replay "
                               "cannot restore it (checkpoints do not carry it); make it a plain dense tensor")
    layout = {"default": default,
              "tensors": {n: _dtype_name(t) for n, t in tensors.items() if _dtype_name(t) != default},
              "buffers": sorted(buffers)}
    attributes = {m: dict(values) for m, values in (rebuilt or {}).items()}
    for module, values in config_attributes(model).items():
        attributes.setdefault(module, {}).update(values)
    if attributes:
        layout["attributes"] = attributes
    checkpointing = activation_checkpointing(model)
    if checkpointing is not None:
        layout["activation_checkpointing"] = checkpointing
    return layout


def activation_checkpointing(model) -> dict | None:
    """``{"kwargs", "input_require_grads"}`` where the model's layers recompute their activations
    (``model.gradient_checkpointing_enable(...)`` called by the program, whatever ``TrainingArguments`` say), else
    None: a replay builds the model without it, and its backward then runs other kernels (every deletion was
    refused after training). ``input_require_grads``: the input embeddings' output requires grad (PEFT sets it for a
    checkpointed base)."""
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            fn = getattr(m, "_gradient_checkpointing_func", None)
            kwargs = {k: v for k, v in (getattr(fn, "keywords", None) or {}).items() if type(v) in _PLAIN}
            hooked = any(getattr(x, "_require_grads_hook", None) is not None for x in model.modules())
            return {"kwargs": kwargs, "input_require_grads": hooked}
    return None


def _restore_checkpointing(model, wanted: dict) -> None:
    """Turn on activation checkpointing as the recorded model had it (a replay's own arguments may already have)."""
    if not any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        target = model.get_base_model() if hasattr(model, "get_base_model") else model
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(wanted.get("kwargs") or {}))
    if wanted.get("input_require_grads") and not any(getattr(x, "_require_grads_hook", None) is not None
                                                     for x in model.modules()):
        target = model.get_base_model() if hasattr(model, "get_base_model") else model
        target.enable_input_require_grads()


_PLAIN = (bool, int, float, str)


def config_attributes(model) -> dict:
    """``{module: {attribute: value}}``: module attributes named like a field of the model's config that hold another
    value than the config. A replay builds the modules from the config, which a module copied at construction:
    ``resize_token_embeddings`` updates ``config.vocab_size`` and leaves ``LlamaModel.vocab_size``, and a config edited
    after loading (``config.attention_dropout = 0.1``) leaves every attention module's copy (the run trains without
    dropout, a replay built from the config with it). Recorded when training starts, given back to rebuilt models."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is None:
        return {}
    fields = {k: v for k, v in vars(text).items() if type(v) in _PLAIN}
    out: dict = {}
    for name, module in model.named_modules():
        for k, v in vars(module).items():
            if k in fields and type(v) in _PLAIN and v != fields[k]:
                out.setdefault(name, {})[k] = v
    return out


def save_buffers(model, run: Path, rebuilt: dict | None = None) -> dict:
    """Write the non-persistent buffers to ``run/model/buffers.safetensors``; return the layout with its digest."""
    from safetensors.torch import save_file

    layout = model_layout(model, rebuilt)
    path = Path(run) / BUFFERS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {n: b.detach().to("cpu").clone().contiguous() for n, b in _non_persistent_buffers(model).items()}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    weights_follow_umask(tmp)
    tmp.replace(path)
    layout["buffers_sha256"] = file_sha256(path)
    return layout


def changed_buffers(model, run: Path) -> list[str]:
    """Non-persistent buffers whose values differ from those recorded when training started (a dynamic RoPE)."""
    from safetensors.torch import load_file

    path = Path(run) / BUFFERS_FILE
    if not path.is_file():
        return []
    saved = load_file(str(path))
    now = _non_persistent_buffers(model)
    return [n for n in sorted(set(saved) | set(now))
            if n not in saved or n not in now or not torch.equal(saved[n], now[n].detach().to("cpu"))]


def restore_layout(model, run, header: dict, given: bool = False) -> None:
    """Give a rebuilt model the recorded dtypes and non-persistent buffers (runs recorded before this: nothing).

    With ``given`` (a model the caller passed), a dtype that differs is refused, naming the tensor, instead of cast.
    """
    layout = (header.get("model") or {}).get("layout")
    if not layout:
        return
    for module_name, attributes in (layout.get("attributes") or {}).items():
        try:
            module = model.get_submodule(module_name)
        except AttributeError:
            raise UnlearnError(f"the replay model has no module {module_name!r}, whose attributes the recorded "
                               "model's forward read") from None
        for k, v in attributes.items():
            setattr(module, k, v)
    if layout.get("activation_checkpointing"):
        _restore_checkpointing(model, layout["activation_checkpointing"])
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    for name, t in tensors.items():
        want = layout["tensors"].get(name, layout["default"])
        if _dtype_name(t) == want:
            continue
        if given:
            raise UnlearnError(f"the model passed to the replay holds {name} as {_dtype_name(t)}, the run trained it as "
                               f"{want}: cast it as the recording did (or omit model= to rebuild it from the trace)")
        _set_tensor(model, name, t.detach().to(getattr(torch, want)))
    if not layout.get("buffers"):
        return
    path = Path(run) / BUFFERS_FILE
    if not path.is_file() or file_sha256(path) != layout.get("buffers_sha256"):
        raise UnlearnError(f"{path} is missing or does not match the digest in header.json: the model's non-persistent "
                           "buffers cannot be restored")
    from safetensors.torch import load_file

    saved = load_file(str(path))
    have = _non_persistent_buffers(model)
    missing = [n for n in layout["buffers"] if n not in have]
    if missing:
        raise UnlearnError(f"the replay model has no buffer {missing[0]!r} that the recorded model's forward read")
    with torch.no_grad():
        for name in layout["buffers"]:
            have[name].copy_(saved[name].to(have[name].device))


def _set_tensor(model, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf in module._parameters:
        module._parameters[leaf].data = value
    else:
        module._buffers[leaf] = value


# ---- checkpoints passed ---------------------------------------------------------------------------------------
def first_difference(recorded: dict, actual: dict) -> tuple[str | None, int]:
    """The first tensor (in the state's own order) whose hash differs between two ``hashes.json`` dicts, and how
    many differ; ``(None, 0)`` when they agree.

    Tensors only (parameters, moments, step counts): the param groups' learning rate in ``meta_sha256`` is the
    scheduler's value for the next step, which a replay writes from the plan when it runs that step.
    """
    diffs = []
    for part, what in (("params", "parameter"), ("optimizer", "optimizer state")):
        a, b = recorded.get(part, {}), actual.get(part, {})
        diffs += [f"{what} {n}" for n in list(b) + [n for n in a if n not in b] if a.get(n) != b.get(n)]
    return (diffs[0] if diffs else None), len(diffs)


def check_against_checkpoint(run_path: Path, step: int, checkpoint: Path, actual: dict, who: str = "the replay") -> None:
    """Refuse (:class:`FidelityError`) unless ``actual`` (a ``hashes.json`` dict) equals the recorded checkpoint's."""
    recorded_file = Path(checkpoint) / "hashes.json"
    if check_sidecar(recorded_file) is False:
        raise UnlearnError(f"{recorded_file} does not match its SHA-256 sidecar: modified after it was written")
    check_against_state(run_path, step, json.loads(recorded_file.read_text()), actual, who)


def check_against_state(run_path: Path, step: int, recorded: dict, actual: dict, who: str = "the replay",
                        where: str | None = None) -> None:
    """Refuse (:class:`FidelityError`) unless two ``hashes.json`` dicts agree (``where``: what ``recorded`` is)."""
    what, n = first_difference(recorded, actual)
    if what is not None:
        raise FidelityError(
            f"the replay engine does not reproduce the recorded run {run_path}: at {where or f'checkpoint step {step}'}"
            f", before any deleted sample, {who}'s state differs from the recorded {'state' if where else 'checkpoint'} "
            f"in {what} (first of {n}); "
            "stopped, a deletion from this engine would not be this run's counterfactual")


# ---- the recording's self-check ----------------------------------------------------------------------------
SELF_CHECK_STEPS = 1  # trace_self_check=True: the first optimizer step (every microbatch, the clip, the update)


def in_memory_reference(step: int, hashes: dict) -> dict:
    """What the recorder keeps for its self-check: the state hashes after optimizer step ``step``, taken in memory
    while training (no checkpoint file)."""
    return {"step": step, "hashes": hashes}


def fidelity_statement(header: dict) -> str:
    """One sentence on the engine-fidelity evidence a run carries (for verify, inspect and receipts)."""
    fid = header.get("fidelity")
    if not fid:
        return "no fidelity evidence recorded (a run recorded before the self-check existed): only the checkpoints a " \
               "replay passes check the engine"
    rec = fid.get("recording", fid)
    if rec.get("checked") and rec.get("reproduced") and rec.get("by") == "proof":
        whole = rec["steps"][1] == header.get("optimizer_steps") or not (fid.get("proof") or {}).get("diverged")
        text = (f"engine reproduced recorded steps {rec['steps'][0]}..{rec['steps'][1] - 1}"
                + (", the whole run" if whole else f" (NOT from step {rec['steps'][1]} on: see the proof)")
                + " (proven at the end of recording: the state after every optimizer step)")
    elif rec.get("checked") and rec.get("reproduced"):
        text = f"engine reproduced recorded steps {rec['steps'][0]}..{rec['steps'][1]} (the recording's self-check)"
    elif rec.get("checked"):
        text = f"ENGINE DID NOT REPRODUCE the recorded run: {rec.get('why')}"
    else:
        text = f"the recording's self-check did not run ({rec.get('why')})"
    guards = fid.get("guards")
    if guards:
        callbacks = [c["class"].rsplit(":", 1)[-1] for c in (header.get("trainer") or {}).get("callbacks") or []]
        text += ("; the recording's per-step guards checked every optimizer step (learning rates at optimizer.step(), "
                 "trainable set, module modes and attributes, in-place edits of parameters, buffers and optimizer "
                 "state)" + (f", callbacks replayed: {', '.join(callbacks)}" if callbacks else ""))
    else:
        text += "; NO per-step guards (steps after the self-check are not proven to be the recorded program)"
    passed = fid.get("checkpoints_matched")
    if passed:
        text += f"; this replay matched the recorded checkpoints at steps {', '.join(map(str, passed))}"
    matched = fid.get("fingerprints_matched") or {}
    if matched.get("state") or matched.get("controls"):
        parts = [f"{what} at steps {r[0]}..{r[1]}" for what, r in (("state", matched.get("state")),
                                                                  ("controls", matched.get("controls"))) if r]
        text += f"; its per-step fingerprints matched the recording's: {', '.join(parts)}"
    return text


def refusal(header: dict) -> str | None:
    """Why verdicts on this run are refused (its engine did not reproduce it), or None."""
    rec = (header.get("fidelity") or {}).get("recording") or {}
    if rec.get("checked") and not rec.get("reproduced"):
        return f"the recording's self-check found the replay engine does not reproduce this run ({rec.get('why')})"
    return None


# ---- CUDA: deterministic kernels, and the device a run can be replayed on -----------------------------------
CUDA_LINES = ("os.environ['CUBLAS_WORKSPACE_CONFIG'] = ':4096:8'  # before torch touches the GPU",
              "torch.use_deterministic_algorithms(True)")


def prepare_cuda_determinism(args) -> bool:
    """On CUDA, turn on deterministic algorithms and the cuBLAS workspace setting they need; True if on CUDA.

    cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when it creates its first handle, so once CUDA is initialised it may be
    too late to set it: then refuse with the two lines to add at the top of the script.
    """
    import os

    if not torch.cuda.is_available() or (args is not None and getattr(args, "use_cpu", False)):
        return False
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        if torch.cuda.is_initialized():
            raise UnlearnError("exact deletion on CUDA needs deterministic kernels and CUDA is already initialised, too "
                               "late to set cuBLAS's workspace; add at the top of the script: "
                               + "  ".join(CUDA_LINES))
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    if not torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(True)
    return True


def device_info(device) -> dict:
    """What decides which kernels run: the device type and, on CUDA, its name, capability and CUDA/cuDNN versions."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"type": device.type}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"type": "cuda", "name": torch.cuda.get_device_name(index),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(index))),
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}


def check_device(header: dict, device) -> None:
    """Refuse a replay on another device, GPU model or CUDA/cuDNN version than the run's (runs recorded before
    this record no device: not checked)."""
    recorded = (header.get("determinism") or {}).get("device_info")
    if not recorded:
        return
    here = device_info(device)
    diff = [f"{k} {here.get(k)!r} (recorded {recorded.get(k)!r})" for k in ("type", "name", "capability", "cuda", "cudnn")
            if recorded.get(k) != here.get(k)]
    if diff:
        raise UnlearnError("this replay runs on other hardware than the recorded run: " + ", ".join(diff)
                           + "; kernels differ, so it would not reproduce the run: replay on the recorded device")
