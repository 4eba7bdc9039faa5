"""The request ledger of a recorded run with the service that honours it: :class:`DeletionLedger`.

What ``hf-unlearn requests`` and the web intake drive. It is the signed journal
(:class:`~hf_unlearn.deletion.journal.RequestJournal`: the ledger folder's records, locks, appends and recovery)
with the service's entry points on top (serve, plan, status: :mod:`hf_unlearn.deletion.service`) and the request
check of :func:`~hf_unlearn.deletion.forget` for :meth:`DeletionLedger.add`. It sits above both, so neither the
journal nor the service imports the other's caller. The names of the ledger's files and the record helpers live in
:mod:`hf_unlearn.deletion.records` and :mod:`hf_unlearn.deletion.journal` and are re-exported here.
"""

from __future__ import annotations

from . import service
from .chain import HEAD_FORMAT
from .checks import check_request
from .journal import (
    CLOCK_SKEW,
    DEFAULT_DEADLINE_DAYS,
    MAX_DEADLINE_DAYS,
    LedgerTail,
    RequestJournal,
    check_deadline_days,
)
from .records import (
    APPENDED,
    APPROXIMATE,
    EXACT,
    HEAD_FILE,
    LEDGER_DIR,
    LEDGER_FORMAT,
    PENDING,
    PRIVATE_FILE,
    RECORDS_FILE,
    Request,
    fold,
    iso,
    parse_time,
    read_head,
    read_records,
    utc_now,
)

__all__ = ["APPENDED", "APPROXIMATE", "CLOCK_SKEW", "DEFAULT_DEADLINE_DAYS", "EXACT", "HEAD_FILE", "HEAD_FORMAT",
           "LEDGER_DIR", "LEDGER_FORMAT", "MAX_DEADLINE_DAYS", "PENDING", "PRIVATE_FILE", "RECORDS_FILE",
           "DeletionLedger", "LedgerTail", "Request", "RequestJournal", "check_deadline_days", "fold", "iso",
           "parse_time", "read_head", "read_records", "utc_now"]


class DeletionLedger(RequestJournal):
    """The deletion requests of one recorded run, and the service that honours them.

    Args:
        run: the recorded run (the ``trace_dir`` of a ``TraceRecordingTrainer``).
        path: the ledger folder (default ``RUN/requests``); created by the first :meth:`add`.
        deadline_days: the deadline of a new request, in days after it was received (default 30: GDPR's month).
        signing_key: the Ed25519 private key that signs receipts and the ledger head (default: the library's,
            :func:`hf_unlearn.keys.load_signing_key`, created on first use).
    """

    def add(self, ids, ref: str | None = None, received=None, deadline_days: float | None = None) -> Request:
        """Append a deletion request; the ids are checked against the run first (unknown or wrongly typed ids are
        refused, naming them; a pipeline's last run: against every stage). Returns the request as recorded; a signed
        acknowledgement is written to ``receipts/r-NNNN.ack.json`` (:func:`hf_unlearn.deletion.receipts.acknowledge`)."""
        return super().add(ids, ref, received, deadline_days, check=check_request)

    # -- serving (hf_unlearn.deletion.service) ---------------------------------------------------------------------
    def serve_exact(self, **options):
        """One exact batch over every pending request (:func:`hf_unlearn.deletion.service.serve_exact`)."""
        return service.serve_exact(self, **options)

    def serve_approximate(self, **options):
        """The approximate hot path (:func:`hf_unlearn.deletion.service.serve_approximate`)."""
        return service.serve_approximate(self, **options)

    def serve_due(self, policy=None, **options):
        """Apply a :class:`~hf_unlearn.deletion.service.Policy` once (what cron runs)."""
        policy = policy if isinstance(policy, service.Policy) else service.Policy.load(policy)
        return service.serve_due(self, policy, **options)

    def plan(self, now=None) -> dict:
        """Replay cost of the pending set: one batch now, each alone, waiting for the earliest deadline."""
        return service.plan(self, now)

    def status(self, now=None) -> dict:
        return service.status(self, now)
