"""The optimizer a replay rebuilds: its importable class and arguments (:func:`optimizer_spec`), rebuilt over the
replay model's parameters (:func:`build_optimizer`); a multi-process recording keeps every process's settings equal."""

from __future__ import annotations

import inspect
import json

import torch
from transformers import Trainer

from ...data.collators import _importable_name
from ...errors import UnlearnError
from ...utils import import_object
from ..hashing import optimizer_param_names


def jsonable(value):
    """``value`` as the run records it: itself when JSON holds it, else its ``repr`` (an argument, a setting)."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def optimizer_spec(optimizer, model=None) -> dict:
    """How to rebuild ``optimizer``: importable class, constructor arguments, param-group sizes and names.

    With ``model``, every optimized tensor must be one of its parameters (a replay finds them by name).
    """
    inner = getattr(optimizer, "optimizer", optimizer)
    cls = type(inner)
    name = _importable_name(cls)
    spec = {"class": name or f"{cls.__module__}:{cls.__qualname__}", "rebuildable": False}
    if name is None:
        return {**spec, "why": f"{cls.__qualname__} is defined locally or in __main__: a replay cannot import it"}
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in inner.defaults.items() if takes_any or k in params}
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError):
        return {**spec, "why": f"the constructor arguments of {cls.__qualname__} are not JSON ({kwargs})"}
    names = None
    if model is not None:
        names = optimizer_param_names(model, inner)
        by_id = {id(p) for p in model.parameters()}
        foreign = sum(id(p) not in by_id for g in inner.param_groups for p in g["params"])
        if foreign:
            return {**spec, "why": f"{foreign} optimized tensor(s) are not parameters of the model"}
    try:  # the constructor must accept the recorded arguments and give back the same defaults
        probe = cls([torch.nn.Parameter(torch.zeros(1))], **kwargs)
        same = json.dumps(probe.defaults, sort_keys=True, default=repr) == json.dumps(inner.defaults, sort_keys=True,
                                                                                         default=repr)
    except Exception as e:  # noqa: BLE001 - any constructor failure means "not rebuildable"
        return {**spec, "why": f"{cls.__qualname__}(**recorded arguments) fails: {e}"}
    if not same:
        return {**spec, "why": f"{cls.__qualname__} rebuilt from its arguments has other defaults"}
    return {**spec, "rebuildable": True, "kwargs": kwargs, "group_sizes": [len(g["params"]) for g in inner.param_groups],
            "param_names": names}


def build_optimizer(spec: dict, model, param_names: list[str]):
    """The optimizer :func:`optimizer_spec` describes, over ``model``'s parameters in the recorded order."""
    named = dict(model.named_parameters())
    missing = [n for n in param_names if n not in named]
    if missing:
        raise UnlearnError(f"the replay model has no parameter {missing[0]!r} that the run's optimizer updated")
    params = [named[n] for n in param_names]
    groups, i = [], 0
    for size in spec["group_sizes"]:
        groups.append({"params": params[i:i + size]})
        i += size
    return import_object(spec["class"])(groups, **spec["kwargs"])



class SameOptimizerSettings:
    """Every process of a multi-process recording, before each optimizer step: the processes' optimizer settings
    (each param group's learning rate, betas, weight decay, ...) must be equal (an all-gather). The plan records the
    main process's, which a replay sets on every process; a process whose settings differ (a callback that changes
    the learning rate on one process only) is refused at that step, on every process, before it steps."""

    def __init__(self, optimizer, step):
        self.step = step  # () -> the optimizer step about to be taken
        inner = getattr(optimizer, "optimizer", optimizer)
        self._hook = inner.register_step_pre_hook(lambda opt, *a: self.check(opt))

    def check(self, optimizer) -> None:
        from accelerate.utils import gather_object

        mine = [{k: jsonable(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        everyone = gather_object([mine])
        differ = [r for r, theirs in enumerate(everyone) if theirs != everyone[0]]
        if differ:
            keys = sorted({k for r in differ for g0, g in zip(everyone[0], everyone[r]) for k in g0 if g.get(k) != g0[k]})
            raise UnlearnError(f"process(es) {differ} would take optimizer step {self.step()} with other optimizer "
                               f"settings than the main process ({', '.join(keys) or 'param groups'}): the plan records "
                               "the main process's for every process; change them the same way on every process")

    def close(self) -> None:
        self._hook.remove()


def optimizer_source(trainer) -> str:
    custom_method = type(trainer).create_optimizer is not Trainer.create_optimizer
    if trainer.optimizer is not None or trainer.optimizer_cls_and_kwargs is not None or custom_method:
        return "custom"
    return "args"

