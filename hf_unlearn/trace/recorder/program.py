"""The guards' wiring into a recording (:mod:`hf_unlearn.trace.guards`, :mod:`hf_unlearn.trace.digests`): the
callbacks sorted into observers, replayed and watched ones; each watched callback's events run inside the guard; what
the whole-program digests read; every process's program compared with the others'."""

from __future__ import annotations

import contextlib
import functools

from ..digests import ProcessComparison
from ..environment_reads import unwatched
from ..guards import StateView, callback_attributes, callback_spec, is_observer
from ..value_reads import ValueReads, can_reach_tensors, mark_logged, unmark_logged

GUARD_CHECKS = ("per optimizer step: param-group settings at optimizer.step(), trainable set, module modes and "
                "attributes, config, user hooks, module classes' forward, process-wide numerics, exact checksums of "
                "parameters, buffers and optimizer state (after optimizer.step()) and of the gradients (before it); "
                "the whole program digested (every TrainingArguments field, the whole config, every module "
                "attribute, the code modules run, recorded callbacks' code and globals, the optimizer's structure, "
                "the dataset's format and the collator, torch switches, numeric environment variables: "
                "hf_unlearn.trace.digests), compared between processes; a keyed digest of every row as collated")


def context(trainer) -> dict:
    """What the whole-program digests read besides the model and the optimizer (hf_unlearn.trace.digests)."""
    loader = getattr(trainer.callback_handler, "train_dataloader", None)
    datasets = {"train_dataset": trainer.train_dataset, "the training dataloader's dataset":
                getattr(loader, "dataset", None)}
    if datasets["the training dataloader's dataset"] is trainer.train_dataset:
        datasets.pop("the training dataloader's dataset")
    return {"args": trainer.args, "trainer": trainer, "callbacks": trainer._trace_program_callbacks,
            "datasets": {k: v for k, v in datasets.items() if v is not None}, "collator": trainer.data_collator}


def processes_start(trainer) -> None:
    """Every process of a multi-process recording compares its whole program with the others' at every optimizer
    step (hf_unlearn.trace.digests.ProcessComparison); the main process records a difference as a change."""
    if not trainer.trace_guards or trainer.accelerator.num_processes < 2:
        return
    trainer._trace_processes = ProcessComparison(
        trainer.accelerator.unwrap_model(trainer.model), trainer.optimizer, lambda: context(trainer),
        guard=trainer._trace_guard, step=lambda: trainer.state.global_step)


def sort_callbacks(trainer) -> dict:
    """Sort the callbacks (hf_unlearn.trace.guards): observers; the user's program callbacks a replay runs again
    (``callbacks`` in the header: class and events); those it cannot (``watched_callbacks``, with why)."""
    trainer._trace_watched, recorded, watched = [], [], []
    for cb in trainer.callback_handler.callbacks:
        if is_observer(cb):
            continue
        spec = callback_spec(cb)
        trainer._trace_watched.append((cb, spec))
        if spec["replayable"]:
            recorded.append({"class": spec["class"], "events": spec["events"]})
        else:
            watched.append({"class": spec["class"], "why": spec["why"]})
    trainer._trace_program_callbacks = [cb for cb, spec in trainer._trace_watched if spec["replayable"]]
    return {"callbacks": recorded, "watched_callbacks": watched}


def callback_extra(trainer, step: int) -> dict:
    """The recorded callbacks' attributes when they changed (a suffix replay restores them with the checkpoint)."""
    if not trainer._trace_program_callbacks:
        return {}
    try:
        states = [callback_attributes(cb) for cb in trainer._trace_program_callbacks]
    except ValueError as e:
        if trainer._trace_guard is not None:
            trainer._trace_guard.pending.append({"step": step, "what": f"a recorded callback's attributes: {e}",
                                              "by": "a recorded callback"})
        return {}
    if states == trainer._trace_cb_states:
        return {}
    trainer._trace_cb_states = states
    return {"callbacks": states}


reaches = functools.lru_cache(maxsize=None)(can_reach_tensors)


def added(trainer, guard, cb) -> None:
    """A callback added while training (``add_callback`` from a callback): the run's record does not hold it and
    replays do not run it. Watched from here on (its edits and reads named), and its arrival is a change."""
    spec = {**callback_spec(cb), "replayable": False,
            "why": "it was added while training, so the run's record does not hold it and replays do not run it"}
    guard.watched[id(cb)] = spec
    trainer._trace_watched.append((cb, spec))
    guard.pending.append({"step": guard.step, "persistent": True, "seen": "program", "by": "code outside the record",
                          "what": f"callback {type(cb).__qualname__} was added while training ({spec['why']})"})


def guarded_call_event(trainer, event, args, state, control, **kwargs):
    """transformers' CallbackHandler.call_event, with each watched callback's event run inside the guard."""
    handler, guard = trainer.callback_handler, trainer._trace_guard
    procs = getattr(trainer, "_trace_processes", None)
    peers = {id(cb): spec["events"] for cb, spec in getattr(trainer, "_trace_watched", ()) if not spec["replayable"]}
    if guard is not None:
        present = {id(cb) for cb in handler.callbacks}
        for cb in [cb for cb in trainer._trace_program_callbacks if id(cb) not in present]:
            trainer._trace_program_callbacks.remove(cb)  # replays run it from the first step to the last
            guard.pending.append({"step": guard.step, "persistent": True, "seen": "program",
                                  "by": "code outside the record", "what": f"recorded callback {type(cb).__qualname__} "
                                  "was removed while training (replays run it at every step)"})
    for cb in handler.callbacks:
        if guard is not None and id(cb) not in guard.watched and not is_observer(cb):
            added(trainer, guard, cb)
        spec = guard.watched.get(id(cb)) if guard is not None else None
        # a recorded callback sees the state through a view that notes reads of fields replays do not set
        view = StateView(state) if spec is not None and spec["replayable"] else None

        def call(cb=cb, control=control, seen=view or state):
            return getattr(cb, event)(args, seen, control, model=handler.model,
                                      processing_class=handler.processing_class, optimizer=handler.optimizer,
                                      lr_scheduler=handler.lr_scheduler, train_dataloader=handler.train_dataloader,
                                      eval_dataloader=handler.eval_dataloader, **kwargs)
        replayed = any(cb is x for x in getattr(trainer, "_trace_program_callbacks", None) or ())
        # the numbers that follow the data, for a callback that could act on tensors from them
        marked = mark_logged(kwargs, state) if event in peers.get(id(cb), ()) and reaches(type(cb)) else []
        try:
            with contextlib.nullcontext() if replayed else unwatched():  # what replays do not run reads nothing
                if spec is not None and event in spec["events"]:  # a replay depends on
                    result = guard.around(cb, event, call, state_view=view)
                    read = guard.last_read
                elif guard is None and procs is not None and event in peers.get(id(cb), ()):
                    with ValueReads() as reads:  # another process of the launch: its reads are compared with
                        result = call()  # process 0's
                    read = reads.first
                else:
                    result, read = call(), None
        finally:
            unmark_logged(marked)
        if read and procs is not None:
            procs.reads.add(f"{type(cb).__qualname__}.{event}")
        if result is not None:
            control = result
    return control

