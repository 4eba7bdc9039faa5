"""Where local copies of the data live.

Loaders take an explicit ``path``. Without one they look at ``HF_UNLEARN_DATA_DIR`` (a folder laid out
like ``shared/data``: ``tofu/``, ``tasks/``, ``muse_news/``) and otherwise go to the Hub. Nothing in the
package hard-codes a local path.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "HF_UNLEARN_DATA_DIR"


def data_dir() -> Path | None:
    """The folder named by ``HF_UNLEARN_DATA_DIR``, or None when it is unset."""
    value = os.environ.get(DATA_DIR_ENV)
    return Path(value).expanduser() if value else None


def resolve_local(path: str | os.PathLike | None, subdir: str) -> Path | None:
    """An explicit ``path`` if given, else ``$HF_UNLEARN_DATA_DIR/<subdir>`` if set, else None (use the Hub)."""
    if path is not None:
        return Path(path).expanduser()
    root = data_dir()
    return root / subdir if root is not None else None
