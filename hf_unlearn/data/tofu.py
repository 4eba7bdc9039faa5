"""TOFU (Maini et al., 2024): fictitious-author QA, by Hub config name.

Id scheme (column ``id``, int64), stable across configs:

* rows of ``full`` and of every forget/retain split: the row index into ``full``
  (``full == retain90 + forget10`` in that order, so forget10's ids are 3600..3999);
  ``retain_perturbed`` is the first 400 rows of full (ids 0..399);
* ``holdoutNN``: 100000 + row index into ``holdout10`` (the smaller holdouts are its prefixes);
* ``real_authors*``: 200000 + row; ``world_facts*``: 300000 + row.

Nothing is keyed by text: one question appears twice in ``full``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..errors import UnlearnError
from .local import resolve_local

TOFU_HUB_ID = "locuslab/TOFU"
FULL_SIZE = 4000
HOLDOUT_OFFSET, REAL_AUTHORS_OFFSET, WORLD_FACTS_OFFSET = 100_000, 200_000, 300_000

_PCT = {"01": 40, "05": 200, "10": 400}
TOFU_CONFIGS: tuple[str, ...] = (
    "full",
    *(f"forget{p}" for p in _PCT),
    *(f"forget{p}_perturbed" for p in _PCT),
    *(f"retain{100 - int(p)}" for p in _PCT),
    "retain_perturbed",
    *(f"holdout{p}" for p in _PCT),
    "real_authors",
    "real_authors_perturbed",
    "world_facts",
    "world_facts_perturbed",
)


def tofu_ids(config: str, n_rows: int) -> list[int]:
    """The stable ids of a config's rows (see the module docstring)."""
    if config == "full" or config == "retain_perturbed" or config.startswith("retain"):
        return list(range(n_rows))
    m = re.fullmatch(r"forget(\d\d)(_perturbed)?", config)
    if m:
        return list(range(FULL_SIZE - n_rows, FULL_SIZE))
    if config.startswith("holdout"):
        return [HOLDOUT_OFFSET + i for i in range(n_rows)]
    if config.startswith("real_authors"):
        return [REAL_AUTHORS_OFFSET + i for i in range(n_rows)]
    if config.startswith("world_facts"):
        return [WORLD_FACTS_OFFSET + i for i in range(n_rows)]
    raise _unknown(config)


def _unknown(config: str) -> UnlearnError:
    return UnlearnError(f"unknown TOFU config {config!r}; choose one of: {', '.join(TOFU_CONFIGS)}")


def _expected_rows(config: str) -> int | None:
    m = re.fullmatch(r"(forget|holdout)(\d\d)(_perturbed)?", config)
    if m:
        return _PCT[m.group(2)]
    m = re.fullmatch(r"retain(\d\d)", config)
    if m:
        return FULL_SIZE - _PCT[f"{100 - int(m.group(1)):02d}"]
    return {"full": FULL_SIZE, "retain_perturbed": 400}.get(config)


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise UnlearnError(f"{path}:{lineno} is not valid JSON ({e.msg}); re-download the file") from None
    return rows


def load_tofu(config: str = "full", path: str | os.PathLike | None = None, *, verify: bool = True):
    """Load one TOFU config as a ``datasets.Dataset`` with a stable ``id`` column.

    Args:
        config: a Hub config name of ``locuslab/TOFU`` (``full``, ``forget10``, ``retain90``,
            ``forget10_perturbed``, ``holdout10``, ``real_authors``, ``world_facts``, ...).
        path: a local folder holding ``<config>.jsonl`` files. Defaults to ``$HF_UNLEARN_DATA_DIR/tofu``
            when that variable is set, else the Hub.
        verify: for local forget/retain splits, check that the rows are the expected rows of ``full``
            (the ids are positions in ``full``, so a reordered file would silently mislabel samples).
    """
    from datasets import Dataset

    if config not in TOFU_CONFIGS:
        raise _unknown(config)
    folder = resolve_local(path, "tofu")
    if folder is None:
        from datasets import load_dataset

        from ..validation import check_hub_dataset

        check_hub_dataset(TOFU_HUB_ID, "set HF_UNLEARN_DATA_DIR to a folder holding tofu/*.jsonl or pass a TOFU "
                                       "folder (--tofu DIR / path=)")
        ds = load_dataset(TOFU_HUB_ID, config, split="train")
        rows = ds.to_list()
    else:
        file = folder / f"{config}.jsonl"
        if not folder.is_dir():
            raise UnlearnError(f"TOFU folder {folder} does not exist; pass path= or set HF_UNLEARN_DATA_DIR")
        if not file.is_file():
            raise UnlearnError(
                f"TOFU folder {folder} has no {config}.jsonl; it needs one JSON Lines file per Hub config "
                f"(export locuslab/TOFU with datasets' to_json)"
            )
        rows = _read_jsonl(file)
    expected = _expected_rows(config)
    if expected is not None and len(rows) != expected:
        raise UnlearnError(f"TOFU {config} has {len(rows)} rows, expected {expected}; the file is incomplete")
    if not rows or "question" not in rows[0]:
        raise UnlearnError(f"TOFU {config} has no 'question' column; is this a TOFU file?")
    ids = tofu_ids(config, len(rows))
    if verify and folder is not None and re.fullmatch(r"(forget|retain)\d\d(_perturbed)?|retain_perturbed", config):
        _verify_against_full(folder, config, rows, ids)
    for row, i in zip(rows, ids):
        row["id"] = i
    return Dataset.from_list(rows)


def _verify_against_full(folder: Path, config: str, rows: list[dict], ids: list[int]) -> None:
    full_file = folder / "full.jsonl"
    if not full_file.is_file():
        return  # nothing to check against; ids follow the documented layout
    full = _read_jsonl(full_file)
    for row, i in zip(rows, ids):
        if i >= len(full) or full[i]["question"] != row["question"]:
            raise UnlearnError(
                f"TOFU {config} row for id {i} does not match full.jsonl row {i}; the split files are not in "
                f"Hub order, so ids would be wrong"
            )
