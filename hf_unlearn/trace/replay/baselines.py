"""The naive baselines a replay is compared with: ``repack`` (retrain on the retained rows with fresh batching)
and the states they produce (``filter`` is :func:`hf_unlearn.trace.replay.filter_counterfactual`, a replay mode)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PrinterCallback, Trainer

from ...data.collators import rebuild_collator
from ...errors import UnlearnError
from ...utils import atomic_write_text
from ..hashing import checkpoint_hashes
from ..packing import is_packed
from ..recorder import build_optimizer
from ..request import _check_types
from ..run import TraceRun, capture_state, full_model_state, load_checkpoint, open_run
from ..run_model import model_from_run
from ..stack import pinned_stack
from ..store import load_store
from .arguments import training_args_from_header

# the naive baselines drop or re-batch whole store rows; a packed row holds several documents
PACKED_BASELINE = ("the {name} baseline drops whole rows, and a packed run's rows hold several documents, so it is not "
                   "defined for packing=True runs; compare the replay with the oracle (trace oracle, trace verify)")
PAIRS_BASELINE = ("the repack baseline retrains with Trainer's own loss, which is not DPO's (pairs, a reference model): "
                  "it is not defined for DPO runs; compare the replay with the oracle (trace oracle without --baselines)")


def repack_counterfactual(run, forget_ids, output_dir, data_collator=None, callbacks=None) -> dict:
    """The naive ``repack`` baseline: retrain from the step-0 state on the retained rows with fresh batching
    (``callbacks``: the Trainer's, e.g. a progress bar)."""
    run = run if isinstance(run, TraceRun) else open_run(run)
    if is_packed(run.header):
        raise UnlearnError(PACKED_BASELINE.format(name="repack"))
    if run.header.get("reference_model"):
        raise UnlearnError(PAIRS_BASELINE)
    _check_types(run, list(forget_ids))
    store = load_store(run.store_path)
    forget = set(forget_ids)
    retained = store.select([n for n, i in enumerate(store[run.id_column]) if i not in forget], keep_in_memory=True)
    model = model_from_run(run)
    start = load_checkpoint(run.checkpoints()[0])
    model.load_state_dict(full_model_state(start))
    args = training_args_from_header(run.header, output_dir, remove_unused_columns=False, logging_strategy="no")
    collate = data_collator or rebuild_collator(run.header.get("collator"), run.path / "collator", model=model)
    id_column = run.id_column

    def collator(features):
        return collate([{k: v for k, v in f.items() if k != id_column} for f in features])

    spec = run.header["optimizer"]
    optimizers = (None, None)
    if spec.get("source") == "custom":
        optimizers = (build_optimizer(spec["rebuild"], model, start["param_names"]), None)
    trainer = Trainer(model=model, args=args, train_dataset=retained, data_collator=collator, optimizers=optimizers,
                      callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # a baseline, not a user's training: no metrics dict on stdout
    with pinned_stack(run.header):  # the run's threads: the baseline's distance is not the thread count's
        trainer.train()
    return capture_state(model, trainer.optimizer, trainer.state.global_step, clone=True)


def save_state(state: dict, path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    atomic_write_text(path.with_suffix(".hashes.json"), json.dumps(checkpoint_hashes(state), indent=1, sort_keys=True))
