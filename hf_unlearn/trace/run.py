"""A recorded run on disk: its layout, checkpoints, sidecars, integrity check and deletion log.

```
RUN/header.json  plan.bin  wal.bin  manifest.bin  deletion_log.jsonl     (publishable: keyed tags only)
RUN/*.sha256                                                               (sidecars, written when sealed)
RUN/checkpoints/step-00000040/, frozen/, index.json                     (see hf_unlearn.trace.checkpoints)
RUN/model/config.json [adapter/]                                           (to rebuild the model)
RUN/collator/                                                              (the collator's tokenizer, if any)
RUN/private/{store/, hmac.key}   (owner-only, never published; hmac.key only in runs with their own key, see tags.run_key)
```

A checkpoint's ``hashes.json`` holds the SHA-256 of every tensor (tied tensors once) and of everything else the
checkpoint holds; it is checked against the loaded state whenever a checkpoint is used, and bound to the run by
``checkpoints/index.json`` (:mod:`hf_unlearn.trace.checkpoints`). Sidecars are plain SHA-256: they catch damage and
edits that did not also rewrite the sidecar, not an editor who rewrites both. What such an editor cannot forge
without the run key: the ids (keyed tags and WAL digests) and the controls (``plan.bin``'s chained segment MACs and
the header's ``controls_mac`` over :data:`KEYED_HEADER_KEYS`; runs recorded with a ``plan.jsonl`` have no such MACs
and are reported as having unkeyed controls).
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import UnlearnError
from ..utils import atomic_write_bytes
from .checkpoints import (  # noqa: F401 - re-exported: the checkpoint functions lived here
    capture_state,
    check_checkpoint_state,
    checkpoint_dir,
    full_model_state,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    tied_aliases,
)
from .checkpoints import check_checkpoints as checkpoint_report
from .compact_format import CompactError, CompactRun, forged_blocks, read_compact
from .files import (  # noqa: F401 - re-exported: they lived here
    BUFFERS_FILE,
    check_sidecar,
    file_sha256,
    read_header,
    write_sidecar,
)
from .packing import PACKED_IDS
from .plan import (
    COMPACT_FILE,
    PLAN_FILE,
    PlanEntry,
    canonical_controls,
    join_plan,
    plan_file,
    read_compact_plan,
    read_plan_jsonl,
    segments,
)
from .store import load_store, store_sha256
from .tags import controls_chain_start, ids_digest, record_digest, run_key, seal_mac, segment_mac, tag
from .wal import FLAG_ACCUM_END, FLAG_DUMMY, WalScan, read_manifest, read_wal

FORMAT = "hf_unlearn.trace.v2"
# Every top-level key a recording or a replay writes into header.json; the Hub's provenance check scans anything
# else (a value the trace code did not write) for forget ids, numbers included.
HEADER_KEYS = frozenset({
    "format", "run_id", "origin_run_id", "parent", "created", "finished", "sealed", "key_fingerprint", "model",
    "optimizer", "training_args", "versions", "determinism", "hazards", "notes", "dataset", "collator",
    "dummy_token_id", "checkpoint_steps", "gradient_accumulation_steps", "max_grad_norm", "world_size",
    "distributed_type", "optimizer_steps", "microbatches", "checkpoint_index", "checkpoint_retention", "fidelity",
    "kept_model", "controls_mac", "trainer", "provenance", "numeric_stack", "lineage", "reference_model", "sharding"})
SEALED_FILES = ("header.json", PLAN_FILE, "wal.bin", "manifest.bin")
PROGRESS_FILE = "progress.json"  # the last optimizer step that ran (written after each step, read after a crash)
# The header fields that decide the replayed state (or what a verdict covers): the keyed seal covers them. A field
# written after the seal must not be one of them (or the writer re-seals with :func:`controls_seal`).
KEYED_HEADER_KEYS = ("format", "run_id", "origin_run_id", "parent", "key_fingerprint", "model", "optimizer",
                     "training_args", "dataset", "collator", "dummy_token_id", "gradient_accumulation_steps",
                     "max_grad_norm", "world_size", "optimizer_steps", "microbatches", "hazards", "sealed",
                     "fidelity", "kept_model", "trainer", "checkpoint_index")
# Sealed only when present (a run sealed before them keeps its seal): ``provenance`` names a compacted run's
# provenance.bin and its SHA-256 (hf_unlearn.trace.compact), so the seal binds that file byte for byte.
# ``numeric_stack`` (hf_unlearn.trace.stack): threads, CPU capability, versions and deterministic settings.
# ``lineage`` (hf_unlearn.trace.lineage): the starting weights' root and the recorded run (or external base) they are.
# ``reference_model`` (hf_unlearn.trace.reference): a DPO run's reference (root, forward fingerprint, where it is);
# ``sharding`` (hf_unlearn.trace.sharding): the FSDP2 sharding a replay must run.
OPTIONAL_KEYED_HEADER_KEYS = ("provenance", "numeric_stack", "lineage", "reference_model", "sharding")
UNKEYED_CONTROLS = ("the run's controls are unkeyed: it was recorded with a plan.jsonl, before keyed controls, so an edit "
                    "of a seed, learning rate, step, flag or normaliser in both the plan and the WAL, with their CRCs "
                    "and sidecars rewritten, is not detected (the ids are keyed); record the run again for keyed "
                    "controls")


def controls_seal(key: bytes, last_mac: bytes, header: dict) -> str:
    """The header's ``controls_mac``: the run key over the last segment MAC and :data:`KEYED_HEADER_KEYS`."""
    fields = {k: header.get(k) for k in KEYED_HEADER_KEYS}
    fields.update({k: header[k] for k in OPTIONAL_KEYED_HEADER_KEYS if k in header})
    fields = json.loads(json.dumps(fields, default=str))
    return seal_mac(key, last_mac, json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


@dataclass
class Report:
    """What :func:`check_run` found. ``errors`` make a run unusable for replay; ``warnings`` do not."""

    summary: dict = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    hazards: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what a check does not cover (unkeyed controls)

    @property
    def ok(self) -> bool:
        return not self.errors


@dataclass
class TraceRun:
    """A recorded run, checked and loaded: header, plan (cut to whole segments), checkpoints, key."""

    path: Path
    header: dict
    plan: list[PlanEntry]
    report: Report
    served_plan: list[PlanEntry] | None = None
    _key: bytes | None = field(default=None, repr=False, compare=False)  # read once per run (a proof asked ~400 times)

    @property
    def key(self) -> bytes:
        if self._key is None:
            self._key = run_key(self.path, self.header)
        return self._key

    @property
    def store_path(self) -> Path:
        return self.path / "private" / "store"

    @property
    def id_column(self) -> str:
        return self.header["dataset"]["id_column"]

    def segments(self) -> list[list[PlanEntry]]:
        return segments(self.plan)

    @property
    def compact(self) -> bool:
        """True for a compacted run (``provenance.bin``): its plan entries carry no batch digests, the batch MACs of
        :meth:`batch_groups` check the collated batches instead."""
        return bool(self.header.get("provenance"))

    def batch_groups(self) -> list[tuple[int, int, bytes | None]]:
        """A compacted run's keyed batch MACs: ``(first microbatch, stop, MAC or None)`` (see trace.compact)."""
        return read_compact(self.path / COMPACT_FILE).batch_groups if self.compact else []

    def checkpoints(self) -> dict[int, Path]:
        return list_checkpoints(self.path)

    @property
    def total_steps(self) -> int:
        return self.plan[-1].step + 1 if self.plan else 0

    def ids_at_steps(self, steps) -> list:
        """Raw ids of the slots of the given optimizer steps (maps tags back through the store and the key; a packed
        run's documents)."""
        steps = set(steps)
        store = load_store(self.store_path)
        if PACKED_IDS in store.column_names:  # a packed run: the documents of the packed rows, in order
            docs = {tag(self.key, i): [d for d in ds if d is not None]
                    for i, ds in zip(store[self.id_column], store[PACKED_IDS])}
            return [d for e in self.plan if e.step in steps for s in e.slots if s for d in docs[s]]
        by_tag = {tag(self.key, i): i for i in store[self.id_column]}
        return [by_tag[s] for e in self.plan if e.step in steps for s in e.slots if s]

    def cut(self, end_step: int) -> TraceRun:
        """This run as if it had stopped before optimizer step ``end_step`` (its plan cut there; ``served_plan``
        keeps the whole plan, so ids served only later are known, not unknown)."""
        import dataclasses

        return dataclasses.replace(self, plan=[e for e in self.plan if e.step < end_step],
                                   served_plan=self.served_plan or self.plan)

    def kept(self) -> TraceRun:
        """The run up to the model its user kept: with ``load_best_model_at_end`` the recorded best step, a control of
        the run like its length (the header's ``kept_model``); otherwise the run itself."""
        step = (self.header.get("kept_model") or {}).get("step")
        return self.cut(step) if step is not None and step < self.total_steps else self

    def final_checkpoint(self) -> Path:
        cps = self.checkpoints()
        if self.total_steps not in cps:
            raise UnlearnError(f"{self.path} has no final checkpoint (step {self.total_steps}); "
                               "the run did not finish")
        return cps[self.total_steps]


def check_run(path: str | Path, key: bytes | None = None, check_checkpoints: bool = True,
              deep: bool = False) -> tuple[Report, dict, list]:
    """Check every file of a run: sidecars, WAL CRCs, torn tail, plan/WAL/manifest agreement, checkpoints, store.

    ``check_checkpoints`` checks each checkpoint's ``hashes.json`` against its sidecar (cheap); ``deep`` also loads
    every checkpoint and checks its state against its ``hashes.json`` (reads every checkpoint).
    Returns the report, the header, and the plan cut to the steps known to have completed.
    """
    path = Path(path)
    rep = Report()
    if not (path / "header.json").exists():
        raise UnlearnError(f"{path} is not a recorded run (no header.json); pass the trace_dir of a TraceRecordingTrainer")
    header = read_header(path)
    if header.get("format") != FORMAT:
        older = str(header.get("format", "")).startswith("hf_unlearn.trace.")
        raise UnlearnError(f"{path}/header.json has format {header.get('format')!r}, expected {FORMAT!r}"
                           + ("; it was recorded by an older hf_unlearn: record the run again" if older else ""))
    rep.hazards = list(header.get("hazards", []))
    sealed = bool(header.get("sealed"))
    compact = bool(header.get("provenance"))
    pfile = path / COMPACT_FILE if compact else plan_file(path)
    names = ("header.json", COMPACT_FILE) if compact else SEALED_FILES[:1] + (pfile.name,) + SEALED_FILES[2:]
    for name in names + ("deletion_log.jsonl",):
        f = path / name
        if not f.exists():
            if name not in ("deletion_log.jsonl",):
                rep.errors.append(f"{name} is missing")
            continue
        ok = check_sidecar(f)
        if ok is False:
            rep.errors.append(f"{name} does not match its SHA-256 sidecar ({name}.sha256): modified after the run was sealed")
        elif ok is None and sealed:
            rep.errors.append(f"{name}.sha256 is missing from a sealed run")
    if rep.errors and any("missing" in e and e.split()[0] in (pfile.name, "wal.bin", "manifest.bin") for e in rep.errors):
        return rep, header, []

    if not compact:
        scan = read_wal(path / "wal.bin")
        manifest = read_manifest(path / "manifest.bin") if (path / "manifest.bin").exists() else []
    if compact:
        if file_sha256(pfile) != (header.get("provenance") or {}).get("sha256"):
            rep.errors.append(f"{COMPACT_FILE} does not match the SHA-256 in header.json's provenance entry: modified "
                              "after the run was compacted")
        try:
            pscan = read_compact(pfile)  # WAL digests read as 0: the block MACs cover what they did
        except CompactError as e:
            rep.errors.append(f"{COMPACT_FILE} is refused: {e}")
            return rep, header, []
        plan, manifest = pscan.entries, pscan.manifest
        scan, planned = WalScan(pscan.records, [], 0), len(pscan.entries)
        leftover = [n for n in SEALED_FILES[1:] if (path / n).exists()]
        if leftover:
            rep.warnings.append(f"{', '.join(leftover)} are left over from an interrupted compaction (the run reads "
                                f"{COMPACT_FILE}); `hf-unlearn trace compact {path}` removes them")
    elif pfile.name == PLAN_FILE:
        pscan = read_compact_plan(pfile)
        plan, planned = join_plan(pscan.segments, scan.records, manifest)
        _check_plan_frames(pscan, planned, rep, sealed)
    else:
        pscan = None
        plan = read_plan_jsonl(pfile)
        planned = len(plan)
    for i in scan.bad_crc:
        where = f" (microbatch {i}, optimizer step {plan[i].step})" if i < len(plan) else ""
        rep.errors.append(f"wal.bin record {i}{where} fails its CRC32 check (byte offset {i * 32}): the WAL is corrupt")
    n = len(scan.records)
    if scan.tail_bytes:
        msg = f"wal.bin ends with a torn record ({scan.tail_bytes} of 32 bytes) after record {n - 1}"
        if sealed:
            rep.errors.append(msg + " in a sealed run: the file was cut after the run finished")
        else:
            rep.warnings.append(msg + f" (crash while recording): recovered to the last whole record ({n} records)")
    if not sealed:
        rep.warnings.append("the run is not sealed (training did not finish): only completed steps are usable")
    disagree = f"{pfile.name} has {planned} entries but wal.bin has {n} records: plan and WAL disagree"
    if planned < n:
        if sealed or pscan is None:
            rep.errors.append(disagree)
        else:  # plan.bin's frame is written first, but the WAL's buffer may reach the disk before it
            rep.warnings.append(f"wal.bin has {n - planned} records past the plan's end (crash while recording); "
                                "they are dropped")
    elif planned > n:
        if sealed:
            rep.errors.append(disagree)
        else:
            rep.warnings.append(f"{pfile.name} has {planned - n} entries past the WAL's end; they are dropped")
        plan = plan[:n]
    pos = 0
    for i, (e, r) in enumerate(zip(plan, scan.records)):
        if i in scan.bad_crc:
            pos += len(e.slots)
            continue
        bad = []
        if r.step != e.step:
            bad.append(f"step {r.step} != {e.step}")
        if r.seed != e.seed:
            bad.append("seed")
        if r.lr != float(np.float32(e.lr)):
            bad.append(f"lr {r.lr} != {e.lr}")
        if r.length != len(e.slots):
            bad.append(f"length {r.length} != {len(e.slots)}")
        if bool(r.flags & FLAG_ACCUM_END) != e.end:
            bad.append("accumulation-end flag")
        if bool(r.flags & FLAG_DUMMY) != (None in e.slots):
            bad.append("dummy flag")
        if e.j and plan[i - 1].step != e.step:
            bad.append(f"step {e.step} inside the segment of step {plan[i - 1].step}")
        if key is not None and pscan is None and r.digest != ids_digest(key, e.slots):
            bad.append("ids digest (the slots' ids differ)")
        elif key is not None and pscan is not None and not compact and r.digest != record_digest(key, e.slots, r.seed, r.lr, r.step,
                                                                                 r.length, r.flags):
            bad.append("keyed record digest (the slots' ids or the record's controls differ)")
        if manifest[pos:pos + len(e.slots)] != e.slots:
            bad.append("id manifest")
        if e.ranks is not None and sum(e.ranks) != len(e.slots):
            bad.append(f"per-process slot counts {e.ranks} do not add up to {len(e.slots)}")
        pos += len(e.slots)
        if bad:
            rep.errors.append(f"plan entry {i} and wal.bin record {i} (optimizer step {e.step}) disagree: {', '.join(bad)}")
    if len(manifest) > pos and not sealed:
        rep.warnings.append(f"manifest.bin lists {len(manifest) - pos} slots past the WAL's end; they are ignored")
    elif len(manifest) != pos and not rep.errors:
        rep.errors.append(f"manifest.bin lists {len(manifest)} slots, the plan {pos}")
    rep.summary["controls"] = _check_controls(pscan, plan, header, key, rep, sealed)
    # Keep whole segments only (a crash can leave a segment half-written).
    while plan and not plan[-1].end:
        plan.pop()

    total = header.get("optimizer_steps") if sealed else None
    cps, ck_errors, ck_warnings = checkpoint_report(path, header, key, sealed,
                                                    total or (plan[-1].step + 1 if plan else 0),
                                                    check_sidecars=check_checkpoints, deep=deep)
    rep.errors += ck_errors
    rep.warnings += ck_warnings
    if not sealed and plan:
        # The WAL is written before a step runs: the last logged step completed only if something follows it.
        last = plan[-1].step
        done = _completed_step(path)
        if last + 1 not in cps and done is not None and done >= last:
            rep.warnings.append(f"the run stopped after optimizer step {last} completed, before step {last + 1} was "
                                f"logged (a crash in logging, saving, evaluation or a callback): replays end after step "
                                f"{last}")
        elif last + 1 not in cps:
            rep.warnings.append(f"optimizer step {last} was logged but never completed (the run stopped during or "
                                f"right after it, before any later record or checkpoint): replays stop at step {last}")
            _keep_guard_record(header, plan, last)
            plan = [e for e in plan if e.step < last]
    if 0 not in cps and not header.get("parent"):
        rep.warnings.append("there is no step-0 checkpoint: full replays (the oracle) are impossible")
    _check_model_files(path, header, rep)
    store = path / "private" / "store"
    if store.exists():
        if store_sha256(store) != header["dataset"].get("store_sha256"):
            rep.errors.append("private/store does not match the store fingerprint in header.json")
    else:
        rep.warnings.append("private/store is absent (moved or redacted away): replays need --store")
    steps = plan[-1].step + 1 if plan else 0
    rep.summary = {"controls": rep.summary.get("controls"),
        "run": str(path),
        "sealed": sealed,
        "optimizer_steps": steps,
        "microbatches": len(plan),
        "slots": sum(len(e.slots) for e in plan),
        "dummy_slots": sum(s is None for e in plan for s in e.slots),
        "world_size": header.get("world_size", 1),
        "checkpoints": sorted(cps),
        "checkpoints_deep_checked": bool(deep and check_checkpoints),
        "store_rows": header["dataset"].get("rows"),
        "wal_bytes": (path / "wal.bin").stat().st_size if not compact else 0,
        "plan_file": pfile.name,
        "plan_bytes": pfile.stat().st_size,
        "manifest_bytes": (path / "manifest.bin").stat().st_size if (path / "manifest.bin").exists() else 0,
        "compact": compact,
        "deletion_requests": len(read_deletion_log(path)),
        "trainer": (header.get("trainer") or {}).get("class", "transformers.trainer:Trainer"),
    }
    return rep, header, plan


def _check_model_files(path: Path, header: dict, rep: Report) -> None:
    """The files a replay rebuilds the model from: ``model/config.json``, the adapter's config, the recorded
    non-persistent buffers (their digest is in the sealed header)."""
    model = header.get("model") or {}
    config = path / "model" / "config.json"
    try:
        json.loads(config.read_text())
    except OSError:
        rep.errors.append("model/config.json is missing: replays cannot rebuild the model")
    except (UnicodeDecodeError, json.JSONDecodeError):
        rep.errors.append("model/config.json is damaged (it does not read as JSON): replays cannot rebuild the model")
    if model.get("peft") and not (path / "model" / "adapter" / "adapter_config.json").is_file():
        rep.errors.append("model/adapter/adapter_config.json is missing: replays cannot rebuild the PEFT adapter")
    for rel, digest in (model.get("files") or {}).items():  # sealed at recording (a run of an older release: none)
        f = path / rel
        if f.is_file() and file_sha256(f) != digest:
            rep.errors.append(f"{rel} does not match the digest in header.json (edited or replaced after recording): "
                              "replays would rebuild another model than the one that trained")
        elif not f.is_file() and rel not in ("model/config.json", "model/adapter/adapter_config.json"):
            rep.errors.append(f"{rel} is missing: replays would rebuild another model than the one that trained")
    layout = model.get("layout") or {}
    if layout.get("buffers"):
        f = path / BUFFERS_FILE
        if not f.is_file() or file_sha256(f) != layout.get("buffers_sha256"):  # the words restore_layout uses
            rep.errors.append(f"{BUFFERS_FILE} is missing or does not match the digest in header.json: the model's "
                              "non-persistent buffers cannot be restored")


def _check_plan_frames(pscan, planned: int, rep: Report, sealed: bool) -> None:
    if pscan.damaged_at is not None:
        rep.errors.append(f"plan.bin segment {len(pscan.segments)} (byte offset {pscan.damaged_at}, after plan entry "
                          f"{planned - 1}) {pscan.damage}: the plan is corrupt")
    if pscan.tail_bytes:
        msg = f"plan.bin ends with a torn segment ({pscan.tail_bytes} bytes) after plan entry {planned - 1}"
        if sealed:
            rep.errors.append(msg + " in a sealed run: the file was cut after the run finished")
        else:
            rep.warnings.append(msg + " (crash while recording): recovered to the last whole segment")


def _check_controls(pscan, plan: list[PlanEntry], header: dict, key: bytes | None, rep: Report, sealed: bool) -> str:
    """Check the chained segment MACs and the header's keyed seal; returns what the summary says of the controls."""
    if pscan is None:
        rep.notes.append(UNKEYED_CONTROLS)
        return "unkeyed"
    if (header.get("parent") or {}).get("controls") == "unkeyed":
        rep.notes.append("the run replays a parent run whose controls are unkeyed (recorded with a plan.jsonl): its "
                         "controls are keyed from the replay on, not checked against the recording")
    if key is None:
        rep.notes.append("the run's controls are keyed but were not checked: the run key is not available here")
        return "keyed, not checked (no key)"
    if isinstance(pscan, CompactRun):
        forged, previous = forged_blocks(key, header.get("run_id", ""), pscan), pscan.last_mac
    else:
        previous, forged = controls_chain_start(key, header.get("run_id", "")), []
    mb = 0
    for k, seg in enumerate(pscan.segments if not isinstance(pscan, CompactRun) else ()):
        entries = plan[mb:mb + len(seg.lens)]
        mb += len(seg.lens)
        if len(entries) < len(seg.lens):
            break  # past the WAL's end (reported above)
        if segment_mac(key, previous, canonical_controls(entries)) != seg.mac:
            forged.append(f"optimizer step {entries[0].step} (plan entries {entries[0].mb}-{entries[-1].mb}, "
                          f"plan.bin segment {k})")
        previous = seg.mac
    if forged:
        rep.errors.append(f"the controls of {forged[0]}{f' and {len(forged) - 1} more segment(s)' if len(forged) > 1 else ''} "
                          "do not match their keyed MAC: a seed, learning rate, step, flag, normaliser, length or id "
                          "was changed without the run key; refusing the run")
    seal_ok = not sealed or header.get("controls_mac") == controls_seal(key, previous, header)
    if not seal_ok:
        rep.errors.append("header.json's controls_mac does not match the run key: the header's training arguments, "
                          "optimizer, model, dataset, step counts, hazards or fidelity evidence were changed, or the "
                          "plan was cut, after the run was sealed"
                          + (f" (or {COMPACT_FILE} was rewritten and its SHA-256 in the header with it)"
                             if isinstance(pscan, CompactRun) else ""))
    return "keyed" if not forged and seal_ok else "keyed, FAILED"


def _completed_step(path: Path) -> int | None:
    f = Path(path) / PROGRESS_FILE
    try:
        return int(json.loads(f.read_text())["completed_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def open_run(path: str | Path, strict: bool = True, check_checkpoints: bool = True) -> TraceRun:
    """Check and load a run; with ``strict`` any integrity error is an :class:`UnlearnError` (replays refuse)."""
    path = Path(path)
    rep, header, plan = check_run(path, key=run_key(path, required=False), check_checkpoints=check_checkpoints)
    if strict and rep.errors:
        raise UnlearnError(f"{path} failed its integrity check; refusing to use it: " + "; ".join(rep.errors[:5]))
    for w in rep.warnings + rep.notes:
        warnings.warn(f"{path}: {w}", stacklevel=2)
    return TraceRun(path=path, header=header, plan=plan, report=rep)


def read_deletion_log(path: str | Path) -> list[dict]:
    f = Path(path) / "deletion_log.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def append_deletion_log(path: str | Path, entry: dict) -> None:
    """Append one request to the run's append-only deletion log (previous entries are kept byte for byte)."""
    f = Path(path) / "deletion_log.jsonl"
    old = f.read_bytes() if f.exists() else b""
    line = json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **entry}, sort_keys=True)
    atomic_write_bytes(f, old + line.encode() + b"\n")
    write_sidecar(f)


def _keep_guard_record(header: dict, plan: list, last: int) -> None:
    """A crashed run's never-completed step ``last`` is cut from its plan, but its first (keyed) entry holds the
    guards' record of step ``last - 1`` (its fingerprint, a program change): kept, in memory, as the header's final
    guard entry (what a sealed run writes there)."""
    guards = (header.get("fidelity") or {}).get("guards")
    extra = next((e.extra for e in plan if e.step == last and e.j == 0), {})
    if guards is None or guards.get("final") or "fp" not in extra:
        return
    guards["final"] = {"step": last - 1, "fp": extra["fp"], **({"changed": extra["changed"]} if "changed" in extra
                                                              else {}), **({"ep": extra["ep"]} if "ep" in extra else {})}
