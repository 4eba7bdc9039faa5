"""Verify a published revision: download it, recompute every tensor's state hash, compare with manifest and card.

The check is per tensor, so a failure names the tensors that differ; the roots close the loop: the recomputed
parameters root must equal the manifest's and the one in the card's metadata, so neither the weights, nor the
manifest, nor the card can be changed alone without ``verify`` failing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnlearnError
from .publish import MANIFEST_FILE, hash_safetensors


@dataclass
class VerifyReport:
    """The outcome of a verification; ``ok`` iff every tensor and every root matches."""

    source: str
    commit: str | None = None
    checked: int = 0
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    params_root: str = ""

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.missing or self.unexpected or self.problems)

    def summary(self) -> str:
        if self.ok:
            return (f"OK: {self.checked} tensors of {self.source}{f' (commit {self.commit})' if self.commit else ''} match "
                    f"the manifest and the card (parameters root {self.params_root})")
        lines = [f"FAILED: {self.source}{f' (commit {self.commit})' if self.commit else ''} does not match its manifest/card"]
        lines += [f"  tensor differs: {n}" for n in self.mismatched]
        lines += [f"  tensor missing from the weights: {n}" for n in self.missing]
        lines += [f"  tensor not in the manifest: {n}" for n in self.unexpected]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)


def verify_folder(folder: str | os.PathLike, *, source: str | None = None, commit: str | None = None) -> VerifyReport:
    """Verify a downloaded (or local) repository folder: safetensors files + ``state_hashes.json`` + ``README.md``."""
    from ..trace.hashing import root_hash
    from .server import _front_matter

    folder = Path(folder)
    report = VerifyReport(source=source or str(folder), commit=commit)
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        report.problems.append(f"no {MANIFEST_FILE} in the revision: nothing to verify against")
        return report
    try:
        manifest = json.loads(manifest_path.read_text())
        expected = dict(manifest["params"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
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
    card = folder / "README.md"
    meta = _front_matter(card.read_text(encoding="utf-8")) if card.is_file() else None
    card_hashes = (meta or {}).get("hf_unlearn") or {} if isinstance(meta, dict) else {}
    if not card_hashes.get("params_root"):
        report.problems.append("the model card records no hf_unlearn.params_root")
    else:
        if card_hashes["params_root"] != report.params_root:
            report.problems.append(f"parameters root {report.params_root} of the weights differs from the card's "
                                   f"{card_hashes['params_root']}")
        if card_hashes.get("root") and card_hashes["root"] != manifest.get("root"):
            report.problems.append("the card's root differs from the manifest's root")
    return report


def verify_on_hub(repo_id: str, revision: str | None = None, *, token: str | None = None,
                  endpoint: str | None = None, cache_dir: str | os.PathLike | None = None) -> VerifyReport:
    """Download ``repo_id`` at ``revision`` (weights, manifest, card) and verify it with :func:`verify_folder`."""
    from huggingface_hub import snapshot_download

    from .publish import hub_error

    try:
        folder = snapshot_download(repo_id, revision=revision, token=token, endpoint=endpoint, cache_dir=cache_dir,
                                   allow_patterns=["*.safetensors", MANIFEST_FILE, "README.md"])
    except Exception as e:
        raise hub_error(e, f"cannot download {repo_id}{'@' + revision if revision else ''}") from None
    commit = Path(folder).name if len(Path(folder).name) == 40 else None
    if not any(Path(folder).glob("*.safetensors")):
        raise UnlearnError(f"{repo_id}{'@' + revision if revision else ''} holds no safetensors weights")
    return verify_folder(folder, source=f"{repo_id}{'@' + revision if revision else ''}", commit=commit)
