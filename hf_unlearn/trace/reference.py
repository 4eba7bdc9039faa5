"""The reference model of a preference run (``trl.DPOTrainer``): bound to the run by its weights, loaded by every
replay and oracle through one function, :func:`load_reference_model`.

The run's header holds ``reference_model``:

* ``{"kind": "adapter_disabled", "params_root": ...}``: ``ref_model=None`` with a PEFT adapter; TRL's reference is the
  policy with its adapter disabled, i.e. the frozen base weights, which the run's checkpoints hold. Nothing to load.
* ``{"kind": "initial" | "model", "params_root": ..., "class", "dtype", "attn_implementation", "source": {...}}``:
  ``ref_model=None`` without an adapter (TRL loads the policy's ``name_or_path`` again: "initial") or a reference
  model given explicitly ("model", e.g. the ``save_pretrained`` folder of an earlier recorded run). ``params_root`` is
  the state-hash root (:mod:`hf_unlearn.trace.hashing`) of the reference TRL actually holds. ``source`` says where a
  replay loads it: ``{"kind": "folder", "revision", "files": {name: {size, sha256}}}`` when the folder it was loaded
  from (a local folder or a Hugging Face cache snapshot, found as :mod:`hf_unlearn.trace.base_source` finds a base)
  still holds exactly those weights, the folder's path kept in ``private/reference.json`` (a local path is never in
  the header); else ``{"kind": "stored", "files": ...}``: its weights saved once in the run's ``reference/`` folder.

Loading checks every file's size and SHA-256 first and the loaded model's params root after: a changed or swapped
reference is refused in one line before any compute. The weights are not all a model computes with: its config
(loaded with overrides), non-persistent buffers (rotary ``inv_freq``), module attributes and hooks can change in memory
and no params root sees them. So the record also holds ``forward_sha256`` (:func:`reference_fingerprint`): the exact
bits of the reference's log-probabilities on a fixed probe, through TRL's fused LM head as the loss calls it, computed
when training starts under the recorded numeric stack. A folder is the source only when a reload of it gives those
bits (else the reference is stored; one that no reload reproduces is refused), every replay recomputes them on the
reference it loaded before any compute, and the recorder again when training ends (a reference changed during
training is sealed into the run as not reproducible). ``override`` replaces the reference (a pipeline stage whose
reference is the new parent): the caller vouches for it, and its root is returned with it by :func:`reference_root`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UnlearnError
from ..utils import atomic_write_text, import_object, private_dir
from .base_source import base_key, file_sha256, loaded_from
from .checkpoints import tied_aliases
from .hashing import state_hashes
from .run import TraceRun, open_run

REFERENCE_DIR = "reference"  # the reference's weights, when no folder on disk holds them
PRIVATE_SOURCE = ("private", "reference.json")  # the local folder a referenced reference is loaded from
KEY = "reference_model"


def reference_root(model) -> str:
    """The params root of a reference model as a checkpoint's ``hashes.json`` computes it (each tied tensor once), so
    it equals the final ``params_root`` of the recorded run whose output it is; a PEFT model: its base weights."""
    state = model.state_dict()
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        state = {base_key(n): t for n, t in state.items() if "lora_" not in n}
    tied = tied_aliases(state)
    return state_hashes({n: t for n, t in state.items() if n not in tied}).params_root


PROBE_TOKENS = 16  # the fingerprint's probe: two rows of this many tokens


def reference_fingerprint(model) -> str | None:
    """SHA-256 of the exact log-probabilities ``model`` (a reference as DPOTrainer holds it: TRL's fused LM head
    added) gives a fixed probe of two token rows, in eval mode, without gradient and without the autocast wrapper
    Accelerate puts on a prepared model's forward (set by the run's recorded ``bf16``/``fp16``, not by the model);
    None if the model has no fused LM head. Depends on the weights, config, buffers, module attributes, hooks and the
    numeric stack."""
    import hashlib

    import torch

    vocab = model.config.get_text_config().vocab_size
    device = next(model.parameters()).device
    ids = (torch.arange(2 * PROBE_TOKENS, device=device).reshape(2, PROBE_TOKENS) * 7 + 3) % vocab
    training, wrapped = model.training, model.__dict__.get("forward")
    original = model.__dict__.get("_original_forward")  # the forward under Accelerate's autocast wrapper
    try:
        model.eval()
        if original is not None:
            model.forward = original
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, fused_lm_head=True,
                        use_cache=False).log_probs
    except TypeError:  # no fused LM head: not a model DPOTrainer prepared
        return None
    finally:
        if original is not None:
            model.forward = wrapped
        model.train(training)
    return hashlib.sha256(out.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()


def _with_fused_head(model):
    """``model`` with TRL's fused LM head, as DPOTrainer adds it to a reference."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model)
    return model


def describe_reference(trainer, given: bool, root_at_start: bool = False) -> dict:
    """What the recording binds as the reference of ``trainer`` (a DPOTrainer just built), in memory.
    ``root_at_start``: an adapter-disabled reference's ``params_root`` is left None, for the recording to take from
    its lineage's start root (:func:`hf_unlearn.trace.preference.is_start_root`)."""
    ref = trainer.ref_model
    if ref is None:
        policy = trainer.accelerator.unwrap_model(trainer.model)
        return {"kind": "adapter_disabled", "params_root": None if root_at_start else reference_root(policy)}
    ref = trainer.accelerator.unwrap_model(ref)
    source = loaded_from(ref)
    return {"kind": "model" if given else "initial", "params_root": reference_root(ref), "class": type(ref).__name__,
            "module": type(ref).__module__, "dtype": str(next(ref.parameters()).dtype).removeprefix("torch."),
            "attn_implementation": getattr(ref.config, "_attn_implementation", None),
            "_model": ref, "_folder": source["path"] if source and source["kind"] == "safetensors" else None,
            "_revision": source.get("revision") if source else None}


def _folder_files(folder: Path) -> dict:
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json"))
    return {p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)} for p in files}


def save_reference(desc: dict, run_dir) -> dict:
    """The header record of ``desc`` (:func:`describe_reference`); the reference's weights are referenced in their
    folder when it holds them bit for bit, else saved in ``run_dir/reference``."""
    record = {k: v for k, v in desc.items() if not k.startswith("_")}
    if desc["kind"] == "adapter_disabled":
        return record
    run_dir = Path(run_dir)
    folder = desc.get("_folder")
    if folder is not None and _load(Path(folder), record, check=False, forward=True) is not None:
        private = private_dir(run_dir) / PRIVATE_SOURCE[-1]
        atomic_write_text(private, json.dumps({"path": str(Path(folder).resolve())}), private=True)
        record["source"] = {"kind": "folder", "revision": desc.get("_revision"), "files": _folder_files(Path(folder))}
        return record
    target = run_dir / REFERENCE_DIR
    desc["_model"].save_pretrained(str(target))
    if _load(target, record, check=False, forward=True) is None:
        import shutil

        shutil.rmtree(target, ignore_errors=True)
        raise UnlearnError("the DPO reference model computes other log-probabilities than a reload of its weights and "
                           "config does (a non-persistent buffer such as rotary inv_freq, a module attribute or a hook "
                           "changed in memory?): a replay could not rebuild it; pass ref_model= a model loaded from a "
                           "folder and left unchanged")
    record["source"] = {"kind": "stored", "files": _folder_files(target)}
    return record


def _from_folder(folder: Path, record: dict):
    """The model in ``folder`` loaded as the recorded reference was (class, dtype, attention), whatever its weights."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        cls = import_object(f"{record['module']}:{record['class']}")
    except (ImportError, AttributeError, KeyError):
        cls = AutoModelForCausalLM
    kwargs = {"dtype": getattr(torch, record.get("dtype") or "float32")}
    if record.get("attn_implementation"):
        kwargs["attn_implementation"] = record["attn_implementation"]
    return cls.from_pretrained(str(folder), **kwargs)


def _load(folder: Path, record: dict, check: bool = True, forward: bool = False):
    """The recorded reference from ``folder``; a model whose params root differs is refused (None if not ``check``).
    With ``forward``, its :func:`reference_fingerprint` (TRL's fused head added) must be the recorded one too."""
    model = _from_folder(folder, record)
    root = reference_root(model)
    if root != record["params_root"]:
        if check:
            raise UnlearnError(f"the reference model in {folder} is not the one the run was trained against (params "
                               f"root {root[:12]}..., recorded {record['params_root'][:12]}...); restore it")
        return None
    if forward and record.get("forward_sha256") and \
            reference_fingerprint(_with_fused_head(model)) != record["forward_sha256"]:
        return None
    return model


def _check_files(folder: Path, files: dict, what: str) -> None:
    for name, rec in files.items():
        path = folder / name
        if not path.is_file():
            raise UnlearnError(f"{path} is missing: the run's DPO reference model ({what}) is that file; put it back "
                               "to replay the run")
        if path.stat().st_size != rec["size"] or file_sha256(path) != rec["sha256"]:
            raise UnlearnError(f"{path} has changed since the run was recorded (SHA-256 {rec['sha256'][:12]}... "
                               f"expected): the run's DPO reference model ({what}) is that file as it was; restore it")


def reference_folder(run) -> Path | None:
    """Where the run's reference is loaded from (None: ``adapter_disabled``, or not a preference run)."""
    record = run.header.get(KEY)
    if not record or record["kind"] == "adapter_disabled":
        return None
    source = record.get("source") or {}
    if source.get("kind") == "stored":
        return Path(run.path) / REFERENCE_DIR
    private = Path(run.path).joinpath(*PRIVATE_SOURCE)
    if not private.is_file():
        raise UnlearnError(f"{run.path} references its DPO reference model in a local folder but has no "
                           f"{'/'.join(PRIVATE_SOURCE)} naming it: pass the reference folder as override=")
    return Path(json.loads(private.read_text())["path"])


def load_reference_model(run, override=None):
    """The reference model a replay or oracle of ``run`` (a :class:`~hf_unlearn.trace.run.TraceRun` or a folder) must
    use, checked against the run (files' size and SHA-256, then the params root); None when the run has none to load
    (not a preference run, or ``adapter_disabled``: TRL disables the adapter).

    ``override``: a model (used as given) or a ``save_pretrained`` folder (loaded with the recorded class, dtype and
    attention) that replaces the recorded reference, e.g. a pipeline stage's new parent.
    """
    run = run if isinstance(run, TraceRun) else open_run(run, check_checkpoints=False)
    record = run.header.get(KEY)
    if override is not None:
        if not isinstance(override, (str, Path)):
            return override
        if not record or record["kind"] == "adapter_disabled":
            raise UnlearnError(f"{run.path} has no reference model to replace with {override} (its reference is the "
                               "policy with its adapter disabled)")
        return _from_folder(Path(override), record)
    folder = check_reference_files(run)
    return None if folder is None else _load(folder, record)


def check_reference_files(run) -> Path | None:
    """The recorded reference's files are where the run found them, unchanged (size and SHA-256): checked before
    any compute of a deletion, and again when a replay loads them. Returns their folder (None: no reference to
    load)."""
    folder = reference_folder(run)
    if folder is None:
        return None
    source = run.header[KEY]["source"]
    what = "saved in the run" if source["kind"] == "stored" else "the folder it was loaded from" + (
        f" (revision {source['revision']})" if source.get("revision") else "")
    _check_files(folder, source.get("files") or {}, what)
    return folder


def reference_as_recorded(run, model):
    """A new parent's output ``model`` as the reference of ``run`` (a pipeline stage whose reference was its parent's
    output): saved and loaded back as the recorded reference was loaded (its class, dtype and attention
    implementation: TRL loads ``ref_model=None`` with the policy's settings, which may not be the parent's), so it
    computes as the recorded reference would on these weights."""
    import tempfile

    record = run.header.get(KEY) or {}
    with tempfile.TemporaryDirectory(prefix="hf_unlearn_reference_") as tmp:
        model.save_pretrained(tmp)
        ref = load_reference_model(run, override=tmp)
        for p in ref.parameters():  # read now: the folder goes away
            p.data = p.data.clone()
    if record.get("attn_implementation") and ref.config._attn_implementation != record["attn_implementation"]:
        raise UnlearnError(f"{run.path}: the reference could not be loaded with the recorded attention implementation "
                           f"{record['attn_implementation']!r}; refusing")
    return ref


def describe_record(record: dict) -> str:
    """One line for ``trace inspect``: the reference model's kind, root and source."""
    kind = {"adapter_disabled": "the policy with its PEFT adapter disabled (the frozen base the checkpoints hold)",
            "initial": "the policy's own folder, loaded again by DPOTrainer (ref_model=None)",
            "model": "a model given as ref_model"}[record["kind"]]
    source = record.get("source") or {}
    where = {"folder": f"referenced in its folder ({len(source.get('files', {}))} files, size and SHA-256 checked at "
                       "every load)", "stored": f"stored in the run's {REFERENCE_DIR}/"}.get(source.get("kind"), "")
    return f"DPO reference model: {kind}, params root {record['params_root'][:16]}" + (f"; {where}" if where else "")
