"""Which trainer class a run used, and how replays rebuild it (``trl.SFTTrainer``, a user's own ``compute_loss``).

A replay must run the loss that trained, so the recording saves the trainer class, its config class (a
``TrainingArguments`` subclass such as ``SFTConfig``) and the constructor arguments the trainer took beyond
``Trainer``'s own, all as importable names and JSON. A replay imports them and builds the same trainer, whose own
``compute_loss`` and ``training_step`` then run every replayed microbatch. What cannot be imported and rebuilt is
refused when the recording trainer is constructed (see :func:`trainer_spec`).
"""

from __future__ import annotations

import dataclasses
import json

from ..errors import UnlearnError
from ..utils import import_object, load_processing_class  # noqa: F401 - load_processing_class lived here

# Constructor arguments a replay supplies itself or that only shape what the recording already saved: the model
# (rebuilt from model/, adapter included, so ``peft_config`` is in it), the config, the collator (collator/), the
# datasets (the token store holds the prepared rows, so ``formatting_func`` has done its work), the tokenizer
# (processing_class/), the optimizer (recorded separately) and what only evaluates or logs.
HANDLED_ARGUMENTS = frozenset({
    "model", "args", "data_collator", "train_dataset", "eval_dataset", "processing_class", "tokenizer", "model_init",
    "compute_metrics", "callbacks", "optimizers", "optimizer_cls_and_kwargs", "preprocess_logits_for_metrics",
    "peft_config", "formatting_func", "compute_loss_func",
    "ref_model"})  # DPO: the reference is bound by its weights (header reference_model, hf_unlearn.trace.reference)
# Config fields that only act while the trainer prepares its dataset or loads its model and tokenizer; a replay
# gets the prepared rows, the saved model and the saved tokenizer, so it sets them to these values.
CONSTRUCTION_ONLY = {"dataset_kwargs": {"skip_prepare_dataset": True}, "chat_template_path": None, "eos_token": None,
                     "model_init_kwargs": None, "dataset_num_proc": None, "assistant_only_loss": False}
# The pip extra that installs a recorded trainer's package.
EXTRAS = {"trl": "hf_unlearn[trl]"}
DEFAULT_TRAINER = "transformers.trainer:Trainer"
PROCESSING_CLASS_DIR = "processing_class"  # the run's tokenizer/processor, saved for trainers that take one
DEFAULT_CONFIG = "transformers.training_args:TrainingArguments"


def importable_name(obj) -> str | None:
    """``module:qualname`` of a class a replay can import back as the very same object, else None."""
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qual or "<" in qual or module == "__main__":
        return None
    name = f"{module}:{qual}"
    try:
        return name if import_object(name) is obj else None
    except Exception:  # noqa: BLE001 - not importable as named
        return None


def _not_importable(cls, what: str) -> str:
    where = ("in __main__ (the script itself)" if cls.__module__ == "__main__" else
             "inside a function" if "<locals>" in cls.__qualname__ else f"as {cls.__module__}:{cls.__qualname__}")
    return (f"the {what} {cls.__qualname__} is defined {where}, so a replay cannot import it and rebuild the trainer "
            "that ran this loss; define it at the top level of an importable module (e.g. my_trainers.py)")


def trainer_spec(trainer_cls, config, arguments: dict) -> dict:
    """What a replay needs to rebuild ``trainer_cls(args=config, **arguments)``; raises what it could not rebuild.

    ``arguments`` are the constructor arguments the trainer was given (bound to its signature). Those in
    :data:`HANDLED_ARGUMENTS` are rebuilt from the run's other files; every other one must be JSON.
    """
    name = importable_name(trainer_cls)
    if name is None:
        raise UnlearnError(_not_importable(trainer_cls, "trainer class"))
    config_name = importable_name(type(config))
    if config_name is None:
        raise UnlearnError(_not_importable(type(config), "config class"))
    kwargs = {}
    for key, value in arguments.items():
        if key in HANDLED_ARGUMENTS or value is None:
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise UnlearnError(f"{trainer_cls.__qualname__}({key}={type(value).__name__}) cannot be recorded: a replay "
                               "rebuilds the trainer from JSON arguments; pass it as a JSON value or a config "
                               "field") from None
        kwargs[key] = value
    return {"class": name, "config_class": config_name, "kwargs": kwargs, "package": name.split(".")[0]}


def _import(name: str, what: str):
    package = name.split(".")[0]
    try:
        return import_object(name)
    except ImportError as e:
        extra = EXTRAS.get(package)
        how = f"pip install '{extra}'" if extra else f"install the package that provides {name.split(':')[0]}"
        raise UnlearnError(f"the run was recorded with the {what} {name}, which cannot be imported here ({e}): "
                           f"{how}") from None
    except AttributeError:
        raise UnlearnError(f"the run was recorded with the {what} {name}, which the installed "
                           f"{package} does not define (renamed or removed?)") from None


def recorded_trainer(header: dict):
    """The trainer class and config class a run was recorded with (``Trainer`` and ``TrainingArguments`` for runs
    recorded before the class was saved)."""
    from transformers import Trainer, TrainingArguments

    spec = header.get("trainer") or {}
    cls = _import(spec.get("class", DEFAULT_TRAINER), "trainer class")
    config = _import(spec.get("config_class", DEFAULT_CONFIG), "config class")
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise UnlearnError(f"the run's trainer class {spec.get('class')} is not a transformers.Trainer subclass")
    if not (isinstance(config, type) and issubclass(config, TrainingArguments)):
        raise UnlearnError(f"the run's config class {spec.get('config_class')} is not a TrainingArguments subclass")
    return cls, config


def is_default(header: dict) -> bool:
    return (header.get("trainer") or {}).get("class", DEFAULT_TRAINER) == DEFAULT_TRAINER


# TrainingArguments that change a replay's arithmetic: a replay given its own args must agree on all of them, and so
# must the launches of a resumed recording (a replay runs one set over the whole run)
REPLAY_ARGS = ("neftune_noise_alpha", "max_grad_norm", "optim", "optim_args", "weight_decay", "adam_beta1",
               "adam_beta2", "adam_epsilon", "learning_rate", "label_smoothing_factor", "bf16", "fp16", "tf32",
               "average_tokens_across_devices", "gradient_checkpointing", "gradient_checkpointing_kwargs",
               "torch_compile", "use_liger_kernel", "seed")
# learning-rate schedulers transformers steps on evaluation metrics (ReduceLROnPlateau, GreedyLR): a replay evaluates
# nothing and sets each step's recorded learning rates itself, so their decisions are recorded controls of the run
# (like its length), and the replay's arguments name a step-only schedule (transformers refuses these without an
# evaluation). A deletion's counterfactual would choose its own: a hazard at recording (recorder/preflight.py)
METRIC_SCHEDULES = frozenset({"reduce_lr_on_plateau", "greedy"})
STEP_ONLY_SCHEDULE = {"lr_scheduler_type": "constant", "lr_scheduler_kwargs": {}}


def metric_schedule(training_args) -> str | None:
    """The run's learning-rate scheduler type when evaluation metrics step it, else None (``training_args``: the
    header's recorded dict or a ``TrainingArguments``)."""
    kind = (training_args.get("lr_scheduler_type") if isinstance(training_args, dict)
            else getattr(training_args, "lr_scheduler_type", None))
    kind = str(getattr(kind, "value", kind))
    return kind if kind in METRIC_SCHEDULES else None


SCHEDULE_HAZARD = "sets the learning rate from evaluation metrics"  # the words the hazard and the refusal share


def metric_scheduler(scheduler, args) -> str | None:
    """``optimizers=(optimizer, scheduler)``'s scheduler when transformers steps it on evaluation metrics
    (ReduceLROnPlateau, GreedyLR: after each evaluation, so only when the run evaluates), as the words
    :func:`schedule_hazard` takes; else None."""
    import torch

    kinds = [torch.optim.lr_scheduler.ReduceLROnPlateau]
    try:
        from transformers.optimization import GreedyLR

        kinds.append(GreedyLR)
    except ImportError:  # an older transformers: no GreedyLR
        pass
    if scheduler is None or not isinstance(scheduler, tuple(kinds)) or str(getattr(
            args.eval_strategy, "value", args.eval_strategy)) == "no":
        return None
    return f"the scheduler {type(scheduler).__name__} passed in optimizers="


def schedule_hazard(kind: str) -> str:
    """``kind``: a ``lr_scheduler_type`` value, or the words :func:`metric_scheduler` returns."""
    what = kind if kind.startswith("the scheduler") else f"lr_scheduler_type={kind!r}"
    return (f"{what} {SCHEDULE_HAZARD}, which a deletion changes: replays keep the recorded "
            "learning rates, a run without the deleted rows would choose its own; use a schedule of the step alone "
            "(linear, cosine, constant, ...)")


# the one a resumed recording may change: the plan records the learning rate at every step (a replay writes it into
# the optimizer). Not activation checkpointing: neutral on any rows, but a replay of the first launch's steps with it
# runs other program controls than they did, which the proof refuses later, at deletion time
RESUMABLE_ARGS = frozenset({"learning_rate"})


def _group_value(groups: list[dict], read) -> float | None:
    """One value ``read`` gives every param group (None when a group lacks it or they disagree)."""
    try:
        values = {float(read(g)) for g in groups}
    except (KeyError, TypeError, IndexError, ValueError):
        return None
    return values.pop() if len(values) == 1 else None


def optimizer_group_args(optimizer) -> dict[str, float]:
    """The TrainingArguments the live optimizer's param groups hold: ``weight_decay`` (the decay group's: the
    largest), ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``, where every group holds one value of it."""
    groups = list(getattr(getattr(optimizer, "optimizer", optimizer), "param_groups", None) or [])
    if not groups:
        return {}
    found = {"adam_beta1": _group_value(groups, lambda g: g["betas"][0]),
             "adam_beta2": _group_value(groups, lambda g: g["betas"][1]),
             "adam_epsilon": _group_value(groups, lambda g: g["eps"])}
    try:
        found["weight_decay"] = max(float(g["weight_decay"]) for g in groups)
    except (KeyError, TypeError, ValueError):
        pass
    return {k: v for k, v in found.items() if v is not None}


def restored_by_optimizer(optimizer, recorded: dict, given: dict) -> set[str]:
    """The optimizer settings (weight decay, Adam's betas and epsilon) a resumed launch was given other values of
    that do not act: transformers restores the param groups from the checkpoint's optimizer state when it resumes,
    so the live groups (``optimizer``'s, read after that) still hold the earlier launch's values, and the whole run
    trains with them. Read from the live optimizer, not assumed: a value that does act is not in the set."""
    live = optimizer_group_args(optimizer) if optimizer is not None else {}
    out = set()
    for k, v in live.items():
        before, now = recorded.get(k), given.get(k)
        if isinstance(before, (int, float)) and isinstance(now, (int, float)) and before != now and v == before:
            out.add(k)
    return out


def arithmetic_differences(recorded: dict, given: dict, header: dict, skip=frozenset()) -> list[str]:
    """The fields of :data:`REPLAY_ARGS` and of the recorded config subclass's own (SFTConfig: loss_type,
    padding_free, ...) on which ``given`` (jsonable TrainingArguments) differs from ``recorded``, as
    ``"name (given vs recorded recorded)"``."""
    from transformers import TrainingArguments

    own = sorted(config_fields(recorded_trainer(header)[1]) - config_fields(TrainingArguments) - set(CONSTRUCTION_ONLY))
    return [f"{k} ({given.get(k)!r} vs recorded {recorded.get(k)!r})" for k in (*REPLAY_ARGS, *own)
            if k not in skip and k in recorded and given.get(k) != recorded.get(k)]


def config_fields(config_cls) -> set[str]:
    return {f.name for f in dataclasses.fields(config_cls) if f.init}


def library_config_fields(header: dict) -> set[str]:
    """The fields of the run's config class when a library we ship an extra for defines it (SFTConfig): settings,
    not user data. A user's own config subclass gives none (its values are the user's)."""
    name = (header.get("trainer") or {}).get("config_class", DEFAULT_CONFIG)
    if name.split(".")[0] not in EXTRAS:
        return set()
    try:
        return config_fields(_import(name, "config class"))
    except UnlearnError:
        return set()


def bound_arguments(init, args: tuple, kwargs: dict) -> dict:
    """The trainer constructor's arguments by name (its ``**kwargs`` flattened in)."""
    import inspect

    try:
        sig = inspect.signature(init)
        bound = sig.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return dict(kwargs)
    out = {}
    for name, value in bound.items():
        if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif sig.parameters[name].kind is not inspect.Parameter.VAR_POSITIONAL:
            out[name] = value
    return out


def adds_behaviour(cls) -> bool:
    """Whether a class defines anything of its own (a method, an attribute), beyond combining its bases."""
    return any(not (k.startswith("__") and k.endswith("__")) or k == "__init__" for k in vars(cls))


def recorded_trainer_class(cls):
    """The trainer class a replay rebuilds: ``cls`` without the trace machinery (the mixin, the classes made by
    :func:`trace_recording`, replays) and without subclasses that only combine their bases."""
    from transformers import Trainer

    for c in cls.__mro__:
        if "_trace_machinery" in vars(c) or not adds_behaviour(c):
            continue
        return c
    return Trainer


def own_functions(cls, skip=("transformers.", "hf_unlearn.")):
    """``(class, name, function)`` of every plain function (a bound classmethod's or staticmethod's too) that
    ``cls`` and its bases define, the bases from the ``skip`` packages and ``object`` aside: the code of a class
    the user wrote, as the program digests and the value-read checks read it."""
    import types

    for c in cls.__mro__:
        if c is object or c.__module__.startswith(skip):
            continue
        for name, v in vars(c).items():
            fn = getattr(v, "__func__", v)
            if isinstance(fn, types.FunctionType):
                yield c, name, fn
