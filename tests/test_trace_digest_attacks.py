"""Attacks on exact deletion through what the guards' lists did not name (issue #41 items 3 and 4).

Each attack changes the training program mid-run in a way a replay would not see: a ``TrainingArguments`` field, a
private config attribute, a dataset transform, a module's child, a monkeypatched function, an environment variable,
... The recorder digests the whole program at every optimizer step (:mod:`hf_unlearn.trace.digests`), so each is
recorded with its step and cause, and a deletion is refused before any compute naming it; or the change is one the
record holds (a scheduler's ``lr_lambda``: the plan records the learning rates; a submodule's ``training`` flag:
``training_step`` sets it again), and the deletion is VERIFIED and equal to an engine-free counterfactual (a plain
``Trainer`` with the same callbacks, the deleted row's labels -100). Rows are checked too
(:mod:`hf_unlearn.trace.rows`): a transform the recorder did not see is refused at the first row that differs.

Default suite: the named attacks on one architecture, and one run carrying a dozen attacks of our own, each at its
own step, every one named. Slow: each attack alone on three architectures (two with grouped-query attention) and a
step-0, a mid-run and a late deletion.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import TrainerCallback

from hf_unlearn.errors import UnlearnError

from .test_trace_common import config_model, delete, get_trace_data, record

AT = 3  # the single attacks act at optimizer step 3
KW = dict(gradient_accumulation_steps=1, max_steps=6)
FAMILIES = ("llama", "qwen2", "gpt_neox")  # llama and qwen2 built with one key/value head for two query heads (GQA)
SCALE = 1.0  # a module global a recorded callback reads


def _shift(batch):
    batch["input_ids"] = [[(t + 1) % 1000 for t in row] for row in batch["input_ids"]]
    return batch


def _scaled_loss(original):
    def loss(*args, **kwargs):
        return original(*args, **kwargs) * 1.5
    return loss


def _patched_silu(original):
    def silu(x, inplace=False):
        return original(x, inplace=inplace) * 1.01
    return silu


_SAVED: dict = {}


def _act(name: str, model, args, optimizer, lr_scheduler, train_dataloader, collator) -> None:
    """Attack ``name`` (one change to the running program)."""
    global SCALE
    if name == "max_grad_norm":
        args.max_grad_norm = 0.05
    elif name == "attn_implementation":
        model.set_attn_implementation("eager")
    elif name == "set_transform":
        train_dataloader.dataset.set_transform(_shift)
    elif name == "args_learning_rate":
        args.learning_rate = args.learning_rate * 10
    elif name == "args_accumulation":
        args.gradient_accumulation_steps = 4
    elif name == "config_use_cache":
        model.config.use_cache = not model.config.use_cache
    elif name == "generation_config":
        model.generation_config.temperature = 0.3
    elif name == "activation_swapped":
        first = next(m for m in model.modules() if hasattr(m, "act_fn") or hasattr(m, "act"))
        setattr(first, "act_fn" if hasattr(first, "act_fn") else "act", torch.nn.GELU())
    elif name == "private_attribute":  # through __dict__, as a careless edit would: a private module attribute
        attn = next(m for n, m in model.named_modules() if n.endswith("attention") or n.endswith("self_attn"))
        attn.__dict__["_trace_scale_hint"] = 2
    elif name == "loss_function":
        model.loss_function = _scaled_loss(model.loss_function)
    elif name == "buffer_added":
        model.register_buffer("extra_scale", torch.ones(1))
    elif name == "collator_pad_to_multiple_of":
        collator.pad_to_multiple_of = 64
    elif name == "functional_monkeypatch":
        _SAVED.setdefault("silu", torch.nn.functional.silu)
        torch.nn.functional.silu = _patched_silu(_SAVED["silu"])
    elif name == "backend_flag":
        _SAVED.setdefault("opt_einsum", torch.backends.opt_einsum.enabled)
        torch.backends.opt_einsum.enabled = not torch.backends.opt_einsum.enabled
    elif name == "numeric_environment":
        _SAVED.setdefault("MKL_CBWR", os.environ.get("MKL_CBWR"))
        os.environ["MKL_CBWR"] = "COMPATIBLE"
    elif name == "recorded_callback_global":
        SCALE = 0.5
    elif name == "group_key_added":
        for g in optimizer.param_groups:
            g["maximize"] = True
    elif name == "lr_lambda_replaced":
        lr_scheduler.lr_lambdas = [lambda step: 0.5 for _ in lr_scheduler.lr_lambdas]
    elif name == "submodule_eval":
        next(m for n, m in model.named_modules() if n.endswith("layers.0")).eval()
    else:
        raise ValueError(name)


def _undo() -> None:
    """Put the process-wide state back (a test must not leak a monkeypatch or an environment variable)."""
    global SCALE
    SCALE = 1.0
    if "silu" in _SAVED:
        torch.nn.functional.silu = _SAVED.pop("silu")
    if "opt_einsum" in _SAVED:
        torch.backends.opt_einsum.enabled = _SAVED.pop("opt_einsum")
    if "MKL_CBWR" in _SAVED:
        value = _SAVED.pop("MKL_CBWR")
        os.environ.pop("MKL_CBWR") if value is None else os.environ.__setitem__("MKL_CBWR", value)


# the cause each attack is refused with (a fragment of the one-line message), or VERIFIED for the changes the record
# holds (an equal engine-free counterfactual is then required)
EXPECTED = {
    "max_grad_norm": "args.max_grad_norm 1.0 -> 0.05",
    "attn_implementation": "config._attn_implementation_internal 'sdpa' -> 'eager'",
    "set_transform": "format type None -> 'custom'",
    "args_learning_rate": "args.learning_rate",
    "args_accumulation": "args.gradient_accumulation_steps 1 -> 4",
    "config_use_cache": "config.use_cache",
    "generation_config": "generation_config.temperature",
    "activation_swapped": "mlp.act",
    "private_attribute": "_trace_scale_hint (absent) -> 2",
    "loss_function": "loss_function",
    "buffer_added": "extra_scale",
    "collator_pad_to_multiple_of": "data collator pad_to_multiple_of None -> 64",
    "functional_monkeypatch": "code module torch.nn.functional",
    "backend_flag": "torch opt_einsum",
    "numeric_environment": "environ MKL_CBWR (absent) -> 'COMPATIBLE'",
    "recorded_callback_global": "SCALE 1.0 -> 0.5",
    "group_key_added": "param group 0's maximize",
    "lr_lambda_replaced": "VERIFIED",
    "submodule_eval": "VERIFIED",
}
OWN = [a for a in EXPECTED if a not in ("max_grad_norm", "attn_implementation", "set_transform")]
# in the run that carries them all: raising the accumulation mid-run changes the Trainer's own step count (it is
# tested alone, in the slow matrix)
TOGETHER = [a for a in OWN if a != "args_accumulation"]


class _Attacks(TrainerCallback):
    """At the start of optimizer step ``at[name]``, attack ``name`` (a callback a replay cannot import: watched)."""

    at: dict = {}

    def on_step_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                      train_dataloader=None, **kwargs):
        for name, step in self.at.items():
            if state.global_step == step:
                collator = getattr(train_dataloader, "collate_fn", None)
                collator = getattr(collator, "collator", collator)  # the recorder's id-carrying wrapper
                _act(name, model, args, optimizer, lr_scheduler, train_dataloader, collator)


def attacks(at: dict):
    return [type("LocalAttacks", (_Attacks,), {"at": dict(at)})()]


class ReadsScale(TrainerCallback):
    """A recorded callback (importable, JSON attributes) whose behaviour depends on the module global ``SCALE``."""

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if SCALE != 1.0:
            for g in optimizer.param_groups:
                g["lr"] *= SCALE


def _callbacks(name: str, at: dict):
    return (attacks(at) if at else []) + ([ReadsScale()] if name == "recorded_callback_global" or len(at) > 1 else [])


def _record(tmp_path, family: str, at: dict, rows: int = 24, **kw):
    from hf_unlearn.data import QACollator

    tok, data = get_trace_data()
    data = data.select(range(rows))
    name = next(iter(at)) if len(at) == 1 else "many" if at else "none"
    try:
        record(tok, data, tmp_path / "rec", model=config_model(family, tok), every=2,
               data_collator=QACollator.from_tokenizer(tok), **{**KW, **kw},
               trainer_kwargs={"callbacks": _callbacks(name, at)})
    finally:
        _undo()
    return tok, data, tmp_path / "rec" / "trace"


def _ids(run, steps):
    """One row served at each of ``steps`` (the run's last step for a step past its end: a raised accumulation ends
    the epoch early)."""
    from hf_unlearn.trace import open_run

    opened = open_run(run)
    return [opened.ids_at_steps([min(s, opened.total_steps - 1)])[0] for s in steps]


def _deletion(tmp_path, run, ids, where: str):
    try:
        _, report = delete(run, ids, tmp_path / where)
    except UnlearnError as e:
        return "refused", str(e)
    return ("verified" if report["verified"] else "not verified"), report


# a process-wide change still in force when training ends reaches the recording's own self-check (a replay of its
# first steps in the same process), which then refuses the run: also before any compute, naming the engine's step
SELF_CHECK = "the recording's self-check found the replay engine does not reproduce this run"


PROCESS_WIDE = ("functional_monkeypatch", "backend_flag", "numeric_environment")


def _assert_refused(tmp_path, run, ids, cause: str, where: str = "del", process_wide: bool = False):
    kind, what = _deletion(tmp_path, run, ids, where)
    assert kind == "refused", (kind, what if kind == "refused" else what["provenance"]["problems"])
    assert (cause in what or (process_wide and SELF_CHECK in what)) and "\n" not in what and "before any compute" in what, what


def _assert_refused_or_verified_counterfactual(tmp_path, tok, data, family, run, ids, at, cause: str, where: str,
                                               process_wide: bool = False):
    """A named change: refused before any compute naming it, or, the proof having shown the engine reproduces the run
    with it (a change numerically neutral on the recorded run: the recording's end-of-training proof), VERIFIED and
    equal to the engine-free counterfactual of the program with the change. Never VERIFIED and different."""
    kind, what = _deletion(tmp_path, run, ids, where)
    if kind == "refused":
        assert (cause in what or (process_wide and SELF_CHECK in what)) and "\n" not in what \
            and "before any compute" in what, what
        return
    _assert_verified_counterfactual(tmp_path, tok, data, family, run, ids, at, where, (kind, what))


def _assert_verified_counterfactual(tmp_path, tok, data, family, run, ids, at, where: str = "del", done=None):
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_fidelity import independent_counterfactual

    kind, report = done or _deletion(tmp_path, run, ids, where)
    assert kind == "verified", (kind, report if kind == "refused" else report["provenance"]["problems"])
    oracle = load_checkpoint(open_run(tmp_path / where / "oracle").final_checkpoint())["model"]
    try:
        plain = independent_counterfactual(tok, data, config_model(family, tok), run, ids, tmp_path / f"{where}-plain",
                                           callbacks=attacks(at), **KW)
    finally:
        _undo()
    differ = [n for n, t in oracle.items() if not torch.equal(t, plain[n])]
    assert not differ, differ[:3]


# ---- the named attacks (default suite: one architecture each) -------------------------------------------
@pytest.mark.parametrize("name", ["max_grad_norm", "attn_implementation"])
def test_a_named_program_change_is_recorded_and_refuses_a_step_0_deletion(tmp_path, name):
    """``args.max_grad_norm = 0.05`` (transformers reads ``args`` live; clipping touches only the gradients) and
    ``model.set_attn_implementation("eager")`` (``to_dict()`` drops ``_attn_implementation``), both at step 3, were
    VERIFIED against another model. Now the recording names them with their step, and a step-0 deletion is refused
    before any compute."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.guards import program_changes

    _, _, run = _record(tmp_path, "qwen2", {name: AT})
    opened = open_run(run)
    changes = program_changes(opened.plan, opened.header)
    assert [c["step"] for c in changes] == [AT] and EXPECTED[name] in changes[0]["what"], changes
    _assert_refused(tmp_path, run, _ids(run, [0]), EXPECTED[name])


def test_a_dataset_transform_and_a_deletion_touching_every_later_microbatch_is_refused(tmp_path):
    """A callback adds a ``set_transform`` to the training dataset at step 3; the deletion takes one row of every
    microbatch from step 3 on, so no microbatch the replay runs is left whole to compare by its batch digest. The
    recording names the transform (step 3), and the deletion is refused before any compute."""
    _, _, run = _record(tmp_path, "llama", {"set_transform": AT})
    _assert_refused(tmp_path, run, _ids(run, range(AT, KW["max_steps"])), "at optimizer step 3")


def test_rows_sharing_a_microbatch_with_a_deleted_one_are_checked(tmp_path, monkeypatch):
    """The same attack, with a recorder blind to datasets (as if the transform lived where no digest reads): the
    per-row keyed digests recorded at collation refuse the deletion at the first kept row that differs, naming its
    step (the transform set at step 3 reaches the rows the dataloader fetches after it), before any compute."""
    from hf_unlearn.trace import digests, open_run
    from hf_unlearn.trace.guards import program_changes

    whole = digests.program_state
    monkeypatch.setattr(digests, "program_state", lambda *a, **k: whole(*a, **{**k, "datasets": {}}))
    _, _, run = _record(tmp_path, "llama", {"set_transform": AT})
    opened = open_run(run)
    assert program_changes(opened.plan, opened.header) == []  # the recorder did not see it
    kind, what = _deletion(tmp_path, run, _ids(run, range(AT, KW["max_steps"])), "del")
    assert kind == "refused", (kind, what)
    assert "is not the row the run trained on" in what and "(optimizer step 5)" in what, what
    # a row the digests name is 12 keyed hex digits per slot in the plan: no raw id, no token
    rows = next(e.extra["rows"] for e in opened.plan if e.j == 0)
    assert all(len(r) == 12 * 4 and int(r, 16) >= 0 for r in rows)


# ---- attacks of our own: one run carrying them all, each at its own step, each named ---------------------------------
def test_a_dozen_further_program_and_environment_changes_are_each_named_with_their_step(tmp_path):
    """Fifteen changes an attacker (or a careless script) can make mid-run, one per optimizer step, in one recording:
    every one the record does not hold is recorded as a program change with its step and its cause (the scheduler's
    ``lr_lambda`` and a submodule's ``eval()`` are held by the record: not changes)."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.guards import program_changes

    at = {name: step for step, name in enumerate(TOGETHER, 1)}
    _, _, run = _record(tmp_path, "llama", at, rows=64, max_steps=len(TOGETHER) + 1)
    opened = open_run(run)
    changes = program_changes(opened.plan, opened.header)
    named = {c["step"]: c["what"] for c in changes}
    for name, step in at.items():
        if EXPECTED[name] == "VERIFIED":
            assert step not in named, (name, named.get(step))
        else:
            assert step in named and EXPECTED[name] in named[step], (name, step, named.get(step))


# ---- slow: each attack alone, three architectures, early / mid / late deletions ---------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_attack_on_three_architectures_is_refused_or_verified_and_counterfactual(tmp_path, name, family):
    """Each attack alone at step 3, and a deletion at step 0, at step 3 and at step 5: refused before any compute
    naming the cause, or VERIFIED and equal to a plain ``Trainer`` run with the same attack and the deleted row's
    labels -100 (a named change the recording's proof showed numerically neutral is not refused: the proof, not the
    list, decides)."""
    at = {name: AT}
    tok, data, run = _record(tmp_path, family, at)
    for step in (0, AT, KW["max_steps"] - 1):
        ids, where = _ids(run, [step]), f"del{step}"
        if EXPECTED[name] == "VERIFIED":
            _assert_verified_counterfactual(tmp_path, tok, data, family, run, ids, at, where)
        elif name == "set_transform" and step >= AT:  # the transform reaches the rows fetched after it
            _assert_refused(tmp_path, run, ids, "at optimizer step 3", where)
        else:
            _assert_refused_or_verified_counterfactual(tmp_path, tok, data, family, run, ids, at, EXPECTED[name], where,
                                                       process_wide=name in PROCESS_WIDE)


def test_a_deleted_rows_digest_does_not_survive_into_the_output_run(tmp_path):
    """The plan keeps a keyed digest of every row as collated; a deletion's output run records its own rows: the
    deleted row's digest is gone (its slot is a dummy), the kept rows' digests are unchanged, and it is VERIFIED."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.rows import recorded_rows, split

    _, _, run = _record(tmp_path, "llama", {}, max_steps=3)
    ids = _ids(run, [1])
    kind, _ = _deletion(tmp_path, run, ids, "del")
    assert kind == "verified"
    parent, out = open_run(run), open_run(tmp_path / "del" / "replay")
    before, after = recorded_rows(parent.plan), recorded_rows(out.plan)
    e = next(x for x in parent.plan if x.step == 1)
    deleted = [i for i, s in enumerate(e.slots) if s not in [y for y in next(x for x in out.plan if x.mb == e.mb).slots]]
    assert len(deleted) == 1
    old, new = split(before[e.mb]), split(after[e.mb])
    assert old[deleted[0]] != new[deleted[0]] and old[deleted[0]] not in "".join(after.values())
    assert [d for i, d in enumerate(old) if i != deleted[0]] == [d for i, d in enumerate(new) if i != deleted[0]]
