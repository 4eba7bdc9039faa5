"""What still holds the deleted rows after a deletion, and the command that erases it: the last rows of
``forget``'s summary.

A deletion writes a new model (and, exact, a new run without the rows); it erases nothing. The source keeps them: a
recorded run's token store (raw rows) and its checkpoints after the replay's start (trained on them), what the
Trainer saved beside the run, an earlier deletion's output the run came from (its model, store and replay) and its
published revision; for an approximate method the model it started from, whose rows it only suppresses. Saying so,
with the command, is the difference between "deleted" and "a new model beside the old one".
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from .config import RECEIPT_FILE
from .records import LEDGER_DIR, RECORDS_FILE

# the engine's rooms (hf_unlearn.trace, hub, data, methods, eval, models) are imported inside the functions: most
# load torch, and `import hf_unlearn.deletion` must not (the CLI's early refusals run before torch loads)

TRAINER_OUTPUTS = ("config.json", "model.safetensors", "model.safetensors.index.json", "adapter_config.json",
                   "pytorch_model.bin")  # a model Trainer.save_model wrote into the run's parent folder


def still_holding(receipt) -> list[tuple[str, str]]:
    """``[("still holds", ...), ("to erase", ...)]`` for a :class:`~hf_unlearn.deletion.ForgetReceipt`."""
    out = Path(receipt.output_dir)
    ledger = _ledger_of(out)
    if receipt.mode != "exact":
        return _approximate(receipt, out, ledger)
    if receipt.evidence.get("pipeline"):
        stages = receipt.evidence["pipeline"]
        stage = next((s["stage"] for s in stages if s.get("replayed")), 1)
        # stages before it that hold an id of the request never trained on it: only their token stores hold the row
        stores = [s["stage"] for s in stages if s["stage"] < stage and s.get("ids")]
        last = max(s["stage"] for s in stages)
        return [("still holds", "the deleted rows: " + (f"the token store of stage(s) {', '.join(map(str, stores))} "
                                                        "(rows never trained on there), " if stores else "")
                 + f"the recorded runs of the pipeline from stage {stage} on (their token stores and checkpoints) and "
                   f"every model they trained; {out}/stage-{last}/replay holds none: the next request deletes from it"),
                ("to erase", "delete those runs (each stage's trace folder, and what its Trainer saved beside it) once "
                             f"you keep {out}")]
    run = Path(receipt.source)
    earlier = _forget_output_of(run)
    if earlier is not None:  # the run is an earlier deletion's replay: that whole output holds the rows now deleted
        held = f"{earlier} (the earlier deletion this one deletes from: its model, store and replay)"
        published = _published(earlier)
        if published:
            held += f", and its revision {published} on the Hub"
        target = earlier
    else:
        held = f"the source run {run} ({_run_parts(run, receipt)})"
        target = run
        trainer = run.parent if run.parent != run else None
        saved = _trainer_outputs(trainer) if trainer is not None else ""
        if saved:
            held += f" and what the Trainer saved beside it in {trainer} ({saved})"
            if not _inside(out, trainer):
                target = trainer
    held = f"the deleted rows: {held}; {out}/replay holds none: the next request deletes from it"
    if ledger is not None:
        erase = (f"`{_purge_command(ledger)}` (the service's erasure: the run's store and checkpoints, earlier "
                 "batches; what it cannot reach it names)")
    else:
        erase = (f"`rm -r {shlex.quote(str(target))}` once you keep {out} (and any copy of the training data); a "
                 "ledger's `hf-unlearn requests purge` does this for requests served with `hf-unlearn requests`")
    return [("still holds", held), ("to erase", erase)]


def _approximate(receipt, out: Path, ledger: Path | None) -> list[tuple[str, str]]:
    source = receipt.source
    held = (f"the deleted rows' influence: the model you started from, {source}, was trained on them, and "
            f"{out}/model only suppresses them (approximate); every copy of the training data holds them")
    if ledger is not None:
        erase = ("an exact batch (`hf-unlearn requests serve --exact`) supersedes this model, then "
                 f"`{_purge_command(ledger)}` erases what the service keeps")
    else:
        where = f"`rm -r {shlex.quote(source)}`" if Path(source).exists() else \
            f"delete (or make private) {source} where it is published"
        erase = (f"{where} once {out}/model replaces it; only a retrain without the rows, or an exact deletion of a "
                 "recorded run, removes their influence")
    return [("still holds", held), ("to erase", erase)]


def _run_parts(run: Path, receipt) -> str:
    from ..trace.checkpoints import list_checkpoints

    start = (receipt.evidence.get("cost") or {}).get("start_checkpoint") or 0
    later = [s for s in list_checkpoints(run) if s > start] if run.is_dir() else []
    parts = ["its token store"] if (run / "private" / "store").is_dir() else []
    if later:
        parts.append(f"its {len(later)} checkpoint(s) after step {start}, trained on them")
    return " and ".join(parts) or "its records"


def _trainer_outputs(folder: Path) -> str:
    """What a Trainer's ``output_dir`` holds besides the run ("checkpoint-*, the final model"), or ""."""
    parts = ["checkpoint-*"] if any(p.is_dir() for p in folder.glob("checkpoint-*")) else []
    if any((folder / f).is_file() for f in TRAINER_OUTPUTS):
        parts.append("the final model")
    return ", ".join(parts)


def _inside(path: Path, folder: Path) -> bool:
    try:
        return os.path.commonpath([os.path.abspath(path), os.path.abspath(folder)]) == os.path.abspath(folder)
    except ValueError:
        return False


def _forget_output_of(run: Path) -> Path | None:
    """The forget output folder whose ``replay/`` the run is, or None."""
    if run.name == "replay" and (run.parent / RECEIPT_FILE).is_file() and (run.parent / "model").is_dir():
        return run.parent
    return None


def _published(output: Path) -> str | None:
    try:
        published = json.loads((output / RECEIPT_FILE).read_text()).get("published") or {}
    except (OSError, ValueError, AttributeError):
        return None
    if published.get("repo") and published.get("tag") and not published.get("error"):
        return f"{published['repo']}@{published['tag']}"
    return None


def _ledger_of(out: Path) -> Path | None:
    """The ledger folder a service batch (``LEDGER/batches/batch-NNNN``) or provisional model was written in."""
    if out.parent.name in ("batches", "provisional") and (out.parent.parent / RECORDS_FILE).is_file():
        return out.parent.parent
    return None


def _purge_command(ledger: Path) -> str:
    """``hf-unlearn requests purge RUN [--ledger DIR]``: the run is the one the first batch deleted from."""
    run = None
    try:
        run = json.loads((ledger / "batches" / "batch-0001" / RECEIPT_FILE).read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        pass
    if ledger.name == LEDGER_DIR and (run is None or Path(run).resolve() == ledger.parent.resolve()):
        return f"hf-unlearn requests purge {shlex.quote(str(ledger.parent))}"
    return f"hf-unlearn requests purge {shlex.quote(str(run or 'RUN'))} --ledger {shlex.quote(str(ledger))}"
