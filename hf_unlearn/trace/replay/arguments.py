"""The replay's ``TrainingArguments``: rebuilt from the run's header, or the user's checked against the recorded
arithmetic; evaluation and checkpoint saving are never replayed."""

from __future__ import annotations

import dataclasses

import torch
from transformers import TrainingArguments

from ...errors import UnlearnError
from ..recorder import _jsonable
from ..sharding import replay_arguments
from ..trainers import (  # noqa: F401 - REPLAY_ARGS lived here
    CONSTRUCTION_ONLY,
    REPLAY_ARGS,
    STEP_ONLY_SCHEDULE,
    config_fields,
    metric_schedule,
    recorded_trainer,
)

# what a recorded run did besides training that a replay does not do (it would need an eval set, or write checkpoints)
NOT_REPLAYED = {"eval_strategy": "no", "save_strategy": "no", "load_best_model_at_end": False, "eval_on_start": False,
                "do_eval": False}


def not_replayed(args) -> dict:
    """The fields a replay sets for ``args`` (recorded dict or ``TrainingArguments``): :data:`NOT_REPLAYED`, and a
    step-only schedule in place of one evaluation metrics step (its learning rates are the plan's)."""
    return {**NOT_REPLAYED, **(STEP_ONLY_SCHEDULE if metric_schedule(args) else {})}


def training_args_from_header(header: dict, output_dir, **overrides) -> TrainingArguments:
    """Rebuild the run's config (TrainingArguments, or its recorded subclass such as SFTConfig): the optimizer,
    clipping and loss settings the replay must share; fields that only prepare data are set as
    :data:`~hf_unlearn.trace.trainers.CONSTRUCTION_ONLY` says (the store holds the prepared rows)."""
    config_cls = recorded_trainer(header)[1]
    names = config_fields(config_cls)
    recorded = header["training_args"]
    kwargs = {k: v for k, v in recorded.items() if k in names and not k.endswith("_token") and "hub" not in k
              and k not in ("logging_dir", "deepspeed", "fsdp_config", "accelerator_config", "report_to", "run_name",
                            "resume_from_checkpoint", "output_dir", "fsdp", "parallelism_config")}
    kwargs = {k: v for k, v in kwargs.items() if not (isinstance(v, str) and v.startswith("<") and v.endswith(">"))}
    kwargs.update(output_dir=str(output_dir), report_to=[], disable_tqdm=True,
                  use_cpu=recorded.get("use_cpu", not torch.cuda.is_available()), **not_replayed(recorded))
    if config_cls is not TrainingArguments:
        kwargs.update({k: v for k, v in CONSTRUCTION_ONLY.items() if k in names})
    kwargs.update(replay_arguments(header))  # an FSDP2 run: its recorded fsdp_config (hf_unlearn.trace.sharding)
    kwargs.update(overrides)
    return config_cls(**kwargs)


def without_evaluation(args: TrainingArguments) -> TrainingArguments:
    """``args`` with evaluation, checkpoint saving and best-model loading off (a replay only re-executes the plan;
    evaluating does not change the trace, and the kept model's step is a recorded control; so are the learning rates
    a metric-driven scheduler chose: :data:`METRIC_SCHEDULES`)."""
    off = not_replayed(args)
    if all(getattr(args, k) == v for k, v in off.items()):
        return args
    return dataclasses.replace(args, **off)


def _check_args(args: TrainingArguments, header: dict) -> None:
    recorded, given = header["training_args"], args.to_dict()
    # the config subclass's own fields (SFTConfig: loss_type, padding_free, ...) count like REPLAY_ARGS
    own = sorted(config_fields(recorded_trainer(header)[1]) - config_fields(TrainingArguments) - set(CONSTRUCTION_ONLY))
    diff = [f"{k} ({_jsonable(given.get(k))!r} vs recorded {recorded.get(k)!r})" for k in (*REPLAY_ARGS, *own)
            if k in recorded and _jsonable(given.get(k)) != recorded.get(k)]
    if diff:
        raise UnlearnError(f"the replay's TrainingArguments differ from the recorded run's in {', '.join(diff)}: a "
                           "replay must run the recorded arithmetic (omit args= to rebuild them from the trace)")
