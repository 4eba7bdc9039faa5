"""Deletion-request id files: the one reader every command uses (`trace`, `forget`, `eval`, `hub`).

Ids are ints or strings, and a digit-only string is not the int it spells. The typed form keeps the difference:
JSON Lines (``.jsonl``), one JSON value per line (``3600`` or ``"3600"`` or ``{"id": ...}``), or a JSON list
(``.json``). Any other file is the legacy text form, one id per line, where all-digit lines become ints.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Union

from ..errors import UnlearnError

SampleId = Union[int, str]


def _typed(value, where: str) -> SampleId:
    if isinstance(value, dict):
        if "id" not in value:
            raise UnlearnError(f"{where}: an object needs an \"id\" field, got keys {sorted(value)}")
        value = value["id"]
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise UnlearnError(f"{where}: an id must be an integer or a string, got {type(value).__name__} {value!r}")
    if isinstance(value, str) and not value.strip():
        raise UnlearnError(f"{where}: empty string id")
    return value


def read_ids(path: str | Path) -> list[SampleId]:
    """The ids of a deletion request file, in file order, duplicates removed; an empty or unreadable file is an error."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UnlearnError(f"cannot read the id file {path}: {e.strerror or e}") from None
    ids: list[SampleId] = []
    suffix = path.suffix.lower()
    if suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise UnlearnError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); expected a list of ids") from None
        if not isinstance(values, list):
            raise UnlearnError(f"{path} must hold a JSON list of ids, got {type(values).__name__}")
        ids = [_typed(v, f"{path} item {i}") for i, v in enumerate(values)]
    elif suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                raise UnlearnError(f"{path} line {n} is not JSON: {line.strip()[:40]!r} (quote string ids: "
                                   f"\"abc-1\")") from None
            ids.append(_typed(value, f"{path} line {n}"))
    else:
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                ids.append(int(line) if line.lstrip("-").isdigit() else line)
    if not ids:
        raise UnlearnError(f"the id file {path} holds no ids")
    return list(dict.fromkeys(ids))


def write_ids(path: str | Path, ids: Iterable[SampleId]) -> Path:
    """Write ids in the typed JSON Lines form (atomically)."""
    from ..utils import atomic_write_text

    ids = [_typed(i, "write_ids") for i in ids]
    atomic_write_text(path, "".join(json.dumps(i) + "\n" for i in ids), private=True)  # raw ids: owner-only
    return Path(path)


def check_id_types(ids: Iterable[SampleId], known: Iterable[SampleId] | type, what: str = "the run") -> None:
    """Refuse ids whose type differs from ``known``'s (e.g. ``"3600"`` against int ids), naming both types.

    ``known`` is the ids of the run (or store), or their type (``int`` or ``str``) when only that is at hand.
    """
    kinds = {known} if isinstance(known, type) else {type(k) for k in known}
    if len(kinds) != 1:
        return
    (kind,) = kinds
    wrong = [i for i in ids if type(i) is not kind]
    if wrong:
        raise UnlearnError(f"id {wrong[0]!r} is {type(wrong[0]).__name__} but {what} uses {kind.__name__} ids "
                           f"({len(wrong)} such id(s)); write ids in the typed form (.jsonl: 3600 vs \"3600\")")


def select_ids(dataset, ids: Iterable[SampleId], what: str = "the data", source: str = "the id list",
               id_column: str = "id"):
    """The rows of ``dataset`` whose id is in ``ids`` (dataset order); ids of the wrong type or absent are an error.

    This is how an id file (e.g. ``hf-unlearn analyze stratify``'s ``hard.jsonl``) becomes a forget set.
    """
    ids = list(ids)
    have = dataset[id_column]
    check_id_types(ids, have, what)
    known = set(have)
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise UnlearnError(f"{len(unknown)} id(s) of {source} are not in {what} (e.g. {unknown[0]!r})")
    keep = set(ids)
    return dataset.filter(lambda r: r[id_column] in keep)
