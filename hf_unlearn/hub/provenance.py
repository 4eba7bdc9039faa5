"""``--trace`` provenance: an allowlist of the files the trace code writes, each checked against its schema.

Published from a recorded run (or a replay's output, which is a run too): ``header.json``, ``plan.bin`` (or
a run's older ``plan.jsonl``), ``wal.bin``, ``manifest.bin`` (or, compacted, the one ``provenance.bin``), ``deletion_log.jsonl``, ``verification.json``, their ``.sha256`` sidecars and the
run's ``model/config.json``. Nothing else leaves: not ``private/`` (the key, the token store), not checkpoints, and
not whatever else happens to sit in the folder (a ``forget.json`` of raw ids): those are listed as kept local.

Every allowlisted file is checked before anything is sent: plan lines hold keyed tags only (16 hex digits or
null) in the fields of :class:`hf_unlearn.trace.plan.PlanEntry`; ``plan.bin`` is whole frames with valid CRCs that
decode (it holds no ids: the manifest has the tags; its free texts are scanned); the WAL is whole 32-byte records with valid CRCs
and the manifest whole 8-byte tags; the deletion log's tags are tags and its roots digests; sidecars are a digest
and a name; ``verification.json`` must carry the seal ``trace verify`` put on it for this replay (its verdict is a
claim). The trace code writes no path of the user's machine into these files (a path field holds
``<local path>``, a parent run and an oracle are named by their run ids); every text the user could have chosen
(a run name, a Hub id, unknown fields, and the paths and folder names that older runs recorded) is scanned for the
forget ids; numbers that the schema says are configuration (hidden sizes, steps, seeds, token ids such as
``pad_token_id``) are not ids and are not matched. A file that fails refuses the whole push, naming file and field.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

from ..errors import UnlearnError
from ..trace.compact import CompactError, texts
from ..trace.plan import PlanEntry, read_compact_plan
from ..trace.run import FORMAT, HEADER_KEYS, file_sha256
from ..trace.tags import TAG_BYTES
from ..trace.trainers import library_config_fields
from ..trace.verification import require_sealed_verdict
from ..trace.wal import RECORD_SIZE, read_wal
from .leaks import Hit, IdScanner, scan_config

PREFIX = "provenance"
_TAG = re.compile(r"^[0-9a-f]{16}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HEX = re.compile(r"^[0-9a-f]{8,64}$")
_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z$")


class SchemaError(UnlearnError):
    """An allowlisted trace file that does not hold what the trace code writes."""


def _fail(name: str, why: str):
    raise SchemaError(f"refusing to publish {PREFIX}/{name}: {why} (it is not the file the trace code wrote; "
                      "leave it out of --trace or restore it)")


def _json(path: Path, name: str):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        _fail(name, f"not valid JSON ({e.__class__.__name__})")


def _jsonl(path: Path, name: str) -> list:
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="strict").splitlines()):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                _fail(name, f"line {n + 1} is not JSON")
    return records


def _values(spec: dict, record, name: str, where: str, scanner: IdScanner) -> list[Hit]:
    """Check a JSON object against ``spec`` ({field: kind}); unknown fields are scanned fully for ids."""
    if not isinstance(record, dict):
        _fail(name, f"{where} is not a JSON object")
    field = f"{PREFIX}/{name}:"
    hits: list[Hit] = []
    for key, value in record.items():
        kind = spec.get(key)
        bad = False
        if kind is None or kind == "text":
            hits += scanner.scan(value, field + str(key))
        elif kind == "number":
            bad = value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)))
        elif kind == "bool":
            bad = not isinstance(value, bool)
        elif kind == "time":
            bad = not (isinstance(value, str) and _TIME.match(value))
        elif kind == "hex":
            bad = value not in (None, "") and not (isinstance(value, str) and _HEX.match(value))
        elif kind == "tags":
            bad = not isinstance(value, list) or not all(t is None or (isinstance(t, str) and _TAG.match(t))
                                                         for t in value)
        elif kind == "numbers":
            bad = value is not None and (not isinstance(value, list) or
                                         not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 for v in value))
        elif kind == "words":  # library-chosen words: string ids only
            hits += scanner.scan(value, field + str(key), numbers=False)
        elif isinstance(kind, dict):
            hits += _values(kind, value, name, f"{where}.{key}", scanner)
        if bad:
            _fail(name, f"{where}.{key} is not a {kind} field")
    return hits


def _plan(path: Path, name: str, scanner: IdScanner) -> list[Hit]:
    kinds = {"slots": "tags", "lens": "numbers", "group_lrs": "numbers", "end": "bool", "norm_dtype": "words",
             "extra": "text", "batch": "tags", "ranks": "numbers"}  # batch: keyed digests; ranks: slots per process
    spec = {f.name: kinds.get(f.name, "number") for f in dataclasses.fields(PlanEntry)}
    hits: list[Hit] = []
    for n, record in enumerate(_jsonl(path, name)):
        unknown = set(record) - set(spec) if isinstance(record, dict) else set()
        if unknown:
            _fail(name, f"line {n + 1} has fields a plan entry does not have: {sorted(unknown)}")
        hits += _values(spec, record, name, f"line {n + 1}", scanner)
    return hits


# parent_run / oracle: the local folder names that runs recorded before the run ids replaced them (still scanned)
_DELETION_LOG = {"time": "time", "request": "number", "mode": "words", "forget_tags": "tags", "start_step": "number",
                 "steps_replayed": "number", "params_root": "hex", "optimizer_root": "hex", "parent_run_id": "hex",
                 "parent_run": "text", "note": "words", "fidelity": "words"}  # fidelity: the library's sentence
_VERIFICATION = {"identical": "bool", "verified": "bool", "provenance_problems": "text", "oracle_run_id": "hex",
                 "run_id": "hex", "mac": "hex",
                 "oracle": "text", "params_mismatched_elements": "number",
                 "optimizer_mismatched_elements": "number", "unproven_steps": "numbers", "unproven_starts": "numbers",
                 "verdict": "words",
                 "roots": {"a": {"params": "hex", "optimizer": "hex"}, "b": {"params": "hex", "optimizer": "hex"}}}


def _plan_bin(path: Path, name: str, scanner: IdScanner) -> list[Hit]:
    try:
        scan = read_compact_plan(path)
    except UnlearnError as e:
        _fail(name, str(e))
    if scan.damaged_at is not None or scan.tail_bytes:
        _fail(name, f"segment {len(scan.segments)} (byte offset {scan.damaged_at}) {scan.damage}" if scan.damage
              else f"a torn last segment ({scan.tail_bytes} bytes)")
    hits: list[Hit] = []
    for k, seg in enumerate(scan.segments):  # the texts a scheduler or a dtype name put there
        hits += scanner.scan(seg.extra, f"{PREFIX}/{name}:segment {k}.extra")
        hits += scanner.scan(seg.norm_dtype, f"{PREFIX}/{name}:segment {k}.norm_dtype", numbers=False)
    return hits


def _provenance_bin(path: Path, name: str, scanner: IdScanner) -> list[Hit]:
    """A compacted run's plan, WAL and manifest: it must decode (xz checks, columns, sampler claims); it holds keyed
    tags and numbers only, and the free texts a scheduler or a dtype name put there are scanned."""
    try:
        found = texts(path)
    except CompactError as e:
        _fail(name, str(e))
    hits: list[Hit] = []
    for k, extra in found["extra"].items():
        hits += scanner.scan(extra, f"{PREFIX}/{name}:segment {k}.extra")
    hits += scanner.scan(found["norm_dtypes"], f"{PREFIX}/{name}:norm_dtypes", numbers=False)
    hits += scanner.scan(found["run_id"], f"{PREFIX}/{name}:run_id", numbers=False)
    return hits


def _deletion_log(path: Path, name: str, scanner: IdScanner) -> list[Hit]:
    return [h for n, r in enumerate(_jsonl(path, name)) for h in _values(_DELETION_LOG, r, name, f"line {n + 1}",
                                                                          scanner)]


def _verification(path: Path, name: str, scanner: IdScanner) -> list[Hit]:
    """The replay's verdict is a claim: published only under the seal ``trace verify`` put on it for this replay."""
    hits = _values(_VERIFICATION, _json(path, name), name, "record", scanner)
    require_sealed_verdict(path.parent, f"refusing to publish {PREFIX}/{name}")
    return hits


def _header(path: Path, name: str, scanner: IdScanner) -> list[Hit]:
    """The run's header: the configuration numbers the trace code writes are not ids; user-chosen texts (paths,
    names) are scanned, and so is everything the trace code does not write (numbers included): a key it has no
    such field for, or a TrainingArguments field of the user's own subclass."""
    from transformers import TrainingArguments

    header = _json(path, name)
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        _fail(name, f"not a run header (format {FORMAT!r})")
    field = f"{PREFIX}/{name}:"
    hits = scanner.scan(header, field.rstrip(":"), numbers=False)  # string ids anywhere, keys included
    texts = {"training_args": header.get("training_args"), "parent": header.get("parent"),
             "model.config._name_or_path": ((header.get("model") or {}).get("config") or {}).get("_name_or_path")}
    for key, value in texts.items():
        hits += scanner.scan_strings(value, field + key)
    for key, value in header.items():
        if key not in HEADER_KEYS:
            hits += scanner.scan(value, field + key)
    trainer = header.get("trainer")
    if isinstance(trainer, dict):  # the user's own constructor arguments: scanned, numbers included
        hits += scanner.scan(trainer.get("kwargs"), field + "trainer.kwargs")
    args = header.get("training_args")
    if isinstance(args, dict):
        standard = {f.name for f in dataclasses.fields(TrainingArguments)} | library_config_fields(header)
        for key, value in args.items():
            if key not in standard:
                hits += scanner.scan(value, f"{field}training_args.{key}")
    for key in ("created", "finished"):
        if header.get(key) is not None and not (isinstance(header[key], str) and _TIME.match(header[key])):
            _fail(name, f"{key} is not a time")
    return hits


def _model_config(path: Path, name: str, scanner: IdScanner) -> list[Hit]:
    data = _json(path, name)
    if not isinstance(data, dict) or "model_type" not in data:
        _fail(name, "not a model config (no model_type)")
    return scan_config(data, f"{PREFIX}/{name}", scanner)


def _wal(path: Path, name: str, scanner: IdScanner) -> list[Hit]:
    scan = read_wal(path)
    if scan.tail_bytes or scan.bad_crc:
        _fail(name, f"{'a torn record' if scan.tail_bytes else 'records with bad CRCs'} (size "
                    f"{path.stat().st_size}, records of {RECORD_SIZE} bytes)")
    return []


def _manifest(path: Path, name: str, scanner: IdScanner) -> list[Hit]:
    if path.stat().st_size % TAG_BYTES:
        _fail(name, f"its size is not a multiple of {TAG_BYTES} bytes (one tag per slot)")
    return []


CHECKERS: dict[str, Callable[[Path, str, IdScanner], list[Hit]]] = {
    "header.json": _header, "plan.bin": _plan_bin, "plan.jsonl": _plan, "wal.bin": _wal, "manifest.bin": _manifest,
    "provenance.bin": _provenance_bin,
    "deletion_log.jsonl": _deletion_log, "verification.json": _verification, "model/config.json": _model_config,
}


def _sidecar(path: Path, name: str) -> None:
    target = name.removesuffix(".sha256")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not re.fullmatch(rf"[0-9a-f]{{64}}  {re.escape(target)}\n?", text):
        _fail(name, "not a SHA-256 sidecar (a digest and the file name)")
    described = path.with_name(Path(target).name)
    if described.is_file() and text[:64] != file_sha256(described):
        _fail(name, f"its digest is not the SHA-256 of {target}")


def select_provenance(trace_dir, scanner: IdScanner) -> tuple[dict[str, Path], dict[str, str], list[Hit]]:
    """Split a trace folder into the files to publish and those kept local (with the reason); check the former.

    Returns (publish: {name: path}, kept local: {relative path: why}, id hits in the published files). A
    published file that is not what the trace code writes raises :class:`SchemaError`.
    """
    root = Path(trace_dir)
    if not root.is_dir():
        raise UnlearnError(f"trace directory {trace_dir} does not exist")
    keep: dict[str, Path] = {}
    skipped: dict[str, str] = {}
    hits: list[Hit] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink()):
        rel = path.relative_to(root).as_posix()
        base = rel.removesuffix(".sha256")
        if path.is_symlink():
            skipped[rel] = "a symbolic link (never followed)"
        elif rel.startswith("private/"):
            skipped[rel] = "private (the key and the token store never leave)"
        elif base in CHECKERS:
            if rel.endswith(".sha256"):
                _sidecar(path, rel)
            else:
                hits += CHECKERS[rel](path, rel, scanner)
            keep[rel] = path
        elif rel.startswith("checkpoints/"):
            skipped[rel] = "checkpoint (model and optimizer state stay local)"
        else:
            skipped[rel] = "not a file the trace code writes for publishing"
    for rel in [r for r in keep if r.endswith(".sha256") and r.removesuffix(".sha256") not in keep]:
        del keep[rel]  # a sidecar without its file proves nothing
    return keep, skipped, hits
