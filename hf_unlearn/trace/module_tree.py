"""One walk of a model's module tree per guard check, with the names and order torch's own iterators give.

A recorded optimizer step read the module tree about twenty times (the state's tensors, the controls, the
whole-program digest, the optimizer's parameter names, whether the model is sharded), each a ``named_modules``
generator that resumes one frame per level for every module: some 40 ms a step on a LoRA model's ~1,000 modules.
Inside :func:`held` (a guard's check, which runs no user code) they share one walk, taken with an explicit stack.

A model whose modules' classes override ``named_modules`` (PEFT's parameter wrapper restores weights in it) or
the member iterators is walked by torch's own functions, so the names, the order and any side effect stay theirs.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

from torch import nn

_OWN = (nn.Module.named_modules, nn.Module._named_members, nn.Module.named_parameters, nn.Module.named_buffers)


class Tree(NamedTuple):
    """``every``: ``(name, module, first)`` as ``named_modules(remove_duplicate=False)`` lists them (``first``: the
    module's first occurrence); ``modules``, ``parameters``, ``buffers``: as ``named_modules()``,
    ``named_parameters()`` and ``named_buffers()`` list them."""

    every: list
    modules: list
    parameters: list
    buffers: list


_HELD: dict[int, tuple] = {}  # id(model) -> (model, its Tree) while held


@contextmanager
def held(model):
    """Within the block, :func:`walk` of ``model`` is taken once (the block must not change the module tree)."""
    if id(model) in _HELD:  # nested: the outer block's walk
        yield
        return
    _HELD[id(model)] = (model, None)
    try:
        yield
    finally:
        del _HELD[id(model)]


def walk(model) -> Tree:
    """The module tree of ``model`` (once per :func:`held` block)."""
    entry = _HELD.get(id(model))
    if entry is not None and entry[0] is model:
        if entry[1] is None:
            entry = _HELD[id(model)] = (model, _walk(model))
        return entry[1]
    return _walk(model)


def _walk(model) -> Tree:
    every, stack, types = [], [("", model)], set()
    seen: set[int] = set()
    while stack:
        prefix, m = stack.pop()
        first = id(m) not in seen
        seen.add(id(m))
        every.append((prefix, m, first))
        types.add(type(m))
        kids = m._modules
        if kids:
            stack.extend(reversed([(f"{prefix}.{n}" if prefix else n, c) for n, c in kids.items() if c is not None]))
    if any((c.named_modules, c._named_members, c.named_parameters, c.named_buffers) != _OWN for c in types):
        return _torch_walk(model)
    modules = [(n, m) for n, m, first in every if first]
    return Tree(every, modules, _members(modules, "_parameters"), _members(modules, "_buffers"))


def _members(modules: list, kind: str) -> list:
    out, seen = [], set()
    for prefix, m in modules:
        for k, v in getattr(m, kind).items():
            if v is None or id(v) in seen:
                continue
            seen.add(id(v))
            out.append((f"{prefix}.{k}" if prefix else k, v))
    return out


def _torch_walk(model) -> Tree:
    firsts, every = set(), []
    for name, m in model.named_modules(remove_duplicate=False):
        every.append((name, m, id(m) not in firsts))
        firsts.add(id(m))
    return Tree(every, list(model.named_modules()), list(model.named_parameters()), list(model.named_buffers()))

