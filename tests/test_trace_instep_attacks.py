"""Attacks on VERIFIED by code a replay does not run whose effect depends on values (issue #41, wave 5).

A callback a replay does not run (a *watched* one: defined in a function or ``__main__``, or with events replays do not
run) that edits gradients or parameters only when they are not what it expects is a no-op on every recorded step: the
guards see no change, the proof (which replays without it) matches every step. A deletion trains on other values, and
a plain ``Trainer`` with the same callback then edits them. Each test builds such a program, deletes a row and compares
the deletion with an engine-free counterfactual (a plain ``Trainer`` with the same callbacks, the deleted rows' labels
-100, the recorded normalisers): a refusal before any compute naming the cause, or VERIFIED and equal to it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainerCallback

from .test_trace_common import config_model, get_trace_data, record
from .test_trace_fidelity import independent_counterfactual
from .test_trace_neutral_attacks import _forget_outcome, _the_trainer

KW = dict(gradient_accumulation_steps=1, max_steps=6)
AT = 3


def _record(tmp_path, family, callbacks=(), name="rec", **kw):
    from hf_unlearn.data import QACollator

    tok, data = get_trace_data()
    data = data.select(range(24))
    trainer_kwargs = {"callbacks": list(callbacks), **kw.pop("trainer_kwargs", {})}
    record(tok, data, tmp_path / name, model=config_model(family, tok), every=2,
           data_collator=kw.pop("data_collator", None) or QACollator.from_tokenizer(tok),
           trainer_kwargs=trainer_kwargs, **{**KW, **kw})
    return tok, data, tmp_path / name / "trace"


def _off_counterfactual(tok, data, family, run, ids, out, callbacks=(), **kw):
    """The oracle's tensors that differ from a plain Trainer's run of the same program with ``ids`` deleted."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    oracle = load_checkpoint(open_run(out / "oracle").final_checkpoint())["model"]
    plain = independent_counterfactual(tok, data, config_model(family, tok), run, ids, out / "plain",
                                       callbacks=callbacks, **{**KW, **kw})
    return [n for n, t in oracle.items() if not torch.equal(t, plain[n])]


def _refused_or_counterfactual(tmp_path, family, run, tok, data, step, callbacks, must_name: str, **kw):
    """Delete the first row of optimizer step ``step``: refused before compute naming ``must_name``, or VERIFIED and
    equal to the plain Trainer's counterfactual. Returns the outcome."""
    from hf_unlearn.trace import open_run

    ids = open_run(run).ids_at_steps([step])[:1]
    out = tmp_path / f"del{step}"
    kind, what = _forget_outcome(run, ids, out)
    if kind == "refused":
        assert "\n" not in what and must_name in what, what
        assert not out.exists()  # before any compute
        return kind
    assert kind == "verified", what.evidence
    off = _off_counterfactual(tok, data, family, run, ids, out, callbacks(), **kw)
    assert not off, f"VERIFIED, and {len(off)} tensor(s) differ from the plain Trainer's counterfactual: {off[:3]}"
    return kind


# ---- value-conditional edits by watched callbacks -----------------------------------------------------------------
def _grad_total(model) -> float:
    return float(sum(p.grad.double().sum() for p in model.parameters() if p.grad is not None))


def _param_total(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


class _Capture(TrainerCallback):
    """Notes the gradients' and the parameters' totals at every step (a calibration run)."""

    def __init__(self):
        self.grads, self.params = {}, {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads[state.global_step] = _grad_total(model)

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.params[state.global_step] = _param_total(model)


def _calibrate(tmp_path, family):
    cap = _Capture()
    _record(tmp_path, family, [cap], name="calibration")
    return cap


def _spike_guard(expected: dict, where: str):
    """A watched callback (defined here) that halves the gradients (``pre``: on_pre_optimizer_step) or shrinks the
    parameters (``post``: on_optimizer_step) of a step whose totals are not the ones it expects: calibrated on the
    recorded rows, a no-op on every recorded step, active on a deletion's."""

    class SpikeGuard(TrainerCallback):
        if where == "pre":
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if _grad_total(model) != expected[state.global_step]:
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.mul_(0.5)
        else:
            def on_optimizer_step(self, args, state, control, model=None, **kwargs):
                if _param_total(model) != expected[state.global_step]:
                    with torch.no_grad():
                        for p in model.parameters():
                            p.mul_(0.99)

    return SpikeGuard()


@pytest.mark.parametrize("where,family", [("pre", "llama"), pytest.param("post", "llama", marks=pytest.mark.slow),
                                          pytest.param("pre", "qwen2", marks=pytest.mark.slow),
                                          pytest.param("post", "gpt_neox", marks=pytest.mark.slow)])
def test_a_watched_callback_that_edits_only_values_it_did_not_expect_is_refused(tmp_path, where, family):
    """A callback a replay does not run reads the gradients (``on_pre_optimizer_step``) or the parameters
    (``on_optimizer_step``) at every step and edits them when they are not what it expects: on the recorded rows
    never (the guards see no change; the proof matches every step), on a deletion's always. Before the fix a step-0
    and a mid-run deletion were VERIFIED with every trained tensor off a plain Trainer with the callback; now the
    recording notes the steps where a callback a replay does not run read tensor values, and a deletion whose replay
    passes them is refused before any compute, naming the callback and the event."""
    cap = _calibrate(tmp_path, family)
    expected = cap.grads if where == "pre" else cap.params
    tok, data, run = _record(tmp_path, family, [_spike_guard(expected, where)])
    event = "on_pre_optimizer_step" if where == "pre" else "on_optimizer_step"
    for step in (0, AT):
        kind = _refused_or_counterfactual(tmp_path, family, run, tok, data, step,
                                          lambda: [_spike_guard(expected, where)], f"SpikeGuard.{event}")
        assert kind == "refused"


# ---- a forward hook registered mid-run by a watched callback ---------------------------------------------------------
def _relabel_unlabelled_rows(module, args, kwargs):
    """A forward pre-hook that gives a row whose labels are all -100 its input ids as labels: a no-op on the recorded
    rows, not on a deletion's."""
    labels = kwargs.get("labels")
    if labels is not None and bool((labels == -100).all(dim=1).any()):
        empty = (labels == -100).all(dim=1, keepdim=True)
        kwargs = {**kwargs, "labels": torch.where(empty, kwargs["input_ids"], labels)}
    return args, kwargs


def _hook_at(step: int):
    class HookAt(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == step:
                model.register_forward_pre_hook(_relabel_unlabelled_rows, with_kwargs=True)

    return HookAt()


def test_a_forward_hook_registered_mid_run_by_a_callback_is_refused(tmp_path):
    """A watched callback registers, at step 3, a forward pre-hook that relabels a row with no label (never one on the
    recorded rows): named at step 3 (a hook is a program control), a deletion at step 3 or 4 refused before any
    compute."""
    tok, data, run = _record(tmp_path, "llama", [_hook_at(AT)])
    for step in (AT, AT + 1):
        assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, step, lambda: [_hook_at(AT)],
                                          "hook") == "refused"


# ---- a module global the recorded trainer's compute_loss reads, set by a watched callback ---------------------------
DOUBLE_UNLABELLED = False  # read by GlobalReadingTrainer.compute_loss


class GlobalReadingTrainer(Trainer):
    """A recorded trainer class (importable: replays run its ``compute_loss``) whose loss doubles a microbatch with an
    unlabelled row when the module global ``DOUBLE_UNLABELLED`` is set."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs.get("labels")
        if DOUBLE_UNLABELLED and labels is not None and bool((labels == -100).all(dim=1).any()):
            return (out[0] * 2, out[1]) if return_outputs else out * 2
        return out


def _set_global_at(step: int):
    class SetGlobal(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            global DOUBLE_UNLABELLED
            DOUBLE_UNLABELLED = state.global_step >= step

        def on_train_end(self, args, state, control, **kwargs):
            global DOUBLE_UNLABELLED
            DOUBLE_UNLABELLED = False

    return SetGlobal()


def test_a_global_the_recorded_loss_reads_set_by_a_watched_callback_is_refused(tmp_path):
    """The recorded trainer's ``compute_loss`` (replays run it) reads a module global that a watched callback sets at
    step 3; on the recorded rows it changes nothing (no row is unlabelled), so the guards and the proof saw nothing,
    and a replay in the deleting process runs with the global's value there. A deletion after step 3 differs from a
    plain Trainer with the callback (its loss doubles the deleted row's microbatch). Now the globals the recorded
    trainer's code reads are digested: the change is named at step 3 and the deletion refused before any compute."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import open_run, trace_recording

    tok, data = get_trace_data()
    data = data.select(range(24))
    from .test_trace_common import train_args

    trace_recording(GlobalReadingTrainer)(
        model=config_model("llama", tok), args=train_args(tmp_path / "rec", **KW), train_dataset=data,
        data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=2, trace_checkpoint_retention="even",
        callbacks=[_set_global_at(AT)]).train()
    assert not DOUBLE_UNLABELLED
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([AT + 1])[:1]
    kind, what = _forget_outcome(run, ids, tmp_path / "del")
    if kind == "verified":  # a plain GlobalReadingTrainer run with the callback, the deleted row's labels -100
        from hf_unlearn.demo import _DropIds
        from hf_unlearn.trace.run import load_checkpoint

        from .test_trace_common import labels_masked, recorded_normalisers_trainer

        oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
        model = config_model("llama", tok)
        recorded_normalisers_trainer(run, base=GlobalReadingTrainer)(
            model=model, args=train_args(tmp_path / "plain", **KW), train_dataset=labels_masked(data, ids),
            callbacks=[_set_global_at(AT)], data_collator=_DropIds(QACollator.from_tokenizer(tok))).train()
        off = [n for n, t in oracle.items() if not torch.equal(t, model.state_dict()[n])]
        assert not off, f"VERIFIED and {len(off)} tensors off the plain trainer's counterfactual"
    assert kind == "refused", what.evidence if kind != "refused" else what
    assert "DOUBLE_UNLABELLED" in what and "\n" not in what, what


# ---- ordinary callbacks must still VERIFY ----------------------------------------------------------------------------
def _ordinary_callbacks():
    from transformers import EarlyStoppingCallback

    class PrintLogs(TrainerCallback):  # a script's logging callback (watched: defined in a function)
        def __init__(self):
            self.seen = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append(dict(logs or {}))

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.seen.append(dict(metrics or {}))

        def on_step_end(self, args, state, control, **kwargs):
            self.seen.append(state.global_step)

    class StopOnDivergence(TrainerCallback):  # a script's own stop rule: decides from the logged loss, reaches
        # no tensor (its stop is the run's length, a recorded control)
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and logs.get("loss", 0.0) > 1e9:
                control.should_training_stop = True

    return [PrintLogs(), StopOnDivergence(), EarlyStoppingCallback(early_stopping_patience=100)]


def test_ordinary_logging_eval_and_early_stopping_callbacks_still_verify(tmp_path):
    """A script's own logging callback (on_log, on_evaluate, on_step_end; defined in a function, so watched),
    evaluation every two steps and ``EarlyStoppingCallback``: no tensor read, nothing changed; a step-0 and a mid-run
    deletion are VERIFIED and equal to a plain Trainer with the same callbacks."""
    tok, data = get_trace_data()
    eval_kw = dict(eval_strategy="steps", eval_steps=2, metric_for_best_model="eval_loss", load_best_model_at_end=False)
    tok, data, run = _record(tmp_path, "llama", _ordinary_callbacks(),
                             trainer_kwargs={"eval_dataset": data.select(range(24, 28))}, **eval_kw)
    for step in (0, AT):
        assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, step, lambda: [], "",
                                          ) == "verified"


# ---- the remedy: the same guard as a recorded callback, which replays run ---------------------------------------------
class RecordedSpikeGuard(TrainerCallback):
    """:func:`_spike_guard`'s gradient edit as a recorded callback (importable, JSON attributes, a replayed event)."""

    def __init__(self, expected=()):
        self.expected = list(expected)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if _grad_total(model) != self.expected[state.global_step]:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)


@pytest.mark.slow  # a calibration run, a recording, two deletions and two counterfactuals (~14 s)
def test_the_value_conditional_guard_as_a_recorded_callback_is_verified_and_counterfactual(tmp_path):
    """Recorded, the same gradient guard runs in replays and the oracle: it halves the deleted row's step there as a
    plain Trainer with it does, so a step-0 and a mid-run deletion are VERIFIED and equal to the counterfactual (what
    the refusal above tells the user to do works)."""
    from hf_unlearn.trace import open_run

    cap = _calibrate(tmp_path, "llama")
    expected = [cap.grads[s] for s in range(KW["max_steps"])]
    tok, data, run = _record(tmp_path, "llama", [RecordedSpikeGuard(expected)])
    assert open_run(run).header["trainer"]["callbacks"], "recorded: replays run it"
    for step in (0, AT):
        assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, step,
                                          lambda: [RecordedSpikeGuard(expected)], "") == "verified"


# ---- a data collator with state that follows what it has collated ----------------------------------------------------
class CountingCollator:
    """An importable collator (its constructor arguments are stored: replays rebuild it) with running state: once it
    has collated ``threshold`` labelled tokens, it ignores the first label of every row. A deletion (labels -100)
    reaches the threshold later, so the kept rows of the steps between are collated otherwise."""

    def __init__(self, tokenizer, threshold: int = 400):
        from hf_unlearn.data import QACollator

        self.tokenizer, self.threshold, self.seen = tokenizer, threshold, 0
        self._inner = QACollator.from_tokenizer(tokenizer)

    def __call__(self, rows):
        batch = self._inner(rows)
        if self.seen >= self.threshold:
            first = (batch["labels"] != -100).int().argmax(dim=1)
            batch["labels"][torch.arange(len(first)), first] = -100
        self.seen += int((batch["labels"] != -100).sum())
        return batch


def test_a_collator_whose_output_follows_what_it_has_seen_is_refused(tmp_path):
    """A collator that changes how it collates once it has seen enough labelled tokens: its running count is an
    attribute, which the whole-program digest reads at every step, so the recording names the change and every
    deletion is refused before any compute (a replay rebuilds it with a fresh count, and on a deletion's rows it would
    reach the threshold at another step)."""
    tok, _ = get_trace_data()
    tok, data, run = _record(tmp_path, "llama", data_collator=CountingCollator(tok))
    assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, 0, lambda: [], "collator") == "refused"


# ---- string ids, the kept rows of the deleted row's microbatch -------------------------------------------------------
@pytest.mark.slow
def test_string_ids_with_kept_rows_beside_the_deleted_one_verify_and_equal_the_counterfactual(tmp_path):
    """String ids (``"row-7"``), four rows a microbatch, accumulation 2: the three kept rows beside a deleted one are
    checked against the recording's per-row digests, and the deletion equals a plain Trainer's counterfactual."""
    from hf_unlearn.trace import open_run

    tok, data = get_trace_data()
    data = data.select(range(24)).map(lambda r: {"id": f"row-{r['id']}"})
    kw = dict(gradient_accumulation_steps=2, max_steps=3)
    record(tok, data, tmp_path / "rec", model=config_model("llama", tok), every=1, **kw)
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([1])[:1]
    assert isinstance(ids[0], str) and ids[0].startswith("row-")
    kind, receipt = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "verified", receipt
    assert not _off_counterfactual(tok, data, "llama", run, ids, tmp_path / "del", **kw)


# ---- publishing an output whose weights were changed after the deletion ---------------------------------------------
def test_hub_push_of_weights_changed_after_the_deletion_is_refused_before_upload(tmp_path, capsys):
    """`forget` writes OUT/model and a card info whose exact-deletion root is the replayed state. One weight changed
    afterwards (a fine-tune, a tamper): `hub push OUT/model` published it with a card saying the deletion was
    verified (only `hub verify` failed it, after the upload). Now the push refuses before anything is sent."""
    from safetensors.torch import load_file, save_file

    from hf_unlearn.cli import main
    from hf_unlearn.demo import local_hub
    from hf_unlearn.trace import open_run

    tok, data, run = _record(tmp_path, "llama")
    ids = open_run(run).ids_at_steps([AT])[:1]
    from hf_unlearn import forget

    assert forget(run, ids, tmp_path / "out", oracle=True, progress=False, tokenizer=tok).evidence["verified"] is True
    weights = tmp_path / "out" / "model" / "model.safetensors"
    sd = load_file(weights)
    name = next(iter(sd))
    sd[name] = sd[name].clone()
    sd[name].view(-1)[0] += 1e-3
    save_file(sd, weights, metadata={"format": "pt"})
    # `trace verify OUT` checks the model folder too: the edited weight is named
    assert main(["trace", "verify", str(tmp_path / "out")]) != 0
    with local_hub(tmp_path / "hub") as (server, token):
        code = main(["hub", "push", str(tmp_path / "out" / "model"), "--repo", "org/t", "--deletion",
                     "--endpoint", server.url, "--token", token])
        assert code != 0
        err = [line for line in capsys.readouterr().err.splitlines() if "refusing to publish" in line]
        assert len(err) == 1 and "changed after the deletion" in err[0], err
        try:
            published = server.store.files("model", "org/t", "main")[1]
        except Exception:  # the repo was never created
            published = {}
        assert "model.safetensors" not in published


# ---- the shape users train: SFTTrainer with LoRA (and modules_to_save) on SmolLM2's GQA shape -------------------------
class _HalveUnexpectedAdapterGradients(TrainerCallback):
    """Notes the trainable gradients' total at each step the first time it runs, halves them when a later run meets
    another total (a no-op on every recorded step)."""

    seen: dict = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        total = float(sum(p.grad.double().sum() for p in model.parameters() if p.grad is not None))
        if self.seen.setdefault(state.global_step, total) != total:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("kind,adapter,precision", [("sft", "lora", "fp32"), ("sft", "lora_mts", "bf16"),
                                                    ("dpo", "lora", "fp32")])
def test_a_value_conditional_adapter_gradient_edit_on_a_gqa_lora_run_is_refused(tmp_path, kind, adapter, precision):
    """``trace_recording(SFTTrainer)`` with a LoRA adapter (and with ``modules_to_save`` under bf16 autocast), and
    ``trace_recording(DPOTrainer)`` with LoRA, on SmolLM2's shape (Llama, grouped-query attention, tied embeddings, the
    GPT-2 vocabulary), a watched callback that halves the trainable gradients only when they are not the totals it
    met before: refused through ``forget`` for a step-0 and a step-2 deletion, before any compute, naming it."""
    from hf_unlearn.trace import open_run

    from .test_real_configs import base_model, config_for, data_for, trainer_for, trainer_kwargs

    class Guard(_HalveUnexpectedAdapterGradients):  # defined here: watched
        seen: dict = {}

    trainer_for(kind, True)(model=base_model(kind, "llama_tied", "sdpa", tmp_path / "base"),
                            args=config_for(kind, tmp_path / "rec", precision), train_dataset=data_for(kind, "llama_tied"),
                            trace_checkpoint_steps=2, trace_checkpoint_retention="even", callbacks=[Guard()],
                            **trainer_kwargs(kind, "llama_tied", adapter)).train()
    run = open_run(tmp_path / "rec" / "trace")
    for step in (0, 2):
        kind, what = _forget_outcome(run.path, run.ids_at_steps([step])[:1], tmp_path / f"del{step}")
        assert kind == "refused", (kind, what if kind == "refused" else what.evidence)
        assert "Guard.on_pre_optimizer_step" in what and "read values a deletion changes" in what and "\n" not in what, what
        assert not (tmp_path / f"del{step}").exists()


# ---- the same edit inside the recorded trainer's compute_loss (replays run it) ---------------------------------------
class DoublingTrainer(Trainer):
    """A recorded trainer class whose loss doubles a microbatch with an unlabelled row (a no-op on every recorded row,
    active on a deletion's: replays and the oracle run it, as a plain run of this class does)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs.get("labels")
        if labels is not None and bool((labels == -100).all(dim=1).any()):
            return (out[0] * 2, out[1]) if return_outputs else out * 2
        return out


@pytest.mark.slow
def test_a_value_conditional_edit_inside_the_recorded_compute_loss_is_verified_and_counterfactual(tmp_path):
    """The loss edit the watched callbacks above are refused for, made by the recorded trainer's own ``compute_loss``:
    replays run it on the deletion's rows, so a step-0 and a mid-run deletion are VERIFIED and equal to a plain run
    of the same trainer class with the deleted row's labels -100."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import open_run, trace_recording
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_common import labels_masked, recorded_normalisers_trainer, train_args

    tok, data = get_trace_data()
    data = data.select(range(24))
    trace_recording(DoublingTrainer)(
        model=config_model("llama", tok), args=train_args(tmp_path / "rec", **KW), train_dataset=data,
        data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=2,
        trace_checkpoint_retention="even").train()
    run = tmp_path / "rec" / "trace"
    for step in (0, AT):
        ids = open_run(run).ids_at_steps([step])[:1]
        kind, receipt = _forget_outcome(run, ids, tmp_path / f"del{step}")
        assert kind == "verified", receipt
        oracle = load_checkpoint(open_run(tmp_path / f"del{step}" / "oracle").final_checkpoint())["model"]
        model = config_model("llama", tok)
        recorded_normalisers_trainer(run, base=DoublingTrainer)(
            model=model, args=train_args(tmp_path / f"plain{step}", **KW), train_dataset=labels_masked(data, ids),
            data_collator=_DropIds(QACollator.from_tokenizer(tok))).train()
        assert not [n for n, t in oracle.items() if not torch.equal(t, model.state_dict()[n])]


# ---- a decision from a logged number, no tensor touched on the recorded run -------------------------------------------
def _shrink_when_loss_unseen(seen: dict):
    class ShrinkWhenLossUnseen(TrainerCallback):
        """Shrinks the weights when the logged loss at a step is not the one it met before: no tensor touched on the
        recorded run (it decides from ``logs``, a Python number)."""

        def on_log(self, args, state, control, logs=None, model=None, **kwargs):
            if "loss" not in (logs or {}):
                return
            if seen.setdefault(state.global_step, logs["loss"]) != logs["loss"]:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.99)

    return ShrinkWhenLossUnseen()


def test_a_callback_deciding_from_the_logged_loss_is_refused(tmp_path):
    """The callback decides from ``logs["loss"]`` (a Python number, not a tensor) and acted on no recorded step; a
    plain Trainer with it shrinks the weights after a deletion's first logged step: a step-0 deletion was VERIFIED with
    21/21 tensors off. Watched callbacks are now handed the logged numbers that follow the data as numbers that note
    a comparison: the recording names it, and the deletion is refused before any compute."""
    seen: dict = {}
    tok, data, run = _record(tmp_path, "llama", [_shrink_when_loss_unseen(seen)], logging_steps=1)
    assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, 0, lambda: [_shrink_when_loss_unseen(seen)],
                                      "ShrinkWhenLossUnseen.on_log", logging_steps=1) == "refused"


# ---- a number the recorded trainer's compute_loss reads from the trainer, set by a watched callback -------------------
class WeightedTrainer(Trainer):
    """A recorded trainer class whose loss weighs a microbatch with an unlabelled row by ``unlabelled_weight``."""

    unlabelled_weight = 1.0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        labels = inputs.get("labels")
        if labels is not None and bool((labels == -100).all(dim=1).any()):
            w = self.unlabelled_weight
            return (out[0] * w, out[1]) if return_outputs else out * w
        return out


def _weight_at(step: int, on: str):
    class SetWeight(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step:
                trainer = _the_trainer()
                (trainer if on == "instance" else WeightedTrainer).unlabelled_weight = 2.0

        def on_train_end(self, args, state, control, **kwargs):
            WeightedTrainer.unlabelled_weight = 1.0

    return SetWeight()


@pytest.mark.parametrize("on", ["instance", pytest.param("class", marks=pytest.mark.slow)])
def test_a_number_the_recorded_loss_reads_from_the_trainer_set_by_a_callback_is_refused(tmp_path, on):
    """A watched callback sets, at step 3, the number the recorded trainer's ``compute_loss`` weighs an unlabelled
    row's microbatch by (on the trainer instance, or on its class): a no-op on the recorded rows, so the proof matched;
    a replay builds its trainer with the class's default. Refused, or VERIFIED and equal to a plain run of the class
    with the callback."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import open_run, trace_recording
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_common import labels_masked, recorded_normalisers_trainer, train_args

    tok, data = get_trace_data()
    data = data.select(range(24))
    trace_recording(WeightedTrainer)(
        model=config_model("llama", tok), args=train_args(tmp_path / "rec", **KW), train_dataset=data,
        data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=2, trace_checkpoint_retention="even",
        callbacks=[_weight_at(AT, on)]).train()
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([AT + 1])[:1]
    kind, what = _forget_outcome(run, ids, tmp_path / "del")
    if kind == "verified":
        oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
        model = config_model("llama", tok)
        recorded_normalisers_trainer(run, base=WeightedTrainer)(
            model=model, args=train_args(tmp_path / "plain", **KW), train_dataset=labels_masked(data, ids),
            callbacks=[_weight_at(AT, on)], data_collator=_DropIds(QACollator.from_tokenizer(tok))).train()
        off = [n for n, t in oracle.items() if not torch.equal(t, model.state_dict()[n])]
        assert not off, f"VERIFIED and {len(off)} tensors off the plain trainer's counterfactual"
        return
    assert kind == "refused" and "unlabelled_weight" in what and "\n" not in what, what


# ---- a callback added while training --------------------------------------------------------------------------------
def _adds_guard_at(step: int, expected: dict):
    class AddsGuard(TrainerCallback):
        """Touches nothing itself; at ``step`` it adds :func:`_spike_guard` to the running trainer's callbacks."""

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step:
                _the_trainer().add_callback(_spike_guard(expected, "pre"))

    return AddsGuard()


def test_a_callback_added_while_training_is_refused(tmp_path):
    """A watched callback that reads nothing adds the value-conditional gradient guard to the trainer at step 3: the
    added callback was never sorted when training started, so it ran unwatched (no value reads noted), and a step-3
    deletion was VERIFIED off a plain Trainer that runs the same program. Now a callback the recording meets for the
    first time while training is a change of that step, named, and every deletion passing it refused."""
    cap = _calibrate(tmp_path, "llama")
    tok, data, run = _record(tmp_path, "llama", [_adds_guard_at(AT, cap.grads)])
    assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, AT, lambda: [_adds_guard_at(AT, cap.grads)],
                                      "added while training") == "refused"


def _removes_recorded_guard_at(step: int):
    class RemovesGuard(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step:
                _the_trainer().remove_callback(RecordedSpikeGuard)

    return RemovesGuard()


@pytest.mark.slow
def test_a_recorded_callback_removed_while_training_is_refused(tmp_path):
    """The recorded gradient guard (replays run it at every step) removed by another callback at step 3: replays
    would run it where the program no longer did. Named at step 3, every deletion passing it refused."""
    cap = _calibrate(tmp_path, "llama")
    expected = [cap.grads[s] for s in range(KW["max_steps"])]
    tok, data, run = _record(tmp_path, "llama", [RecordedSpikeGuard(expected), _removes_recorded_guard_at(AT)])
    assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, AT, lambda: [
        RecordedSpikeGuard(expected), _removes_recorded_guard_at(AT)], "was removed while training") == "refused"


def _shrink_when_history_unseen(seen: dict):
    class ShrinkWhenHistoryUnseen(TrainerCallback):
        """As :func:`_shrink_when_loss_unseen`, deciding from ``state.log_history`` in ``on_step_end``."""

        def on_step_end(self, args, state, control, model=None, **kwargs):
            losses = [e["loss"] for e in state.log_history if "loss" in e]
            if losses and seen.setdefault(state.global_step, losses[-1]) != losses[-1]:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.99)

    return ShrinkWhenHistoryUnseen()


@pytest.mark.slow
def test_a_callback_deciding_from_the_log_history_is_refused(tmp_path):
    """The same decision read from ``state.log_history``: refused, naming the callback."""
    seen: dict = {}
    tok, data, run = _record(tmp_path, "llama", [_shrink_when_history_unseen(seen)], logging_steps=1)
    assert _refused_or_counterfactual(tmp_path, "llama", run, tok, data, 0, lambda: [_shrink_when_history_unseen(seen)],
                                      "ShrinkWhenHistoryUnseen.on_step_end", logging_steps=1) == "refused"


def test_value_reads_see_through_disabled_torch_functions():
    """The monitor notes a read made under ``torch._C.DisableTorchFunction`` (a dispatch mode below the function
    mode), a ``.numpy()`` of ``.data`` and a comparison of a logged number, and nothing for metadata."""
    from hf_unlearn.trace.value_reads import LoggedNumber, ValueReads

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with ValueReads() as meta:
        _ = (p.grad is None, p.shape, p.dtype, p.requires_grad, p.numel(), p.dim())
    assert meta.first is None
    with ValueReads() as hidden:
        with torch._C.DisableTorchFunction():
            float(p.grad.sum())
    assert hidden.first is not None
    with ValueReads() as raw:
        with torch._C.DisableTorchFunction():
            p.data.numpy()
    assert raw.first is not None
    with ValueReads() as logged:
        f"{LoggedNumber(1.5, 'loss'):.3f}"  # formatting is not a decision
        assert logged.first is None
        assert LoggedNumber(1.5, "loss") * 2 > 1
    assert logged.first == "a comparison of the logged loss"


# ---- a resumed recording ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_value_conditional_guard_in_a_resumed_recording_is_refused(tmp_path):
    """The gradient guard in a recording stopped after step 4 and resumed from the Trainer's checkpoint-4
    (``resume_from_checkpoint``): the reads of the steps before the stop are in the plan the resume keeps, those after
    it are noted by the resumed run; a step-0 and a step-5 deletion are refused before any compute."""
    from hf_unlearn.trace import open_run

    from .test_trace_neutral_attacks import stopped_at_4_then_resumed

    cap = _calibrate(tmp_path, "llama")
    tok, data = get_trace_data()
    data = data.select(range(24))
    trainer = stopped_at_4_then_resumed(tmp_path, tok, data, [_spike_guard(cap.grads, "pre")],
                                        trace_checkpoint_retention="even")
    trainer(trainer.stop_at_4).train()
    trainer().train(resume_from_checkpoint=str(tmp_path / "rec" / "checkpoint-4"))
    run = tmp_path / "rec" / "trace"
    assert open_run(run).total_steps == KW["max_steps"]
    for step in (0, 5):
        kind, what = _forget_outcome(run, open_run(run).ids_at_steps([step])[:1], tmp_path / f"del{step}")
        assert kind == "refused" and "SpikeGuard.on_pre_optimizer_step" in what and "\n" not in what, (kind, what)
        assert not (tmp_path / f"del{step}").exists()


def _numpy_guard(seen: dict):
    """A watched callback that keeps a numpy view of the final norm's weight (taken when the trainer is built, outside
    any training event) and shrinks it, through the view, after a step whose total is not the one it saw there
    first: no torch function runs in its event, so the value-read monitor saw nothing."""

    class NumpyGuard(TrainerCallback):
        def on_init_end(self, args, state, control, model=None, **kwargs):
            self.view = model.model.norm.weight.detach().numpy()

        def on_optimizer_step(self, args, state, control, **kwargs):
            total = float(self.view.astype("float64").sum())
            if seen.setdefault(state.global_step, total) != total:
                self.view *= 0.99

    return NumpyGuard()


def test_a_watched_callback_reading_through_a_numpy_view_is_refused(tmp_path):
    """ATTACK: the callback reads and edits the weight through a numpy view (``.numpy()`` shares the tensor's
    memory): a no-op on every recorded step, active on a deletion's. Before, a step-3 deletion was VERIFIED with
    the norm weight off the plain Trainer's counterfactual; now a watched callback holding a numpy view of memory it
    does not own is a value read at each of its events, and the deletion is refused before any compute."""
    seen: dict = {}
    tok, data, run = _record(tmp_path, "llama", [_numpy_guard(seen)])
    assert seen  # it ran at every step
    kind = _refused_or_counterfactual(tmp_path, "llama", run, tok, data, AT, lambda: [_numpy_guard(seen)],
                                      "NumpyGuard.on_optimizer_step")
    assert kind == "refused"
