"""Verify a published revision: download it, recompute every hash, load the model, compare with manifest and card.

What ``verify`` proves, and what it cannot:

* Always (self-consistency): every tensor of the revision's safetensors files hashes to the value in
  ``state_hashes.json``; every other file that changes what the model computes (config, generation config,
  tokenizer, chat template; also the forget request and provenance) has the SHA-256 the manifest lists, and no
  file outside the manifest is in the revision (apart from the card and ``.gitattributes``); the manifest's roots
  are the roots of its own entries and the card states the same roots; the model **loads** with ``transformers``
  from the revision and the loaded state dict is exactly the hashed tensors (tied weights included). Whoever can
  write the repository can rewrite weights, manifest and card together, so this alone does not show that the
  weights are the ones the publisher produced.
* With ``expect_root`` (from the publisher's own records: the run's deletion log, the replay's verification
  record, or the push's ``hub_pushes.jsonl``): the loaded weights hash to that root (the full state-dict root, or
  the saved-tensor root). The repository cannot rewrite that value. It says nothing about ``config.json``, the
  tokenizer or any other file: a writer can change ``hidden_act`` and rewrite the manifest's ``files_root`` and the
  card to match, and the weights still hash to the root. The report then says so (``anchored`` is False,
  ``weights_anchored`` True).
* With ``expect_files_root`` (``hub_pushes.jsonl`` records it for every push): every file but the weights, the card
  and the manifest hashes to that root, as the publisher pushed them, and so does the header metadata of each
  weights file (manifests written before it was covered say so). With ``expect_file_hashes`` as well (newer push
  records hold them) a mismatch names the files that differ.
* With ``expect_card_sha256`` (``hub_pushes.jsonl`` records it): the model card (``README.md``: the method, the
  claims, every sentence) is the one pushed. The card is outside the files root (it states that root), so without
  this or ``expect_commit`` a writer can rewrite the card ("This model forgot nothing.") and ``anchored`` is False.
* With ``expect_commit``: the revision checked is exactly that commit (a tag or branch that was moved fails); a
  commit id covers the content of every file, config, tokenizer and card included.

``expected_from(record, repo_id, revision)`` reads all of these from the publisher's records.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnlearnError
from ..trace.hashing import root_hash, state_hashes
from ..trace.run import file_sha256
from ..trace.verification import require_sealed_verdict
from .publish import (
    MANIFEST_FILE,
    METADATA_KEY,
    PUSH_LOG_FILE,
    ROOT_NAMES,
    files_root,
    hash_safetensors,
    hashed_files,
    hub_error,
    loaded_model,
)
from .server import _front_matter


@dataclass
class VerifyReport:
    """The outcome of a verification; ``ok`` iff every check passed. ``statement`` says what was proven."""

    source: str
    commit: str | None = None
    checked: int = 0
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    params_root: str = ""
    state_dict_root: str = ""
    files_checked: int = 0
    loaded: str | None = None  # the class the revision loaded as (None: not loaded)
    files_root: str = ""  # root of the SHA-256 of every file but the weights, the card and the manifest
    expect_root: str | None = None
    expect_commit: str | None = None
    expect_files_root: str | None = None
    expect_card_sha256: str | None = None
    card_sha256: str = ""  # of the revision's README.md
    metadata_covered: bool = True  # False for manifests written before safetensors header metadata was hashed

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.missing or self.unexpected or self.problems)

    @property
    def weights_anchored(self) -> bool:
        """``ok``, and the weights were checked against a root given from outside the repository (``expect_root``).
        Says nothing about config, tokenizer or any other file."""
        return self.ok and bool(self.expect_root)

    @property
    def files_anchored(self) -> bool:
        """``ok``, and the config, tokenizer and every other non-weight file were checked against a value from
        outside the repository (``expect_files_root``, or ``expect_commit``: a commit id covers every file)."""
        return self.ok and bool(self.expect_files_root or self.expect_commit)

    @property
    def card_anchored(self) -> bool:
        """``ok``, and the model card (method, claims, text) was checked against a value from outside the
        repository (``expect_card_sha256``, or ``expect_commit``)."""
        return self.ok and bool(self.expect_card_sha256 or self.expect_commit)

    @property
    def anchored(self) -> bool:
        """True when everything published was checked against values the repository's writer cannot rewrite: the
        weights (``expect_root``), the config, tokenizer and other files (``expect_files_root`` or
        ``expect_commit``) and the model card (``expect_card_sha256`` or ``expect_commit``). ``expect_root`` alone
        gives ``weights_anchored`` only: a writer can change ``config.json`` (``hidden_act``) and rewrite manifest
        and card to match; without the card pinned, the card's method and claims can be rewritten."""
        return self.weights_anchored and self.files_anchored and self.card_anchored and not self.unpinned

    @property
    def unpinned(self) -> list[str]:
        """Published files no value from outside the repository covers: ``.gitattributes`` and the manifest
        (``state_hashes.json``) are outside the weights root, the files root and the card's hash; only a commit pin
        (``expect_commit``) covers them (a writer could rewrite ``.gitattributes`` or add fields to the manifest)."""
        return [] if self.expect_commit else [".gitattributes", "state_hashes.json"]

    @property
    def statement(self) -> str:
        """What this verification proved, and what it did not (one paragraph)."""
        where = f"{self.source}{f' at commit {self.commit}' if self.commit else ''}"
        if not self.ok:
            return f"Nothing is proven about {where}: the checks failed (see the problems)."
        text = (f"Proven: the {self.checked} tensors and {self.files_checked} other files of {where} match its "
                f"state_hashes.json and its model card, and the model loads with transformers ({self.loaded}) to "
                f"exactly those tensors ({ROOT_NAMES['params_root']} {self.params_root}, {ROOT_NAMES['state_dict_root']} "
                f"{self.state_dict_root}).")
        if self.expect_root:
            text += f" The weights hash to the expected root {self.expect_root}, given from outside the repository."
        if self.expect_files_root:
            text += (f" The config, tokenizer and other non-weight files ({self.files_checked} files) hash to the "
                     f"expected files root {self.expect_files_root}, given from outside the repository.")
        if self.expect_card_sha256:
            text += " The model card is the one pushed (its SHA-256 was given from outside the repository)."
        if self.expect_commit:
            text += (f" The revision is the expected commit {self.expect_commit} (a commit id covers every file, "
                     "config, tokenizer and model card included).")
        if not self.metadata_covered and not self.expect_commit:
            text += (" Not covered: the safetensors header metadata (the manifest predates it being hashed; only "
                     "--expect-commit pins it).")
        if not self.expect_root and not self.files_anchored:
            text += (" Not proven: that these are the weights, config and tokenizer files the publisher produced; "
                     "whoever can write the repository can replace weights, other files, manifest and card "
                     "together. Pass --expect-from with your hub_pushes.jsonl (or --expect-root, "
                     "--expect-files-root and --expect-commit from the publisher's own records) for that.")
        elif not self.expect_root:
            text += (" Not proven: that these weights hash to the root the publisher recorded (no expected root "
                     "was given); pass --expect-root (or --expect-from) for that.")
        elif not self.files_anchored:
            text += (" Not proven: that config.json, the tokenizer files and the other non-weight files are the "
                     "publisher's: only the weights were checked against a value from outside the repository, and "
                     "whoever can write it can change those files (config.json's hidden_act, the chat template) "
                     "and rewrite manifest and card to match, which changes what the model computes. Pass "
                     "--expect-files-root or --expect-commit (--expect-from takes both from hub_pushes.jsonl) for "
                     "that.")
        if self.weights_anchored and self.files_anchored and not self.card_anchored:
            text += (" Not proven: that the model card (README.md: the method, the claims and every sentence) is "
                     "the publisher's: it is outside the files root, and whoever can write the repository can "
                     "rewrite it; `anchored` is false. Pass --expect-card-sha256 or --expect-commit (--expect-from "
                     "takes them from hub_pushes.jsonl) for that.")
        if self.weights_anchored and self.files_anchored and self.card_anchored and self.unpinned:
            text += (f" Not proven: that {' and '.join(self.unpinned)} are the publisher's: they are outside every "
                     "root and hash given, and whoever can write the repository can rewrite .gitattributes or add "
                     "fields to the manifest; `anchored` is false. Pass --expect-commit (--expect-from takes it "
                     "from hub_pushes.jsonl): a commit id covers every published byte.")
        return text

    def summary(self) -> str:
        if self.ok:
            return f"OK: {self.statement}"
        lines = [f"FAILED: {self.source}{f' (commit {self.commit})' if self.commit else ''} does not verify"]
        lines += [f"  tensor differs: {n}" for n in self.mismatched]
        lines += [f"  tensor missing from the weights: {n}" for n in self.missing]
        lines += [f"  tensor not in the manifest: {n}" for n in self.unexpected]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {**asdict(self), "ok": self.ok, "anchored": self.anchored, "weights_anchored": self.weights_anchored,
                "files_anchored": self.files_anchored, "unpinned": self.unpinned, "statement": self.statement}


def verify_folder(folder: str | os.PathLike, *, source: str | None = None, commit: str | None = None,
                  expect_root: str | None = None, expect_commit: str | None = None,
                  expect_files_root: str | None = None, expect_file_hashes: dict[str, str] | None = None,
                  expect_card_sha256: str | None = None, load: bool = True) -> VerifyReport:
    """Verify a downloaded (or local) repository folder (see the module docstring for what is checked).

    ``expect_files_root`` (and optionally ``expect_file_hashes``, the per-file SHA-256 it is the root of) pins
    every file but the weights, the card and the manifest to what the publisher pushed.
    ``load=False`` skips loading the model (for a model too large for this machine); the report then says so
    and is not ``ok``: loadability is part of the claim.
    """
    folder = Path(folder)
    if expect_file_hashes:
        derived = files_root(expect_file_hashes)
        if expect_files_root and derived != expect_files_root:
            raise UnlearnError(f"the expected file hashes have root {derived}, not the expected files root "
                               f"{expect_files_root}: the record is inconsistent; pass only the files root")
        expect_files_root = derived
    report = VerifyReport(source=source or str(folder), commit=commit, expect_root=expect_root or None,
                          expect_commit=expect_commit or None, expect_files_root=expect_files_root or None,
                          expect_card_sha256=expect_card_sha256 or None)
    if expect_commit and commit != expect_commit:
        report.problems.append(f"the revision is commit {commit}, not the expected commit {expect_commit}")
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        report.problems.append(f"no {MANIFEST_FILE} in the revision: nothing to verify against")
        return report
    try:
        manifest = json.loads(manifest_path.read_text())
        expected = dict(manifest["params"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        report.problems.append(f"{MANIFEST_FILE} is malformed: {e!r}")
        return report

    actual, _ = hash_safetensors(folder)
    report.checked = len(actual)
    report.mismatched = sorted(n for n in set(actual) & set(expected) if actual[n] != expected[n])
    report.missing = sorted(set(expected) - set(actual))
    report.unexpected = sorted(set(actual) - set(expected))
    report.params_root = root_hash(actual) if actual else ""
    if root_hash(expected) != manifest.get("params_root"):
        report.problems.append("the manifest's params_root is not the root of its own per-tensor hashes "
                               "(the manifest was edited)")
    present = _check_files(folder, manifest, report)
    report.files_root = files_root(present)
    if expect_files_root and report.files_root != expect_files_root:
        report.problems.append(_files_differ(present, expect_files_root, expect_file_hashes, report.files_root))

    card = folder / "README.md"
    report.card_sha256 = file_sha256(card) if card.is_file() else ""
    if expect_card_sha256 and report.card_sha256 != expect_card_sha256:
        report.problems.append(f"the model card (README.md, SHA-256 {report.card_sha256 or 'missing'}) is not the "
                               f"one pushed ({expect_card_sha256}): its method or claims may have been rewritten")
    try:
        meta = _front_matter(card.read_text(encoding="utf-8")) if card.is_file() else None
    except Exception as e:
        meta = None
        report.problems.append(f"the model card's metadata cannot be read ({type(e).__name__})")
    card_hashes = ((meta or {}).get("hf_unlearn") or {}) if isinstance(meta, dict) else {}
    if not card_hashes.get("params_root"):
        report.problems.append("the model card records no hf_unlearn.params_root")
    else:
        if card_hashes["params_root"] != report.params_root:
            report.problems.append(f"{ROOT_NAMES['params_root']} {report.params_root} of the weights differs from the card's "
                                   f"{card_hashes['params_root']}")
        if card_hashes.get("root") and card_hashes["root"] != manifest.get("root"):
            report.problems.append("the card's root differs from the manifest's root")
        for name in ("files_root", "state_dict_root"):
            if card_hashes.get(name) != manifest.get(name):
                report.problems.append(f"the card's {name} differs from the manifest's")

    if load:
        _check_loads(folder, manifest, report)
        exact = card_hashes.get("exact_deletion_params_root")
        # the trace hashes each tied tensor once under its first name (as safetensors saves it): the saved
        # tensors' root; the full state dict's root (ties listed twice) is accepted for runs hashed that way
        if exact and report.state_dict_root and exact not in (report.params_root, report.state_dict_root):
            report.problems.append(f"the card's exact-deletion root {exact} (the replayed state) is not the root "
                                   f"{report.state_dict_root} of the published weights")
    else:
        report.problems.append("loading was skipped (load=False): that the revision loads is not checked")
    if expect_root and expect_root not in (report.state_dict_root, report.params_root):
        report.problems.append(f"the weights do not hash to the expected root {expect_root} "
                               f"({ROOT_NAMES['state_dict_root']} {report.state_dict_root or 'not computed'}, "
                               f"{ROOT_NAMES['params_root']} {report.params_root})")
    return report


def _check_files(folder: Path, manifest: dict, report: VerifyReport) -> dict[str, str]:
    """Every file but the weights and the card must be in the manifest with its SHA-256, and nothing more.
    Returns the SHA-256 of each such file present."""
    listed = manifest.get("file_hashes")
    present = hashed_files(folder)
    if isinstance(listed, dict) and not any(k.startswith(METADATA_KEY) for k in listed):
        # written before the header metadata was hashed: checked as then, and the report says it is not covered
        present = {k: v for k, v in present.items() if not k.startswith(METADATA_KEY)}
        report.metadata_covered = False
    if not isinstance(listed, dict):
        report.problems.append(f"the manifest lists no file hashes (published before hf_unlearn covered files): "
                               f"{', '.join(sorted(present)) or 'no file'} cannot be checked")
        return present
    report.files_checked = len({n for n in set(present) & set(listed) if not n.startswith(METADATA_KEY)})
    for name in sorted(set(present) | set(listed)):
        if name.startswith(METADATA_KEY):
            if present.get(name) != listed.get(name):
                report.problems.append(f"the header metadata of {name[len(METADATA_KEY):]} differs from the manifest")
        elif name not in listed:
            report.problems.append(f"file not covered by the manifest: {name}")
        elif name not in present:
            report.problems.append(f"file listed in the manifest but missing: {name}")
        elif present[name] != listed[name]:
            report.problems.append(f"file differs from the manifest: {name}")
    if files_root(listed) != manifest.get("files_root"):
        report.problems.append("the manifest's files_root is not the root of its own file hashes")
    return present


def _names(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _files_differ(present: dict[str, str], expected_root: str, expected: dict[str, str] | None, actual_root: str) -> str:
    """One line: which non-weight files differ from the publisher's record (by name when it lists file hashes)."""
    head = f"the config, tokenizer and other non-weight files differ from the publisher's record (files root " \
           f"{actual_root}, expected {expected_root})"
    if not expected:
        return (f"{head}: one or more of {_names(sorted(present)) or 'no file'} is not what was pushed "
                "(the record holds only the root, so the file cannot be named)")
    changed = sorted(n for n in set(present) & set(expected) if present[n] != expected[n])
    added = sorted(set(present) - set(expected))
    gone = sorted(set(expected) - set(present))
    parts = [f"{what}: {_names(names)}" for what, names in
             (("changed", changed), ("not pushed by the publisher", added), ("missing", gone)) if names]
    return f"{head}: {'; '.join(parts)}"


def _check_loads(folder: Path, manifest: dict, report: VerifyReport) -> None:
    """Load the revision with transformers; its state dict must be exactly the hashed tensors (ties included)."""
    if not (folder / "config.json").is_file():
        report.problems.append("no config.json: the revision does not load with transformers")
        return
    try:
        model = loaded_model(folder)
    except Exception as e:
        report.problems.append(f"the revision does not load with transformers: {type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")
        return
    report.loaded = type(model).__name__
    loaded = state_hashes(model)
    report.state_dict_root = loaded.params_root
    params = manifest.get("params") or {}
    renamed = manifest.get("renamed") or {}  # saved under another name than the model holds (GPT-NeoX's embed_out):
    held = {renamed.get(n, n): n for n in params}  # their bytes are checked by the state_dict_root below
    converted = manifest.get("converted") or {}  # fused tensors saved split (MoE experts): the state_dict_root too
    for saved in converted.get("saved") or []:
        held.pop(saved, None)
    held.update({name: name for name in converted.get("held") or []})
    differ = sorted(n for n in params if n not in renamed and n in loaded.params and loaded.params[n] != params[n])
    absent = sorted(saved for name, saved in held.items() if name not in loaded.params)
    extra = sorted(set(loaded.params) - set(held) - set(manifest.get("not_saved") or []))
    if differ or absent or extra:
        report.problems.append(f"the loaded model is not the hashed tensors: differs {differ[:5]}, not loaded "
                               f"{absent[:5]}, not in the manifest {extra[:5]}")
    if manifest.get("state_dict_root") and manifest["state_dict_root"] != loaded.params_root:
        report.problems.append(f"the loaded state dict's {ROOT_NAMES['state_dict_root']} {loaded.params_root} differs "
                               f"from the manifest's {manifest['state_dict_root']}")


def expected_from(record: str | os.PathLike, repo_id: str, revision: str | None = None) -> dict[str, str]:
    """The values a revision must match, read from the publisher's own records (never from the repository).

    ``record`` is one of (or a folder holding one of, looked for in this order):

    * ``hub_pushes.jsonl`` (next to the pushed weights; in ``OUT/model`` for a ``forget`` output folder): the push of ``repo_id`` whose tag or commit is
      ``revision`` (without a revision, or for a branch name, the latest push of ``repo_id``): its state-dict
      root and commit;
    * ``deletion_log.jsonl`` (a trace run or replay output): the last request's ``params_root`` (the state the
      run ended in, which is what its model publishes);
    * ``verification.json`` (a replay checked by ``trace verify``): the replay's parameter root, only under the seal
      ``trace verify`` put on it for this replay (checked with the replay's run key, which must be on this machine).

    Returns ``{"expect_root": ..., "expect_commit": ..., "expect_files_root": ..., "expect_file_hashes": ...,
    "expect_card_sha256": ...}``: the commit, the files root (config, tokenizer and every other non-weight file),
    the per-file hashes and the card's SHA-256 only from ``hub_pushes.jsonl``, each where the push recorded it
    (older records lack the file hashes and the card's hash).
    """
    path = Path(record)
    if path.is_dir():
        names = (PUSH_LOG_FILE, f"model/{PUSH_LOG_FILE}", "deletion_log.jsonl", "verification.json")  # model/: forget's OUT
        found = [path / n for n in names if (path / n).is_file()]
        if not found:
            raise UnlearnError(f"{path} holds no {PUSH_LOG_FILE}, deletion_log.jsonl or verification.json to take "
                               "the expected root from")
        path = found[0]
    if not path.is_file():
        raise UnlearnError(f"{record} does not exist (pass OUT/{PUSH_LOG_FILE}, a run's deletion_log.jsonl or a "
                           "replay's verification.json, or the folder holding it)")
    try:
        text = path.read_text(encoding="utf-8")
        entries = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
            else [json.loads(text)]
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnlearnError(f"{path} is not valid JSON ({e})") from None
    if not entries or not all(isinstance(e, dict) for e in entries):
        raise UnlearnError(f"{path} records nothing to verify against")
    if path.name == PUSH_LOG_FILE:
        pushes = [e for e in entries if e.get("repo_id") == repo_id]
        if not pushes:
            raise UnlearnError(f"{path} records no push of {repo_id} (it has {sorted({str(e.get('repo_id')) for e in entries})})")
        chosen = [e for e in pushes if revision in (e.get("tag"), e.get("commit"))] if revision else []
        entry = (chosen or pushes)[-1]
        if revision and not chosen and (revision.startswith("deletion-") or re.fullmatch(r"[0-9a-f]{40}", revision)):
            raise UnlearnError(f"{path} records no push of {repo_id} tagged or committed as {revision!r}")
        root, commit = entry.get("state_dict_root") or entry.get("params_root"), entry.get("commit")
        if not (isinstance(root, str) and isinstance(commit, str)):
            raise UnlearnError(f"{path}: the push of {repo_id} records no root or commit")
        out = {"expect_root": root, "expect_commit": commit}
        fr, hashes = entry.get("files_root"), entry.get("file_hashes")
        if fr is not None and not (isinstance(fr, str) and re.fullmatch(r"[0-9a-f]{64}", fr)):
            raise UnlearnError(f"{path}: the push of {repo_id} records a malformed files_root {str(fr)[:80]!r}")
        if fr:
            out["expect_files_root"] = fr
        card = entry.get("card_sha256")
        if card is not None and not (isinstance(card, str) and re.fullmatch(r"[0-9a-f]{64}", card)):
            raise UnlearnError(f"{path}: the push of {repo_id} records a malformed card_sha256 {str(card)[:80]!r}")
        if card:
            out["expect_card_sha256"] = card
        if hashes is not None:
            if not (fr and isinstance(hashes, dict) and all(isinstance(v, str) for v in hashes.values())
                    and files_root(hashes) == fr):
                raise UnlearnError(f"{path}: the push of {repo_id} records file hashes that are not those of its "
                                   "files_root (the record was edited); restore it from a backup")
            out["expect_file_hashes"] = dict(hashes)
        return out
    if path.name == "verification.json":
        require_sealed_verdict(path.parent, f"{path}: not taking the expected root from it")
        try:
            root = entries[0]["roots"]["a"]["params"]
        except (KeyError, TypeError):
            raise UnlearnError(f"{path} is not a replay verification record (no roots.a.params)") from None
        return {"expect_root": _published_root(path, root)}
    root = entries[-1].get("params_root")
    if not isinstance(root, str) or not re.fullmatch(r"[0-9a-f]{64}", root):
        raise UnlearnError(f"{path}: its last entry records no params_root")
    return {"expect_root": _published_root(path, root)}


def _published_root(path: Path, root: str) -> str:
    """The root of the model a run publishes, given the root its ``path`` (deletion log, verification record)
    records for its final state. A LoRA (PEFT) run records its replayed state (adapter and base), but publishes the
    adapter merged into its base (``forget``'s ``OUT/model``): that root is recomputed here from the run's final
    checkpoint, as ``forget`` merged it (the recorded numeric stack), once the checkpoint is the recorded state."""
    folder = path.parent
    try:
        header = json.loads((folder / "header.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return root
    if not (header.get("model") or {}).get("peft"):
        return root
    from ..trace.lineage import open_quietly, output_checkpoint, output_root

    run = open_quietly(folder)
    final = json.loads((output_checkpoint(run) / "hashes.json").read_text())["params_root"]
    if final != root:
        raise UnlearnError(f"{path} records the state {root[:12]}..., not the final state of the LoRA run {folder} "
                           f"({final[:12]}...), and a LoRA run publishes its merged state: pass the forget output's "
                           f"OUT/model (its {PUSH_LOG_FILE}) instead")
    return output_root(run)


def verify_on_hub(repo_id: str, revision: str | None = None, *, token: str | None = None,
                  endpoint: str | None = None, cache_dir: str | os.PathLike | None = None,
                  expect_root: str | None = None, expect_commit: str | None = None,
                  expect_files_root: str | None = None, expect_file_hashes: dict[str, str] | None = None,
                  expect_card_sha256: str | None = None, load: bool = True) -> VerifyReport:
    """Download ``repo_id`` at ``revision`` (every file) and verify it with :func:`verify_folder`.

    ``expect_root`` / ``expect_files_root`` / ``expect_commit`` come from the publisher's own records
    (``PushResult.state_dict_root``, ``.files_root`` and ``.commit``, the local ``hub_pushes.jsonl`` via
    :func:`expected_from`, a run's deletion log), never from the repository itself. ``expect_root`` alone pins the
    weights only (see :attr:`VerifyReport.anchored`). Without ``revision``, ``expect_commit`` is the revision
    downloaded.
    """
    from huggingface_hub import snapshot_download

    revision = revision or expect_commit or None
    label = f"{repo_id}{'@' + revision if revision else ''}"
    try:
        folder = snapshot_download(repo_id, revision=revision, token=token, endpoint=endpoint, cache_dir=cache_dir)
    except Exception as e:
        raise hub_error(e, f"cannot download {label}") from None
    commit = Path(folder).name if len(Path(folder).name) == 40 else None
    if not any(Path(folder).glob("*.safetensors")):
        raise UnlearnError(f"{label} holds no safetensors weights")
    return verify_folder(folder, source=label, commit=commit, expect_root=expect_root, expect_commit=expect_commit,
                         expect_files_root=expect_files_root, expect_file_hashes=expect_file_hashes,
                         expect_card_sha256=expect_card_sha256, load=load)

