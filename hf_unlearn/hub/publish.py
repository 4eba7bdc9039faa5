"""Push an unlearned model to the Hub: weights, tokenizer, state-hash manifest, card and provenance in ONE commit.

One commit per push means a revision is either fully published or not at all (the Hub moves the branch only when
the commit succeeds), and one tag per deletion request (``deletion-0003``) makes the history of a model's deletions
auditable from the repository's refs.

Order of work, so that a refused push creates nothing on the Hub: stage every file locally, scan every value and
file for the forget ids (:mod:`hf_unlearn.hub.leaks`, :mod:`hf_unlearn.hub.provenance`), render the card, and only
then talk to the Hub (token, repo, tag, commit).

The state-hash manifest (``state_hashes.json``) hashes every tensor actually saved in the safetensors files with the
library's one hash function (:func:`hf_unlearn.trace.hashing.state_hashes`); safetensors stores a tied weight once,
so the manifest lists the saved names and records the tied duplicates in ``not_saved``, and its
``state_dict_root`` is the root over the full state dict (duplicates included); the trace and its deletion log
hash each tied tensor once, as saved, so their ``params_root`` is the manifest's ``params_root``. It also holds the SHA-256 of every other published file that changes what the model computes (config,
generation config, tokenizer files, chat template) and of the forget request and provenance files.

Deletion tags are allocated safely under concurrency: the commit is made against the branch head that the tag
number was computed from (``parent_commit``), the number counts the deletion commits already on the branch as
well as the tags, and a push that loses the race recomputes and commits again, so two pushes never take the same
number and every deletion commit carries its tag (a push cut off between commit and tag is completed by running
it again).

LoRA: a PEFT model (or a folder holding only an adapter) is published **merged** into its base weights, so the
repository loads with plain ``transformers``; the card records the adapter's settings.
"""

from __future__ import annotations

import copy
import fnmatch
import hashlib
import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UnlearnError
from ..trace.hashing import StateHashes, root_hash, tensor_hash
from ..trace.run import file_sha256
from ..trace.tags import run_key
from ..trace.verification import REVERIFY, VERIFICATION_FILE, require_sealed_verdict
from ..utils import atomic_write_text, weights_follow_umask
from .cards import (
    card_scanner,
    checked_card_info,
    forget_request,
    hub_model_id,
    normalize_card_info,
    public_value,
    render_model_card,
)
from .keys import key_fingerprint, load_key
from .leaks import (  # noqa: F401 - scan_config lived here
    Hit,
    IdScanner,
    scan_config,
    scan_tokenizer_rules,
    scan_vocabulary,
    vocabulary_tokens,
)
from .provenance import select_provenance
from .store import git_blob_id

CARD_INFO_FILE = "unlearning_info.json"  # local only: holds raw forget ids, never uploaded
PUSH_LOG_FILE = "hub_pushes.jsonl"  # local only: what each push published (commit, tag, roots), for verify
MANIFEST_FILE = "state_hashes.json"
# The one name each root of the manifest goes by in every summary, message, card and page (two hashes of the same
# weights once went by "weights root" and "state-dict root"): the tensors as saved (a tied tensor once, the root a
# trace's checkpoints and deletion log record), and the full state dict (every tied name, as transformers loads it).
ROOT_NAMES = {"params_root": "saved-tensor root", "state_dict_root": "state-dict root"}
FORGET_REQUEST_FILE = "forget_request.json"
PROVENANCE_DIR = "provenance"
PUBLISHED_PATTERNS = (
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "chat_template.jinja", "chat_template.json",
)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
NOT_HASHED = {"README.md", MANIFEST_FILE, ".gitattributes"}  # the card and manifest vouch; .gitattributes is Hub's
DELETION_TAG = re.compile(r"^deletion-(\d{4,})$")
DELETION_TITLE = re.compile(r"^(deletion-\d{4,}): ")
SHARD_NAME = re.compile(r"^[A-Za-z_]+-\d{5}-of-\d{5}\.safetensors(\.index\.json)?$")
TAG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
MAX_ATTEMPTS = 20


@dataclass
class PushResult:
    """What a push published: the commit, its tag, the files and the manifest's roots."""

    repo_id: str
    commit: str
    url: str
    tag: str | None
    files: list[str]
    params_root: str
    root: str
    state_dict_root: str = ""
    files_root: str = ""
    skipped_provenance: dict[str, str] = field(default_factory=dict)
    card: str = ""
    file_hashes: dict[str, str] = field(default_factory=dict)  # SHA-256 of every non-weight file (files_root's)
    card_sha256: str = ""  # of the card as pushed (outside files_root: the card states that root)
    already_published: bool = False  # a deletion tag held these weights and files already: nothing was pushed

    @property
    def verify_command(self) -> str:
        """The command that checks this push against values the repository cannot rewrite (weights, config and
        tokenizer files, commit)."""
        rev = f" --revision {self.tag}" if self.tag else ""
        files = f" --expect-files-root {self.files_root}" if self.files_root else ""
        files += f" --expect-card-sha256 {self.card_sha256}" if self.card_sha256 else ""
        return (f"hf-unlearn hub verify {self.repo_id}{rev} --expect-commit {self.commit} "
                f"--expect-root {self.state_dict_root or self.params_root}{files}")


# -- card info on disk -----------------------------------------------------------------------------------------
def save_card_info(output_dir: str | os.PathLike, card_info: Mapping[str, Any]) -> Path:
    """Store a trainer's ``unlearning_card_info()`` next to its weights, for ``hf-unlearn hub push OUT``.

    The file holds the raw forget ids; it stays local (``push_unlearned`` never uploads it).
    """
    info = normalize_card_info(card_info)
    path = Path(output_dir) / CARD_INFO_FILE
    atomic_write_text(path, json.dumps(info, indent=1, default=_jsonable), private=True)  # raw ids
    return path


def load_card_info(output_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(output_dir) / CARD_INFO_FILE
    if not path.is_file():
        raise UnlearnError(f"{output_dir} has no {CARD_INFO_FILE} (written by the trainer's create_model_card() or "
                           "hf_unlearn.hub.save_card_info); pass card_info= or --card-info FILE")
    try:
        return normalize_card_info(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise UnlearnError(f"{path} is not valid JSON: {e}") from None


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-able")


# -- manifest ---------------------------------------------------------------------------------------------------
def safetensors_files(folder: str | os.PathLike) -> list[Path]:
    return sorted(p for p in Path(folder).glob("*.safetensors") if p.is_file() and p.name not in ADAPTER_FILES)


def hash_safetensors(folder: str | os.PathLike) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Per-tensor state hashes of every tensor in the folder's safetensors files, and which file holds which."""
    from safetensors import safe_open

    hashes: dict[str, str] = {}
    layout: dict[str, list[str]] = {}
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            names = sorted(f.keys())
            for name in names:
                if name in hashes:
                    raise UnlearnError(f"tensor {name} is stored twice ({path.name} and another shard)")
                hashes[name] = tensor_hash(name, f.get_tensor(name))
        layout[path.name] = names
    return hashes, layout


METADATA_KEY = "/safetensors-metadata/"  # + shard name: never a relative file path, so never a file's key


def hashed_files(folder: Path) -> dict[str, str]:
    """SHA-256 of every file of a repository folder that the manifest covers by file: all but the card, the
    manifest and the weights hashed per tensor (top-level ``*.safetensors``; an adapter's or a subfolder's
    safetensors file is hashed here like any other file, so it cannot sit in a revision unchecked), and of the
    header metadata of each per-tensor hashed weights file (``/safetensors-metadata/<name>``: free text that the
    tensor hashes do not cover)."""
    folder = Path(folder)
    tensors = {p.name for p in safetensors_files(folder)}
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and rel not in NOT_HASHED and rel not in tensors:
            out[rel] = file_sha256(p)
    for name in sorted(tensors):
        out[METADATA_KEY + name] = safetensors_metadata_sha256(folder / name)
    return out


def safetensors_metadata_sha256(path: Path) -> str:
    """SHA-256 of a safetensors file's header metadata (``{}`` when it has none), as canonical JSON."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    return hashlib.sha256(json.dumps(metadata, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def files_root(file_hashes: Mapping[str, str]) -> str:
    h = hashlib.sha256(b"hf_unlearn.files_root.v1")
    for name in sorted(file_hashes):
        h.update(name.encode("utf-8") + b"\0" + file_hashes[name].encode() + b"\n")
    return h.hexdigest()


def _meta_model(folder: str | os.PathLike):
    """The folder's model built on the meta device (no weights), or None when transformers cannot build it."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:
        return None


def tied_names(folder: str | os.PathLike, model=None) -> dict[str, str]:
    """State-dict names that share a tensor with another (saved) name: {duplicate: saved name}, from the model
    built on the meta device (no weights loaded). An architecture transformers cannot build gives {}."""
    model = model if model is not None else _meta_model(folder)
    if model is None:
        return {}
    first: dict[int, str] = {}
    out = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            out[name] = first[id(param)]
        else:
            first[id(param)] = name
    return out


def saved_as(folder: str | os.PathLike, model=None) -> tuple[dict[str, str], list[str], list[str]]:
    """How ``save_pretrained`` writes the model's tensors where transformers' weight conversion changes them, from one
    reverse conversion of the folder's model built on the meta device (no weights):

    * ``renamed``: {saved name: state-dict name} for a tensor saved under another name (GPT-NeoX's ``lm_head.weight``
      saved as ``embed_out.weight``, renamed back by ``from_pretrained``);
    * ``held``, ``made``: the state-dict names of tensors saved split or merged into other tensors, and those saved
      names (a Mixtral or Qwen-MoE layer's fused ``experts.gate_up_proj`` saved as one ``w1``/``w3`` pair per expert).
      Their bytes under the names the model holds come only from loading the folder (:func:`loaded_model`).

    ``({}, [], [])`` when transformers converts nothing (or has no such mapping: transformers 4)."""
    model = model if model is not None else _meta_model(folder)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: saved names are the state-dict names
        return {}, [], []
    if model is None:
        return {}, [], []
    state = model.state_dict()
    try:
        saved = revert_weight_conversion(model, dict(state))
    except Exception:
        return {}, [], []
    by_id: dict[int, list[str]] = {}
    for name, t in state.items():
        by_id.setdefault(id(t), []).append(name)
    renamed = {}
    for name, t in saved.items():
        if name not in state:  # a tied tensor keeps one of its own names; a renamed one gets a new name
            held = [n for n in by_id.get(id(t), []) if n not in saved]
            if held:
                renamed[name] = held[0]
    held = sorted(set(state) - set(saved) - set(renamed.values()))
    made = sorted(set(saved) - set(state) - set(renamed))
    return (renamed, held, made) if held and made else (renamed, [], [])


def loaded_model(folder: str | os.PathLike):
    """The folder's model loaded with transformers as a user loads it (the class its config names, the saved dtype)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    return (cls or AutoModelForCausalLM).from_pretrained(folder, dtype="auto")


def build_manifest(folder: str | os.PathLike, *, optimizer_root: str = "",
                   state_dict_names: list[str] | None = None) -> dict[str, Any]:
    """The state-hash manifest of the repository folder ``folder`` (see the module docstring for its scope).

    ``optimizer_root`` (exact deletion) is carried over from the trace; the optimizer state itself is not
    published. ``state_dict_names`` (the model's full state dict) lets the manifest list tied duplicates.
    """
    from safetensors import safe_open

    folder = Path(folder)
    params, layout = hash_safetensors(folder)
    if not params:
        raise UnlearnError(f"no safetensors weights in {folder}; save the model with save_pretrained() "
                           "(safetensors is the default) before publishing")
    model = _meta_model(folder)
    renamed, converted, made = saved_as(folder, model)
    renamed = {saved: held for saved, held in renamed.items() if saved in params}
    made = [n for n in made if n in params]
    as_held = {renamed.get(n, n): n for n in params}  # state-dict name -> saved name
    ties = {dup: src for dup, src in tied_names(folder, model).items() if src in as_held and dup not in as_held}
    full = {n: h for n, h in params.items() if n not in renamed}

    def rehash(name: str, saved_name: str) -> str:  # the saved tensor's bytes under the name the model holds it
        shard = next(f for f, names in layout.items() if saved_name in names)
        with safe_open(str(folder / shard), framework="pt") as f:
            return tensor_hash(name, f.get_tensor(saved_name))

    for saved_name, held in renamed.items():
        full[held] = rehash(held, saved_name)
    for dup, src in ties.items():  # the tied name's tensor is the saved tensor's bytes under another name
        full[dup] = rehash(dup, as_held[src])
    if converted and made:  # fused tensors saved split (MoE experts): hashed as the loaded model holds them
        for name in made:
            full.pop(name, None)
        state = loaded_model(folder).state_dict()
        for name in converted:
            full[name] = tensor_hash(name, state[name])
        del state
    hashes = StateHashes(params=params, optimizer_root=optimizer_root or "")
    file_hashes = hashed_files(folder)
    manifest = hashes.to_dict()
    manifest.update(
        scope="tensors saved in this repository's *.safetensors files (tied duplicates are saved once), their "
              "header metadata (file_hashes['/safetensors-metadata/NAME']) and the SHA-256 of every other file "
              "except README.md and this manifest",
        files=layout, not_saved=sorted((set(state_dict_names or ()) | set(ties)) - set(params) - set(renamed.values())),
        tied=dict(sorted(ties.items())), state_dict_root=root_hash(full),
        **({"renamed": dict(sorted(renamed.items()))} if renamed else {}),
        **({"converted": {"held": converted, "saved": made}} if converted and made else {}),
        file_hashes=file_hashes, files_root=files_root(file_hashes),
    )
    return manifest


# -- staging ----------------------------------------------------------------------------------------------------
def peft_settings(model) -> dict[str, Any] | None:
    """The settings of a PeftModel's active adapter as plain values (for the card), or None for a plain model."""
    config = getattr(model, "peft_config", None)
    if not isinstance(config, Mapping) or not config:
        return None
    cfg = config.get(getattr(model, "active_adapter", "default")) or next(iter(config.values()))
    out = {"peft_type": public_value(getattr(cfg, "peft_type", "")) or type(cfg).__name__}
    for name in ("r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora", "use_dora"):
        value = getattr(cfg, name, None)
        if value is not None:
            out[name] = public_value(value)
    base = hub_model_id(getattr(cfg, "base_model_name_or_path", None))
    if base:
        out["base_model"] = base
    return out


def merged_copy(model):
    """A plain transformers model with the PEFT adapter merged in; ``model`` itself is left untouched."""
    merged = copy.deepcopy(model)
    if hasattr(merged, "merge_and_unload"):
        return merged.merge_and_unload()
    raise UnlearnError(f"cannot merge the adapter of {type(model).__name__}: only LoRA-style adapters that "
                       "merge_and_unload() can publish as a plain model")


def _merge_adapter_folder(src: Path):
    """Load ``src`` (an adapter-only folder) on its base model and merge it; the base must be loadable here."""
    try:
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(src)
    except Exception as e:
        base = json.loads((src / "adapter_config.json").read_text()).get("base_model_name_or_path")
        raise UnlearnError(f"{src} holds only a LoRA adapter and its base model {base!r} cannot be loaded here "
                           f"({type(e).__name__}); publish the merged model: trainer.push_to_hub() merges, or "
                           "model.merge_and_unload().save_pretrained(DIR) and push DIR") from None
    return model


def stage_files(source, staging: Path, tokenizer=None) -> tuple[list[str], dict[str, Any] | None]:
    """Copy (or save) what is published from ``source`` (an output dir or a model) into ``staging``.

    Returns the model's state-dict names when a model was saved here ([] for a copied folder: the manifest finds
    tied duplicates itself) and the settings of a PEFT adapter merged on the way (None if none was).
    """
    adapter = None
    if hasattr(source, "save_pretrained") and not isinstance(source, (str, os.PathLike)):
        adapter = peft_settings(source)
        model = merged_copy(source) if adapter else source
        model.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        _drop_adapter_files(staging)
        weights_follow_umask(staging)
        return list(model.state_dict().keys()), adapter
    src = Path(source)
    if not src.is_dir():
        raise UnlearnError(f"{source} is not a directory (expected a trainer output dir or save_pretrained() dir)")
    if (src / "adapter_config.json").is_file() and not (src / "config.json").is_file():
        peft_model = _merge_adapter_folder(src)
        adapter = peft_settings(peft_model)
        model = peft_model.merge_and_unload()
        model.save_pretrained(staging, safe_serialization=True)
        names = list(model.state_dict().keys())
    else:
        names = None
    for path in sorted(src.iterdir()):
        if path.is_file() and any(fnmatch.fnmatch(path.name, pat) for pat in PUBLISHED_PATTERNS) \
                and path.name not in ADAPTER_FILES and not (staging / path.name).exists():
            shutil.copy2(path, staging / path.name)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    _drop_adapter_files(staging)
    weights_follow_umask(staging)
    return names or [], adapter


def _drop_adapter_files(staging: Path) -> None:
    for name in ADAPTER_FILES:
        (staging / name).unlink(missing_ok=True)


def _base_model(staging: Path, base_model: str | None, info: dict, adapter: dict | None,
                trace_dir) -> str | None:
    """The Hub id of the model that was unlearned, from the first source that knows one."""
    candidates = [base_model, info["extra"].get("base_model"), (adapter or {}).get("base_model")]
    try:
        candidates.append(json.loads((staging / "config.json").read_text()).get("_name_or_path"))
    except (OSError, json.JSONDecodeError):
        pass
    if trace_dir is not None and (Path(trace_dir) / "header.json").is_file():
        try:
            header = json.loads((Path(trace_dir) / "header.json").read_text())
            candidates.append(((header.get("model") or {}).get("config") or {}).get("_name_or_path"))
        except json.JSONDecodeError:
            pass
    return next((hub_model_id(c) for c in candidates if hub_model_id(c)), None)


_TOKENIZER_NUMBERS = {"added_tokens_decoder", "model_max_length", "max_length", "stride", "pad_to_multiple_of",
                      "pad_token_type_id"}


def scan_files(staging: Path, scanner: IdScanner) -> list[Hit]:
    """Forget ids in the staged files (the card, manifest and forget request are checked where they are made).

    Config files: numbers under the fields the config class defines are configuration (layer counts, token ids),
    every other value is matched, and so are the label names of ``id2label``/``label2id``. Tokenizer files: token
    ids and the learned vocabulary and merges are not sample ids; added and special tokens are matched numbers
    included (a block of reserved tokens numbered 0..n-1 or 1..n is numbered by position), every other string for
    string ids. Chat templates: text, comments and string literals numbers included. Safetensors: the header
    metadata is matched; tensor names for string ids.
    """
    hits: list[Hit] = []
    for path in sorted(p for p in staging.iterdir() if p.is_file()):
        name = path.name
        if name in ("README.md", MANIFEST_FILE, FORGET_REQUEST_FILE):
            continue
        # the file's name is published too; a shard name's numbers are its position, not ids
        hits += scanner.scan_text(name, f"file name {name}", numbers=not SHARD_NAME.match(name))
        if name.endswith(".safetensors"):
            hits += _scan_safetensors(path, scanner)
        elif name in ("config.json", "generation_config.json"):
            hits += scan_config(_load_json(path), name, scanner, generation=name == "generation_config.json")
        elif name == "tokenizer.json":
            hits += _scan_tokenizer_json(_load_json(path), name, scanner)
        elif name == "tokenizer_config.json":
            hits += _scan_tokenizer_config(_load_json(path), name, scanner)
        elif name in ("special_tokens_map.json", "added_tokens.json"):
            hits += scan_tokens(_token_texts(_load_json(path)), name, scanner)
        elif name == "chat_template.jinja":
            hits += scanner.scan_template(path.read_text(encoding="utf-8", errors="replace"), name)
        elif name == "chat_template.json":
            data = _load_json(path)
            hits += _scan_chat_template(data.get("chat_template") if isinstance(data, dict) else data, name,
                                        scanner)
            hits += scanner.scan(data, name, numbers=False)
        elif name in ("vocab.json", "vocab.txt"):  # a vocabulary: any number, no string forget id
            text = path.read_text(encoding="utf-8", errors="replace")
            tokens = vocabulary_tokens(_load_json(path)) if name == "vocab.json" else text.splitlines()
            hits += scan_vocabulary(tokens, name, scanner)
        elif name in ("merges.txt", "tokenizer.model", "spiece.model"):
            continue  # merges pair tokens of the vocabulary (scanned above); SentencePiece models are binary
        else:
            hits += scanner.scan_text(path.read_text(encoding="utf-8", errors="replace"), name)
    return hits


_NUMBERED = re.compile(r"^(\D*)(\d+)(\D*)$")


def scan_tokens(tokens: list[str], field: str, scanner: IdScanner) -> list[Hit]:
    """Forget ids in added/special token texts (``<forget_3600>``), numbers included, except the numbers of a
    block of reserved tokens that differ only by a number running 0..n-1 or 1..n (``<extra_id_0>``...,
    ``<|reserved_special_token_0|>``...): those number positions in the block."""
    families: dict[tuple[str, str], set[int]] = {}
    for token in tokens:
        if m := _NUMBERED.match(token):
            families.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    blocks = {k for k, nums in families.items()
              if len(nums) > 1 and (nums == set(range(len(nums))) or nums == set(range(1, len(nums) + 1)))}
    hits: list[Hit] = []
    for token in dict.fromkeys(tokens):
        m = _NUMBERED.match(token)
        hits += scanner.scan_text(token, field, numbers=not (m and (m.group(1), m.group(3)) in blocks))
    return hits


def _token_texts(value) -> list[str]:
    """Every token text in a special-tokens map, an added-tokens file (its keys) or a list of AddedToken dicts."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        if isinstance(value.get("content"), str):
            return [value["content"]]
        out = []
        for k, v in value.items():
            out += [str(k)] if isinstance(v, int) and not isinstance(v, bool) else _token_texts(v)  # token -> id
        return out
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _token_texts(v)]
    return []


def _scan_chat_template(template, field: str, scanner: IdScanner) -> list[Hit]:
    """A chat template is one Jinja source or a list of ``{"name", "template"}``."""
    if isinstance(template, str):
        return scanner.scan_template(template, field)
    if isinstance(template, list):
        return [h for t in template if isinstance(t, Mapping) for h in
                scanner.scan_template(str(t.get("template", "")), f"{field}:{t.get('name', '')}")]
    return []


def _scan_tokenizer_json(data, name: str, scanner: IdScanner) -> list[Hit]:
    if not isinstance(data, dict):
        return scanner.scan(data, name, numbers=False)
    rest = {k: v for k, v in data.items() if k not in ("added_tokens", "normalizer", "post_processor")}
    vocab = []
    if isinstance(rest.get("model"), dict):
        vocab = vocabulary_tokens(rest["model"].get("vocab"))
        rest["model"] = {k: v for k, v in rest["model"].items() if k not in ("vocab", "merges")}
    return (scan_tokens(_token_texts(data.get("added_tokens") or []), f"{name}:added_tokens", scanner)
            + scan_vocabulary(vocab, f"{name}:model.vocab", scanner) + scan_tokenizer_rules(data, name, scanner)
            + scanner.scan(rest, name, numbers=False))


def _scan_tokenizer_config(data, name: str, scanner: IdScanner) -> list[Hit]:
    hits: list[Hit] = []
    for key, value in (data.items() if isinstance(data, dict) else [("", data)]):
        where = f"{name}:{key}"
        hits += scanner.scan_text(str(key), f"{where} (key)")
        if key == "chat_template":
            hits += _scan_chat_template(value, where, scanner)
        elif key in ("added_tokens_decoder", "additional_special_tokens", "extra_special_tokens") \
                or key.endswith("_token"):
            hits += scan_tokens(_token_texts(value), where, scanner)  # token ids (the decoder's keys) are not
        else:
            hits += scanner.scan(value, where, numbers=key not in _TOKENIZER_NUMBERS)
    return hits


def _load_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnlearnError(f"{path.name} is not valid JSON ({e}); it cannot be published") from None


def _scan_safetensors(path: Path, scanner: IdScanner) -> list[Hit]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        names = list(f.keys())
    hits = scanner.scan(metadata, f"{path.name}:metadata")
    return hits + scanner.scan(names, f"{path.name}:tensor names", numbers=False)


# -- the push ---------------------------------------------------------------------------------------------------
def push_unlearned(
    source,
    repo_id: str,
    *,
    card_info: Mapping[str, Any] | None = None,
    tokenizer=None,
    tag: str | None = None,
    deletion: bool = False,
    revision: str = "main",
    private: bool | None = None,
    token: str | None = None,
    base_model: str | None = None,
    datasets: list[str] | None = None,
    license: str = "apache-2.0",
    trace_dir: str | os.PathLike | None = None,
    key: bytes | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
    template: str | os.PathLike | None = None,
    extra_tags: list[str] | str | None = None,
    not_ids: Mapping[str, Any] | None = None,
    local_dir: str | os.PathLike | None = None,
) -> PushResult:
    """Publish an unlearned model (an output directory, or a model + ``tokenizer``) to ``repo_id`` in one commit.

    ``card_info`` is the trainer's ``unlearning_card_info()`` (default: ``source/unlearning_info.json``). ``tag``
    names this revision (e.g. ``deletion-0003``); ``deletion=True`` takes the next free ``deletion-NNNN`` tag.
    Files of the branch that this push does not contain are deleted in the same commit, so the revision holds
    exactly one model. Every value and file is scanned for the forget ids first; ``not_ids`` allows numbers that
    merely equal an id, per field (``{"hyperparameters.max_steps": 3600}``, see :mod:`hf_unlearn.hub.leaks`).
    Raises :class:`UnlearnError` for a missing/bad token, a forget id in anything published, an existing tag, or a
    failed upload (nothing is published then; run it again). A PEFT model is published merged. The pushed card is
    also written to ``local_dir`` (default: ``source`` when it is a folder) with a line in ``hub_pushes.jsonl``.
    """
    if not isinstance(repo_id, str) or not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
        raise UnlearnError(f"repo id {repo_id!r} must look like 'org/name'")
    if tag is not None and deletion:
        raise UnlearnError("pass either tag= or deletion=True, not both")
    if tag is not None and not TAG_NAME.match(tag):
        raise UnlearnError(f"tag {tag!r} is not a valid tag name (letters, digits, '.', '_', '-')")
    if card_info is None:
        if hasattr(source, "save_pretrained"):
            raise UnlearnError("card_info is required when pushing a model object (use unlearning_card_info())")
        card_info = load_card_info(source)
    info = checked_card_info(card_info, not_ids)  # refuses forget ids before anything is staged or sent
    scanner = card_scanner(info, not_ids)
    if not hasattr(source, "save_pretrained"):
        if not Path(source).is_dir():
            raise UnlearnError(f"{source} is not a directory (expected a trainer output dir or save_pretrained() dir)")
        if not safetensors_files(source) and not (Path(source) / "adapter_config.json").is_file():
            raise UnlearnError(f"no safetensors weights in {source}; save the model with save_pretrained() "
                               "(safetensors is the default) before publishing")
    key = _push_key(key, trace_dir)
    _check_verified_claim(info, trace_dir)
    hits = scanner.scan({"repo_id": repo_id, "tag": tag, "branch": revision, "commit_message": commit_message}, "")

    with tempfile.TemporaryDirectory(prefix="hf_unlearn_push_") as tmp:
        staging = Path(tmp)
        names, adapter = stage_files(source, staging, tokenizer)
        hits += scan_files(staging, scanner)
        request = forget_request(info["forget_ids"], key)
        atomic_write_text(staging / FORGET_REQUEST_FILE, json.dumps(request, indent=1))
        skipped: dict[str, str] = {}
        if trace_dir is not None:
            keep, skipped, trace_hits = select_provenance(trace_dir, scanner)
            hits += trace_hits
            for rel, path in keep.items():
                dest = staging / PROVENANCE_DIR / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest)
        scanner.refuse(hits, "the push")
        exact = info["extra"].get("exact_deletion") or {}
        manifest = build_manifest(staging, optimizer_root=exact.get("optimizer_root", ""), state_dict_names=names)
        if exact.get("params_root") and exact["params_root"] not in (manifest["params_root"],
                                                                     manifest["state_dict_root"]):
            # the card would say these weights are the replayed state: `hub verify` fails it after the upload
            raise UnlearnError(f"refusing to publish: the weights in {source} (root {manifest['params_root']}) are not "
                               f"the exact deletion's replayed state (root {exact['params_root']}) that the card "
                               "states; they were changed after the deletion: publish the model folder `forget` "
                               "wrote, or run the deletion again")
        atomic_write_text(staging / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True))
        base = _base_model(staging, base_model, info, adapter, trace_dir)
        provenance = [f"{PROVENANCE_DIR}/{r}" for r in sorted(_provenance_rel(staging))]

        def card_for(revision_tag: str | None) -> str:
            return render_model_card(
                info, key=key, repo_id=repo_id, base_model=base, datasets=datasets, license=license,
                manifest=manifest, tag=revision_tag, template=template, extra_tags=extra_tags, not_ids=not_ids,
                provenance_files=provenance, merged_adapter=adapter)

        card_for(tag)  # every check that does not need the Hub, first (the user's tag was scanned above)
        summary = f"{info['method']} unlearning of {request['count']} samples"

        def message_for(revision_tag: str | None) -> str:
            text = commit_message or summary
            return f"{revision_tag}: {text}" if revision_tag else text

        api = _authenticated_api(endpoint, token)
        _create_repo(api, repo_id, private)
        already = False
        try:
            commit, tag, card = _commit_and_tag(api, repo_id, staging, revision, tag, deletion, card_for, message_for,
                                                manifest)
        except _AlreadyPublished as e:
            commit, tag, card, already = e.commit, e.tag, e.card, True
        files = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
    result = PushResult(repo_id=repo_id, commit=commit, url=f"{api.endpoint}/{repo_id}", tag=tag, files=files,
                        params_root=manifest["params_root"], root=manifest["root"],
                        state_dict_root=manifest["state_dict_root"], files_root=manifest["files_root"],
                        skipped_provenance=skipped, card=card, file_hashes=dict(manifest["file_hashes"]),
                        card_sha256=hashlib.sha256(card.encode("utf-8")).hexdigest(), already_published=already)
    local_dir = local_dir if local_dir is not None else (None if hasattr(source, "save_pretrained") else source)
    if local_dir is not None:
        _record_locally(Path(local_dir), result, key_fingerprint(key))
    return result


def _check_verified_claim(info: dict, trace_dir) -> None:
    """A card that says the deletion was verified, published with the replay's provenance, must agree with the
    replay's own sealed verdict: the card info may come from a file of the publisher's (``unlearning_info.json``)."""
    if trace_dir is None or not (info["extra"].get("exact_deletion") or {}).get("verified"):
        return
    verdict = require_sealed_verdict(trace_dir, f"refusing to publish {Path(trace_dir) / VERIFICATION_FILE}")
    if not (verdict and verdict.get("verified")):
        raise UnlearnError(f"refusing to publish: the card says the deletion was verified, but {trace_dir} holds no "
                           f"{VERIFICATION_FILE} that says VERIFIED; {REVERIFY}, or publish without the claim")


def _push_key(key: bytes | None, trace_dir) -> bytes:
    """The key that tags the card: the run's key when publishing its provenance (so the card's tags match its
    deletion log), else the library's one key."""
    if trace_dir is not None and (Path(trace_dir) / "header.json").is_file():
        run = run_key(trace_dir)
        if key is not None and key != run:
            raise UnlearnError(f"key= (fingerprint {key_fingerprint(key)}) is not the key of the run in {trace_dir} "
                               f"({key_fingerprint(run)}): the card's tags would not match its deletion log")
        return run
    return key if key is not None else load_key()


def _record_locally(folder: Path, result: PushResult, fingerprint: str) -> None:
    """Keep the pushed card next to the weights (the local README.md is the one on the Hub) and log the push."""
    atomic_write_text(folder / "README.md", result.card)
    log = folder / PUSH_LOG_FILE
    old = log.read_text() if log.is_file() else ""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "repo_id": result.repo_id,
             "commit": result.commit, "tag": result.tag, "params_root": result.params_root,
             "state_dict_root": result.state_dict_root, "files_root": result.files_root,
             "file_hashes": result.file_hashes, "card_sha256": result.card_sha256, "key_fingerprint": fingerprint}
    atomic_write_text(log, old + json.dumps(entry, sort_keys=True) + "\n")


def _provenance_rel(staging: Path) -> list[str]:
    base = staging / PROVENANCE_DIR
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()) if base.is_dir() else []


def hub_error(e: Exception, action: str) -> UnlearnError:
    """A one-line UnlearnError for a failed Hub call (token problems get their own advice)."""
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    if isinstance(e, LocalTokenNotFoundError):
        return UnlearnError(f"{action}: no Hugging Face token; set HF_TOKEN, pass --token, or run `hf auth login`")
    status = _status(e)
    if isinstance(e, HfHubHTTPError) and status == 401:
        return UnlearnError(f"{action}: the Hub rejected the token (401 Unauthorized); check HF_TOKEN / --token")
    if isinstance(e, HfHubHTTPError) and status == 403:
        return UnlearnError(f"{action}: the token may not write here (403 Forbidden)")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UnlearnError(f"{action}: {first}")


def _status(e: Exception) -> int | None:
    return getattr(getattr(e, "response", None), "status_code", None)


def _authenticated_api(endpoint: str | None, token: str | None):
    """An HfApi whose token the Hub accepts (checked with whoami before anything is uploaded)."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint, token=token)
    try:
        me = api.whoami()
    except Exception as e:
        raise hub_error(e, "cannot publish") from None
    if (me.get("hf_unlearn_hub") or {}).get("xet") is False:
        # our local Hub serves large files over LFS only; huggingface_hub checks this flag at upload time
        from huggingface_hub import constants

        constants.HF_HUB_DISABLE_XET = True
    return api


def _create_repo(api, repo_id: str, private: bool | None) -> None:
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
    except Exception as e:
        raise hub_error(e, f"cannot create {repo_id}") from None


def _head(api, repo_id: str, revision: str) -> tuple[str, dict[str, str]]:
    """The branch's head commit (the branch is created from main if missing) and the repo's tags -> commits."""
    refs = api.list_repo_refs(repo_id)
    branches = {b.name: b.target_commit for b in refs.branches}
    if revision not in branches:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
        refs = api.list_repo_refs(repo_id)
        branches = {b.name: b.target_commit for b in refs.branches}
    return branches[revision], {t.name: t.target_commit for t in refs.tags}


def next_deletion_tag(api, repo_id: str, head: str | None = None, tags: Mapping[str, str] | None = None) -> str:
    """``deletion-NNNN`` one above every deletion number in the repo's tags and in the branch's commit titles."""
    tags = {t.name: t.target_commit for t in api.list_repo_refs(repo_id).tags} if tags is None else tags
    numbers = [int(m.group(1)) for t in tags if (m := DELETION_TAG.match(t))]
    if head is not None:
        for c in api.list_repo_commits(repo_id, revision=head):
            m = DELETION_TITLE.match(c.title or "")
            if m:
                numbers.append(int(DELETION_TAG.match(m.group(1)).group(1)))
    return f"deletion-{max(numbers, default=0) + 1:04d}"


def _unfinished_push(api, repo_id: str, head: str, tags: Mapping[str, str], manifest_path: Path,
                     tag: str | None) -> tuple[str, str] | None:
    """``(tag, commit)`` of this same push if it was committed but never tagged (cut off between its commit and its
    tag: the commit's title names the tag, its manifest is ours), else None. Every commit of the branch is looked
    at, not only the head: another push may have landed on top before this one is run again."""
    from huggingface_hub import hf_api

    ours = git_blob_id(manifest_path.read_bytes())
    for c in api.list_repo_commits(repo_id, revision=head):
        title = c.title or ""
        wanted = tag if tag is not None else (m.group(1) if (m := DELETION_TITLE.match(title)) else None)
        if not wanted or not title.startswith(f"{wanted}: ") or wanted in tags:
            continue
        try:
            info = api.get_paths_info(repo_id, [MANIFEST_FILE], revision=c.commit_id)
        except Exception:
            continue
        if any(isinstance(i, hf_api.RepoFile) and i.blob_id == ours for i in info):
            return wanted, c.commit_id
    return None


def _titled_commit(api, repo_id: str, head: str, tag: str) -> str | None:
    """A commit of the branch whose title claims ``tag`` (``"deletion-0002: ..."``), or None: taking that tag for
    another commit would leave the claiming commit untagged for ever."""
    for c in api.list_repo_commits(repo_id, revision=head):
        if (c.title or "").startswith(f"{tag}: "):
            return c.commit_id
    return None


class _AlreadyPublished(UnlearnError):
    """A deletion tag holds this push's weights and files already (the publish step run again)."""

    def __init__(self, tag: str, commit: str, card: str):
        super().__init__(f"{tag} already holds these weights and files")
        self.tag, self.commit, self.card = tag, commit, card


def _refuse_a_published_deletion(api, repo_id: str, tags: Mapping[str, str], manifest: dict) -> None:
    """Before a new ``deletion-NNNN``: a deletion tag whose weights are these (the saved-tensor root) is this deletion,
    published before (re-running the publish step published it again as the next tag). Same files too: raises
    :class:`_AlreadyPublished` (nothing is pushed, the existing tag is the result); other files: refused, naming it."""
    number = {t: int(m.group(1)) for t in tags if (m := DELETION_TAG.match(t))}
    with tempfile.TemporaryDirectory(prefix="hf_unlearn_published_") as cache:
        for name in sorted(number, key=number.get, reverse=True):
            try:
                theirs = json.loads(Path(api.hf_hub_download(repo_id, MANIFEST_FILE, revision=tags[name],
                                                             cache_dir=cache)).read_text())
            except Exception:
                continue  # a revision without a readable manifest is not this model
            if theirs.get("params_root") != manifest["params_root"]:
                continue
            if theirs.get("files_root") != manifest["files_root"]:
                raise UnlearnError(f"{repo_id}@{name} already published these weights ({ROOT_NAMES['params_root']} "
                                   f"{manifest['params_root'][:16]}...) with other files (config, tokenizer, forget "
                                   "request or provenance): a new deletion tag would publish the same deletion twice; "
                                   "nothing was pushed")
            try:
                card = Path(api.hf_hub_download(repo_id, "README.md", revision=tags[name], cache_dir=cache)).read_text()
            except Exception as e:
                raise hub_error(e, f"cannot read the card of {repo_id}@{name}, which holds these weights") from None
            raise _AlreadyPublished(name, tags[name], card)


def _commit_and_tag(api, repo_id, staging: Path, revision: str, tag, deletion: bool, card_for, message_for,
                    manifest) -> tuple[str, str | None, str]:
    """Commit against the head the tag was chosen from, retrying when another push got there first; then tag."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    for attempt in range(MAX_ATTEMPTS):
        try:
            head, tags = _head(api, repo_id, revision)
            if deletion or tag is not None:
                found = _unfinished_push(api, repo_id, head, tags, staging / MANIFEST_FILE, None if deletion else tag)
                if found:
                    done, commit = found
                    card = card_for(done)
                    _tag(api, repo_id, done, commit, message_for(done))
                    return commit, done, card
            if deletion:
                _refuse_a_published_deletion(api, repo_id, tags, manifest)
                tag = next_deletion_tag(api, repo_id, head, tags)
            if tag is not None and tag in tags:
                raise UnlearnError(f"{repo_id} already has a tag {tag!r}; deletion tags are append-only, pick a new "
                                   "one (or use --deletion for the next number)")
            if tag is not None and not deletion and (claimed := _titled_commit(api, repo_id, head, tag)):
                raise UnlearnError(f"commit {claimed} of {repo_id} is already titled {tag!r} but not tagged yet (a "
                                   "push cut off before its tag: run that push again to tag it); pick another tag")
            card = card_for(tag)
            atomic_write_text(staging / "README.md", card)
            files = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
            remote = set(api.list_repo_files(repo_id, revision=head))
            ops = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(staging / f)) for f in files]
            ops += [CommitOperationDelete(path_in_repo=f) for f in sorted(remote - set(files) - {".gitattributes"})]
            commit = api.create_commit(repo_id, operations=ops, commit_message=message_for(tag), revision=revision,
                                       parent_commit=head).oid
        except UnlearnError:
            raise
        except Exception as e:
            if _status(e) in (409, 412) and attempt + 1 < MAX_ATTEMPTS:  # another push moved the branch first
                time.sleep(random.uniform(0.05, 0.3) * (attempt + 1))
                continue
            raise hub_error(e, f"the upload to {repo_id} failed, nothing was published (a Hub commit is atomic); "
                               "run the push again") from None
        if tag is not None:
            _tag(api, repo_id, tag, commit, message_for(tag))
        return commit, tag, card
    raise UnlearnError(f"{repo_id}: the branch kept moving under {MAX_ATTEMPTS} attempts; run the push again")


def _tag(api, repo_id: str, tag: str, commit: str, message: str) -> None:
    for attempt in range(3):
        try:
            api.create_tag(repo_id, tag=tag, revision=commit, tag_message=message)
            return
        except Exception as e:
            if _status(e) == 409:
                current = {t.name: t.target_commit for t in api.list_repo_refs(repo_id).tags}.get(tag)
                if current == commit:
                    return  # already tagged (a retried request)
                raise UnlearnError(f"commit {commit} was published but the tag {tag!r} was taken by another writer "
                                   f"(it points to {current}); tag the commit by hand") from None
            if attempt == 2:
                raise hub_error(e, f"commit {commit} was published but tagging it {tag!r} failed; run the same push "
                                   "again (it finds the untagged commit and tags it)") from None
            time.sleep(0.2 * (attempt + 1))


