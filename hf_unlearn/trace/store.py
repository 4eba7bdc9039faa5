"""The token store a run read (Arrow, via ``datasets``) and its physical redaction.

The recorder saves exactly the rows the dataloader served (after unused columns were removed), so a replay can
rebuild every microbatch. Redaction writes a *new* store holding only the retained rows (fresh Arrow files, no
shared file, no indices mapping over the old data) and a receipt that says how the absence of the deleted rows
was checked. The receipt binds the new store to its source: it names the source's fingerprint (which the run's
header records) and the new store's, and carries an HMAC under the run's key, so a replay accepts a store only if
it was redacted from this run, for this request, and not changed since (:func:`check_store_binding`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from pathlib import Path

from ..errors import UnlearnError
from ..utils import atomic_write_text, owner_only
from .packing import PACKED_IDS, document_ids, redact_packed_rows, save_store_info
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
    if not path.exists():
        raise UnlearnError(f"the token store {path} is missing (moved or deleted); pass the store with --store / "
                           "store=, or restore it")
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


def receipt_mac(key: bytes, receipt: dict) -> str:
    """HMAC-SHA256 under the run's key over the receipt's content (everything but the ``mac`` field)."""
    body = json.dumps({k: v for k, v in receipt.items() if k != "mac"}, sort_keys=True).encode()
    return hmac.new(key, b"hf_unlearn.redaction_receipt\0" + body, hashlib.sha256).hexdigest()


def read_receipt(store: str | Path) -> dict | None:
    f = Path(store) / RECEIPT_NAME
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError:
        raise UnlearnError(f"{f} is not valid JSON: the redaction receipt is damaged") from None


def check_store_binding(store: str | Path, run_store_sha256: str | None, key: bytes,
                        forget_tags: set[str] | None) -> str:
    """Refuse a store that is not the run's own store or a redaction of it for exactly ``forget_tags``.

    Returns ``"original"`` (the store's fingerprint is the one in the run's header) or ``"redacted"`` (its receipt
    verifies under the run's key, its source is the run's store, its own fingerprint is the receipt's, and it
    deleted exactly ``forget_tags``). Checked before any compute; the store's content is hashed once.
    """
    store = Path(store)
    actual = store_sha256(store)
    if run_store_sha256 and actual == run_store_sha256:
        return "original"
    receipt = read_receipt(store)
    if receipt is None:
        raise UnlearnError(f"the store {store} is neither the run's own store (its fingerprint differs from the one in "
                           "the run's header) nor a redaction of it (no redaction_receipt.json); use the folder "
                           "`hf-unlearn trace redact` wrote for this run")
    if not hmac.compare_digest(str(receipt.get("mac", "")), receipt_mac(key, receipt)):
        raise UnlearnError(f"{store / RECEIPT_NAME} does not verify under this run's key: it was written for another run "
                           "or edited after redaction; redact again from this run's store")
    if receipt.get("source_store_sha256") != run_store_sha256:
        raise UnlearnError(f"the store {store} was redacted from another store (source fingerprint "
                           f"{str(receipt.get('source_store_sha256'))[:16]}..., this run's store is "
                           f"{str(run_store_sha256)[:16]}...); redact from this run's store")
    if receipt.get("store_sha256") != actual:
        raise UnlearnError(f"the store {store} was changed after redaction: its fingerprint {actual[:16]}... is not the "
                           f"receipt's {str(receipt.get('store_sha256'))[:16]}...; redact again")
    if forget_tags is not None and set(receipt.get("deleted_tags", [])) != set(forget_tags):
        deleted = set(receipt.get("deleted_tags", []))
        raise UnlearnError(f"the store {store} was redacted for another deletion request ({len(deleted)} id(s), "
                           f"{len(deleted & set(forget_tags))} of them in this request of {len(forget_tags)}); "
                           "redact with the same forget list")
    return "redacted"


def redact_store(source: str | Path, forget_ids, out: str | Path, key: bytes, id_column: str = "id",
                 already_deleted=()) -> dict:
    """Write a new store at ``out`` without the rows whose id is in ``forget_ids``; return the receipt.

    Unknown ids are an error (listed), except those in ``already_deleted`` (ids an earlier request removed: the
    run's deletion log has them; see :func:`hf_unlearn.trace.replay.already_deleted`). The new store is read back
    and scanned: no deleted id in the id column, and no retained row whose content (every column but the id)
    equals a deleted row's. The receipt carries keyed tags of the deleted ids, never raw ids. On any failure
    ``out`` is removed.
    """
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UnlearnError(f"{out} exists and is not empty; choose a new folder for the redacted store")
    store = load_store(source)
    id_index(store, id_column)
    packed = PACKED_IDS in store.column_names  # rows of several documents (SFTConfig(packing=True))
    index = {i: n for n, i in enumerate(document_ids(store, id_column))}
    forget = list(dict.fromkeys(forget_ids))
    if not forget:
        raise UnlearnError("the forget list is empty")
    from ..data.ids import check_id_types

    check_id_types(forget, list(index)[:1], what="the store")
    absent_ok = set(already_deleted)
    unknown = [i for i in forget if i not in index and i not in absent_ok]
    if unknown:
        raise UnlearnError(f"{len(unknown)} id(s) to forget are not in the store: {unknown[:20]}"
                           f"{' ...' if len(unknown) > 20 else ''}; check the forget list")
    packing = None
    if packed:
        redacted, replaced, touched, dummy = redact_packed_rows(store, forget, id_column, Path(source))
        drop, deleted_digests = set(), set()
        packing = {"fragments_replaced": replaced, "packed_rows_touched": touched, "dummy_token_id": dummy}
    else:
        drop = {index[i] for i in forget if i in index}
        keep = [n for n in range(len(store)) if n not in drop]
        deleted_digests = {_row_digest(store[n], id_column) for n in sorted(drop)}
        redacted = store.select(keep, keep_in_memory=True).flatten_indices(keep_in_memory=True)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    owner_only(out)  # a token store is private wherever it lives: the raw ids and token ids of every kept row
    try:
        receipt = _write_and_check(store, redacted, source, out, forget, deleted_digests, key, id_column, packing)
    except BaseException:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        raise
    receipt["already_absent"] = len([i for i in forget if i not in index]) if packing else len(forget) - len(drop)
    receipt["mac"] = receipt_mac(key, receipt)
    atomic_write_text(out / RECEIPT_NAME, json.dumps(receipt, indent=1))
    owner_only(out)
    return receipt


def _write_and_check(store, redacted, source, out: Path, forget: list, deleted_digests: set, key: bytes,
                     id_column: str, packing: dict | None = None) -> dict:
    fingerprint = save_store(redacted, out)
    if packing:
        save_store_info(out, packing["dummy_token_id"])

    # Read back what was written, as a stranger would, and check.
    written = load_store(out)
    forget_set = set(forget)
    present = [i for i in [*written[id_column], *document_ids(written, id_column)] if i in forget_set]
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
        "deleted": len(forget),  # ids of the request (rows removed: rows_before - rows_after)
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
    if packing:  # packed rows stay: the deleted documents' fragments hold dummy tokens now
        receipt["checks"]["id_column_scanned"] = (f"all {len(written)} packed rows of the new store read back (row ids "
                                                  f"and document ids); 0 of {len(forget)} deleted ids present")
        receipt["checks"]["content_scanned"] = (
            f"{packing['fragments_replaced']} fragment(s) of the deleted documents in {packing['packed_rows_touched']} "
            f"packed row(s) replaced by dummy token {packing['dummy_token_id']} (labels ignored), lengths and "
            "position ids unchanged")
        receipt["packing"] = {k: v for k, v in packing.items() if k != "dummy_token_id"}
    return receipt
