"""Multiple-choice / classification task sets (``shared/data/tasks`` schema) with a seeded split.

Schema, one JSON object a line: ``{"id", "context" (or null), "question", "choices": [...], "label": int}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import UnlearnError
from .local import resolve_local

TASK_NAMES = ("piqa", "arc_easy", "arc_challenge", "sciq", "pubmedqa", "mnli", "rte", "cola")


def _task_file(name_or_path: str | os.PathLike, path: str | os.PathLike | None) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix == ".jsonl":
        return candidate
    folder = resolve_local(path, "tasks")
    if folder is None:
        raise UnlearnError(
            f"task {str(name_or_path)!r}: no local task folder; pass path= or set HF_UNLEARN_DATA_DIR "
            f"(known tasks: {', '.join(TASK_NAMES)})"
        )
    file = folder / f"{name_or_path}.jsonl"
    if not file.is_file():
        known = sorted(p.stem for p in folder.glob("*.jsonl")) if folder.is_dir() else []
        raise UnlearnError(f"no task {str(name_or_path)!r} in {folder}; available: {', '.join(known) or 'none'}")
    return file


def validate_task_rows(rows: list[dict], name: str) -> None:
    """Labels inside their choices, at least two choices, no empty split."""
    if not rows:
        raise UnlearnError(f"task {name!r} has no rows")
    for row in rows:
        for key in ("id", "question", "choices", "label"):
            if key not in row:
                raise UnlearnError(f"task {name!r} row {row.get('id', '?')!r} has no {key!r} field")
        n = len(row["choices"])
        if n < 2:
            raise UnlearnError(f"task {name!r} row {row['id']!r} has {n} choice(s); multiple choice needs at least 2")
        if not isinstance(row["label"], int) or not 0 <= row["label"] < n:
            raise UnlearnError(f"task {name!r} row {row['id']!r} has label {row['label']!r} outside its {n} choices")


def load_task(
    name_or_path: str | os.PathLike,
    path: str | os.PathLike | None = None,
    *,
    test_size: float | int = 0.5,
    seed: int = 0,
    max_rows: int | None = None,
):
    """Load a task set as a ``DatasetDict`` with ``train`` and ``test`` splits (seeded, reproducible).

    Args:
        name_or_path: a task name (``rte``, ``piqa``, ...) looked up in ``path`` or ``$HF_UNLEARN_DATA_DIR/tasks``,
            or a ``.jsonl`` file.
        test_size: fraction (or count) of rows held out as unseen examples.
        max_rows: take a seeded random subset of this many rows first (for quick experiments).
    """
    from datasets import Dataset

    file = _task_file(name_or_path, path)
    name = Path(file).stem
    with open(file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    validate_task_rows(rows, name)
    for row in rows:
        row.setdefault("context", None)
        row["id"] = str(row["id"])
    ds = Dataset.from_list(rows)
    if max_rows is not None and max_rows < len(ds):
        ds = ds.shuffle(seed=seed).select(range(max_rows))
    split = ds.train_test_split(test_size=test_size, seed=seed)
    for part in ("train", "test"):
        if len(split[part]) == 0:
            raise UnlearnError(f"task {name!r}: the {part} split is empty; change test_size or max_rows")
    return split
