"""Attacks on the proof's "numerically neutral" acceptance (issue #41 item 5) and on the deleting environment.

A program change a replay does not make (a watched callback's) is accepted when the proof, replaying the recorded run
without it, matches every step: it was neutral **on the rows the run trained on**. A deletion trains on other rows
(a deleted row's labels all -100), so a change whose effect depends on the data can be neutral on the recording and
not on the counterfactual: each test here builds such a change, and compares the deletion with an engine-free
counterfactual (a plain ``Trainer`` with the same callback and the deleted rows' labels -100, the recorded loss
normalisers). The outcome must be a refusal before any compute naming the change, or VERIFIED and equal to it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from hf_unlearn.errors import UnlearnError

from .test_trace_common import config_model, get_trace_data, record
from .test_trace_fidelity import independent_counterfactual

KW = dict(gradient_accumulation_steps=1, max_steps=6)
AT = 3


def _doubles_masked_rows(original):
    """A loss equal to ``original`` on every batch whose rows each have a label, doubled when a row has none: neutral
    on the recorded rows, not on a counterfactual whose deleted row's labels are all -100."""
    def loss(logits, labels, vocab_size, **kwargs):
        out = original(logits, labels, vocab_size, **kwargs)
        return out * 2 if labels is not None and bool((labels == -100).all(dim=1).any()) else out
    return loss


def _loss_swap_at(step: int):
    class SwapLoss(TrainerCallback):  # defined here: watched, not replayed
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == step:
                model.loss_function = _doubles_masked_rows(model.loss_function)

    return SwapLoss()


def _record(tmp_path, family, callbacks, **kw):
    from hf_unlearn.data import QACollator

    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=config_model(family, tok), every=2,
           data_collator=QACollator.from_tokenizer(tok), trainer_kwargs={"callbacks": callbacks}, **{**KW, **kw})
    return tok, data, tmp_path / "rec" / "trace"


def stopped_at_4_then_resumed(tmp_path, tok, data, callbacks, **trace_kw):
    """``trainer(*extra)``: a recording of a tiny Llama into ``tmp_path/rec`` (``KW``'s 6 steps, the Trainer
    checkpointing every 4, a trace checkpoint every 2) with ``callbacks``; the caller runs
    ``trainer(trainer.stop_at_4)`` (a watched callback: defined here, replays cannot import it) and then ``trainer()``
    resumed from ``checkpoint-4``."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer

    from .test_trace_common import train_args

    kw = {**KW, "save_strategy": "steps", "save_steps": 4}

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 4

    def trainer(*extra):
        return TraceRecordingTrainer(model=config_model("llama", tok), args=train_args(tmp_path / "rec", **kw),
                                     train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
                                     trace_checkpoint_steps=2, callbacks=[*callbacks, *extra], **trace_kw)
    trainer.stop_at_4 = Stop()
    return trainer


def _forget_outcome(run, ids, out):
    from hf_unlearn import forget

    try:
        receipt = forget(run, ids, out, oracle=True, progress=False)
    except UnlearnError as e:
        return "refused", str(e)
    return ("verified" if receipt.evidence["verified"] is True else "not verified"), receipt


def _differs_from_counterfactual(tok, data, family, run, ids, out, callbacks, **kw):
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    oracle = load_checkpoint(open_run(out / "oracle").final_checkpoint())["model"]
    plain = independent_counterfactual(tok, data, config_model(family, tok), run, ids, out / "plain",
                                       callbacks=callbacks, **{**KW, **kw})
    return [n for n, t in oracle.items() if not torch.equal(t, plain[n])]


@pytest.mark.parametrize("step", [pytest.param(3, marks=pytest.mark.slow), 4])
def test_a_change_neutral_on_the_recorded_rows_only_is_not_verified_for_a_deletion(tmp_path, step):
    """A watched callback replaces ``model.loss_function`` at step 3 by one that doubles the loss of a microbatch with
    a row whose labels are all -100: the recorded rows never have one, so the proof (which replays without the
    callback) matches every step and accepts the change as neutral. A deletion's counterfactual has such a row at the
    deleted row's step: a plain Trainer with the callback doubles that step's loss, the replay does not. Before the
    fix a step-0 and a step-4 deletion were VERIFIED with every trained tensor off the counterfactual; now refused
    before any compute, naming the change and that the proof shows it neutral only on the recorded rows."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.guards import program_changes

    tok, data, run = _record(tmp_path, "llama", [_loss_swap_at(AT)])
    opened = open_run(run)
    changes = program_changes(opened.plan, opened.header)
    assert changes and changes[0]["step"] == AT and "loss_function" in changes[0]["what"], changes
    proof = opened.header["fidelity"]["proof"]
    assert proof["proven"] and proof["steps"] == [0, KW["max_steps"] - 1], proof  # neutral on the recorded rows
    ids = opened.ids_at_steps([step])[:1]
    kind, what = _forget_outcome(run, ids, tmp_path / "del")
    if kind == "verified":  # the only acceptable VERIFIED is one equal to the counterfactual
        assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "del", [_loss_swap_at(AT)])
        return
    assert kind == "refused", (kind, what)
    assert "\n" not in what and "loss_function" in what and "not on a deletion's" in what, what
    assert not (tmp_path / "del").exists()  # before any compute


def _scope_of(change):
    """The recorder's record of ``change(model)``: where the guards see it, and whether it is neutral on any rows."""
    from hf_unlearn.trace import digests
    from hf_unlearn.trace.guards import _scope, snapshot

    tok, _ = get_trace_data()
    model = config_model("llama", tok)
    opt = torch.optim.AdamW(model.parameters())

    def snap():
        s = snapshot(model, opt, exact=True)
        s.controls["whole"] = digests.program_state(model, opt)
        return s

    before = snap()
    change(model)
    return _scope(before, snap())


def test_only_activation_checkpointing_is_neutral_on_any_rows():
    """The allowlist that keeps issue #41's over-refusal fixed (gradient checkpointing switched on mid-run by a callback
    replays do not run: neutral on any rows, deletions VERIFIED, tests/test_trace_proof.py) covers that change alone:
    with a loss swapped at the same step, or a weight edited, it is not neutral on any rows."""
    def checkpointing(m):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def with_loss(m):
        checkpointing(m)
        m.loss_function = _doubles_masked_rows(m.loss_function)

    def with_edit(m):
        checkpointing(m)
        with torch.no_grad():
            m.lm_head.weight[0, 0] += 1

    assert _scope_of(checkpointing) == {"seen": "controls", "any_rows": True}
    assert _scope_of(with_loss) == {"seen": "controls"}
    assert _scope_of(with_edit) == {"seen": "controls"}
    # a function held by the model instance is named with the hooks (the controls); a private attribute only in the
    # whole-program digest (a private module attribute)
    assert _scope_of(lambda m: setattr(m, "loss_function", _doubles_masked_rows(m.loss_function))) == {"seen": "controls"}
    assert _scope_of(lambda m: setattr(m.model.layers[0].self_attn, "_trace_hint", 2)) == {"seen": "program"}


def test_what_the_proof_shows_reproduced_of_a_change():
    """A change is shown reproduced on a deletion's rows only when it is neutral on any rows, or was made while the step
    ran (the recorded trainer's compute_loss, which replays run) and seen where the proof compares (state, controls)
    with the proof's controls equal to the recording's from it on; a watched callback's change, one made between
    steps (a scheduler's lambda, a dataset's __getitem__: code replays do not run), one only the whole-program digest
    saw, and one after which the proof saw other controls are not."""
    from hf_unlearn.trace.guards import unproven_changes

    header = {"fidelity": {"proof": {"proven": True, "steps": [0, 5], "neutral_controls": [4, 5]}}}
    compute_loss = {"step": 3, "what": "w was edited in place", "seen": "tensors", "in_step": True}
    ok = [compute_loss, {"step": 2, "what": "gc", "seen": "controls", "by": "C.on_step_begin (...)", "any_rows": True}]
    bad = [{**compute_loss, "by": "C.on_step_begin (...)"}, {**compute_loss, "in_step": False},
           {**compute_loss, "seen": "program"}, {**compute_loss, "seen": "controls", "step": 4},  # the proof's controls differed there
           {"step": 3, "what": "old record"}]
    from unittest import mock

    with mock.patch("hf_unlearn.trace.proven.proven_steps", return_value=(set(range(6)), None)):
        assert unproven_changes(ok, header, 0, 6) == []
        assert unproven_changes(bad, header, 0, 6)[:len(bad)] == bad
        # other controls in the proof's replay that no allowlisted change explains: a difference only a replay makes
        alone = unproven_changes([], header, 0, 6)
        assert [c["step"] for c in alone] == [4] and "4..5" in alone[0]["what"], alone


# ---- the trainer's own attributes, set mid-run by a callback (not among the whole-program digests' objects) --------
def _the_trainer():
    """The Trainer running this callback (found up the stack, as a callback without a reference to it can)."""
    import sys

    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        found = frame.f_locals.get("self")
        if isinstance(found, Trainer):
            return found
        frame = frame.f_back
    raise AssertionError("no trainer up the stack")


def _mean_over_kept(outputs, labels, num_items_in_batch=None):
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
    return ForCausalLMLoss(logits, labels, logits.shape[-1])  # the mean over this microbatch's labelled tokens


def _trainer_attack_at(step: int, name: str):
    class TrainerAttribute(TrainerCallback):  # defined here: watched, not replayed
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step:
                trainer = _the_trainer()
                if name == "model_accepts_loss_kwargs":  # the model's loss then averages over its own tokens
                    trainer.model_accepts_loss_kwargs = False
                elif name == "label_smoother":
                    from transformers.trainer_pt_utils import LabelSmoother

                    trainer.label_smoother = LabelSmoother(epsilon=0.1)
                elif name == "compute_loss_func":
                    trainer.compute_loss_func = _mean_over_kept

    return TrainerAttribute()


TRAINER_ATTACKS = ("model_accepts_loss_kwargs", "label_smoother", "compute_loss_func")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "compute_loss_func" else n
                                  for n in TRAINER_ATTACKS])
def test_a_trainer_attribute_set_mid_run_is_refused_or_verified_and_counterfactual(tmp_path, name):
    """A callback reaches the Trainer and sets one of its attributes at step 3: ``model_accepts_loss_kwargs = False``
    (each microbatch's loss then averages over its own labelled tokens instead of the recorded normaliser: on the
    recorded rows with one microbatch a step the same number, on a deletion's not), a ``label_smoother``, a
    ``compute_loss_func``. The first two were VERIFIED with every tensor off a plain Trainer with the callback (the
    trainer's instance attributes were not digested, and both changes are neutral on the recorded rows); now each is
    named with its step when recording and the deletion refused before any compute."""
    tok, data, run = _record(tmp_path, "llama", [_trainer_attack_at(AT, name)])
    from hf_unlearn.trace import open_run

    ids = open_run(run).ids_at_steps([AT])[:1]
    kind, what = _forget_outcome(run, ids, tmp_path / "del")
    if kind == "verified":  # before the trainer's settings were digested: VERIFIED, every tensor off (the first two)
        assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "del",
                                                [_trainer_attack_at(AT, name)])
    assert kind == "refused", (kind, what if kind == "refused" else what.evidence)
    assert "\n" not in what and f"trainer.{name}" in what and "at optimizer step 3" in what, what
    assert not (tmp_path / "del").exists()  # before any compute


# ---- a method patched on torch.Tensor mid-run ----------------------------------------------------------------------
_ORIGINAL_CONTIGUOUS = torch.Tensor.contiguous


def _labels_for_unlabelled_rows(self, *args, **kwargs):
    """``Tensor.contiguous`` that gives a row of labels that are all -100 (the loss's shifted labels) the label 0: the
    same as the original on every recorded row, not on a counterfactual's deleted row."""
    out = _ORIGINAL_CONTIGUOUS(self, *args, **kwargs)
    if out.dtype == torch.long and out.dim() == 2 and bool((out == -100).all(dim=1).any()):
        out = torch.where((out == -100).all(dim=1, keepdim=True), torch.zeros_like(out), out)
    return out


def _tensor_patch_at(step: int):
    class PatchTensor(TrainerCallback):  # defined here: watched, not replayed
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step:
                torch.Tensor.contiguous = _labels_for_unlabelled_rows

        def on_train_end(self, args, state, control, **kwargs):
            torch.Tensor.contiguous = _ORIGINAL_CONTIGUOUS

    return PatchTensor()


def test_a_method_patched_on_torch_tensor_mid_run_is_named_and_refused(tmp_path):
    """A callback replaces ``torch.Tensor.contiguous`` at step 3 by one that labels a row whose labels are all -100
    (neutral on the recorded rows, so the proof matched every step): not digested before, a step-3 deletion was
    VERIFIED with every tensor off a plain Trainer with the callback. Now ``torch.Tensor``'s methods are digested
    with the model's classes: the recording names the patch at step 3, the deletion is refused before any compute."""
    from hf_unlearn.trace import open_run

    try:
        tok, data, run = _record(tmp_path, "llama", [_tensor_patch_at(AT)])
    finally:
        torch.Tensor.contiguous = _ORIGINAL_CONTIGUOUS
    ids = open_run(run).ids_at_steps([AT])[:1]
    kind, what = _forget_outcome(run, ids, tmp_path / "del")
    if kind == "verified":
        try:
            assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "del",
                                                    [_tensor_patch_at(AT)])
        finally:
            torch.Tensor.contiguous = _ORIGINAL_CONTIGUOUS
    assert kind == "refused", (kind, what if kind == "refused" else what.evidence)
    assert "\n" not in what and "code class torch.Tensor" in what and "at optimizer step 3" in what, what
    assert not (tmp_path / "del").exists()


def _set_after_construction(trainer, name: str) -> None:
    if name == "model_accepts_loss_kwargs":
        trainer.model_accepts_loss_kwargs = False
    elif name == "compute_loss_func":
        trainer.compute_loss_func = _mean_over_kept


class _SetAtTrainBegin(TrainerCallback):
    """The counterfactual's way to set the same attribute before its first step."""

    def __init__(self, name):
        self.name = name

    def on_train_begin(self, args, state, control, **kwargs):
        _set_after_construction(_the_trainer(), self.name)


WHY_AT_TRAIN = {"model_accepts_loss_kwargs": "the model does not accept num_items_in_batch",
                "compute_loss_func": "compute_loss_func"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WHY_AT_TRAIN))
def test_a_trainer_setting_changed_between_construction_and_train_is_refused(tmp_path, name):
    """The constructor refuses ``compute_loss_func=`` and a model that ignores the normaliser; the same settings made
    on the trainer after construction, before ``train()``, are outside those checks. The replay rebuilds the trainer
    from its recorded arguments (without them), and on the recorded rows they are neutral (one microbatch a step),
    so the proof matched: refused when training starts, or VERIFIED and equal to a plain Trainer that has them."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer, open_run

    from .test_trace_common import train_args

    tok, data = get_trace_data()
    data = data.select(range(24))
    trainer = TraceRecordingTrainer(model=config_model("llama", tok), args=train_args(tmp_path / "rec", **KW),
                                    train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
                                    trace_checkpoint_steps=2, trace_checkpoint_retention="even")
    _set_after_construction(trainer, name)
    try:
        trainer.train()
    except UnlearnError as e:
        assert "\n" not in str(e) and WHY_AT_TRAIN[name] in str(e), e
        return
    print("OUTCOME-TRAINED", name)
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([AT])[:1]
    kind, what = _forget_outcome(run, ids, tmp_path / "del")
    if kind == "refused":
        assert "\n" not in what and name in what, what
        return
    assert kind == "verified", what.evidence
    assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "del", [_SetAtTrainBegin(name)])


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_a_loss_neutral_on_the_recorded_rows_on_a_gqa_sft_run_is_refused(tmp_path, adapter):
    """The loss swap on the shape users train: SmolLM2's (Llama, grouped-query attention, tied embeddings, the GPT-2
    vocabulary), ``trace_recording(SFTTrainer)`` with and without a LoRA adapter, the swap on the base model at step
    2: the proof matches every step (no recorded row is unlabelled), and `forget` refuses a step-0 and a step-2
    deletion before any compute, naming the change."""
    from hf_unlearn.trace import open_run

    from .test_real_configs import base_model, config_for, data_for, trainer_for, trainer_kwargs

    class SwapBaseLoss(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                base = model.get_base_model() if hasattr(model, "get_base_model") else model
                base.loss_function = _doubles_masked_rows(base.loss_function)

    trainer_for("sft", True)(model=base_model("sft", "llama_tied", "sdpa", tmp_path / "base"),
                             args=config_for("sft", tmp_path / "rec", "fp32"), train_dataset=data_for("sft", "llama_tied"),
                             trace_checkpoint_steps=2, trace_checkpoint_retention="even", callbacks=[SwapBaseLoss()],
                             **trainer_kwargs("sft", "llama_tied", adapter)).train()
    run = open_run(tmp_path / "rec" / "trace")
    assert run.header["fidelity"]["proof"]["proven"]
    for step in (0, 2):
        kind, what = _forget_outcome(run.path, run.ids_at_steps([step])[:1], tmp_path / f"del{step}")
        assert kind == "refused", (kind, what if kind == "refused" else what.evidence)
        assert "loss_function" in what and "not on a deletion's" in what and "\n" not in what, what
        assert not (tmp_path / f"del{step}").exists()


# ---- a dataset that returns other rows than it holds -----------------------------------------------------------------
def _noisy_after(calls: int):
    """A ``datasets.Dataset`` class whose rows lose their last 1-3 tokens at random once ``calls`` rows were fetched
    (after the recorder saved the store, which it reads from the table, not through ``__getitem__``)."""
    import random

    import datasets

    seen = [0]

    class Noisy(datasets.Dataset):
        def __getitems__(self, keys):
            return [self.__getitem__(int(k)) for k in keys]

        def __getitem__(self, key):
            row = super().__getitem__(key)
            if not isinstance(key, int):
                return row
            seen[0] += 1
            if seen[0] > calls:
                k = random.randint(1, 3)
                row = {**row, **{c: row[c][:-k] for c in ("input_ids", "attention_mask", "labels")}}
            return row

    return Noisy


@pytest.mark.slow
def test_a_dataset_returning_other_rows_than_it_holds_is_sealed_as_a_divergence(tmp_path):
    """Training fetched rows the store does not hold from step 3 on (a ``__getitem__`` with random truncation): the
    proof used to stop on the batch check with an error, never sealing anything, so every deletion was refused with
    "prove the run once" while proving failed. Now the proof seals the steps before the first such microbatch and a
    divergence there naming the microbatch; deletions whose replay passes it are refused before any compute."""
    import copy

    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.proof import prove

    tok, data = get_trace_data()
    data = copy.copy(data.select(range(24)))
    data.__class__ = _noisy_after(4 * 5 + 4)
    record(tok, data, tmp_path / "rec", model=config_model("llama", tok), every=2,
           data_collator=QACollator.from_tokenizer(tok), **KW)
    run = tmp_path / "rec" / "trace"
    proof = prove(run, progress=False)
    at = proof["diverged"]["step"]  # the first microbatch the noise reached (the preflight reads rows too)
    assert not proof["proven"] and 0 < at < KW["max_steps"] and proof["steps"] == [0, at - 1], proof
    assert f"(optimizer step {at}) does not collate to the batch the run recorded" in proof["diverged"]["why"], proof
    kind, what = _forget_outcome(run, open_run(run).ids_at_steps([KW["max_steps"] - 1])[:1], tmp_path / "del")
    assert kind == "refused" and "\n" not in what and f"optimizer step {at}" in what, what
    assert not (tmp_path / "del").exists()


# ---- a user hook registered before training ------------------------------------------------------------------------
def _relabel_unlabelled_rows(module, args, kwargs):
    """A forward pre-hook (with kwargs) that gives a row whose labels are all -100 the labels of its input ids: a no-op
    on every recorded row, not on a counterfactual's deleted row."""
    labels = kwargs.get("labels")
    if labels is not None and bool((labels == -100).all(dim=1).any()):
        empty = (labels == -100).all(dim=1, keepdim=True)
        kwargs = {**kwargs, "labels": torch.where(empty, kwargs["input_ids"], labels)}
    return args, kwargs


def test_a_user_hook_registered_before_training_and_neutral_on_the_recorded_rows_is_refused(tmp_path):
    """A forward pre-hook on the model, registered before ``train()`` (the recording names it at step 0: a hook a
    replay does not run), that only acts on a row with no label: the proof matched every step, and a deletion was
    VERIFIED with every tensor off a plain Trainer on the hooked model. Now refused before any compute."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import open_run

    tok, data = get_trace_data()
    data = data.select(range(24))
    model = config_model("llama", tok)
    model.register_forward_pre_hook(_relabel_unlabelled_rows, with_kwargs=True)
    try:  # the construction probe runs the hooked model: a hook that gives the dummy row labels is refused there
        record(tok, data, tmp_path / "rec", model=model, every=2, data_collator=QACollator.from_tokenizer(tok),
               **KW)
    except UnlearnError as e:
        what = str(e)
        assert "\n" not in what and "hook" in what and "_relabel_unlabelled_rows" in what, what
        assert not (tmp_path / "rec" / "trace").exists()
        return
    run = tmp_path / "rec" / "trace"
    assert open_run(run).header["fidelity"]["proof"]["proven"]
    ids = open_run(run).ids_at_steps([AT])[:1]
    kind, what = _forget_outcome(run, ids, tmp_path / "del")
    if kind == "verified":
        from hf_unlearn.trace.run import load_checkpoint

        oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
        hooked = config_model("llama", tok)
        hooked.register_forward_pre_hook(_relabel_unlabelled_rows, with_kwargs=True)
        plain = independent_counterfactual(tok, data, hooked, run, ids, tmp_path / "plain", **KW)
        assert not [n for n, t in oracle.items() if not torch.equal(t, plain[n])]
    assert kind == "refused", (kind, what if kind == "refused" else what.evidence)
    assert "\n" not in what and "hook" in what and "not on a deletion's" in what, what
    assert not (tmp_path / "del").exists()


# ---- the model's own attributes set before training ----------------------------------------------------------------
def test_a_loss_function_set_on_the_model_before_training_is_refused(tmp_path):
    """``model.loss_function = ...`` set by the script before ``train()`` (not a change during the run: the program's
    first state). A replay rebuilds the model from its config, without it; on the recorded rows the loss is the same,
    so the proof matched. Refused, or VERIFIED and equal to a plain Trainer on the same model."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import open_run

    tok, data = get_trace_data()
    data = data.select(range(24))
    model = config_model("llama", tok)
    model.loss_function = _doubles_masked_rows(model.loss_function)
    try:
        record(tok, data, tmp_path / "rec", model=model, every=2, data_collator=QACollator.from_tokenizer(tok), **KW)
    except UnlearnError as e:
        assert "\n" not in str(e) and "loss_function" in str(e), e
        return
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([AT])[:1]
    kind, what = _forget_outcome(run, ids, tmp_path / "del")
    if kind == "verified":
        from hf_unlearn.trace.run import load_checkpoint

        oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
        swapped = config_model("llama", tok)
        swapped.loss_function = _doubles_masked_rows(swapped.loss_function)
        plain = independent_counterfactual(tok, data, swapped, run, ids, tmp_path / "plain", **KW)
        assert not [n for n, t in oracle.items() if not torch.equal(t, plain[n])]
        return
    assert kind == "refused" and "\n" not in what and "loss_function" in what, what


# ---- a recorded callback whose behaviour follows the environment of the process that runs it ------------------------
class SwapLossWhenAsked(TrainerCallback):
    """A recorded callback (importable, JSON attributes: replays run it again) that swaps the model's loss for
    :func:`_doubles_masked_rows` from optimizer step ``at`` on when ``HFU_TEST_SWAP_LOSS`` is set in its process."""

    def __init__(self, at: int = AT):
        self.at = at

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        import os

        if state.global_step == self.at and os.environ.get("HFU_TEST_SWAP_LOSS"):
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            base.loss_function = _doubles_masked_rows(base.loss_function)


def test_a_recorded_callback_that_reads_the_environment_is_not_verified_when_it_acts_otherwise(tmp_path, monkeypatch):
    """The callback did nothing while recording; in the deleting process the environment makes it swap the loss at
    step 3 (neutral on the recorded rows: the environment probe and the proof cannot see it). Replay and oracle run it
    alike and agree with each other, not with the run that trained. The recording noted that the callback read the
    variable (unset then): the deletion is refused before any compute, naming it (before that was noted, the function
    it sets on the model, a program control compared at every step a replay runs, stopped it at step 3)."""
    from hf_unlearn.trace import open_run

    tok, data, run = _record(tmp_path, "llama", [SwapLossWhenAsked()])
    assert open_run(run).header["trainer"]["callbacks"], "recorded: replays run it again"
    monkeypatch.setenv("HFU_TEST_SWAP_LOSS", "1")
    ids = open_run(run).ids_at_steps([AT])[:1]
    kind, what = _forget_outcome(run, ids, tmp_path / "del")
    if kind == "verified":
        monkeypatch.delenv("HFU_TEST_SWAP_LOSS")
        assert not _differs_from_counterfactual(tok, data, "llama", run, ids, tmp_path / "del", [SwapLossWhenAsked()])
    assert kind == "refused", (kind, what if kind == "refused" else what.evidence)
    # the callback read the variable while recording (unset then): refused before any compute, naming it
    assert "\n" not in what and "HFU_TEST_SWAP_LOSS" in what and "before any compute" in what, what
