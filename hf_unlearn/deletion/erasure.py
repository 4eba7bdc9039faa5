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
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UnlearnError
from .ledger import DeletionLedger, iso, utc_now

RETIRED_FILE = "retired.json"


@dataclass
class PurgeResult:
    removed: list[dict] = field(default_factory=list)  # {"path": relative to the ledger, "bytes": n}
    kept: list[str] = field(default_factory=list)
    not_erased: list[str] = field(default_factory=list)
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
        lines += [f"  NOT ERASED (outside the service): {n}" for n in self.not_erased]
        return "\n".join(lines)


def _size(path: Path) -> int:
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def purge(ledger: DeletionLedger, *, log=None, dry_run: bool = False) -> PurgeResult:
    """Remove what the served rows left in the service's stores and runs (see the module docstring). Refused while
    a batch is interrupted or before any batch is exact. Idempotent: a second purge removes what a crashed one left
    and records nothing when nothing is left."""
    from .service import serving

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
        targets: list[Path] = []
        for r in done[:-1]:
            folder = ledger.path / "batches" / r["batch"]
            targets += [folder / name for name in ("model", "replay", "store", "oracle")]
        current = ledger.path / "batches" / last["batch"]
        targets += [current / "store", current / "oracle"]
        for r in records:
            if r["type"] == "approximate" and set(r["requests"]) <= exact:
                targets.append(ledger.path / "provisional" / r["name"])
        retire, clean_limit = _recorded_run_targets(ledger, done)
        targets += retire
        result = PurgeResult()
        for path in targets:
            if not (path.exists() or path.is_symlink()):
                continue
            size = _size(path)
            if not dry_run:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            result.removed.append({"path": _rel(ledger, path), "bytes": size})
            log(f"{'would remove' if dry_run else 'removed'} {_rel(ledger, path)} ({size / 2**20:.2f} MiB)")
        result.kept = [f"{_rel(ledger, current / 'replay')} (the current exact run: the next batch deletes from it)",
                       f"{_rel(ledger, current / 'model')} (the served exact model)",
                       "the ledger, receipts, bundles and each batch's receipt.json (audit evidence, keyed tags only)",
                       f"the recorded run's provenance, key and checkpoints up to step {clean_limit} (no deleted row "
                       "reached them)"]
        result.not_erased = _outside(done)
        if dry_run or not result.removed:
            return result
        if retire:
            _mark_retired(ledger, current / "replay", clean_limit)
        result.record = ledger.append("purge", batch=last["batch"], requests=sorted(exact), removed=result.removed,
                                      bytes_removed=result.bytes_removed, not_erased=result.not_erased,
                                      time=iso(utc_now()))
    return result


def _rel(ledger: DeletionLedger, path: Path) -> str:
    return os.path.relpath(os.path.abspath(path), os.path.abspath(ledger.path))


def _recorded_run_targets(ledger: DeletionLedger, done: list[dict]) -> tuple[list[Path], int]:
    """The recorded run's token store and every checkpoint a deleted row reached (after the earliest checkpoint any
    batch replayed from), and that step."""
    from ..trace.run import list_checkpoints

    limits = []
    for r in done:
        try:
            batch = json.loads((ledger.path / "receipts" / f"{r['batch']}.json").read_text())
            limits.append(int(batch["cost"]["start_checkpoint"]))
        except (OSError, ValueError, KeyError, TypeError):
            raise UnlearnError(f"cannot read where {r['batch']} replayed from (receipts/{r['batch']}.json): restore "
                               "the receipt before purging") from None
    limit = min(limits)
    run = ledger.run
    targets = [run / "private" / "store"]
    targets += [p for step, p in sorted(list_checkpoints(run).items()) if step > limit]
    return targets, limit


def _mark_retired(ledger: DeletionLedger, current: Path, limit: int) -> None:
    from ..utils import atomic_write_text

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
