"""Erasure: once a batch is exact, remove the served rows from every store and run the service keeps.

What the service keeps after :func:`purge`, and why (everything else it wrote is removed):

* the ledger (``ledger.jsonl``, ``head.json``), every receipt and bundle, and each batch's ``receipt.json`` (the
  forget evidence): what audits check; they hold keyed tags, never rows;
* the **current exact run** (the last batch's ``replay/``: plan, WAL, checkpoints, its redacted token store in
  ``replay/private/store``): what the next exact batch deletes from; none of its checkpoints saw a deleted row
  (the ones before the first replayed step are the earlier runs' clean prefix, kept as hard links);
* the served model (the last batch's ``model/``, and provisional models of requests still waiting for their exact
  batch);
* the recorded run's publishable provenance (``header.json``, plan, WAL, manifest, deletion log) and its key
  (``private/hmac.key``, if it has one): the ledger is bound to the run by them and tags are made with the key;
  the checkpoints that no deleted row reached (at or before the earliest replayed step).

What it removes: earlier batches' ``model/``, ``replay/``, ``store/`` and ``oracle/`` (they hold or were trained on
rows a later batch deleted), the current batch's ``store/`` and ``oracle/`` (a copy of the replay's store, and a
second run), provisional models whose requests are now exact, and from the recorded run its token store
(``private/store``) and every checkpoint a deleted row reached (the run is then *retired*: ``retired.json`` says so
and names the current exact run). A signed ``purge`` record lists each removed path (relative to the ledger) and its
size. What it cannot remove is listed too: copies outside the service (the training output folder of the recorded
run, its ``checkpoint-*`` folders, the source dataset, backups) and models published earlier to the Hub.

What it decides from: the signed ledger records and the batch receipts whose hashes they bind (where each batch
replayed from), and a walk of every file and folder under the ledger and the run (indexed or not, complete or not):
what it cannot classify is erased where rows or weights can live, else named (``unclassified`` in the record), and
never skipped. A ``purge_start`` record lists what is about to go before the first removal, so a purge cut off is
finished, and recorded with everything both runs removed, by the next one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnlearnError
from ..utils import atomic_write_text
from .journal import RequestJournal, serving
from .receipts import receipt_sha256
from .records import iso, unfinished_purge, utc_now

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)

RETIRED_FILE = "retired.json"


@dataclass
class PurgeResult:
    removed: list[dict] = field(default_factory=list)  # {"path": relative to the ledger, "bytes": n}
    kept: list[str] = field(default_factory=list)
    not_erased: list[str] = field(default_factory=list)
    unclassified: list[str] = field(default_factory=list)  # found, not classified, kept: named, never skipped
    record: dict | None = None

    @property
    def bytes_removed(self) -> int:
        return sum(r["bytes"] for r in self.removed)

    def summary_line(self) -> str:
        return f"{len(self.removed)} path(s), {self.bytes_removed / 2**20:.1f} MiB"

    def summary(self) -> str:
        lines = [f"removed {self.summary_line()}" + (f" (ledger record {self.record['seq']})" if self.record else
                                                     " (nothing left to remove: no record written)")]
        lines += [f"  removed  {r['path']}  ({r['bytes'] / 2**20:.2f} MiB)" for r in self.removed]
        lines += [f"  kept     {k}" for k in self.kept]
        lines += [f"  NOT CLASSIFIED (kept, check it): {u}" for u in self.unclassified]
        lines += [f"  NOT ERASED (outside the service): {n}" for n in self.not_erased]
        return "\n".join(lines)


def _size(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def purge(ledger: RequestJournal, *, log=None, dry_run: bool = False) -> PurgeResult:
    """Remove what the served rows left in the service's stores and runs (see the module docstring). Refused while
    a batch is interrupted or before any batch is exact. What to erase is decided from the signed ledger records (and
    the batch receipts whose hashes they bind) and from every file and folder under the ledger and the run, indexed
    or not: anything it cannot classify is erased (where rows or weights can live) or named. A ``purge_start`` record
    precedes the first removal, so a purge cut off is finished and recorded by the next one. Idempotent: a second
    purge removes what a crashed one left and records nothing when nothing is left."""
    log = log or (lambda m: print(m, flush=True))
    with serving(ledger):
        records = ledger.records()
        if ledger.unfinished_batch() is not None:
            raise UnlearnError(f"{ledger.unfinished_batch()['batch']} was interrupted; finish it (`hf-unlearn requests "
                               "serve --exact`) before purging")
        done = [r for r in records if r["type"] == "batch_done"]
        if not done:
            raise UnlearnError("nothing to purge: no batch is exact yet (`hf-unlearn requests serve --exact` first)")
        last = done[-1]
        exact = {rid for r in done for rid in r["requests"]}
        current = ledger.path / "batches" / last["batch"]
        clean_limit = _clean_limit(ledger, done)  # refused (nothing removed) when a batch receipt is not the signed one
        targets, unclassified = _ledger_targets(ledger, records, done, exact)
        retire, more = _run_targets(ledger, clean_limit)
        targets += retire
        unclassified += more
        replay = Path(os.path.normpath(ledger.path / last["run"]))
        if (replay / "header.json").is_file():  # the current exact run: what no record names in it
            extra, more = _run_targets(ledger, 1 << 62, replay)
            targets += extra
            unclassified += more
        pending = unfinished_purge(records)
        result = PurgeResult()
        sizes = {}
        for path in targets:
            if path.exists() or path.is_symlink():
                sizes[path] = _size(path)
        planned = [{"path": _rel(ledger, p), "bytes": n} for p, n in sizes.items()]
        if not dry_run and planned:
            ledger.append("purge_start", batch=last["batch"], planned=planned, time=iso(utc_now()))
        for path, size in sizes.items():
            if not dry_run:
                _remove(path)
            result.removed.append({"path": _rel(ledger, path), "bytes": size})
            log(f"{'would remove' if dry_run else 'removed'} {_rel(ledger, path)} ({size / 2**20:.2f} MiB)")
        if pending is not None:  # what a purge cut off removed before it was killed: recorded now
            seen = {r["path"] for r in result.removed}
            result.removed += [e for e in pending["planned"] if e["path"] not in seen]
        result.kept = [f"{_rel(ledger, current / 'replay')} (the current exact run: the next batch deletes from it)",
                       f"{_rel(ledger, current / 'model')} (the served exact model)",
                       "the ledger, receipts, bundles and each batch's receipt.json (audit evidence, keyed tags only)",
                       f"the recorded run's provenance, key and checkpoints up to step {clean_limit} (no deleted row "
                       "reached them)"]
        result.unclassified = unclassified
        for u in unclassified:
            log(f"not classified, kept: {u}")
        result.not_erased = _outside(done)
        if dry_run or not result.removed:
            return result
        if any(not r["path"].startswith(("batches/", "provisional/")) for r in result.removed) or \
                (ledger.run / RETIRED_FILE).exists():
            _mark_retired(ledger, current / "replay", clean_limit)
        result.record = ledger.append("purge", batch=last["batch"], requests=sorted(exact), removed=result.removed,
                                      bytes_removed=result.bytes_removed, not_erased=result.not_erased,
                                      unclassified=unclassified, time=iso(utc_now()),
                                      **({"resumes": pending["seq"]} if pending is not None else {}))
    return result


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _rel(ledger: RequestJournal, path: Path) -> str:
    return os.path.relpath(os.path.abspath(path), os.path.abspath(ledger.path))


def _clean_limit(ledger: RequestJournal, done: list[dict]) -> int:
    """The earliest checkpoint any batch replayed from: read from each batch receipt whose hash its signed
    ``batch_done`` record binds (an edited receipt is refused, naming it, before anything is removed)."""
    limits = []
    for r in done:
        path = ledger.path / "receipts" / f"{r['batch']}.json"
        try:
            batch = json.loads(path.read_text(encoding="utf-8"))
            ok = isinstance(batch, dict) and receipt_sha256(batch) == r.get("batch_receipt")
        except (OSError, ValueError, RecursionError):
            batch, ok = None, False
        if not ok:
            raise UnlearnError(f"receipts/{r['batch']}.json is missing or is not the batch receipt record {r['seq']} "
                               "signs (its hash differs): purge reads where each batch replayed from only from the "
                               "signed receipt; restore it (nothing was removed)")
        try:
            limits.append(int(batch["cost"]["start_checkpoint"]))
        except (KeyError, TypeError, ValueError):
            limits.append(0)  # a pipeline's cost (per stage): keep only the run's first checkpoint
    return min(limits)


# what may hold rows or weights trained on them: unknown entries there are erased; elsewhere they are named
_DATA_SUFFIXES = (".arrow", ".safetensors", ".pt", ".bin", ".parquet", ".npy", ".gguf")


def _holds_data(path: Path) -> bool:
    if path.is_symlink():
        return False
    if path.is_file():
        return path.name.endswith(_DATA_SUFFIXES) or path.name == "dataset_info.json"
    return any(_holds_data(p) for p in path.rglob("*") if p.is_file())


def _ledger_targets(ledger: RequestJournal, records: list[dict], done: list[dict], exact: set) -> tuple[list, list]:
    """Every path under the ledger to remove, and those it cannot classify (kept, named)."""
    root = ledger.path
    targets, unclassified = [], []
    named = {r["batch"]: r for r in done}
    current = done[-1]
    keep_current = {"model", "receipt.json", Path(os.path.normpath(current["run"])).parts[2]
                    if len(Path(os.path.normpath(current["run"])).parts) > 2 else "replay"}
    batches = root / "batches"
    for entry in sorted(batches.iterdir()) if batches.is_dir() else []:
        r = named.get(entry.name)
        if r is None or not entry.is_dir() or entry.is_symlink():
            targets.append(entry)  # not a finished batch of this ledger (a copy, a leftover): rows may be inside
            continue
        keep = keep_current if r is current else {"receipt.json"}
        targets += [p for p in sorted(entry.iterdir()) if p.name not in keep]
    provisional = root / "provisional"
    served = {r["name"]: set(r["requests"]) <= exact for r in records if r["type"] == "approximate"}
    for entry in sorted(provisional.iterdir()) if provisional.is_dir() else []:
        if served.get(entry.name, True):  # superseded by an exact batch, or not from this ledger
            targets.append(entry)
    private = root / "private"
    for entry in sorted(private.iterdir()) if private.is_dir() else []:
        if entry.name not in ("ids.jsonl", "card_info"):
            (targets if _holds_data(entry) else unclassified).append(entry)
    known = {"ledger.jsonl", "head.json", ".lock", ".serve.lock", "receipts", "batches", "provisional", "private"}
    for entry in sorted(root.iterdir()):
        if entry.name in known:
            continue
        (targets if _holds_data(entry) else unclassified).append(entry)
    receipts = root / "receipts"
    for entry in sorted(receipts.iterdir()) if receipts.is_dir() else []:
        if not (entry.is_file() and entry.name.endswith(".json")):
            (targets if _holds_data(entry) else unclassified).append(entry)
    return targets, [_rel(ledger, p) for p in unclassified]


_RUN_KEPT = {"header.json", "plan.bin", "plan.jsonl", "wal.bin", "manifest.bin", "provenance.bin",
             "deletion_log.jsonl", "progress.json", "model", RETIRED_FILE, "packing.json"}


def _run_targets(ledger: RequestJournal, limit: int, run: Path | None = None) -> tuple[list[Path], list[str]]:
    """The recorded run's token store, every checkpoint folder a deleted row reached (after ``limit``, the earliest
    checkpoint any batch replayed from), and everything else under ``checkpoints/`` and ``private/`` that is not a
    complete, indexed checkpoint at or before it, the index, the frozen tensors or the key: a folder whose index
    entry is gone, one missing ``hashes.json``, an operator's ``step-00000005.bak``. Unknown entries elsewhere in the
    run are erased when they hold data, else named. With ``run`` (the current exact run, whose store and checkpoints
    hold no deleted row), the same walk keeps its store and every complete, indexed checkpoint."""
    import re

    from ..trace.checkpoints import is_complete

    current = run is not None
    run = run if current else ledger.run
    ledger_abs = os.path.abspath(ledger.path)
    targets, unclassified = [], []
    listed = _trusted_steps(ledger, run)
    checkpoints = run / "checkpoints"
    for entry in sorted(checkpoints.iterdir()) if checkpoints.is_dir() else []:
        if entry.name in ("index.json", "frozen"):
            continue
        m = re.fullmatch(r"step-(\d+)", entry.name)
        clean = m is not None and int(m.group(1)) <= limit and entry.is_dir() and not entry.is_symlink() \
            and is_complete(entry) and (listed is None or int(m.group(1)) in listed) and (current or _intact(entry))
        if not clean:
            targets.append(entry)
    private = run / "private"
    for entry in sorted(private.iterdir()) if private.is_dir() else []:
        if entry.name not in ("hmac.key", "lineage.json") + (("store",) if current else ()):
            targets.append(entry)  # the token store, and anything else kept beside it
    for entry in sorted(run.iterdir()):
        name = entry.name[: -len(".sha256")] if entry.name.endswith(".sha256") else entry.name
        if name in _RUN_KEPT or entry.name in ("checkpoints", "private") or \
                os.path.abspath(entry) == ledger_abs or ledger_abs.startswith(os.path.abspath(entry) + os.sep):
            continue
        if _holds_data(entry):
            targets.append(entry)
        else:
            unclassified.append(_rel(ledger, entry))
    return targets, unclassified


def check_not_retired(run) -> None:
    """A run that ``requests purge`` retired (its store and later checkpoints are erased) is refused, naming the exact
    run that replaced it: deletions continue from that one."""
    path = Path(run) / RETIRED_FILE
    if not path.is_file():
        return
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
        current = Path(os.path.normpath(Path(run) / info["current_exact_run"]))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        raise UnlearnError(f"{run} was retired (its {RETIRED_FILE} is unreadable): its token store and the checkpoints "
                           "a deleted row reached were erased; delete from the ledger's current exact run") from None
    raise UnlearnError(f"{run} was retired by `hf-unlearn requests purge` (ledger {info.get('ledger')}): its token "
                       f"store and every checkpoint a deleted row reached were erased; it was replaced by the exact "
                       f"run {current} (every row deleted so far is gone from it): delete from that run, or add the "
                       "request to the ledger (`hf-unlearn requests add`)")


def _trusted_steps(ledger: RequestJournal, run: Path) -> set[int] | None:
    """The steps of the run's checkpoint index, if its MAC (under the run key) holds; an empty set when it does not
    (an edited index vouches for no checkpoint); None for a run recorded before indexes."""
    import hmac

    from ..trace.checkpoints import _mac, read_index

    try:
        index = read_index(run)
    except (OSError, ValueError):
        return set()
    if index is None:
        return None
    try:
        ok = hmac.compare_digest(str(index.get("mac", "")), _mac(ledger.tag_key, index))
        return {int(s) for s in index.get("checkpoints", {})} if ok else set()
    except (AttributeError, TypeError, ValueError, UnlearnError):
        return set()


def _intact(folder: Path) -> bool:
    """A kept checkpoint is the one the run's index recorded for its step, tensor by tensor (a dirty checkpoint's
    files copied under a clean step's name are not kept)."""
    from ..trace.checkpoints import verify_checkpoint_files

    try:
        verify_checkpoint_files(folder)
        return True
    except Exception:  # any failure to verify: not classifiable as clean, so erased
        return False


def _mark_retired(ledger: RequestJournal, current: Path, limit: int) -> None:
    atomic_write_text(ledger.run / RETIRED_FILE, json.dumps({
        "retired_by": "hf-unlearn requests purge", "ledger": ledger.records()[0]["ledger"],
        "current_exact_run": os.path.relpath(current, ledger.run), "store": "removed",
        "checkpoints_kept_up_to_step": limit,
        "why": "every request of the ledger was deleted exactly; this run's store and later checkpoints held the "
               "deleted rows. Replays continue from the current exact run."}, indent=1) + "\n")


def _outside(done: list[dict]) -> list[str]:
    out = ["the recorded run's training output folder (its final model and checkpoint-* folders) and any copy of "
           "the source dataset: outside the service, delete them yourself",
           "backups and copies of the ledger folder or the run"]
    for r in done[:-1]:
        p = r.get("published") or {}
        if p.get("repo") and p.get("tag") and not p.get("error"):
            out.append(f"{p['repo']}@{p['tag']} ({r['batch']}) on the Hub: a model trained on rows a later batch "
                       "deleted; delete that revision on the Hub")
    return out
