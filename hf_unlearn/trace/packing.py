"""Exact deletion with ``SFTConfig(packing=True)``: which documents each packed row holds, and where.

TRL's best-fit-decreasing packer (``packing_strategy="bfd"`` or ``"bfd_split"``) concatenates several tokenised rows
(documents) into one training row and gives each document its own position ids (``seq_lengths``; the padding-free
collator then keeps documents from attending to each other). It drops every column but ``input_ids`` and
``labels``, so the recorder packs with one more per-token column, the source row's index, which the packer cuts and
concatenates exactly like ``input_ids``; each packed row then knows the document of every fragment (``bfd_split``
cuts a long document into fragments that may sit in several packed rows).

What the run keeps:

* the store's packed rows carry ``packed_ids``: the raw id of each fragment's document (private, like the store);
* ``packing.json`` (public, keyed tags only): per packed row, its fragments as ``[document tag, start, length]``;
  its SHA-256 is in the header's ``dataset.packing``, under the run's keyed seal, so an edited map is refused.

A deleted document's fragments become dummy tokens of the same length at the same positions, every label ignored,
``seq_lengths`` (so every position id) unchanged: the other documents' computation is untouched and the deleted
one has weight 0. The redacted store holds the dummies in place of its tokens (:func:`redact_packed_rows`); the
oracle puts the same dummies into the original rows.

Refused (:func:`packing_refusal`): ``packing_strategy="wrapped"``, which cuts documents at row boundaries and lets
the pieces attend to each other, so "the run without document X" is not defined.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from ..errors import UnlearnError
from ..utils import atomic_write_bytes, atomic_write_text
from .tags import tag

PACKED_IDS = "packed_ids"  # store column: the raw id of each fragment's document (None once deleted)
MAP_FILE = "packing.json"  # public map: per packed row, [document tag, start, length] of each fragment
STORE_INFO = "packing.json"  # inside the store folder: what redaction needs (the dummy token)
ROW_PREFIX = "hf_unlearn.packed:"  # packed rows' own ids (the plan's slots), never a user's id
_DOC = "_hf_unlearn_document"  # the per-token source-row column the packer carries
SUPPORTED = ("bfd", "bfd_split")
IGNORE_INDEX = -100


def packing_refusal(args) -> str | None:
    """Why a run with these ``SFTConfig`` settings cannot be recorded for exact deletion (None: it can)."""
    if not getattr(args, "packing", False):
        return None
    strategy = getattr(args, "packing_strategy", None)
    if strategy in SUPPORTED:
        return None
    if strategy == "wrapped":
        return ("packing_strategy='wrapped' cuts documents at packed-row boundaries and lets the pieces attend to "
                "each other, so 'the run without document X' is not defined; use packing_strategy='bfd' (or "
                "'bfd_split'), which keeps documents apart with position ids")
    return f"packing_strategy={strategy!r} is not one of {SUPPORTED}; use packing_strategy='bfd'"


def is_packed(header: dict) -> bool:
    return bool((header.get("dataset") or {}).get("packing"))


def pack_with_documents(prepare, dataset, processing_class, args, formatting_func, dataset_name, id_column: str):
    """SFTTrainer's packed dataset, with ``id_column`` the packed rows' own ids and :data:`PACKED_IDS` the documents.

    ``prepare`` is SFTTrainer's own ``_prepare_dataset``; it runs unpacked and untruncated (packing truncates or
    splits), then the steps it runs when packing are run here with the source-row column added to what is packed:
    the same ``pack_dataset``, the same shuffles, so the packed ``input_ids``/``labels``/``seq_lengths`` are the ones
    SFTTrainer would train on.
    """
    from trl.data_utils import pack_dataset

    if id_column not in dataset.column_names:
        raise UnlearnError(f"train_dataset has no {id_column!r} column: every document needs its stable sample id")
    unpacked = copy.copy(args)
    unpacked.max_length, unpacked.shuffle_dataset = None, False
    rows = prepare(dataset, processing_class, unpacked, False, formatting_func, dataset_name)
    ids = rows[id_column]
    clash = [i for i in ids if isinstance(i, str) and i.startswith(ROW_PREFIX)]
    if clash:
        raise UnlearnError(f"id {clash[0]!r} starts with {ROW_PREFIX!r}, which names packed rows; rename it")
    map_kwargs = {"num_proc": args.dataset_num_proc}
    rows = rows.map(lambda r, n: {_DOC: [n] * len(r["input_ids"])}, with_indices=True, **map_kwargs)
    rows = rows.select_columns(["input_ids", "labels", _DOC])
    if args.shuffle_dataset:
        rows = rows.shuffle(seed=args.seed)
    packed = pack_dataset(rows, args.max_length, args.packing_strategy, map_kwargs)

    def name_documents(row, n):
        docs, start = [], 0
        for length in row["seq_lengths"]:
            source = set(row[_DOC][start:start + length])
            if len(source) != 1:  # the packer's fragments and the source column disagree: never train on it
                raise UnlearnError(f"packed row {n}: a fragment of {length} tokens mixes source rows {sorted(source)}")
            docs.append(ids[source.pop()])
            start += length
        return {id_column: f"{ROW_PREFIX}{n}", PACKED_IDS: docs}

    packed = packed.map(name_documents, with_indices=True, remove_columns=[_DOC])
    if args.shuffle_dataset:
        packed = packed.shuffle(seed=args.seed)
    return packed


def document_ids(store, id_column: str) -> list:
    """The ids a deletion request names: the documents of a packed store, else the store's id column."""
    if PACKED_IDS not in store.column_names:
        return list(store[id_column])
    return [i for docs in store[PACKED_IDS] for i in docs if i is not None]


def fragments(row: dict) -> list[tuple[int, int]]:
    """``(start, length)`` of each fragment of a packed row, from its ``seq_lengths``."""
    out, start = [], 0
    for length in row["seq_lengths"]:
        out.append((start, length))
        start += length
    return out


def document_map(store, key: bytes, id_column: str) -> list:
    """The public map: ``[[row tag, [[document tag or None, start, length], ...]], ...]`` in store order."""
    out = []
    for row_id, docs, lengths in zip(store[id_column], store[PACKED_IDS], store["seq_lengths"]):
        frags = fragments({"seq_lengths": lengths})
        out.append([tag(key, row_id), [[None if d is None else tag(key, d), s, n] for d, (s, n) in zip(docs, frags)]])
    return out


def write_map(run: Path, entries: list) -> dict:
    """Write ``packing.json`` into ``run``; returns the header's ``dataset.packing`` fields for it."""
    body = json.dumps(entries, separators=(",", ":")).encode()
    atomic_write_bytes(Path(run) / MAP_FILE, body)
    return {"map": MAP_FILE, "map_sha256": hashlib.sha256(body).hexdigest()}


def _map_bytes(path, header: dict) -> bytes:
    info = header["dataset"]["packing"]
    f = Path(path) / info.get("map", MAP_FILE)
    try:
        body = f.read_bytes()
    except OSError:
        raise UnlearnError(f"{path} is a packed run without its document map {f.name}; refusing") from None
    if hashlib.sha256(body).hexdigest() != info.get("map_sha256"):
        raise UnlearnError(f"{f} is not the document map the run sealed (its SHA-256 differs from the header's): "
                           "which packed rows and spans hold which documents cannot be trusted; refusing")
    return body


def load_map(run) -> dict:
    """Row tag -> ``[[document tag or None, start, length], ...]`` of a packed run, checked against the sealed header."""
    return {row: frags for row, frags in json.loads(_map_bytes(run.path, run.header))}


def map_status(path, header: dict) -> str:
    """What ``trace inspect`` says about a packed run's document map."""
    try:
        _map_bytes(path, header)
    except UnlearnError as e:
        return f"DOCUMENT MAP REFUSED: {e}"
    return f"document map {MAP_FILE} matches the sealed header"


def document_tags(doc_map: dict) -> set[str]:
    return {d for frags in doc_map.values() for d, _, _ in frags if d is not None}


def deleted_spans(doc_map: dict, doc_tags: set[str]) -> dict[str, list[int]]:
    """Row tag -> indices of the fragments to replace by dummies (the deleted documents' and those deleted before)."""
    out = {}
    for row, frags in doc_map.items():
        hit = [k for k, (d, _, _) in enumerate(frags) if d is None or d in doc_tags]
        if any(frags[k][0] is not None for k in hit):
            out[row] = hit
    return out


def emptied_rows(doc_map: dict, doc_tags: set[str]) -> set[str]:
    """Rows all of whose fragments are deleted (now or by an earlier request): no weight left (a microbatch of only
    those takes no step)."""
    return {row for row, frags in doc_map.items() if all(d is None or d in doc_tags for d, _, _ in frags)}


def with_dummies(row: dict, hit: list[int], dummy_token_id: int) -> dict:
    """``row`` with fragments ``hit`` replaced by dummy tokens (label ignored); lengths and position ids unchanged."""
    row = dict(with_labels_ignored(row, hit), input_ids=list(row["input_ids"]))
    frags = fragments(row)
    for k in hit:
        start, length = frags[k]
        row["input_ids"][start:start + length] = [dummy_token_id] * length
    return row


def with_labels_ignored(row: dict, hit: list[int]) -> dict:
    """``row`` with fragments ``hit`` kept but without weight (their labels ignored, their document ids dropped as
    :func:`with_dummies` drops them): a deleted document as the counterfactual trains it (the oracle's)."""
    row = dict(row, labels=list(row["labels"]))
    if PACKED_IDS in row:
        row[PACKED_IDS] = list(row[PACKED_IDS])
    frags = fragments(row)
    for k in hit:
        start, length = frags[k]
        row["labels"][start:start + length] = [IGNORE_INDEX] * length
        if PACKED_IDS in row:
            row[PACKED_IDS][k] = None
    return row


def check_redacted_row(row: dict, hit: list[int], frags: list, dummy_token_id: int, where: str) -> None:
    """A redacted store's packed row must have the map's fragments and hold only dummies where documents were
    deleted (nothing smuggled back)."""
    if [[s, n] for s, n in fragments(row)] != [[s, n] for _, s, n in frags]:
        raise UnlearnError(f"{where}: its fragments are not the ones the run's document map records")
    expected = with_dummies(row, hit, dummy_token_id)
    docs = row.get(PACKED_IDS) or [None] * len(frags)
    if expected["input_ids"] != list(row["input_ids"]) or expected["labels"] != list(row["labels"]) \
            or any(docs[k] is not None for k in hit):
        raise UnlearnError(f"{where} still holds tokens, labels or the id of a deleted document where the redacted "
                           "store must hold dummy tokens; redact again (hf-unlearn trace redact)")


def save_store_info(store: Path, dummy_token_id: int) -> None:
    atomic_write_text(Path(store) / STORE_INFO, json.dumps({"dummy_token_id": dummy_token_id}))


def redact_packed_rows(store, forget: list, id_column: str, store_dir: Path):
    """The packed store with ``forget``'s fragments replaced by dummies: ``(new dataset, fragments replaced, rows
    touched)``. Rows stay (other documents train on), none is dropped."""
    info = Path(store_dir) / STORE_INFO
    try:
        dummy = int(json.loads(info.read_text())["dummy_token_id"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UnlearnError(f"{store_dir} is a packed store without its {STORE_INFO} (the dummy token): it is not a "
                           "store a recording wrote") from None
    gone = set(forget)
    hits = {n: [k for k, d in enumerate(docs) if d in gone] for n, docs in enumerate(store[PACKED_IDS])}
    hits = {n: k for n, k in hits.items() if k}
    replaced = sum(len(k) for k in hits.values())

    def redact(row, n):
        return with_dummies(row, hits[n], dummy) if n in hits else row

    out = store.map(redact, with_indices=True, keep_in_memory=True)
    return out, replaced, len(hits), dummy
