"""Preflight: what a replay cannot reproduce is refused at construction (and again when training starts): the
dataset and its ids, the collator (random, or giving a deleted slot weight), the loss, fp16, dynamic rope, an
optimizer or model a replay cannot rebuild, a trainer class it cannot import; hazards raise unless allowed."""

from __future__ import annotations

import torch
from transformers import Trainer

from ...data.collators import _importable_name
from ...errors import UnlearnError
from ..hashing import batch_digest
from ..model_info import (
    dropout_settings,
    dynamic_rope,
    experts_hazard,
    peft_and_base,
    quantized,
    rebuilt_state_difference,
    routed_experts,
    samples_sharing_a_microbatch,
)
from ..packing import packing_refusal
from ..rng import rng_kept, seeded
from ..sharding import unsharded_class
from ..store import id_index
from ..trainers import metric_schedule, metric_scheduler, recorded_trainer_class, schedule_hazard
from ..trainers import trainer_spec as _trainer_spec
from .optimizers import optimizer_spec


def _collator_is_random(collator, rows: list[dict]) -> bool:
    """Collate the same rows under two seeds; a difference means the collator draws random numbers."""
    outs = []
    for s in (1, 2):
        with seeded(s):
            outs.append(batch_digest(collator([dict(r) for r in rows])))
    return outs[0] != outs[1]


PROBE_ROWS = 256  # the dummy-weight probe runs on the shortest of this many first rows


def probe_row(served, id_column: str) -> dict:
    """The row the dummy-weight probe runs its forward and backward passes on (their cost is its tokens'): the
    shortest of the first :data:`PROBE_ROWS` rows (fewest tokens over its token columns), among those with no empty
    token column and a token to train on (``completion_mask``, ``assistant_masks``, ``labels``), else the first
    row. What the probe checks is a property of the loss (a deleted slot's dummy gets no gradient, a neighbour's
    deletion does not re-weight a row), which any real row shows; the first one was as arbitrary and often longer.
    The probes then keep a few of its tokens (:func:`hf_unlearn.trace.preference.probe_pair`,
    :func:`.probe.probe_window`)."""
    head = served[:PROBE_ROWS]
    best, fewest = 0, None
    for i in range(len(head[id_column])):
        lists = [head[c][i] for c in head if c != id_column and isinstance(head[c][i], list)]
        if not lists or any(len(x) == 0 for x in lists):
            continue
        if any(m in head and not any(head[m][i]) for m in ("completion_mask", "assistant_masks")):
            continue
        if "labels" in head and isinstance(head["labels"][i], list) and all(x == -100 for x in head["labels"][i]):
            continue
        size = sum(len(x) for x in lists)
        if fewest is None or size < fewest:
            best, fewest = i, size
    return {k: v for k, v in served[best].items() if k != id_column}


def recorded_trainer(trainer) -> dict:
    """The recorded trainer class, config class and extra arguments (refused here if a replay cannot rebuild
    them)."""
    cls = recorded_trainer_class(type(trainer))
    spec = _trainer_spec(cls, trainer.args, trainer._trace_arguments)
    why = packing_refusal(trainer.args)
    if why:
        raise UnlearnError(f"{cls.__qualname__} with packing=True cannot be recorded for exact deletion: {why}")
    return spec


def preflight(trainer) -> tuple:
    """Check that a replay can reproduce this run; return ``(served rows, hazards, notes)``.

    Errors (an unusable dataset, a collator that gives a deleted slot weight, an optimizer or adapter a replay
    cannot rebuild) raise :class:`UnlearnError`; hazards (the replay would run but differ) raise too unless
    ``trace_allow_hazards``. Run at construction, again when training starts, with every RNG stream (Python's,
    numpy's, torch's) given back after it: the checks run the user's collator and ``compute_loss``, and a draw they
    made would shift what the recorded run trains on (a loss drawing from ``random`` trained another model than the
    same program without the recorder).
    """
    with rng_kept():
        return _preflight(trainer)


def _preflight(trainer) -> tuple:
    try:
        import datasets
    except ImportError:  # pragma: no cover
        datasets = None
    dataset = trainer.train_dataset
    if datasets is None or not isinstance(dataset, datasets.Dataset):
        raise UnlearnError("TraceRecordingTrainer needs train_dataset to be a datasets.Dataset of token rows "
                           f"with an id column (got {type(dataset).__name__}); the token store is saved from it")
    served = trainer._trace_served(dataset)
    if trainer.id_column not in served.column_names:
        raise UnlearnError(f"train_dataset has no {trainer.id_column!r} column; add stable sample ids "
                           "(hf_unlearn.tokenize_qa keeps TOFU's `id`), or pass id_column=")
    if trainer._trace_token_column not in served.column_names:
        raise UnlearnError(f"train_dataset has no `{trainer._trace_token_column}` column: the trace stores token rows")
    id_type = served.features[trainer.id_column]
    if getattr(id_type, "dtype", None) not in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                                                 "uint64", "string", "large_string"):
        raise UnlearnError(f"the id column {trainer.id_column!r} has type {id_type}; ids must be ints or strings")
    if len(served) == 0:
        raise UnlearnError("train_dataset is empty")
    id_index(served, trainer.id_column)  # unique ids
    collator = trainer.data_collator
    hazards, notes = [], []
    args = trainer.args
    rows = [{k: v for k, v in served[i].items() if k != trainer.id_column} for i in range(min(2, len(served)))]
    try:
        random_collator = _collator_is_random(collator, rows)
    except Exception as e:  # noqa: BLE001 - a collator that fails on real rows is the user's error to see
        raise UnlearnError(f"the data collator fails on the training rows (without the id column): {e}") from None
    name = getattr(collator, "__qualname__", type(collator).__qualname__)
    if random_collator:
        hazards.append(f"the data collator ({name}) is random (its output changes with the RNG seed): replays "
                       "re-collate stored rows and cannot reproduce its draws")
    if args.dataloader_num_workers > 0:
        notes.append(f"dataloader_num_workers={args.dataloader_num_workers}: harmless, the collator is "
                     "deterministic and batches are digested in the plan")
    if served.format.get("type") == "custom":
        hazards.append("train_dataset has an on-the-fly transform (set_transform/with_transform): the store holds "
                       "the untransformed rows")
    stock_loss = recorded_trainer_class(type(trainer)).compute_loss is Trainer.compute_loss
    if stock_loss and not trainer.model_accepts_loss_kwargs and trainer.compute_loss_func is None:
        hazards.append("the model does not accept num_items_in_batch: the loss is a per-microbatch mean, so "
                       "deleting a row re-weights the other rows of its microbatch")
    if trainer.compute_loss_func is not None and not isinstance(trainer.compute_loss_func, str):
        name = getattr(trainer.compute_loss_func, "__qualname__", "custom")
        hazards.append(f"a custom loss (compute_loss_func={name}): a function argument is not recorded, so "
                       "replays and the oracle would agree with each other on a loss this run did not train on; "
                       "subclass the trainer and override compute_loss in an importable module instead")
    if args.fp16:
        hazards.append("fp16 with dynamic loss scaling: the grad scaler's state is not checkpointed, so replays "
                       "may scale (and skip) steps differently; use bf16 or fp32")
    schedule = metric_schedule(args) or metric_scheduler(trainer.lr_scheduler, args)
    if schedule:
        hazards.append(schedule_hazard(schedule))
    if args.device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        hazards.append("CUDA without torch.use_deterministic_algorithms(True): kernels may not be bit-reproducible")
    template = served[0]
    if trainer._trace_dummy_has_weight(collator, trainer._trace_dummy_row(template, 4, trainer.dummy_token_id)):
        raise UnlearnError(
            f"the data collator ({name}) gives the dummy row that replaces a deleted sample a label "
            f"(dummy_token_id={trainer.dummy_token_id}): a deleted slot would not have weight 0; add a `labels` column "
            "(-100 on ignored tokens) or pass dummy_token_id= a token the collator masks (its pad token)")
    if trainer.neftune_noise_alpha is not None:
        notes.append(f"NEFTune (alpha {trainer.neftune_noise_alpha}) is reproduced: its noise is drawn under each "
                     "microbatch's recorded seed")
    base = peft_and_base(trainer.accelerator.unwrap_model(trainer.model))[1]
    rope = dynamic_rope(getattr(base, "config", None))
    if rope:
        hazards.append(f"the model's rotary embedding is {rope!r} (rope_scaling / rope_parameters): its inv_freq "
                       "buffers change with the longest sequence seen so far, which no checkpoint holds, so a "
                       "replay from a checkpoint computes other positions and a mid-run deletion never verifies; "
                       "use a static rope type (default, linear, yarn, llama3)")
    experts = routed_experts(base)
    shared = samples_sharing_a_microbatch(args)
    if experts and shared:
        hazards.append(experts_hazard(experts, shared))
    if dropout_settings(trainer.accelerator.unwrap_model(trainer.model)):
        notes.append("dropout is active: reproduced by per-microbatch reseeding")
    if args.max_grad_norm and args.max_grad_norm > 0:
        notes.append("gradient clipping is replayed on the replay's own gradients (part of the counterfactual)")
    check_optimizer_rebuildable(trainer)
    check_model_rebuildable(trainer)
    if hazards and not trainer.trace_allow_hazards:
        raise UnlearnError("TraceRecordingTrainer cannot record a run a replay reproduces: " + "; ".join(hazards)
                           + ". Fix this, or pass trace_allow_hazards=True to record anyway (inspect and verify "
                           "will then list what their verdicts do not cover)")
    custom_loss = trainer.compute_loss_func is not None and not isinstance(trainer.compute_loss_func, str)
    if not trainer._trace_probed and not (custom_loss and stock_loss):  # a compute_loss_func: a hazard (above)
        trainer._trace_probed = True  # once, at construction, after the cheaper refusals: a forward and backward
        coupled = trainer._check_dummy_has_no_influence(probe_row(served, trainer.id_column))  # two rows (DPO: two)
        if coupled:  # allowed as a hazard (trace_allow_hazards): the run lists it
            hazards.append(coupled)
    return served, hazards, notes


def check_optimizer_rebuildable(trainer) -> None:
    if trainer._trace_optimizer_source != "custom":
        return
    if trainer.optimizer is not None:
        spec = optimizer_spec(trainer.optimizer, trainer.accelerator.unwrap_model(trainer.model))
    elif trainer.optimizer_cls_and_kwargs is not None:
        cls, kwargs = trainer.optimizer_cls_and_kwargs
        try:
            spec = optimizer_spec(cls([torch.nn.Parameter(torch.zeros(1))], **kwargs))
        except Exception as e:  # noqa: BLE001
            spec = {"rebuildable": False, "why": f"{getattr(cls, '__qualname__', cls)}(**kwargs) fails: {e}"}
    else:
        return  # a subclass's create_optimizer: checked on the optimizer it creates when training starts
    if not spec["rebuildable"]:
        raise UnlearnError(f"a replay must rebuild the optimizer and cannot: {spec['why']}; use an importable "
                           "torch optimizer class (optimizers=(...) or optimizer_cls_and_kwargs=) or the "
                           "TrainingArguments `optim` options")


def check_model_rebuildable(trainer) -> None:
    if getattr(trainer.model, "_orig_mod", None) is not None:  # torch.compile(model): an OptimizedModule
        raise UnlearnError("the model is compiled (torch.compile(model)): compilation replaces the model's forward "
                           "with generated kernels that a replay, which rebuilds the model from its class and config, "
                           "does not run; record the model uncompiled (as torch_compile=True is refused)")
    model = trainer.accelerator.unwrap_model(trainer.model)
    peft, base = peft_and_base(model)
    if getattr(base, "config", None) is None or _importable_name(unsharded_class(type(base))) is None:
        raise UnlearnError(f"a replay must rebuild the model and cannot: {type(base).__qualname__} is not an "
                           "importable transformers model with a config (pass model= to replays otherwise)")
    if peft and peft.get("why"):
        raise UnlearnError(f"a replay must rebuild the PEFT model and cannot: {peft['why']}")
    parametrized = [name for name, m in model.named_modules() if getattr(m, "parametrizations", None)]
    if parametrized:
        what = ", ".join(f"{parametrized[0]}.{k}" for k in model.get_submodule(parametrized[0]).parametrizations)
        raise UnlearnError(f"a replay must rebuild the model and cannot: torch.nn.utils.parametrize is registered on "
                           f"{len(parametrized)} module(s) ({what} first), and a replay rebuilds the model from its "
                           "class and config, without them; remove them before training "
                           "(parametrize.remove_parametrizations(module, name)) or make them part of the model's code")
    how = quantized(base)
    if how:
        raise UnlearnError(f"a replay must rebuild the model and cannot: its base was loaded quantized ({how}, as "
                           "QLoRA does), and a replay rebuilds the base from its files unquantized; load the base in "
                           "bf16 or fp32 (LoRA on it records and deletes exactly)")
    differs = rebuilt_state_difference(model)
    if differs:
        raise UnlearnError(f"a replay must rebuild the model and cannot: the model built from its class and config "
                           f"differs from this one at {differs}, and a replay loads every checkpoint into that model "
                           "(a module replaced or added after loading?); make the change part of the model's class "
                           "or config (a config field its modules read), so that the model from_pretrained loads has "
                           "it")

