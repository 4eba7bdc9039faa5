"""Deletion requests, from one request end to end (:func:`forget`) to a stream of them (the request ledger).

``forgetting`` holds :func:`forget` (the module is not named ``forget``: a submodule of that name would shadow the
function on this package as soon as it was imported). Every name other modules and tests import from
``hf_unlearn.deletion`` is re-exported here, so ``from hf_unlearn.deletion import forget`` keeps working.
"""

from __future__ import annotations

from .forgetting import (
    COMMON_METHOD_ARGS,
    DEFAULT_APPROXIMATE,
    EXACT,
    OWN_COUNTS,
    OWN_SETTINGS,
    PROVENANCE_FILES,
    RECEIPT_FILE,
    RECEIPT_FORMAT,
    ForgetConfig,
    ForgetReceipt,
    _exact,
    _preset_values,
    _validate,
    _validate_run,
    forget,
    load_receipt,
    load_rows,
    parse_method_args,
    with_replay_progress,
)

__all__ = ["COMMON_METHOD_ARGS", "DEFAULT_APPROXIMATE", "EXACT", "OWN_COUNTS", "OWN_SETTINGS", "PROVENANCE_FILES",
           "RECEIPT_FILE", "RECEIPT_FORMAT", "ForgetConfig", "ForgetReceipt", "_exact", "_preset_values", "_validate", "_validate_run",
           "forget", "load_receipt", "load_rows", "parse_method_args", "with_replay_progress"]

from .ledger import DeletionLedger, Request  # noqa: E402
from .receipts import verify_receipt  # noqa: E402
from .service import Policy  # noqa: E402

__all__ += ["DeletionLedger", "Policy", "Request", "verify_receipt"]
