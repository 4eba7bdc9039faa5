"""The sealed compact provenance: ``provenance.bin``, one file that decodes to the run's plan, WAL and manifest.

While a run records, ``plan.bin``, ``wal.bin`` and ``manifest.bin`` are appended ahead of every segment (crash-safe,
the paper's format). :func:`compact_run` (``hf-unlearn trace compact RUN``) replaces them in a sealed run with one
xz-compressed file holding the same records column by column, with what is implied not stored:

* slot tags as indices into a table of the distinct rows' 8-byte tags; when every epoch's order is the permutation
  that accelerate's ``SeedableRandomSampler`` (what ``Trainer`` uses) draws, ``torch.randperm(N)`` seeded with
  ``seed + epoch``, only the seeds are stored (checked at compaction by drawing them; readers draw them again);
* seeds as the recorder's rule ``microbatch_seed(base, step, j)`` when they follow it; steps, positions,
  accumulation ends and the WAL flags from the segment sizes; lengths per distinct row when a row always has one;
  learning rates as second differences of their float64 bit patterns; normalisers as their difference to the
  segment's token count;
* the keyed digests folded: the WAL's per-microbatch digest is recomputed from the decoded records (the key holder
  gets the same WAL); the chained MAC per segment becomes one per block of :data:`BLOCK_SEGMENTS` segments over the
  same canonical controls (a forged control is still named, to its block's steps, before any compute); the 8-byte
  keyed batch digests per microbatch become one :data:`BATCH_MAC_BYTES`-byte keyed MAC per group of whole segments
  of at least :data:`BATCH_GROUP_MIN` microbatches, checked by replays before compute.

Compaction decodes what it wrote and compares it with the append-only files before removing them, and the header
records the file's SHA-256 under the run key's seal (``controls_mac``), so any edit of it without the key (a byte, a
seed claim, the tag table) is refused. Lower bound: one 8-byte tag per distinct row (deletion lookup and third-party
tag checks need them), so the file is at least 8 bytes times the rows the run trained on.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..errors import UnlearnError
from ..utils import atomic_write_bytes, atomic_write_text
from .compact_format import (  # noqa: F401 - re-exported: the codec lived here
    BATCH_GROUP_MIN,
    BATCH_MAC_BYTES,
    BLOCK_SEGMENTS,
    FORMAT,
    MAGIC,
    CompactError,
    CompactRun,
    batch_group_ranges,
    batch_mac,
    block_mac,
    block_ranges,
    controls_chain,
    decode,
    encode,
    forged_blocks,
    read_compact,
    sampler_order,
    texts,
)
from .files import file_sha256, write_sidecar
from .records import COMPACT_FILE
from .run import check_run, controls_seal
from .tags import run_key
from .wal import read_manifest, read_wal

# ---- compaction ----------------------------------------------------------------------------------------------
APPEND_ONLY = ("plan.bin", "wal.bin", "manifest.bin")


def is_compact(run: str | Path, header: dict | None = None) -> bool:
    run = Path(run)
    if header is None:
        try:
            header = json.loads((run / "header.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False
    return bool(header.get("provenance"))


def compact_run(run_dir: str | Path, batch_macs: dict | None = None) -> dict:
    """Replace a sealed run's plan.bin, wal.bin and manifest.bin by provenance.bin (see the module docstring).

    Refuses, before writing anything, a run that is not sealed, fails its check, or has unkeyed controls (a
    plan.jsonl run has no MACs to fold). Crash-safe: provenance.bin is written, then the header that names it (with
    its SHA-256 under the keyed seal), then the append-only files are removed; running it again finishes an
    interrupted compaction. Returns what was replaced and the sizes."""
    run = Path(run_dir)
    header = json.loads((run / "header.json").read_text()) if (run / "header.json").is_file() else None
    if header is None:
        raise UnlearnError(f"{run} is not a recorded run (no header.json)")
    key = run_key(run, header)
    if is_compact(run, header):
        _remove_append_only(run)  # an interrupted compaction, or a second call
        return dict(header["provenance"])
    if not header.get("sealed"):
        raise UnlearnError(f"{run} is not sealed (training did not finish): only a sealed run can be compacted")
    rep, header, plan = check_run(run, key=key, check_checkpoints=False)
    if rep.errors:
        raise UnlearnError(f"{run} fails its integrity check, so it is not compacted: {rep.errors[0]}")
    if rep.summary.get("controls") != "keyed":
        raise UnlearnError(f"{run} has {rep.summary.get('controls')} controls (a plan.jsonl run): it has no keyed MACs "
                           "to fold, so it stays in its recorded format (it still replays)")
    det = header.get("determinism") or {}
    seed = (header.get("training_args") or {}).get("seed", det.get("seed"))
    bases = [s for s in (det.get("data_seed"), det.get("seed"), seed) if isinstance(s, int)]
    data = encode(plan, key, header["run_id"], seed_base=seed if isinstance(seed, int) else None,
                  sampler_seeds=tuple(bases), batch_macs=batch_macs)
    decoded = decode(data)  # the WAL digests were checked against these very records by check_run above
    wal = [dataclasses.replace(r, digest=0) for r in read_wal(run / "wal.bin").records]
    if decoded.entries != [dataclasses.replace(e, batch=None) for e in plan] or decoded.records != wal or \
            decoded.manifest != read_manifest(run / "manifest.bin") or forged_blocks(key, header["run_id"], decoded):
        raise UnlearnError(f"internal: {run}'s compact provenance does not decode to its records; the run is left "
                           "as recorded (please report this)")
    sizes = {n: (run / n).stat().st_size for n in APPEND_ONLY}
    atomic_write_bytes(run / COMPACT_FILE, data)
    header["provenance"] = {"format": FORMAT, "file": COMPACT_FILE, "sha256": file_sha256(run / COMPACT_FILE),
                            "bytes": len(data), "replaced_bytes": sizes, "order": decoded.meta["order"]["rule"],
                            "seeds": decoded.meta["seeds"]["rule"], "lens": decoded.meta["lens"]}
    header["controls_mac"] = controls_seal(key, decoded.last_mac, header)
    write_sidecar(run / COMPACT_FILE)
    atomic_write_text(run / "header.json", json.dumps(header, indent=1, sort_keys=True))
    write_sidecar(run / "header.json")
    _remove_append_only(run)
    return dict(header["provenance"])


def _remove_append_only(run: Path) -> None:
    for name in APPEND_ONLY:
        for f in (run / name, run / f"{name}.sha256"):
            f.unlink(missing_ok=True)
