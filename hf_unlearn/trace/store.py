"""The token store a run read (Arrow, via ``datasets``) and its physical redaction.

The recorder saves exactly the rows the dataloader served (after unused columns were removed), so a replay can
rebuild every microbatch. Redaction writes a *new* store holding only the retained rows (fresh Arrow files, no
shared file, no indices mapping over the old data) and a receipt that says how the absence of the deleted rows
was checked.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from ..errors import UnlearnError
from .tags import tag

RECEIPT_NAME = "redaction_receipt.json"


def arrow_files(store: str | Path) -> list[Path]:
    return sorted(Path(store).glob("*.arrow"))


def store_sha256(store: str | Path) -> str:
    """SHA-256 over the store's Arrow files (names and bytes), the store's content fingerprint."""
    h = hashlib.sha256()
    for f in arrow_files(store):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def save_store(dataset, path: str | Path) -> str:
    """Save ``dataset`` as a fresh store; returns its fingerprint."""
    path = Path(path)
    dataset.save_to_disk(str(path))
    return store_sha256(path)


def load_store(path: str | Path):
    from datasets import load_from_disk

    path = Path(path)
    if not (path / "dataset_info.json").exists() and not (path / "state.json").exists():
        raise UnlearnError(f"{path} is not a token store (no datasets state.json); pass the folder `trace redact` wrote")
    return load_from_disk(str(path), keep_in_memory=False)


def id_index(store, id_column: str = "id") -> dict:
    """Raw id -> row index; ids must be unique."""
    if id_column not in store.column_names:
        raise UnlearnError(f"the store has no {id_column!r} column (columns: {store.column_names})")
    ids = store[id_column]
    index = {i: n for n, i in enumerate(ids)}
    if len(index) != len(ids):
        seen, dup = set(), []
        for i in ids:
            if i in seen:
                dup.append(i)
            seen.add(i)
        raise UnlearnError(f"ids in column {id_column!r} are not unique (e.g. {dup[:5]}); every row needs its own id")
    return index


def _row_digest(row: dict, id_column: str) -> str:
    body = {k: v for k, v in row.items() if k != id_column}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def redact_store(source: str | Path, forget_ids, out: str | Path, key: bytes, id_column: str = "id") -> dict:
    """Write a new store at ``out`` without the rows whose id is in ``forget_ids``; return the receipt.

    Unknown ids are an error (listed). The new store is read back and scanned: no deleted id in the id
    column, and no retained row whose content (every column but the id) equals a deleted row's. The receipt
    carries keyed tags of the deleted ids, never raw ids.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UnlearnError(f"{out} exists and is not empty; choose a new folder for the redacted store")
    store = load_store(source)
    index = id_index(store, id_column)
    forget = list(dict.fromkeys(forget_ids))
    unknown = [i for i in forget if i not in index]
    if unknown:
        raise UnlearnError(f"{len(unknown)} id(s) to forget are not in the store: {unknown[:20]}"
                           f"{' ...' if len(unknown) > 20 else ''}; check the forget list")
    drop = {index[i] for i in forget}
    keep = [n for n in range(len(store)) if n not in drop]
    deleted_digests = {_row_digest(store[n], id_column) for n in sorted(drop)}
    redacted = store.select(keep, keep_in_memory=True).flatten_indices(keep_in_memory=True)
    fingerprint = save_store(redacted, out)

    # Read back what was written, as a stranger would, and check.
    written = load_store(out)
    forget_set = set(forget)
    present = [i for i in written[id_column] if i in forget_set]
    content_matches = sum(_row_digest(r, id_column) in deleted_digests for r in written)
    src_files = {f.resolve() for f in arrow_files(source)}
    shared_files = [f.name for f in arrow_files(out) if f.resolve() in src_files]
    if present or shared_files:
        raise UnlearnError(f"redaction check failed: {len(present)} deleted id(s) still present, shared files {shared_files}")
    receipt = {
        "format": "hf_unlearn.redaction_receipt.v1",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "source_store_sha256": store_sha256(source),
        "store_sha256": fingerprint,
        "rows_before": len(store),
        "rows_after": len(written),
        "deleted": len(forget),
        "deleted_tags": sorted(tag(key, i) for i in forget),
        "checks": {
            "id_column_scanned": f"all {len(written)} rows of the new store read back; 0 of {len(forget)} deleted ids present",
            "content_scanned": f"{content_matches} retained row(s) have the same content (all columns but the id) "
                               "as a deleted row" + (" (duplicates in the source data)" if content_matches else ""),
            "fresh_files": "the new store's Arrow files were written from scratch: no file shared with the source, "
                           "no indices mapping over the source data",
        },
        "content_duplicates": content_matches,
    }
    from ..utils import atomic_write_text

    atomic_write_text(out / RECEIPT_NAME, json.dumps(receipt, indent=1))
    return receipt
