"""A small TOFU subset shipped inside the package, so the demo and the examples run with no data folder and no Hub.

``tofu_subset/tofu_10_authors.jsonl`` holds the first 10 fictitious authors of TOFU ``full`` (200 QA pairs, 20 per
author, in Hub order). TOFU (Maini et al., 2024) is MIT licensed; ``tofu_subset/LICENSE`` carries its notice. Ids
are the row index into ``full``, the same scheme as :func:`hf_unlearn.data.load_tofu`, so a request written against
the subset names the same rows in the whole dataset.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UnlearnError

EMBEDDED_TOFU_FILE = Path(__file__).with_name("tofu_subset") / "tofu_10_authors.jsonl"
EMBEDDED_TOFU_AUTHORS = 10
ROWS_PER_AUTHOR = 20


def load_embedded_tofu(authors: int | None = None):
    """The embedded TOFU subset (the first ``authors`` authors, default all 10) as a ``datasets.Dataset``.

    Columns ``id``, ``question``, ``answer``; ids ``0 .. 20*authors-1`` are rows of TOFU ``full``.
    """
    import json

    from datasets import Dataset

    authors = EMBEDDED_TOFU_AUTHORS if authors is None else authors
    if not 1 <= authors <= EMBEDDED_TOFU_AUTHORS:
        raise UnlearnError(f"the embedded TOFU subset has {EMBEDDED_TOFU_AUTHORS} authors, asked for {authors}; "
                           "pass a TOFU folder (--tofu DIR) for more")
    with open(EMBEDDED_TOFU_FILE, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return Dataset.from_list(rows[: authors * ROWS_PER_AUTHOR])


def author_ids(author: int) -> list[int]:
    """The TOFU ids of author number ``author`` (0-based): its 20 consecutive rows of ``full``."""
    return list(range(author * ROWS_PER_AUTHOR, (author + 1) * ROWS_PER_AUTHOR))
