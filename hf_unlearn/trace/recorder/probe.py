"""The dummy-weight probe: a trainer with its own ``compute_loss`` must give a deleted slot's dummy row no gradient;
checked once at construction on a real row, leaving no trace of the call in the trainer's attributes."""

from __future__ import annotations

import copy
import json

import torch

from ...errors import UnlearnError
from ..guards import program_hooks
from ..model_info import samples_sharing_a_microbatch
from ..rng import all_seeded
from ..trainers import recorded_trainer_class
from .slots import dummy_row


def check_dummy_has_no_influence(trainer, row: dict) -> str | None:
    """The trainer's loss must give a deleted slot's dummy row no weight: the loss's gradient with respect to the
    dummy's input embeddings, in a microbatch beside a real row, must be exactly zero (a term on every token
    regardless of the labels would fail). Run for the stock ``Trainer.compute_loss`` too: the loss is the model's,
    and a model can add a term over every token itself (a MoE router's load-balancing loss, ``output_router_logits``),
    which no label check shows. Run with the dummy after the real row and before it: a flattened (padding-free)
    microbatch whose attention is not cut at the rows' starts lets a later row attend to the dummy, which only the
    second order shows (the counterfactual's later rows attend to the deleted row's tokens, a replay's to dummies).
    Then, where a microbatch holds several samples, the real row's gradient beside the dummy must be the one beside a
    row whose labels are masked (:func:`_couples_rows`); with ``trace_allow_hazards`` a difference is returned as a
    hazard instead of refused."""
    cls = recorded_trainer_class(type(trainer))
    whole = row  # the coupling check compares the row's real tokens with the dummy's: a window could miss the token
    whole_dummy = dummy_row(whole, len(whole["input_ids"]), trainer.dummy_token_id, trainer.id_column)  # it counts
    row = probe_window(row)
    dummy = dummy_row(row, len(row["input_ids"]), trainer.dummy_token_id, trainer.id_column)
    model = trainer.model
    for dummy_first in (False, True):
        if _dummy_gradient(trainer, cls, row, dummy, dummy_first):
            hooks = program_hooks(trainer.accelerator.unwrap_model(model))
            why = (f"a hook or function a replay does not run is set on the model ({hooks[0]}), and it acts on the "
                   "dummy row: remove it, or make it part of the model's code" if hooks and not dummy_first else
                   _why_a_term_on_every_token(model) if not dummy_first else
                   "the real row after it attends to it: the microbatch's rows are flattened into one sequence whose "
                   "attention is not cut at the rows' starts (a padding-free collator with use_cache=True, or an "
                   "attention implementation that ignores the position ids' restarts), so the counterfactual's later "
                   "rows attend to a deleted row's tokens and a replay's to dummies; set use_cache=False (the "
                   "TrainingArguments default) or pad the rows instead")
            raise UnlearnError(f"{cls.__qualname__}.compute_loss gives the dummy row that replaces a deleted sample a "
                               f"gradient ({why}): a deleted slot would not have weight 0, so a replay would not "
                               "delete it" + ("" if dummy_first else "; weight every term by the labels"))
    trainer._trace_trainer["dummies_only_loss"] = _dummies_only_loss(trainer, cls, dummy)
    if samples_sharing_a_microbatch(trainer.args) and _couples_rows(trainer, cls, whole, whole_dummy):
        why = (f"{cls.__qualname__}.compute_loss weights a row by what the other rows of its microbatch hold: a row's "
               "gradient beside a deleted row's dummy is not the one beside a row whose labels are masked (the "
               "counterfactual), e.g. a normaliser counted on input_ids or attention_mask instead of the labels; "
               "deleting a row would re-weight the others, so a replay is not the run without it; divide by "
               "num_items_in_batch (the labelled tokens) instead, or record with per_device_train_batch_size=1")
        if not trainer.trace_allow_hazards:
            raise UnlearnError(why)
        return why  # a hazard the run lists
    return None


def _dummy_gradient(trainer, cls, row: dict, dummy: dict, dummy_first: bool) -> bool:
    """Whether the loss of a microbatch of ``row`` and ``dummy`` (in that order, or the dummy first) gives the
    dummy's input embeddings a non-zero gradient."""
    batch = trainer.data_collator([dummy, dict(row)] if dummy_first else [dict(row), dummy])
    grad, n = _embedding_gradient(trainer, cls, batch), len(row["input_ids"])
    if grad is None:
        return False
    if dummy_first:  # padded: row 0; flattened (one row): its first n tokens
        part = grad[0, :n]
    else:
        part = grad[0, n:2 * n] if grad.shape[0] == 1 else grad[1, :n]  # 1 row: padding-free
    return bool((part != 0).any())


def _couples_rows(trainer, cls, row: dict, dummy: dict) -> bool:
    """Whether ``row``'s gradient beside the dummy differs from its gradient beside a copy of itself whose labels are
    all -100 (what the counterfactual trains on in the deleted slot): a loss that reads a neighbour's tokens other
    than through its labels (a normaliser counted on ``input_ids`` or ``attention_mask``, a batch statistic)
    re-weights a row when its neighbour is deleted, and the dummy's own zero gradient does not show it."""
    n = len(row["input_ids"])
    with all_seeded(0):  # a collator that draws: the same draws for both microbatches
        masked = trainer.data_collator([dict(row), dict(row)])
        beside = trainer.data_collator([dict(row), dict(dummy)])
    labels = masked.get("labels")
    if not torch.is_tensor(labels) or labels.dim() != 2:
        return False  # no labels to mask: the loss is the model's own over every token (probed above)
    labels = labels.clone()
    if labels.shape[0] == 2:
        labels[1] = -100
    elif labels.shape[0] == 1 and labels.shape[1] >= 2 * n:  # padding-free: one flattened row
        labels[0, n:2 * n] = -100
    else:
        return False
    masked["labels"] = labels
    beside_dummy = _embedding_gradient(trainer, cls, beside)
    beside_masked = _embedding_gradient(trainer, cls, masked)
    if beside_dummy is None or beside_masked is None:
        return False
    return not torch.equal(beside_dummy[0, :n], beside_masked[0, :n])


def _embedding_gradient(trainer, cls, batch: dict):
    """The gradient ``compute_loss`` gives the input embeddings of a collated microbatch (eval mode, seeded, every
    attribute of the trainer put back after it), or None if none reaches them."""
    return _run_loss(trainer, cls, batch, torch.tensor(1.0, device=trainer.args.device), backward=True)[1]


def _dummies_only_loss(trainer, cls, dummy: dict) -> str:
    """``"finite"`` or ``"not finite"``: the loss ``compute_loss`` returns on a microbatch of dummies only, called
    without a normaliser (as a run with none calls it). The plain run with a step's every row masked calls the loss on
    such a microbatch and steps the optimizer on what it gives: a finite loss (a sum over the labelled tokens divided
    by at least 1) gives zero gradients, and replays run those microbatches and step too; a mean over no labelled
    token is NaN, which the plain run would spread into every weight, and replays skip those microbatches (the
    documented counterfactual). Sealed in the header, so every replay and oracle of the run decide alike."""
    batch = trainer.data_collator([dict(dummy) for _ in range(2 if samples_sharing_a_microbatch(trainer.args) else 1)])
    with torch.no_grad():
        loss = _run_loss(trainer, cls, batch, None, backward=False)[0]
    return "finite" if torch.is_tensor(loss) and bool(torch.isfinite(loss).all()) else "not finite"


def _run_loss(trainer, cls, batch: dict, num_items, backward: bool):
    """``(loss, gradient at the input embeddings or None)`` of ``compute_loss`` on a collated microbatch: eval mode,
    seeded, every attribute of the trainer put back after it (the user's loss may count its calls: the probe is not
    one of them)."""
    batch = trainer._prepare_inputs(batch)
    model = trainer.model
    seen = {}

    def capture(module, args, output):  # a leaf in place of the embeddings: its gradient is the dummy's weight
        seen["embeds"] = output.detach().requires_grad_(backward)
        return seen["embeds"]

    handle = model.get_input_embeddings().register_forward_hook(capture)
    training = model.training
    saved = copy.deepcopy(getattr(trainer, "_metrics", None))  # SFTTrainer logs metrics in compute_loss: not ours
    own = _attributes_kept(trainer)
    try:
        model.eval()  # no dropout: the probe's answer does not depend on a draw
        with all_seeded(0):
            loss = trainer.compute_loss(model, batch, num_items_in_batch=num_items)
            if backward:
                loss.backward()
    except Exception as e:  # noqa: BLE001 - the user's loss failed on a real row and a dummy
        raise UnlearnError(f"{cls.__qualname__}.compute_loss fails on the recorder's probe, a microbatch of a training "
                           f"row beside the dummy row that replaces a deleted sample: {e} (if the same trainer fails "
                           "without the recorder too, the model or its adapter is the cause, not the dummy)") from None
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
        model.train(training)
        if saved is not None:
            trainer._metrics = saved
        own.restore()
    embeds = seen.get("embeds")
    return loss.detach() if torch.is_tensor(loss) else loss, None if embeds is None else embeds.grad


def _why_a_term_on_every_token(model) -> str:
    """The likely cause the probe names: the model's own router loss, or a loss term on tokens labelled -100."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0):
        return ("the model's MoE router load-balancing loss, output_router_logits=True with router_aux_loss_coef="
                f"{config.router_aux_loss_coef}, runs over every token of the microbatch, a deleted row's included; "
                "set output_router_logits=False or router_aux_loss_coef=0")
    return "a term on tokens whose labels are -100?"



PROBE_WINDOW = 8  # tokens of the probe's row: PROBE_WINDOW // 2 before its first token to train on, the rest from it
_TOKEN_COLUMNS = {"input_ids", "attention_mask", "completion_mask", "assistant_masks", "labels"}


def probe_window(row: dict) -> dict:
    """The row the dummy-weight probe runs on: :data:`PROBE_WINDOW` consecutive tokens of ``row`` around its first
    token to train on (``completion_mask``/``assistant_masks`` 1, ``labels`` not -100; the first token without
    them), every token column cut alike: a real row's tokens, with tokens to train on and tokens not to. What the
    probe checks, that the loss gives a dummy row beside a real one no gradient, is a property of the loss that does
    not depend on the row's length; its forward and backward pass cost the row's tokens. A row with any other column
    (packing's positions, images) is kept whole."""
    n = len(row.get("input_ids") or [])
    if not set(row) <= _TOKEN_COLUMNS or n <= PROBE_WINDOW or any(
            not isinstance(v, list) or len(v) != n for v in row.values()):
        return row
    trained = [all(row[m][i] for m in ("completion_mask", "assistant_masks") if m in row)
               and row.get("labels", [0] * n)[i] != -100 for i in range(n)]
    first = trained.index(True) if True in trained else 0
    start = max(0, min(first - PROBE_WINDOW // 2, n - PROBE_WINDOW))
    return {k: v[start:start + PROBE_WINDOW] for k, v in row.items()}


class _attributes_kept:
    """The trainer's attributes as they are now, to put back after a probe runs the user's ``compute_loss``: every
    attribute rebound, added or removed comes back, and plain values (numbers, strings, lists and dicts of them) are
    copied, so an in-place ``self.calls.append(...)`` is undone too. The probe leaves no trace a later step could
    read (a counter-based edit would otherwise run one step early)."""

    def __init__(self, obj):
        self.obj, self.before = obj, dict(vars(obj))
        self.copies = {}
        for k, v in self.before.items():
            if isinstance(v, (list, dict, set)):
                try:
                    json.dumps(list(v) if isinstance(v, set) else v)
                except (TypeError, ValueError):
                    continue
                self.copies[k] = copy.deepcopy(v)

    def restore(self) -> None:
        now = vars(self.obj)
        for k in [k for k in now if k not in self.before]:
            del now[k]
        now.update(self.before)
        for k, v in self.copies.items():
            target = now[k]
            target.clear()
            target.update(v) if isinstance(target, (dict, set)) else target.extend(v)
