"""Data loading: TOFU, multiple-choice task sets, MUSE-News; tokenisation and collation.

Every row carries a stable ``id`` (see :mod:`hf_unlearn.data.tofu` for TOFU's id scheme).
"""

from .collators import QACollator
from .local import data_dir, resolve_local
from .muse import load_muse_news
from .tasks import load_task
from .tofu import TOFU_CONFIGS, load_tofu
from .tokenize import tokenize_qa

__all__ = [
    "QACollator",
    "TOFU_CONFIGS",
    "data_dir",
    "load_muse_news",
    "load_task",
    "load_tofu",
    "resolve_local",
    "tokenize_qa",
]
