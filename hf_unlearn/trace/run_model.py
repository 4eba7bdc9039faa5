"""The recorded run's model rebuilt from its header: class, dtype, attention implementation, PEFT adapter and frozen
parameters, with fresh weights (a replay, the consolidated save and a pipeline stage's output load a checkpoint into
it)."""

from __future__ import annotations

import contextlib
import warnings

import torch

from ..utils import import_object

# PEFT initialisations computed from the base's weights (an SVD, a quantisation error, activations): a rebuilt model's
# base is uninitialised memory until a checkpoint is loaded into it, on which PiSSA's SVD failed (non-finite values)
DATA_DEPENDENT_INITS = ("pissa", "olora", "corda", "eva", "loftq")


def check_attention(run) -> None:
    """Before any compute: the attention implementation the run's model (and a DPO reference) trained with is known
    to this process. A training script may register its own under a name (``AttentionInterface.register("name",
    fn)`` and ``attn_implementation="name"``); a deleting process that never ran that registration cannot rebuild
    the model, and transformers' own error says only that the name "is not supported"."""
    from ..errors import UnlearnError

    names = [(run.header.get("model") or {}).get("attn_implementation"),
             (run.header.get("reference_model") or {}).get("attn_implementation")]
    unknown = sorted({n for n in names if isinstance(n, str) and not _attention_known(n)})
    if not unknown:
        return
    name = unknown[0]
    raise UnlearnError(f"{run.path} trained with the attention function its training script registered as {name!r} "
                       "(AttentionInterface.register), and this process has no attention function by that name: "
                       "register it before the deletion (import the module that registers it, e.g. `python -c "
                       "\"import my_attention; from hf_unlearn.cli import main; main()\" forget ...`, or call "
                       "hf_unlearn.forget from a script that imports it), or delete from the training script; nothing "
                       "was done")


def _attention_known(name: str) -> bool:
    if "/" in name:  # a Hub kernel ("kernels-community/..."): transformers fetches it, or names what is missing
        return True
    from transformers import AttentionInterface

    registered = set(AttentionInterface._global_mapping) | {"eager"}
    return all(part in registered for part in name.split("|") if part != "paged") or name in registered


def model_from_run(run, weights_follow: bool = False):
    """The run's model (its class, dtype, attention implementation and PEFT adapter) with fresh weights.

    ``weights_follow``: the caller loads a whole checkpoint into it (strictly) and restores the recorded layout, so
    when the run recorded its non-persistent buffers (every tensor is then overwritten) the random initialisation
    is skipped (seconds of CPU at 135M parameters; the weights are tied as ``init_weights`` would have).
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    check_attention(run)
    info = run.header["model"]
    config = AutoConfig.from_pretrained(run.path / "model")
    try:
        cls = import_object(f"{info['module']}:{info['class']}")
    except (ImportError, AttributeError):
        cls = AutoModelForCausalLM
    kwargs = {"dtype": getattr(torch, info.get("dtype") or "float32")}
    if info.get("attn_implementation"):
        kwargs["attn_implementation"] = info["attn_implementation"]
    skip_init = weights_follow and (info.get("layout") or {}).get("buffers") is not None
    with no_init_weights() if skip_init else contextlib.nullcontext():
        model = (cls.from_config if cls is AutoModelForCausalLM else cls._from_config)(config, **kwargs)
    if skip_init:
        model.tie_weights()  # no_init_weights skips init_weights, which ties
    if info.get("peft"):
        from peft import PeftConfig, get_peft_model

        adapter = PeftConfig.from_pretrained(str(run.path / "model" / "adapter"))
        init = getattr(adapter, "init_lora_weights", None)
        if isinstance(init, str) and init.startswith(DATA_DEPENDENT_INITS):
            adapter.init_lora_weights = True  # the weights come from a checkpoint: no SVD of uninitialised memory
        with warnings.catch_warnings():  # the rebuilt base is named by the run's folder; outputs name the recorded base
            warnings.filterwarnings("ignore", message="The PEFT config's `base_model_name_or_path` was renamed")
            model = get_peft_model(model, adapter, adapter_name=info["peft"]["adapter_name"])
        if isinstance(init, str):
            model.peft_config[info["peft"]["adapter_name"]].init_lora_weights = init  # as recorded, for what is saved
    if info.get("frozen_parameters") is not None:  # the same parameters frozen as in the recorded run
        frozen = set(info["frozen_parameters"])
        for name, p in model.named_parameters(remove_duplicate=False):
            p.requires_grad_(name not in frozen)
    return model
