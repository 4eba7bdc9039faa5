"""MUSE-News (Shi et al., 2024): verbatim memorisation, knowledge memorisation, privacy leakage sets.

Local layout (as on the Hub's ``muse-bench/MUSE-News``): ``<subset>/<split>.json``, e.g. ``verbmem/forget.json``
(prompt/gt), ``knowmem/forget_qa.json`` (question/answer), ``privleak/holdout.json`` and ``raw/forget.json``
(lists of texts, returned with a ``text`` column). Rows get ``id`` = row index within the split.
"""

from __future__ import annotations

import json
import os

from ..errors import UnlearnError
from .local import resolve_local

MUSE_NEWS_HUB_ID = "muse-bench/MUSE-News"
MUSE_SPLITS = {
    "raw": ("forget", "retain1", "retain2", "holdout"),
    "verbmem": ("forget",),
    "knowmem": ("forget_qa", "retain_qa", "retain2_qa"),
    "privleak": ("forget", "retain2", "holdout"),
}


def load_muse_news(subset: str, split: str, path: str | os.PathLike | None = None):
    """Load one MUSE-News subset/split as a ``datasets.Dataset`` with an ``id`` column."""
    from datasets import Dataset

    if subset not in MUSE_SPLITS:
        raise UnlearnError(f"unknown MUSE-News subset {subset!r}; choose one of {', '.join(MUSE_SPLITS)}")
    folder = resolve_local(path, "muse_news")
    if folder is None:
        from datasets import load_dataset

        from ..validation import check_hub_dataset

        check_hub_dataset(MUSE_NEWS_HUB_ID, "set HF_UNLEARN_DATA_DIR to a folder holding muse_news/ or pass "
                                            "--muse DIR (path=)")
        rows = load_dataset(MUSE_NEWS_HUB_ID, subset, split=split).to_list()
    else:
        file = folder / subset / f"{split}.json"
        if not file.is_file():
            raise UnlearnError(
                f"MUSE-News folder {folder} has no {subset}/{split}.json (splits of {subset}: "
                f"{', '.join(MUSE_SPLITS[subset])}); the raw retain/holdout corpora are only on the Hub"
            )
        with open(file, encoding="utf-8") as f:
            rows = json.load(f)
    rows = [{"text": r} if isinstance(r, str) else dict(r) for r in rows]
    if not rows:
        raise UnlearnError(f"MUSE-News {subset}/{split} is empty")
    for i, row in enumerate(rows):
        row["id"] = i
    return Dataset.from_list(rows)
