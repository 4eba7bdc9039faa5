"""Moved: every key lives in :mod:`hf_unlearn.keys`, keyed tags in :mod:`hf_unlearn.trace.tags`.

The names that used to be here are re-exported so existing imports keep working.
"""

from __future__ import annotations

from ..keys import (  # noqa: F401
    KEY_BYTES,
    KEY_ENV,
    KEY_FILE_ENV,
    MIN_KEY_BYTES,
    TAG_FORMAT,
    TAG_HEX_CHARS,
    archived_key_path,
    default_key_path,
    find_key,
    key_fingerprint,
    load_key,
    read_key_file,
    rotate_key,
    write_key_file,
)
from ..trace.tags import keyed_tag, keyed_tags  # noqa: F401
