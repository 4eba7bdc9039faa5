"""What an exact deletion publishes when the run trained a PEFT adapter (``peft_config=``, LoRA).

``OUT/model`` is the **merged** model (the replayed adapter merged into its base with the recorded numeric stack, as
``merge_and_unload`` does in a training script): one ``save_pretrained`` folder that loads without peft, hashes like
any full model and is what ``hub push`` and ``hub verify`` handle. The replayed adapter itself is kept beside it in
``OUT/adapter`` (``adapter_config.json`` + ``adapter_model.safetensors``) for users who serve adapters; it is not
published. Why merged rather than "adapter plus a pinned base": the base a LoRA run trained on is often a local
folder or a private snapshot that a reader of the Hub cannot fetch, and a pinned base only proves something if the
verifier re-merges with the same numeric stack; the merged weights are checked tensor by tensor instead.

:func:`check_output` runs before any compute (peft importable, the adapter mergeable); :func:`save_output` after the
replay writes both folders and returns the roots the receipt and the card carry.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UnlearnError
from ..utils import weights_follow_umask

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)

ADAPTER_DIR = "adapter"


def is_adapter_run(header: dict) -> bool:
    return bool((header.get("model") or {}).get("peft"))


def check_output(run) -> None:
    """Before any compute: a PEFT run's output can be merged here (peft importable, a mergeable adapter type)."""
    if not is_adapter_run(run.header):
        return
    try:
        from peft import PeftConfig
    except ImportError:
        raise UnlearnError(f"{run.path} trained a PEFT adapter: install peft (pip install 'hf-unlearn[peft]') to "
                           "replay and merge it; nothing was done") from None
    try:
        config = PeftConfig.from_pretrained(str(run.path / "model" / "adapter"))
    except Exception as e:
        raise UnlearnError(f"{run.path}: its adapter config cannot be read ({type(e).__name__}); nothing was done") \
            from None
    from ..trace.model_info import mergeable_adapter

    if not mergeable_adapter(config):
        raise UnlearnError(f"{run.path} trained a {config.peft_type} adapter, which cannot be merged into its base; "
                           "forget publishes merged models (LoRA, DoRA, LoHa, LoKr, IA3, OFT, BOFT, AdaLoRA, VeRA, "
                           "...); delete with `hf-unlearn trace replay` instead; nothing was done")


def save_output(replay, replay_dir: Path, model_dir: Path) -> dict:
    """Save a finished replay's model: a PEFT run's adapter merged into ``model_dir`` and kept unmerged in
    ``model_dir.parent / "adapter"``; any other run as the replay saves it. Returns the card's ``exact_deletion``
    fields that change: ``params_root`` (the merged weights, which the published manifest hashes) and
    ``adapter_params_root`` (the replayed state the trace hashed, adapter included)."""
    if not is_adapter_run(replay.run.header):
        replay.save_model(str(model_dir))
        return {}
    adapter_dir = model_dir.parent / ADAPTER_DIR
    replay.save_model(str(adapter_dir))
    for extra in ("training_args.bin",):  # the trainer's pickle is not part of an adapter folder
        (adapter_dir / extra).unlink(missing_ok=True)
    _recorded_base(replay.run.path, adapter_dir)
    return {**_save_merged(replay_dir, model_dir, adapter_dir), **_base_dtype(replay.run.header, adapter_dir)}


def _base_dtype(header: dict, adapter_dir: Path) -> dict:
    """The dtype the run loaded its base in (``header.model.dtype``), said in the adapter's ``README.md``: the
    adapter merged into a base loaded in another dtype (``from_pretrained`` loads float32 by default) is not the
    published model. Returns ``{"base_dtype": ...}`` for the receipt's ``evidence.output`` (empty if unrecorded)."""
    dtype = (header.get("model") or {}).get("dtype")
    if not isinstance(dtype, str):
        return {}
    dtype = dtype.removeprefix("torch.")
    readme = adapter_dir / "README.md"
    if readme.is_file():
        from ..utils import atomic_write_text

        text = readme.read_text(encoding="utf-8")
        if BASE_DTYPE_HEADING not in text:
            atomic_write_text(readme, text.rstrip("\n") + f"\n\n{BASE_DTYPE_HEADING}\n\nThe run trained this adapter "
                              f"on its base loaded in `{dtype}`: load the base in that dtype "
                              f"(`AutoPeftModelForCausalLM.from_pretrained(path, dtype=torch.{dtype})`). Merged "
                              "(`merge_and_unload()`), it then equals the published merged model; a base loaded "
                              "in another dtype (float32 is the default) gives other merged weights.\n")
    return {"base_dtype": dtype}


BASE_DTYPE_HEADING = "## Load the base in the dtype it trained in"


def _recorded_base(run_path: Path, adapter_dir: Path) -> None:
    """The saved adapter names the base the run trained on, as the recording saved it (``RUN/model/adapter``, kept
    by every replay), not the replay's rebuilt ``RUN/model`` (a config without weights, which
    ``AutoPeftModelForCausalLM.from_pretrained(OUT/adapter)`` could not load); none where the run recorded none (a
    base built from a config: the published merged model is the loadable output). A single run's deletion leaves
    the frozen base as it was. PEFT's model card (``README.md``) says the same."""
    import json

    from ..utils import atomic_write_text

    recorded = Path(run_path) / "model" / ADAPTER_DIR / "adapter_config.json"
    saved = adapter_dir / "adapter_config.json"
    if not (recorded.is_file() and saved.is_file()):
        return
    base = json.loads(recorded.read_text()).get("base_model_name_or_path")
    config = json.loads(saved.read_text())
    if config.get("base_model_name_or_path") != base:
        config["base_model_name_or_path"] = base
        atomic_write_text(saved, json.dumps(config, indent=2, sort_keys=True) + "\n")
    readme = adapter_dir / "README.md"
    if readme.is_file():
        from huggingface_hub import ModelCard

        card = ModelCard.load(readme)
        data = card.data.to_dict()
        tags = [t for t in data.get("tags") or [] if not t.startswith("base_model:")]
        if base:
            tags.insert(0, f"base_model:adapter:{base}")
        if data.get("base_model") != base or tags != (data.get("tags") or []):
            card.data.base_model = base
            card.data.tags = tags or None
            atomic_write_text(readme, str(card))


def save_consolidated_output(run, state: dict, replay_dir: Path, model_dir: Path) -> dict:
    """:func:`save_output` for a run of several processes (DDP, FSDP2), on the main process once every process has
    replayed: the model rebuilt from the replay's final state (``state``: full tensors, as its checkpoints hold
    them) and saved as one ``save_pretrained`` folder; a PEFT run's adapter merged into ``model_dir`` and kept
    unmerged in ``model_dir.parent / "adapter"``, as for one process (the replay's own model may be sharded)."""
    from ..trace.sharding import save_consolidated

    if not is_adapter_run(run.header):
        save_consolidated(run, state, model_dir)
        return {}
    adapter_dir = model_dir.parent / ADAPTER_DIR
    save_consolidated(run, state, adapter_dir)  # the PEFT model's save_pretrained: the adapter's files
    _recorded_base(run.path, adapter_dir)
    return {**_save_merged(replay_dir, model_dir, adapter_dir), **_base_dtype(run.header, adapter_dir)}


def _save_merged(replay_dir: Path, model_dir: Path, adapter_dir: Path) -> dict:
    """The replay's output (its final checkpoint, the adapter merged with the recorded numeric stack) saved into
    ``model_dir``; the card's fields (:func:`card_fields`)."""
    from ..trace.lineage import open_quietly, output_model, weights_root

    merged = output_model(open_quietly(replay_dir))
    merged.save_pretrained(str(model_dir))
    weights_follow_umask(model_dir)
    return {"params_root": weights_root(merged.state_dict()), "merged_adapter": True,
            "adapter_dir": str(adapter_dir)}


def card_fields(exact: dict, replayed: dict) -> dict:
    """The card's ``exact_deletion`` entry for a merged adapter run: the published (merged) root, and the replayed
    state's own root (adapter included, what ``trace verify`` compared) under ``replayed_params_root``."""
    if not replayed.get("merged_adapter"):
        return exact
    return {**exact, "params_root": replayed["params_root"], "replayed_params_root": exact.get("params_root"),
            "merged_adapter": True}


def adapter_problems(out: Path, replay) -> list[str]:
    """``OUT/adapter`` of a PEFT run's deletion against the replayed state (``replay``: the replay's run): the
    adapter saved again from the replay's kept checkpoint, as :func:`save_output` saved it, must match it file for
    file (``adapter_config.json`` field by field, naming what differs, and every tensor of
    ``adapter_model.safetensors`` bit for bit), so `trace verify` covers the folder it says merges into ``OUT/model``.
    An absent folder is not a problem (it is not published); a run without an adapter has none."""
    import json
    import tempfile

    if replay is None or not is_adapter_run(replay.header):
        return []
    adapter_dir = Path(out) / ADAPTER_DIR
    if not adapter_dir.is_dir():
        return []
    from ..trace.checkpoints import full_model_state, load_checkpoint
    from ..trace.fidelity import restore_layout
    from ..trace.lineage import output_checkpoint
    from ..trace.run_model import model_from_run

    model = model_from_run(replay, weights_follow=True)
    restore_layout(model, replay.path, replay.header)
    model.load_state_dict(full_model_state(load_checkpoint(output_checkpoint(replay))))
    problems = []
    with tempfile.TemporaryDirectory(prefix="hfu-adapter-") as tmp:
        model.save_pretrained(tmp)
        _recorded_base(replay.path, Path(tmp))
        want = json.loads((Path(tmp) / "adapter_config.json").read_text())
        try:
            have = json.loads((adapter_dir / "adapter_config.json").read_text())
        except (OSError, ValueError) as e:
            return [f"{adapter_dir / 'adapter_config.json'} cannot be read ({type(e).__name__}): the adapter is not the "
                    "replayed one"]
        fields = sorted(k for k in set(want) | set(have) if _config_value(want.get(k)) != _config_value(have.get(k)))
        if fields:
            problems.append(f"{adapter_dir / 'adapter_config.json'} differs from the replayed adapter's in "
                            f"{', '.join(fields[:8])}{' ...' if len(fields) > 8 else ''} (edited after the deletion?)")
        problems += _adapter_tensor_problems(adapter_dir, Path(tmp))
    return problems


def _config_value(value):
    """A config field as compared: PEFT saves a set of module names (``target_modules``) as a list in the process's
    set order, which changes with the hash seed, so a list of names compares as a set."""
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return sorted(set(value))
    return value


def _adapter_tensor_problems(adapter_dir: Path, expected_dir: Path) -> list[str]:
    import torch
    from safetensors.torch import load_file

    name = "adapter_model.safetensors"
    if not (expected_dir / name).is_file():  # an older PEFT's .bin: nothing this check can read alike
        return []
    try:
        have = load_file(str(adapter_dir / name))
    except Exception as e:  # a missing or damaged file
        return [f"{adapter_dir / name} cannot be read ({type(e).__name__}): the adapter is not the replayed one"]
    want = load_file(str(expected_dir / name))
    differ = sorted(k for k in set(want) | set(have) if k not in want or k not in have
                    or want[k].dtype != have[k].dtype or want[k].shape != have[k].shape
                    or not torch.equal(want[k], have[k]))
    if not differ:
        return []
    return [f"{adapter_dir / name} differs from the replayed adapter in {len(differ)} tensor(s) (e.g. "
            f"{', '.join(differ[:3])}; edited after the deletion?)"]
