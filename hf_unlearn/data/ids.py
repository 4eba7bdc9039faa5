"""Sample ids against data: the type check every store and run applies, and the selection of rows by id.

The id file format (:func:`read_ids`, :func:`write_ids`, ``SampleId``) is read where every command checks its inputs,
:mod:`hf_unlearn.validation`, and re-exported here.
"""

from __future__ import annotations

from typing import Iterable

from ..errors import UnlearnError
from ..validation import SampleId, read_ids, write_ids

__all__ = ["SampleId", "check_id_types", "read_ids", "select_ids", "write_ids"]

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
