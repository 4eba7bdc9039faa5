"""Push an unlearned model to the Hub: weights, tokenizer, state-hash manifest, card and provenance in ONE commit.

One commit per push means a revision is either fully published or not at all (the Hub moves the branch only when
the commit succeeds), and one tag per deletion request (``deletion-0003``) makes the history of a model's deletions
auditable from the repository's refs. The state-hash manifest (``state_hashes.json``) is computed with the
library's one hash function, :func:`hf_unlearn.trace.hashing.state_hashes`, over the tensors actually saved in the
safetensors files: safetensors stores a tied weight once (``lm_head.weight`` tied to ``embed_tokens.weight`` is
saved under one name), so the manifest lists the saved names and records the dropped duplicates in ``not_saved``.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UnlearnError
from ..utils import atomic_write_text
from .cards import checked_card_info, find_raw_ids, forget_request, normalize_card_info, render_model_card

CARD_INFO_FILE = "unlearning_info.json"  # local only: holds raw forget ids, never uploaded
MANIFEST_FILE = "state_hashes.json"
FORGET_REQUEST_FILE = "forget_request.json"
PROVENANCE_DIR = "provenance"
PUBLISHED_PATTERNS = (
    "*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json", "adapter_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "spiece.model", "chat_template.jinja", "chat_template.json",
)
DELETION_TAG = re.compile(r"^deletion-(\d{4,})$")
_TAG_LIKE = re.compile(r"^[0-9a-f]{16,}$")


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
    skipped_provenance: dict[str, str] = field(default_factory=dict)


# -- card info on disk -----------------------------------------------------------------------------------------
def save_card_info(output_dir: str | os.PathLike, card_info: Mapping[str, Any]) -> Path:
    """Store a trainer's ``unlearning_card_info()`` next to its weights, for ``hf-unlearn hub push OUT``.

    The file holds the raw forget ids; it stays local (``push_unlearned`` never uploads it).
    """
    info = normalize_card_info(card_info)
    path = Path(output_dir) / CARD_INFO_FILE
    atomic_write_text(path, json.dumps(info, indent=1, default=_jsonable))
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
    return sorted(p for p in Path(folder).glob("*.safetensors") if p.is_file())


def hash_safetensors(folder: str | os.PathLike) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Per-tensor state hashes of every tensor in the folder's safetensors files, and which file holds which."""
    from safetensors import safe_open

    from ..trace.hashing import tensor_hash

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


def build_manifest(folder: str | os.PathLike, *, optimizer_root: str = "",
                   state_dict_names: list[str] | None = None) -> dict[str, Any]:
    """The state-hash manifest of the weights saved in ``folder`` (see the module docstring for its scope).

    ``optimizer_root`` (exact deletion) is carried over from the trace; the optimizer state itself is not
    published. ``state_dict_names`` (the model's full state dict) lets the manifest list tied duplicates.
    """
    from ..trace.hashing import StateHashes

    params, layout = hash_safetensors(folder)
    if not params:
        raise UnlearnError(f"no safetensors weights in {folder}; save the model with save_pretrained() "
                           "(safetensors is the default) before publishing")
    hashes = StateHashes(params=params, optimizer_root=optimizer_root or "")
    manifest = hashes.to_dict()
    manifest.update(
        scope="tensors saved in this repository's *.safetensors files (tied duplicates are saved once)",
        files=layout, not_saved=sorted(set(state_dict_names or ()) - set(params)),
    )
    return manifest


def _state_dict_names(folder: Path) -> list[str]:
    """The full state-dict names of the model in ``folder``, built on the meta device (no weights loaded).

    Best effort: used only to list tied duplicates in the manifest; an unknown architecture gives [].
    """
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return list(model.state_dict().keys())
    except Exception:
        return []


# -- provenance -------------------------------------------------------------------------------------------------
def select_provenance(trace_dir: str | os.PathLike, forget_ids=()) -> tuple[dict[str, Path], dict[str, str]]:
    """Split a trace directory into files safe to publish (keyed tags only) and files that stay local.

    Published: JSON/JSONL files whose id-like fields hold only keyed tags (hex digests) and that name none of the
    forget ids, and WAL files (``*.wal``, ``wal*.bin``: fixed records of keyed digests). Everything else (the token
    store, checkpoints, id manifests with raw ids) stays local, with the reason.
    """
    root = Path(trace_dir)
    if not root.is_dir():
        raise UnlearnError(f"trace directory {trace_dir} does not exist")
    keep: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if any(part.startswith(".") for part in path.relative_to(root).parts):
            continue
        name = path.name.lower()
        if name.endswith(".wal") or fnmatch.fnmatch(name, "wal*.bin"):
            keep[rel] = path
        elif name.endswith((".json", ".jsonl")):
            reason = _raw_id_reason(path, forget_ids)
            if reason:
                skipped[rel] = reason
            else:
                keep[rel] = path
        else:
            skipped[rel] = "not a publishable provenance file (token stores, checkpoints and tensors stay local)"
    return keep, skipped


def _raw_id_reason(path: Path, forget_ids) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
        records = ([json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl"
                   else [json.loads(text)])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"unreadable JSON ({e.__class__.__name__})"
    for record in records:
        bad = _untagged_id_field(record)
        if bad:
            return f"carries raw ids in field {bad!r}"
    named = [i for i in forget_ids if not str(i).isdigit()]  # numbers in a plan (steps, seeds) are not ids
    if named and find_raw_ids(records, named):
        return "names forget ids"
    return None


def _untagged_id_field(value, key: str = "") -> str | None:
    """The first id-like field whose values are not keyed tags (hex digests)."""
    from .cards import _ID_KEY

    if isinstance(value, Mapping):
        for k, v in value.items():
            found = _untagged_id_field(v, str(k))
            if found:
                return found
        return None
    if isinstance(value, list):
        for v in value:
            found = _untagged_id_field(v, key)
            if found:
                return found
        return None
    if key and _ID_KEY.search(key) and value is not None and not (isinstance(value, str) and _TAG_LIKE.match(value)):
        return key
    return None


# -- staging ----------------------------------------------------------------------------------------------------
def stage_files(source, staging: Path, tokenizer=None) -> list[str]:
    """Copy (or save) what is published from ``source`` (an output dir or a model) into ``staging``."""
    if hasattr(source, "save_pretrained") and not isinstance(source, (str, os.PathLike)):
        source.save_pretrained(staging, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        return list(source.state_dict().keys())
    src = Path(source)
    if not src.is_dir():
        raise UnlearnError(f"{source} is not a directory (expected a trainer output dir or save_pretrained() dir)")
    for path in sorted(src.iterdir()):
        if path.is_file() and any(fnmatch.fnmatch(path.name, pat) for pat in PUBLISHED_PATTERNS):
            shutil.copy2(path, staging / path.name)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    return _state_dict_names(staging) if (staging / "config.json").is_file() else []


def _base_model(staging: Path, base_model: str | None, info: dict) -> str | None:
    candidate = base_model or info["extra"].get("base_model")
    if candidate:
        return str(candidate)
    try:  # a Hub id in config._name_or_path (never a local path: it would leak the publisher's file system)
        name = json.loads((staging / "config.json").read_text()).get("_name_or_path") or ""
    except (OSError, json.JSONDecodeError):
        return None
    return name if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not os.path.exists(name) else None


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
) -> PushResult:
    """Publish an unlearned model (an output directory, or a model + ``tokenizer``) to ``repo_id`` in one commit.

    ``card_info`` is the trainer's ``unlearning_card_info()`` (default: ``source/unlearning_info.json``). ``tag``
    names this revision (e.g. ``deletion-0003``); ``deletion=True`` picks the next ``deletion-NNNN`` tag. Files of
    the branch that this push does not contain (an old shard layout) are deleted in the same commit, so the
    revision holds exactly one model. Raises :class:`UnlearnError` for a missing/bad token, a card that would carry
    raw ids, an existing tag, or a failed upload (nothing is published then; run it again).
    """
    from .keys import load_key

    if not isinstance(repo_id, str) or not re.fullmatch(r"[\w.-]+/[\w.-]+", repo_id):
        raise UnlearnError(f"repo id {repo_id!r} must look like 'org/name'")
    if tag is not None and deletion:
        raise UnlearnError("pass either tag= or deletion=True, not both")
    if card_info is None:
        if hasattr(source, "save_pretrained"):
            raise UnlearnError("card_info is required when pushing a model object (use unlearning_card_info())")
        card_info = load_card_info(source)
    info = checked_card_info(card_info)  # refuses raw ids before anything is staged or sent
    key = key if key is not None else load_key()
    if not hasattr(source, "save_pretrained") and not Path(source).is_dir():
        raise UnlearnError(f"{source} is not a directory (expected a trainer output dir or save_pretrained() dir)")
    if not hasattr(source, "save_pretrained") and not safetensors_files(source):
        raise UnlearnError(f"no safetensors weights in {source}; save the model with save_pretrained() "
                           "(safetensors is the default) before publishing")
    api = _authenticated_api(endpoint, token)  # cheap checks first: token, repo, tag, before staging
    _create_repo(api, repo_id, private)
    if deletion:
        tag = next_deletion_tag(api, repo_id)
    if tag is not None:
        _check_new_tag(api, repo_id, tag)

    with tempfile.TemporaryDirectory(prefix="hf_unlearn_push_") as tmp:
        staging = Path(tmp)
        names = stage_files(source, staging, tokenizer)
        exact = info["extra"].get("exact_deletion") or {}
        manifest = build_manifest(staging, optimizer_root=exact.get("optimizer_root", ""), state_dict_names=names)
        atomic_write_text(staging / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True))
        request = forget_request(info["forget_ids"], key)
        atomic_write_text(staging / FORGET_REQUEST_FILE, json.dumps(request, indent=1))

        skipped: dict[str, str] = {}
        if trace_dir is not None:
            keep, skipped = select_provenance(trace_dir, info["forget_ids"])
            for rel, path in keep.items():
                dest = staging / PROVENANCE_DIR / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest)

        card = render_model_card(
            info, key=key, repo_id=repo_id, base_model=_base_model(staging, base_model, info), datasets=datasets,
            license=license, manifest=manifest, tag=tag, template=template, extra_tags=extra_tags,
            provenance_files=[f"{PROVENANCE_DIR}/{r}" for r in sorted(_provenance_rel(staging))],
        )
        atomic_write_text(staging / "README.md", card)

        files = sorted(p.relative_to(staging).as_posix() for p in staging.rglob("*") if p.is_file())
        message = commit_message or (f"{tag}: " if tag else "") + (
            f"{info['method']} unlearning of {request['count']} samples")
        commit = _commit(api, repo_id, staging, files, message, revision)
        if tag is not None:
            _tag(api, repo_id, tag, commit, message)
    url = f"{api.endpoint}/{repo_id}"
    return PushResult(repo_id=repo_id, commit=commit, url=url, tag=tag, files=files,
                      params_root=manifest["params_root"], root=manifest["root"], skipped_provenance=skipped)


def _provenance_rel(staging: Path) -> list[str]:
    base = staging / PROVENANCE_DIR
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()) if base.is_dir() else []


def hub_error(e: Exception, action: str) -> UnlearnError:
    """A one-line UnlearnError for a failed Hub call (token problems get their own advice)."""
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    if isinstance(e, LocalTokenNotFoundError):
        return UnlearnError(f"{action}: no Hugging Face token; set HF_TOKEN, pass --token, or run `hf auth login`")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, HfHubHTTPError) and status == 401:
        return UnlearnError(f"{action}: the Hub rejected the token (401 Unauthorized); check HF_TOKEN / --token")
    if isinstance(e, HfHubHTTPError) and status == 403:
        return UnlearnError(f"{action}: the token may not write here (403 Forbidden)")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UnlearnError(f"{action}: {first}")


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


def next_deletion_tag(api, repo_id: str) -> str:
    """``deletion-NNNN`` one above the highest deletion tag of the repo (``deletion-0001`` for the first)."""
    numbers = [int(m.group(1)) for t in api.list_repo_refs(repo_id).tags if (m := DELETION_TAG.match(t.name))]
    return f"deletion-{max(numbers, default=0) + 1:04d}"


def _check_new_tag(api, repo_id: str, tag: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", tag):
        raise UnlearnError(f"tag {tag!r} is not a valid tag name (letters, digits, '.', '_', '-')")
    existing = {t.name for t in api.list_repo_refs(repo_id).tags}
    if tag in existing:
        raise UnlearnError(f"{repo_id} already has a tag {tag!r}; deletion tags are append-only, pick a new one "
                           "(or use --deletion for the next number)")


def _commit(api, repo_id: str, staging: Path, files: list[str], message: str, revision: str) -> str:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    try:
        if revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        remote = set(api.list_repo_files(repo_id, revision=revision))
        ops = [CommitOperationAdd(path_in_repo=f, path_or_fileobj=str(staging / f)) for f in files]
        ops += [CommitOperationDelete(path_in_repo=f) for f in sorted(remote - set(files) - {".gitattributes"})]
        return api.create_commit(repo_id, operations=ops, commit_message=message, revision=revision).oid
    except UnlearnError:
        raise
    except Exception as e:
        raise hub_error(e, f"the upload to {repo_id} failed, nothing was published (a Hub commit is atomic); "
                           "run the push again") from None


def _tag(api, repo_id: str, tag: str, commit: str, message: str) -> None:
    try:
        api.create_tag(repo_id, tag=tag, revision=commit, tag_message=message)
    except Exception as e:
        raise hub_error(e, f"commit {commit} was published but tagging it {tag!r} failed; run the same push "
                           "again (an unchanged push re-uses the commit and tags it)") from None
