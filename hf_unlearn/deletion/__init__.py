"""Deletion requests, from one request end to end (:func:`forget`) to a stream of them (the request ledger).

``forgetting`` holds :func:`forget` (the module is not named ``forget``: a submodule of that name would shadow the
function on this package as soon as it was imported). Every name other modules and tests import from
``hf_unlearn.deletion`` is re-exported here, so ``from hf_unlearn.deletion import forget`` keeps working. No module
of the package imports the package itself (``from . import x`` or ``hf_unlearn.deletion``): each imports the room it
needs, so this file stays the top of the graph.

Inside, the rooms form floors that only point down (a module imports only from its own floor or lower ones; "|" =
independent rooms on one floor). From the top:

* ``ledger``: :class:`DeletionLedger`, the journal with the service's entry points (serve, plan, status) and the
  request check of ``add``: what ``hf-unlearn requests`` and the web intake drive.
* ``service``: serving a ledger's requests: exact batches (one :func:`forget` for the union of pending requests),
  the approximate hot path, the signed per-request receipts of a batch, the planner, the :class:`Policy`, status.
* ``forgetting``: :func:`forget`, one request end to end: validate, run, publish, write the receipt.
* ``checks``: every refusal before compute (ids, options, run, program, proof gate, Hub); returns the plan.
* ``exact`` | ``approximate`` | ``pipeline``: the runs: one recorded run's redacted replay (and oracle), an
  approximate method on a model, a training pipeline's stages (and ``verify_pipeline``).
* ``publishing``: the Hub side of a deletion: pre-compute Hub checks, push, fresh-download verification, the card's
  own numbers the id scanner must not take for ids.
* ``forget_receipt``: :class:`ForgetReceipt` (guarantee, verdict, summary table), built from the saved model's
  hashes, written (no raw id) and read back.
* ``remains`` | ``preference_terms`` | ``outputs`` | ``runs``: what still holds the deleted rows (the summary's last
  rows); what a DPO counterfactual keeps; a LoRA run's merged output; what the exact paths share about a run
  (pipeline stage?, collator, launch size, a replay trainer with progress).
* ``config``: :class:`ForgetConfig`, the method and output names, the flags' short spellings.
* ``erasure``: ``purge`` (what a served batch leaves in the service's stores and runs) and the retired-run check.
* ``journal``: :class:`~hf_unlearn.deletion.journal.RequestJournal`, the signed append-only store of a ledger
  folder: checked reads, locks (appends, one serve at a time), atomic appends with key rotation, ``add``, ``recover``.
* ``receipts``: signed service receipts, acknowledgements, bundles and :func:`verify_receipt` (public key alone).
* ``evidence`` | ``prefix``: a ledger checked against the service's own evidence beside it (rollback detection);
  what a journal object already checked of ``ledger.jsonl`` (the SHA-256 of the prefix it read and the signature
  walk over it), so a read checks only what was appended since.
* ``records``: the ledger folder's file names, request states, time helpers, :func:`~.records.read_records`,
  ``read_head``, ``fold``: the records read without a key.
* ``chain``: canonical JSON, record hashes and signatures, the signed head, :func:`~.chain.check_chain`.

``forget`` sits below the service because a batch *is* a ``forget`` call; ``receipts`` below the journal because
``add`` acknowledges and ``recover`` checks receipts (they take the journal as an argument, never import it).
"""

from __future__ import annotations

from .approximate import _preset_values
from .checks import _validate, _validate_run, load_rows
from .config import (
    COMMON_METHOD_ARGS,
    DEFAULT_APPROXIMATE,
    EXACT,
    RECEIPT_FILE,
    RECEIPT_FORMAT,
    ForgetConfig,
    parse_method_args,
)
from .exact import _exact
from .forget_receipt import ForgetReceipt, load_receipt
from .forgetting import forget
from .ledger import DeletionLedger, Request
from .publishing import OWN_COUNTS, OWN_SETTINGS, PROVENANCE_FILES
from .receipts import verify_receipt
from .runs import with_replay_progress
from .service import Policy

__all__ = ["COMMON_METHOD_ARGS", "DEFAULT_APPROXIMATE", "EXACT", "OWN_COUNTS", "OWN_SETTINGS", "PROVENANCE_FILES",
           "RECEIPT_FILE", "RECEIPT_FORMAT", "ForgetConfig", "ForgetReceipt", "_exact", "_preset_values", "_validate",
           "_validate_run", "forget", "load_receipt", "load_rows", "parse_method_args", "with_replay_progress",
           "DeletionLedger", "Policy", "Request", "verify_receipt"]
