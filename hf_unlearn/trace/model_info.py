"""What the recording and the replays read off a model: its PEFT adapter and base model, its frozen parameters, its
dropout, a rotary embedding that follows the sequence length, a parameter holding a NaN, and the first tensor a replay's
rebuilt model would hold otherwise."""

from __future__ import annotations

import torch

from .guards import all_finite
from .sharding import local


def dynamic_rope(config) -> str | None:
    """The rope type of a config whose rotary frequencies follow the sequence length (``dynamic``, ``longrope``),
    or None. Their ``inv_freq`` buffers change with the longest sequence seen so far: history no checkpoint holds."""
    found = []

    def walk(value):
        if isinstance(value, dict):
            kind = value.get("rope_type", value.get("type"))
            if isinstance(kind, str) and ("dynamic" in kind or kind == "longrope"):
                found.append(kind)
            for v in value.values():
                walk(v)

    for name in ("rope_parameters", "rope_scaling"):
        walk(getattr(config, name, None))
    return found[0] if found else None


_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


EXPERTS_HAZARD = "routes each token to a few experts"  # the words the hazard and the refusal share


def routed_experts(model) -> str | None:
    """What makes ``model`` route each token to a few of several experts (a mixture of experts: Mixtral, Qwen-MoE,
    OLMoE, DeepSeek...), named, or None. An expert's weight gradient is a sum over the tokens the microbatch routes to
    it, so which other tokens share that sum (and where the zero terms of a row with no loss fall in it) depends on
    every row of the microbatch: a deleted row's dummy, routed elsewhere, changes the other rows' update in the last
    bits. Read from the config (:func:`routed_experts_config`) and from module class names."""
    named = routed_experts_config(getattr(model, "config", None))
    if named:
        return f"{type(model).__name__}: {named}"
    for name, module in model.named_modules():
        kind = type(module).__name__
        if "SparseMoe" in kind or kind.endswith(("Experts", "MoE", "MoeBlock", "MoEBlock")):
            return f"{type(model).__name__}: {name} is a {kind}"
    return None


def routed_experts_config(config) -> str | None:
    """``num_experts_per_tok`` with more than one expert in a model config (its text config), named; else None."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_top_k", None)
    counts = {n: getattr(config, n, None) for n in _EXPERT_COUNTS}
    experts = next((f"{n}={v}" for n, v in counts.items() if isinstance(v, int) and v > 1), None)
    return f"{experts}, num_experts_per_tok={top_k}" if isinstance(top_k, int) and top_k > 0 and experts else None


def samples_sharing_a_microbatch(args) -> list[str]:
    """The settings (``TrainingArguments`` or a header's dict of them) that put several samples in one microbatch."""
    get = args.get if isinstance(args, dict) else lambda k, d=None: getattr(args, k, d)
    batch = get("per_device_train_batch_size", 1) or 1
    return [f"per_device_train_batch_size={batch}"] * (batch > 1) + ["packing=True"] * bool(get("packing", False))


def experts_hazard(experts: str, shared: list[str]) -> str:
    return (f"the model {EXPERTS_HAZARD} ({experts}) and a microbatch holds several samples ({', '.join(shared)}): an "
            "expert's weight gradient sums over the tokens the microbatch routes to it, and a deleted sample's dummy "
            "is routed elsewhere than the sample, so the other samples' update differs in the last bits from the run "
            "without it; record with per_device_train_batch_size=1 (gradient_accumulation_steps for the same batch)"
            + (" and without packing" if "packing=True" in shared else ""))


def experts_refusal(run) -> str | None:
    """Why no deletion from ``run`` can be exact, for a run recorded before the recorder named it a hazard: a
    mixture-of-experts model (read from the run's saved config) whose microbatches held several samples. None when
    it is not such a run, or when its header lists the hazard (recorded with ``trace_allow_hazards``: the verdicts
    list it)."""
    header = run.header
    if any(EXPERTS_HAZARD in h for h in header.get("hazards") or []):
        return None
    shared = samples_sharing_a_microbatch(header.get("training_args") or {})
    if not shared:
        return None
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(run.path / "model")
    except Exception:  # noqa: BLE001 - no config to read: the replay's own model checks name it
        return None
    named = routed_experts_config(config)
    if not named:
        return None
    return (f"{run.path} cannot delete exactly: {experts_hazard(f'{type(config).__name__}: {named}', shared)} "
            "(this run was recorded before the recorder refused it); record the run again so")


def quantized(model) -> str | None:
    """How ``model``'s weights were quantized when loaded (``quantization_config=``: bitsandbytes 4-bit or 8-bit, as
    QLoRA loads its base, GPTQ, AWQ, ...), named, or None. A replay rebuilds the base from its files unquantized."""
    if getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False):
        return None
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    method = getattr(qc, "quant_method", None) or (qc.get("quant_method") if isinstance(qc, dict) else None)
    method = str(getattr(method, "value", method) or "quantized")
    bits = next((b for b, k in ((4, "load_in_4bit"), (8, "load_in_8bit")) if getattr(qc, k, False)), None)
    return method + (f" {bits}-bit" if bits else "")


def first_non_finite(model, skip=()) -> str | None:
    """The name of the first parameter holding a NaN or an infinity, or None. ``skip``: names already read and
    unchanged since (a LoRA run's frozen base, nearly all its bytes, read at its step-0 checkpoint)."""
    for name, p in model.named_parameters():
        if name in skip:
            continue
        if p.is_floating_point() and not all_finite(local(p)):  # FSDP2: this process's shard (one read)
            return name
    return None


def dropout_settings(model) -> dict:
    """Every non-zero dropout probability of the model: config fields (``*dropout*``, GPT-2's ``*_pdrop``) and
    ``nn.Dropout`` modules."""
    config = getattr(model, "config", None)
    found = {}
    for k, v in (config.to_dict() if config is not None else {}).items():
        if ("dropout" in k or k.endswith("pdrop")) and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            found[k] = v
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found.setdefault("modules", {})[name] = module.p
    return found



def frozen_parameters(model) -> list[str]:
    """Names of the parameters that do not train (``requires_grad=False``): a replay freezes the same ones."""
    return sorted(n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad)


def peft_and_base(model) -> tuple[dict | None, object]:
    """(:func:`_peft_info` of ``model``, the model under its adapter, or ``model`` itself without one)."""
    peft = _peft_info(model)
    return peft, (peft["base"] if peft else model)


def _peft_info(model) -> dict | None:
    """``{"name", "config", "base"}`` of a PEFT model (``why`` when a replay could not rebuild it), else None."""
    peft_config = getattr(model, "peft_config", None)
    if not isinstance(peft_config, dict) or not hasattr(model, "get_base_model"):
        return None
    names = list(peft_config)
    info = {"name": names[0], "config": peft_config[names[0]], "base": model.get_base_model()}
    if len(names) != 1:
        info["why"] = f"it has {len(names)} adapters ({names}); record runs with one adapter"
        if "ref" in names and len(names) == 2:  # trl's DPOTrainer copies a PeftModel's adapter as its reference
            info["why"] = (f"it has 2 adapters ({names}): DPOTrainer copied the PeftModel's adapter into 'ref', its "
                           "reference, as trl does for a PeftModel passed with ref_model=None; pass the base model "
                           "with peft_config= instead (the reference is then the base, adapter disabled), or a "
                           "ref_model=")
    elif not mergeable_adapter(info["config"]):
        info["why"] = (f"its {getattr(info['config'], 'peft_type', '?')} adapter adds virtual tokens or prompts "
                       "instead of a weight update, and cannot be merged into the model, whose weights a recording "
                       "hashes and a deletion publishes; use an adapter that merges (LoRA, DoRA, LoHa, LoKr, IA3, "
                       "VeRA, ...)")
    elif getattr(info["config"], "lora_bias", False) and any(
            getattr(getattr(m, "base_layer", None), "bias", 0) is None for m in model.modules()
            if hasattr(m, "lora_A")):
        info["why"] = ("its LoRA has lora_bias=True on layers without a bias, which PEFT cannot merge into the "
                       "model (the recording hashes the merged model when training ends, and a deletion publishes "
                       "it); set lora_bias=False, or target layers that have a bias")
    return info


def mergeable_adapter(config) -> bool:
    """Whether a PEFT adapter's config is a weight update ``merge_and_unload`` folds into the base: every tuner but
    prompt learning (prompt and prefix tuning, P-tuning) and adaption prompts."""
    return not (getattr(config, "is_prompt_learning", False) or getattr(config, "is_adaption_prompt", False))


def rebuilt_on_meta(model):
    """The model a replay rebuilds for ``model`` (the live model, unwrapped, PEFT adapter included), on the meta
    device (no weights), or None where it cannot be built there. The replay's model is built as
    :func:`hf_unlearn.trace.run_model.model_from_run` builds it (the class, the config saved and read back, the dtype,
    the attention implementation, the saved adapter); the recording compares it with the live model before training
    (:func:`rebuilt_state_difference`, :func:`rebuilt_attributes`)."""
    import tempfile
    import warnings
    from pathlib import Path
    from types import SimpleNamespace

    from .run_model import model_from_run
    from .sharding import unsharded_class

    peft, base = peft_and_base(model)
    config = getattr(base, "config", None)
    first = next(base.parameters(), None)
    if config is None or first is None:
        return None
    cls = unsharded_class(type(base))
    info = {"class": cls.__name__, "module": cls.__module__, "dtype": str(first.dtype).removeprefix("torch."),
            "attn_implementation": getattr(config, "_attn_implementation", None),
            "peft": {"adapter_name": peft["name"]} if peft else None}
    try:
        with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config.save_pretrained(Path(folder) / "model")
            if peft:
                peft["config"].save_pretrained(str(Path(folder) / "model" / "adapter"))
            with torch.device("meta"):
                rebuilt = model_from_run(SimpleNamespace(header={"model": info}, path=Path(folder)))
    except Exception:  # noqa: BLE001 - not buildable on the meta device: nothing compared here
        return None
    return rebuilt


def rebuilt_state_difference(model) -> str | None:
    """The first state-dict tensor (name, shape or dtype) in which the model a replay rebuilds differs from ``model``,
    described, or None (also where it cannot be built on the meta device: a replay's own checks name what it cannot
    rebuild). A replay loads each checkpoint into that model strictly, so a module replaced or added after the model
    was built (``lm_head`` with a bias) trained for hours and then failed that load."""
    rebuilt = rebuilt_on_meta(model)
    if rebuilt is None:
        return None
    live, built = model.state_dict(), rebuilt.state_dict()
    for name, t in live.items():
        other = built.get(name)
        if other is None:
            return f"{name} (the rebuilt model has no such tensor)"
        if tuple(other.shape) != tuple(t.shape) or other.dtype != t.dtype:
            return (f"{name} ({str(t.dtype).removeprefix('torch.')} {list(t.shape)}; rebuilt: "
                    f"{str(other.dtype).removeprefix('torch.')} {list(other.shape)})")
    missing = next((name for name in built if name not in live), None)
    return f"{missing} (the rebuilt model has it, the trained model does not)" if missing else None


def rebuilt_attributes(model) -> dict:
    """``{module: {attribute: value}}``: the plain public attributes (numbers, strings, booleans) in which the live
    model's modules differ from the model a replay rebuilds (:func:`rebuilt_on_meta`): set by the program after the
    model was built (``self_attn.scaling``, ``rotary_emb.attention_scaling``, a norm's ``variance_epsilon``), which a
    rebuilt model does not have; recorded when training starts and given back to rebuilt models (before, the proof
    failed at step 0 and every deletion was refused without naming the attribute). ``training`` and activation
    checkpointing are set by replays themselves; ``name_or_path`` is where the model was loaded from."""
    from .fidelity import _PLAIN  # the plain values the layout keeps of a module

    rebuilt = rebuilt_on_meta(model)
    if rebuilt is None:
        return {}
    built = dict(rebuilt.named_modules())
    out: dict = {}
    for name, module in model.named_modules():
        other = built.get(name)
        if other is None or type(other) is not type(module):
            continue
        theirs = vars(other)
        for k, v in vars(module).items():
            if k.startswith("_") or k in _SET_BY_REPLAYS or type(v) not in _PLAIN or k not in theirs:
                continue
            if type(theirs[k]) in _PLAIN and theirs[k] != v and v == v:
                out.setdefault(name, {})[k] = v
    return out


_SET_BY_REPLAYS = frozenset({"training", "gradient_checkpointing", "name_or_path"})  # the last: where it was loaded
