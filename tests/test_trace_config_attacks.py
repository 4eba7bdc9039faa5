"""Attacks on a VERIFIED through configurations users train with (grouped-query attention, MoE, LoRA, resumed runs,
callbacks that reconfigure the run).

Each test records a tiny run, deletes the way a user would (``hf_unlearn.forget`` with the oracle), and asserts that
the deletion is EITHER refused before any compute with a one-line message naming the cause, OR VERIFIED and equal,
bit for bit, to an engine-free counterfactual the test builds itself (a plain ``Trainer`` of the same program with the
deleted rows' labels -100 and the recorded loss normalisers).
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from hf_unlearn.errors import UnlearnError

from .test_trace_common import config_model, get_trace_data, record, slow_params
from .test_trace_fidelity import independent_counterfactual
from .test_trace_neutral_attacks import _forget_outcome

KW = dict(gradient_accumulation_steps=1, max_steps=6)
MOE_KW = dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, max_steps=6)  # one sample a microbatch
AT = 3


def _oracle_off_counterfactual(tok, data, make_model, run, ids, out, callbacks=(), **kw):
    """The names of the oracle's tensors that differ from a plain Trainer's with the deleted rows' labels -100."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    oracle = load_checkpoint(open_run(out / "oracle").final_checkpoint())["model"]
    plain = independent_counterfactual(tok, data, make_model(), run, ids, out / "plain", callbacks=callbacks,
                                       **{**KW, **kw})
    return [n for n, t in oracle.items() if not torch.equal(t, plain[n])]


def _assert_refused_or_equal(tok, data, make_model, run, ids, out, needle, callbacks=(), **kw):
    kind, what = _forget_outcome(run, ids, out)
    print("OUTCOME", kind, what if kind == "refused" else what.evidence.get("verified"))
    if kind == "verified":
        off = _oracle_off_counterfactual(tok, data, make_model, run, ids, out, callbacks, **kw)
        assert not off, f"WRONG VERIFIED: {len(off)} tensors off the counterfactual, e.g. {off[:3]}"
        return "verified"
    assert kind == "refused", (kind, what.evidence)
    assert "\n" not in what and needle in what, what
    assert not out.exists()  # before any compute
    return "refused"


# ---- a MoE model whose load-balancing loss runs over every token of the microbatch ---------------------------------
def _mixtral(tok, warm: bool = True):
    """A tiny Mixtral with grouped-query attention (one key/value head) and its router's load-balancing loss on."""
    import transformers

    from .test_trace_common import tiny_config_kwargs

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**tiny_config_kwargs(tok), num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)
    model = transformers.MixtralForCausalLM(config)
    if warm:  # a forward first installs transformers' output-capturing hooks (as a user's sanity check does)
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]))
    return model


def test_a_moe_router_load_balancing_loss_under_a_plain_trainer_is_refused_or_counterfactual(tmp_path):
    """Mixtral's ``output_router_logits=True`` adds ``router_aux_loss_coef`` times a load-balancing loss computed over
    every unmasked token of the microbatch, a deleted row's included (its labels do not matter): the counterfactual
    (labels -100) still routes the deleted row's tokens into that loss, a replay's dummy routes pad tokens. DPO refused
    this already; a plain ``Trainer`` must too (or be equal)."""
    tok, data = get_trace_data()
    data = data.select(range(24))
    try:  # one sample per microbatch (several share an expert's gradient sum: refused on their own, below)
        record(tok, data, tmp_path / "rec", model=_mixtral(tok), every=2, **MOE_KW)
    except UnlearnError as e:  # refused when the recording is built: the right outcome
        print("OUTCOME refused at construction:", e)
        assert "\n" not in str(e) and "router_aux_loss_coef" in str(e), e
        return
    from hf_unlearn.trace import open_run

    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([AT])[:1]
    _assert_refused_or_equal(tok, data, lambda: _mixtral(tok), run, ids, tmp_path / "del", "router_aux_loss_coef",
                             **MOE_KW)


# ---- SFTTrainer packing (bfd): padding-free rows whose documents attend to each other under SDPA ------------------
def test_packed_sft_a_document_others_attend_to_is_refused_or_counterfactual(tmp_path):
    """``packing=True`` (bfd) flattens a microbatch's documents into one sequence with restarting position ids. With
    SDPA or eager attention (the CPU default; only varlen kernels cut the sequence at the documents' starts) a later
    document attends to an earlier one. A deletion replaces the deleted document's tokens by dummies, which every later
    document of the microbatch then attends to: replay == oracle, but the counterfactual (the document's labels -100,
    its tokens still there) differs. Deleting a document that is not the last of its microbatch must be refused or be
    equal to a plain SFTTrainer on the packed rows with that document's labels -100."""
    from trl import SFTTrainer  # noqa: F401 - the counterfactual's base

    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint
    from hf_unlearn.trace.store import load_store
    from hf_unlearn.trace.tags import tag

    from .test_trace_sft import PACKED, model, prompt_completion, record_sft, recorded_normalisers, sft_config

    tok, data = prompt_completion()
    try:
        recorder = record_sft(tmp_path / "rec", tok, data, **PACKED)
    except UnlearnError as e:
        print("OUTCOME refused at construction:", e)
        assert "\n" not in str(e) and "attend" in str(e), e
        return
    run_dir = tmp_path / "rec" / "trace"
    run = open_run(run_dir)
    store = load_store(run.store_path)
    index = {tag(run.key, i): n for n, i in enumerate(store["id"])}
    entry = next(e for e in run.plan if e.step == 1 and len(e.slots) > 1)
    first_row = store[index[entry.slots[0]]]
    forget = [first_row["packed_ids"][0]]  # the first document of the flattened microbatch: all the rest attend to it
    kind, what = _forget_outcome(run_dir, forget, tmp_path / "del")
    print("OUTCOME", kind, what if kind == "refused" else what.evidence.get("verified"))
    if kind == "refused":
        assert "\n" not in what and "attend" in what, what
        return
    assert kind == "verified", what.evidence

    def labels_off(r):
        if forget[0] not in r["packed_ids"]:
            return {}
        k = r["packed_ids"].index(forget[0])
        a = sum(r["seq_lengths"][:k])
        b = a + r["seq_lengths"][k]
        return {"labels": r["labels"][:a] + [-100] * (b - a) + r["labels"][b:]}

    plain = recorded_normalisers(run)(
        model=model(tok), args=sft_config(tmp_path / "cf", dataset_kwargs={"skip_prepare_dataset": True}, **PACKED),
        train_dataset=recorder.train_dataset.map(labels_off), processing_class=tok)
    plain.train()
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
    mine = plain.accelerator.unwrap_model(plain.model).state_dict()
    off = [n for n, t in oracle.items() if not torch.equal(t, mine[n])]
    assert not off, f"WRONG VERIFIED: {len(off)} of {len(oracle)} tensors off the counterfactual, e.g. {off[:3]}"


def _without_ids(collator):
    return lambda features: collator([{k: v for k, v in f.items() if k != "id"} for f in features])


# ---- a plain Trainer with DataCollatorWithFlattening: padding-free rows that attend to each other -------------------
class _CacheOnAtTrainBegin(TrainerCallback):
    """``model.config.use_cache = True`` when training begins, after the Trainer set it from its arguments (a user
    who wants the cache for generation in evaluation), where the construction probe saw it off."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.config.use_cache = True


@pytest.mark.parametrize("use_cache", [False, True, "at_train_begin"])
def test_flattened_rows_under_a_plain_trainer_a_row_others_attend_to_is_refused_or_counterfactual(tmp_path, use_cache):
    """``DataCollatorWithFlattening`` (a supported collator) concatenates a microbatch's rows into one sequence with
    restarting position ids. transformers cuts the attention at the rows' starts only when the forward has no cache;
    a plain ``Trainer`` leaves ``use_cache`` to the config (True for Llama), so under SDPA every later row of the
    microbatch attends to the earlier ones. A deleted row's dummy (pad tokens) is then attended to where the
    counterfactual (labels -100, tokens kept) attends to the row's tokens: deleting the first row of a microbatch must
    be refused or equal a plain Trainer with the same collator and that row's labels -100."""
    from transformers import DataCollatorWithFlattening

    from hf_unlearn.trace import open_run

    from .test_trace_common import labels_masked, recorded_normalisers_trainer, train_args

    tok, data = get_trace_data()
    data = data.select(range(24))
    kw = dict(KW, per_device_train_batch_size=2, use_cache=use_cache is True)
    make = lambda: config_model("llama", tok)  # noqa: E731 - GQA: one key/value head
    callbacks = [_CacheOnAtTrainBegin()] if use_cache == "at_train_begin" else []
    try:
        record(tok, data, tmp_path / "rec", model=make(), every=2, data_collator=DataCollatorWithFlattening(),
               trainer_kwargs={"callbacks": callbacks}, **kw)
    except UnlearnError as e:
        print("OUTCOME refused at construction:", e)
        assert "\n" not in str(e) and "attend" in str(e), e
        return
    run = tmp_path / "rec" / "trace"
    opened = open_run(run)
    from hf_unlearn.trace.tags import tag

    first = next(e for e in opened.plan if e.step == AT).slots[0]
    ids = [i for i in opened.ids_at_steps([AT]) if tag(opened.key, i) == first]  # the second row attends to it
    kind, what = _forget_outcome(run, ids, tmp_path / "del")
    print("OUTCOME", kind, what if kind == "refused" else what.evidence.get("verified"))
    if kind == "refused":  # set when training begins: the proof's replay (the Trainer sets use_cache from its
        # arguments) does not reproduce the run, so every deletion is refused as unproven
        assert "\n" not in what and ("attend" in what or "not proven" in what), what
        assert not (tmp_path / "del").exists()
        return
    assert kind == "verified", what.evidence
    from hf_unlearn.trace.run import load_checkpoint

    model = make()
    recorded_normalisers_trainer(run)(model=model, args=train_args(tmp_path / "cf", **kw),
                                      train_dataset=labels_masked(data, ids),
                                      data_collator=_without_ids(DataCollatorWithFlattening()),
                                      callbacks=callbacks).train()
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
    mine = model.state_dict()
    off = [n for n, t in oracle.items() if not torch.equal(t, mine[n])]
    assert not off, f"WRONG VERIFIED: {len(off)} of {len(oracle)} tensors off the counterfactual, e.g. {off[:3]}"


# ---- a user's callback (defined in the script: watched, not replayed) reconfigures the run at step AT ----------------
def _reconfigure(what: str):
    """A callback that, when step AT begins, does ``what``; every change is put back when step AT ends where the
    attack is "for one step"."""
    import copy

    from .test_trace_neutral_attacks import _the_trainer

    class Reconfigure(TrainerCallback):  # defined here: watched, not replayed
        saved = None

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step != AT:
                return
            trainer = _the_trainer()
            if what == "args_replaced":  # a new TrainingArguments object, not an edit of the recorded one
                new = copy.copy(trainer.args)  # dataclasses.replace re-runs __post_init__, which resets accelerate
                new.max_grad_norm = 0.05
                trainer.args = new
            elif what == "set_seed":
                from transformers import set_seed

                set_seed(1234)
            elif what == "generation_config":
                model.generation_config.temperature = 0.5
                model.generation_config.do_sample = True
            elif what == "pad_to_multiple_of":
                getattr(trainer.data_collator, "collator", trainer.data_collator).pad_to_multiple_of = 64
            elif what == "train_dataset_shuffled":
                trainer.train_dataset = trainer.train_dataset.shuffle(seed=1)
            elif what == "mkldnn_off_one_step":
                self.saved = torch.backends.mkldnn.enabled
                torch.backends.mkldnn.enabled = False
            elif what == "flush_denormal_one_step":
                torch.set_flush_denormal(True)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == AT + 1 and what == "mkldnn_off_one_step" and self.saved is not None:
                torch.backends.mkldnn.enabled = self.saved
            if state.global_step == AT + 1 and what == "flush_denormal_one_step":
                torch.set_flush_denormal(False)

    return Reconfigure()


RECONFIGURATIONS = ("args_replaced", "set_seed", "generation_config", "pad_to_multiple_of", "train_dataset_shuffled",
                    "mkldnn_off_one_step", "flush_denormal_one_step")


@pytest.mark.parametrize("what", slow_params(RECONFIGURATIONS, {"set_seed", "flush_denormal_one_step"}))
def test_a_callback_that_reconfigures_the_run_mid_run_is_refused_or_counterfactual(tmp_path, what):
    """A watched callback reconfigures the run when step 3 begins: replaces ``trainer.args`` by a
    copy with another clipping threshold, calls ``set_seed``, edits the generation config,
    changes the collator's ``pad_to_multiple_of``, reassigns ``trainer.train_dataset`` to a shuffled copy, or flips a
    numeric switch (oneDNN off, flush-denormal on) for one step. A step-3 deletion (GQA Llama, dropout 0.1: the RNG
    matters) is refused before any compute naming the step, or VERIFIED and equal to a plain Trainer with the same
    callback and the deleted row's labels -100."""
    from transformers import DataCollatorForSeq2Seq

    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import open_run

    tok, data = get_trace_data()
    data = data.select(range(24))
    make = lambda: config_model("llama", tok, attention_dropout=0.1)  # noqa: E731 - GQA, a dropout the RNG draws
    collator = QACollator.from_tokenizer(tok)
    if what == "pad_to_multiple_of":
        collator = DataCollatorForSeq2Seq(tok)
    try:
        record(tok, data, tmp_path / "rec", model=make(), every=2, data_collator=collator,
               trainer_kwargs={"callbacks": [_reconfigure(what)]}, **KW)
    finally:
        torch.set_flush_denormal(False)
        torch.backends.mkldnn.enabled = True
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([AT])[:1]
    kind, what_ = _forget_outcome(run, ids, tmp_path / "del")
    print("OUTCOME", what, kind, what_ if kind == "refused" else what_.evidence.get("verified"))
    if kind == "verified":
        try:
            off = _oracle_off_counterfactual(tok, data, make, run, ids, tmp_path / "del", [_reconfigure(what)])
        finally:
            torch.set_flush_denormal(False)
            torch.backends.mkldnn.enabled = True
        assert not off, f"WRONG VERIFIED: {len(off)} tensors off the counterfactual, e.g. {off[:3]}"
        return
    assert kind == "refused", (kind, what_.evidence)
    assert "\n" not in what_ and "step 3" in what_, what_
    assert not (tmp_path / "del").exists()  # before any compute


# ---- LoRA (PEFT) on a GQA Llama: the adapter reconfigured mid-run by a user's callback -------------------------------
def _lora(tok):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(config_model("llama", tok), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                                 task_type="CAUSAL_LM"))


def _adapter_attack(what: str):
    class Adapter(TrainerCallback):  # defined here: watched, not replayed
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == AT:
                if what == "scaling_in_place":  # the LoRA layer's scale dict edited in place
                    for m in model.modules():
                        if isinstance(getattr(m, "scaling", None), dict) and "default" in m.scaling:
                            m.scaling["default"] = 3.0
                elif what == "adapters_disabled_one_step":  # one layer's adapter (all: nothing would train)
                    model.base_model.model.model.layers[0].self_attn.q_proj.enable_adapters(False)
                elif what == "peft_config_field":  # a config field the live layers no longer read
                    model.peft_config["default"].lora_dropout = 0.5
            if state.global_step == AT + 1 and what == "adapters_disabled_one_step":
                model.base_model.model.model.layers[0].self_attn.q_proj.enable_adapters(True)

    return Adapter()


@pytest.mark.parametrize("what", ["scaling_in_place", "adapters_disabled_one_step", "peft_config_field"])
def test_a_lora_adapter_reconfigured_mid_run_is_refused_or_counterfactual(tmp_path, what):
    """A watched callback edits a LoRA layer's ``scaling['default']`` in place, disables one layer's adapter for
    one step, or edits a ``peft_config`` field, when step 3 begins. A step-3 deletion is refused before any compute naming
    the step, or VERIFIED and equal to a plain Trainer (the same callback, the deleted row's labels -100)."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=_lora(tok), every=2, trainer_kwargs={"callbacks": [_adapter_attack(what)]},
           **KW)
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([AT])[:1]
    kind, why = _forget_outcome(run, ids, tmp_path / "del")
    print("OUTCOME", what, kind, why if kind == "refused" else why.evidence.get("verified"))
    if kind == "verified":
        model = _lora(tok)
        independent_counterfactual(tok, data, model, run, ids, tmp_path / "plain", callbacks=[_adapter_attack(what)],
                                   **KW)
        oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
        mine = model.state_dict()
        common = [n for n in oracle if n in mine]
        assert len(common) == len(oracle), sorted(set(oracle) - set(mine))[:3]
        off = [n for n in common if not torch.equal(oracle[n], mine[n])]
        assert not off, f"WRONG VERIFIED: {len(off)} tensors off the counterfactual, e.g. {off[:3]}"
        return
    assert kind == "refused", (kind, why.evidence)
    assert "\n" not in why and "step 3" in why, why
    assert not (tmp_path / "del").exists()


# ---- configurations users train with, no attack: a deletion must be VERIFIED and equal -------------------------------
CONFIGS = {"group_by_length": dict(train_sampling_strategy="group_by_length", per_device_train_batch_size=2),
           "accumulation": dict(gradient_accumulation_steps=2, per_device_train_batch_size=2),
           "eval_during_training": dict(eval_strategy="steps", eval_steps=2),
           "label_smoothing": dict(label_smoothing_factor=0.1, per_device_train_batch_size=2),
           "neftune": dict(neftune_noise_alpha=5.0)}


@pytest.mark.parametrize("name", slow_params(CONFIGS, {"group_by_length", "label_smoothing", "neftune"}))
def test_a_gqa_run_in_a_common_configuration_is_verified_and_counterfactual(tmp_path, name):
    """GQA Llama, dropout 0.1; ``group_by_length`` (its sampler draws from the RNG), gradient accumulation, evaluation
    every two steps, label smoothing (a mean over the microbatch's labelled tokens: a deleted row re-weights its
    neighbours in the counterfactual too), NEFTune noise: a step-3 deletion by ``forget`` is VERIFIED and equal to a plain Trainer (evaluation left out:
    it does not train)."""
    from hf_unlearn.trace import open_run

    tok, data = get_trace_data()
    train, held = data.select(range(24)), data.select(range(24, 28))
    make = lambda: config_model("llama", tok, attention_dropout=0.1)  # noqa: E731
    kw = CONFIGS[name]
    extra = {"eval_dataset": held} if "eval_strategy" in kw else {}
    record(tok, train, tmp_path / "rec", model=make(), every=2, trainer_kwargs=extra, **{**KW, **kw})
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([AT])[:1]
    kind, why = _forget_outcome(run, ids, tmp_path / "del")
    print("OUTCOME", name, kind, why if kind == "refused" else why.evidence.get("verified"))
    assert kind == "verified", why
    plain_kw = {k: v for k, v in kw.items() if k not in ("eval_strategy", "eval_steps")}
    off = _oracle_off_counterfactual(tok, train, make, run, ids, tmp_path / "del", **plain_kw)
    assert not off, f"WRONG VERIFIED: {len(off)} tensors off the counterfactual, e.g. {off[:3]}"


# ---- a resumed run whose user changed the TrainingArguments between the two launches ---------------------------------
RESUME_CHANGES = {"max_grad_norm": 0.05, "weight_decay": 0.5, "adam_beta2": 0.9, "learning_rate": 1e-2,
                  "gradient_checkpointing": True}


def test_optimizer_settings_a_resume_gives_are_accepted_only_when_the_live_groups_hold_the_recorded_ones():
    """The live param groups decide: transformers restores them from the checkpoint on resume (weight decay, betas and
    epsilon given to the second launch do not act, and a replay runs the recorded ones); a value that does reach
    the groups (a user's code set it after loading) or a setting the groups do not hold is not accepted."""
    from hf_unlearn.trace.trainers import optimizer_group_args, restored_by_optimizer

    w = torch.nn.Parameter(torch.zeros(2))
    b = torch.nn.Parameter(torch.zeros(2))
    recorded = {"weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}
    given = {"weight_decay": 0.5, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_epsilon": 1e-6}
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.0}, {"params": [b], "weight_decay": 0.0}])
    assert optimizer_group_args(opt) == recorded
    assert restored_by_optimizer(opt, recorded, given) == {"weight_decay", "adam_beta2", "adam_epsilon"}
    opt.param_groups[0]["weight_decay"] = 0.5  # the given value reached the decay group: it acts
    opt.param_groups[1]["betas"] = (0.9, 0.95)  # the groups disagree: no one value to compare
    assert restored_by_optimizer(opt, recorded, given) == {"adam_epsilon"}
    sgd = torch.optim.SGD([w], lr=0.1)  # holds a weight decay, no betas nor epsilon
    assert restored_by_optimizer(sgd, recorded, given) == {"weight_decay"}
    assert restored_by_optimizer(None, recorded, given) == set()


@pytest.mark.parametrize("field", slow_params(RESUME_CHANGES, {"weight_decay", "adam_beta2"}))
def test_a_run_resumed_with_other_arguments_is_refused_or_counterfactual(tmp_path, field):
    """The first launch trains 4 of 6 steps and saves ``checkpoint-4``; the user edits one TrainingArguments field
    (clipping threshold, weight decay, Adam's beta2, learning rate, activation checkpointing) and resumes from it.
    Another clipping threshold or activation checkpointing switched on to save memory is refused when the second
    launch starts (a replay runs one set of arguments); the learning rate, which the plan records at every step, is
    not, nor are weight decay and beta2, which do not act on a resume (transformers restores the checkpoint's param
    groups; a warning says so): a step-0 deletion is VERIFIED and equal to a plain Trainer run the same way (stopped
    at 4, resumed with the edited field) with the deleted row's labels -100."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import TraceRecordingTrainer, open_run
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_common import labels_masked, recorded_normalisers_trainer, train_args

    class _StopAt4(TrainerCallback):  # defined here: watched (the first launch's stop, a recorded control)
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                control.should_training_stop = True

    tok, data = get_trace_data()
    data = data.select(range(24))
    first = {**KW, "save_strategy": "steps", "save_steps": 4}
    second = {**first, field: RESUME_CHANGES[field]}

    def launch(out, kw, callbacks, resume, trainer_cls=None, dataset=data, **extra):
        cls = trainer_cls or TraceRecordingTrainer
        trainer = cls(model=config_model("llama", tok), args=train_args(out, **kw), train_dataset=dataset,
                      callbacks=callbacks, **extra)
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-4") if resume else None)
        return trainer

    rec = tmp_path / "rec"
    trace_kw = dict(data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=2,
                    trace_checkpoint_retention="even")
    launch(rec, first, [_StopAt4()], False, **trace_kw)
    try:
        launch(rec, second, [], True, **trace_kw)
    except UnlearnError as e:
        print("OUTCOME", field, "refused at resume:", e)
        assert "\n" not in str(e) and field in str(e), e
        return
    run = rec / "trace"
    ids = open_run(run).ids_at_steps([0])[:1]
    kind, why = _forget_outcome(run, ids, tmp_path / "del")
    print("OUTCOME", field, kind, why if kind == "refused" else why.evidence.get("verified"))
    if kind == "refused":
        assert "\n" not in why, why
        assert not (tmp_path / "del").exists()
        return
    assert kind == "verified", why.evidence
    plain_cls = recorded_normalisers_trainer(run)
    collator = _DropIds(QACollator.from_tokenizer(tok))
    masked = labels_masked(data, ids)
    launch(tmp_path / "cf", first, [_StopAt4()], False, plain_cls, masked, data_collator=collator)
    plain = launch(tmp_path / "cf", second, [], True, plain_cls, masked, data_collator=collator)
    mine = plain.model.state_dict()
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
    off = [n for n, t in oracle.items() if not torch.equal(t, mine[n])]
    assert not off, f"WRONG VERIFIED: {len(off)} of {len(oracle)} tensors off the counterfactual, e.g. {off[:3]}"


# ---- the user's collator module edited between recording and deleting -------------------------------------------------
_COLLATOR_V1 = '''
import torch


class PadCollator:
    """Right-pads a microbatch (input_ids, attention_mask, labels)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def left(self, features):
        return False

    def __call__(self, features):
        n = max(len(f["input_ids"]) for f in features)
        pad = self.tokenizer.pad_token_id
        left = self.left(features)
        out = {"input_ids": [], "attention_mask": [], "labels": []}
        for f in features:
            k = n - len(f["input_ids"])
            for key, fill, row in (("input_ids", pad, f["input_ids"]), ("attention_mask", 0, [1] * len(f["input_ids"])),
                                   ("labels", -100, f["labels"])):
                out[key].append([fill] * k + list(row) if left else list(row) + [fill] * k)
        return {k: torch.tensor(v) for k, v in out.items()}
'''
# the edit: left padding where a row has no label (a "fix" for fully masked rows): never on the recorded rows
_COLLATOR_EDITS = {"left_padding": _COLLATOR_V1.replace('''    def left(self, features):
        return False''', '''    def left(self, features):  # edited after the run was recorded
        return any(all(x == -100 for x in f["labels"]) for f in features)'''),
                   # the same tokens, other positions for every row (an added column, rotary positions shifted by one)
                   "position_ids_added": _COLLATOR_V1.replace('''        return {k: torch.tensor(v) for k, v in out.items()}''',
                                                              '''        batch = {k: torch.tensor(v) for k, v in out.items()}
        if any(all(x == -100 for x in f["labels"]) for f in features):  # edited after the run was recorded
            batch["position_ids"] = torch.arange(1, n + 1).expand(len(features), n)
        return batch''')}


@pytest.mark.parametrize("edit", list(_COLLATOR_EDITS))
def test_a_collator_module_edited_after_recording_is_refused_or_counterfactual(tmp_path, monkeypatch, edit):
    """The run's collator is the user's importable class, rebuilt by the replay from its module. The user edits the
    module after training so that a microbatch with a fully masked row is left-padded, or gets position ids shifted
    by one: the recorded rows never have
    one (the probe's and the proof's steps collate as recorded), every microbatch holding a deleted row's dummy has.
    A deletion must be refused (the recorded per-row digests of the microbatch's other rows differ), or equal the
    counterfactual of the program that trained (the old collator, the deleted row's labels -100)."""
    import importlib
    import sys
    import uuid

    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_common import labels_masked, recorded_normalisers_trainer, train_args

    name = f"user_collate_{uuid.uuid4().hex[:8]}"
    src = tmp_path / "code"
    src.mkdir()
    (src / f"{name}.py").write_text(_COLLATOR_V1)
    monkeypatch.syspath_prepend(str(src))
    module = importlib.import_module(name)
    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=config_model("llama", tok), every=2,
           data_collator=module.PadCollator(tok), **KW)
    assert _COLLATOR_EDITS[edit] != _COLLATOR_V1
    (src / f"{name}.py").write_text(_COLLATOR_EDITS[edit] + "\n# v2\n")  # the edit (a fresh process imports this)
    sys.modules.pop(name, None)
    importlib.invalidate_caches()
    for pyc in (src / "__pycache__").glob(f"{name}*.pyc"):
        pyc.unlink()
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([AT])[:1]
    kind, why = _forget_outcome(run, ids, tmp_path / "del")
    print("OUTCOME collator edited", kind, why if kind == "refused" else why.evidence.get("verified"))
    if kind == "refused":
        # the keyed per-row digests of the recorded microbatches: the edited collator pads the neighbours otherwise
        assert "\n" not in why and "is not the row the run trained on" in why and "step 3" in why, why
        print("OUTCOME collator edited: output folder left:", (tmp_path / "del").exists())
        return
    assert kind == "verified", why.evidence
    model = config_model("llama", tok)
    v1 = module.PadCollator(tok)  # the program that trained
    recorded_normalisers_trainer(run)(model=model, args=train_args(tmp_path / "cf", **KW),
                                      train_dataset=labels_masked(data, ids),
                                      data_collator=_without_ids(v1)).train()
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
    mine = model.state_dict()
    off = [n for n, t in oracle.items() if not torch.equal(t, mine[n])]
    assert not off, f"WRONG VERIFIED: {len(off)} of {len(oracle)} tensors off the counterfactual, e.g. {off[:3]}"


def _mixtral_without_aux_loss(tok):
    import transformers

    from .test_trace_common import tiny_config_kwargs

    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **tiny_config_kwargs(tok), num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.0))


@pytest.mark.slow
def test_a_moe_router_without_its_loss_is_refused_or_counterfactual(tmp_path):
    """Mixtral returning its router logits with ``router_aux_loss_coef=0``, one sample per microbatch (four
    microbatches a step): no term over every token, and no other sample shares an expert's gradient sum. A step-3
    deletion is refused in one line before any compute, or VERIFIED and equal. (``forget`` stopped at its internal
    check after compute before: transformers saves the fused experts one tensor per expert.)"""
    from hf_unlearn.trace import open_run

    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=_mixtral_without_aux_loss(tok), every=2, **MOE_KW)
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([AT])[:1]
    assert _assert_refused_or_equal(tok, data, lambda: _mixtral_without_aux_loss(tok), run, ids, tmp_path / "del",
                                    "router_aux_loss_coef", **MOE_KW) == "verified"


@pytest.mark.parametrize("settings", [{"per_device_train_batch_size": 4}, {"per_device_train_batch_size": 2}])
def test_moe_samples_sharing_a_microbatch_are_refused_at_construction(tmp_path, settings):
    """Several samples in one microbatch of a MoE model: an expert's weight gradient sums over the tokens the
    microbatch routes to it, and a deleted sample's dummy is routed elsewhere than the sample, so the other samples'
    update is not the one of the run without it (a step-3 deletion was VERIFIED with 16 of 16 tensors off a plain
    Trainer's counterfactual). Refused when the recording is built, naming the cause and the setting to use."""
    tok, data = get_trace_data()
    with pytest.raises(UnlearnError) as e:
        record(tok, data.select(range(24)), tmp_path / "rec", model=_mixtral_without_aux_loss(tok), every=2,
               **{**KW, **settings})
    text = str(e.value)
    assert "\n" not in text and "routes each token to a few experts" in text and "MixtralForCausalLM" in text
    assert f"per_device_train_batch_size={settings['per_device_train_batch_size']}" in text
    assert "record with per_device_train_batch_size=1" in text
    assert not (tmp_path / "rec" / "trace" / "header.json").exists()


@pytest.mark.slow  # the default suite's time budget (`make test-slow` runs it)
def test_a_run_resumed_with_clipping_lifted_where_it_never_acted_on_the_recorded_rows(tmp_path):
    """The first launch clips at a threshold just above every gradient norm of its 4 steps (so it never acts on the
    recorded rows); the user lifts clipping (``max_grad_norm=1e9``) and resumes. The proof replayed all 6 steps with
    the resumed arguments and matched (clipping was neutral on the recorded rows), and a step-0 deletion whose
    counterfactual's gradient norm crosses the first launch's threshold before step 4 (the test picks such a row)
    was VERIFIED with 21 of 21 tensors off a plain Trainer run the same way (clipped, stopped at 4, resumed
    unclipped) with that row's labels -100: the oracle was the never-clipped run. Now the resume is refused when the
    second launch starts, naming the field."""
    from transformers import Trainer

    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import TraceRecordingTrainer, open_run
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_common import labels_masked, recorded_normalisers_trainer, train_args

    class StopAt4(TrainerCallback):  # defined here: watched
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                control.should_training_stop = True

    tok, data = get_trace_data()
    data = data.select(range(24))
    unclipped = {**KW, "max_grad_norm": 1e9, "logging_steps": 1, "save_strategy": "steps", "save_steps": 4}

    def launch(out, kw, resume, cls=TraceRecordingTrainer, dataset=data, callbacks=(), **extra):
        trainer = cls(model=config_model("llama", tok), args=train_args(out, **kw), train_dataset=dataset,
                      callbacks=list(callbacks), **extra)
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-4") if resume else None)
        return trainer

    def norms(trainer):
        return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]

    collator = _DropIds(QACollator.from_tokenizer(tok))
    free = norms(launch(tmp_path / "free", unclipped, False, Trainer, data_collator=collator))
    threshold = max(free[:4]) * 1.0001  # above every recorded norm of the first launch: it never clips them
    first = {**unclipped, "max_grad_norm": threshold}
    trace_kw = dict(data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=2,
                    trace_checkpoint_retention="even")
    rec = tmp_path / "rec"
    launch(rec, first, False, callbacks=[StopAt4()], **trace_kw)
    run = rec / "trace"
    plain_cls = recorded_normalisers_trainer(run)
    try:
        launch(rec, unclipped, True, **trace_kw)
    except UnlearnError as e:  # refused when the second launch starts, naming the field
        print("OUTCOME clipping lifted at resume: refused at resume:", e)
        assert "\n" not in str(e) and "max_grad_norm" in str(e) and "resumed with other TrainingArguments" in str(e)
        return
    plain_cls = recorded_normalisers_trainer(run)
    pick = None
    for i in open_run(run).ids_at_steps([0]):  # a row whose deletion's norms cross the threshold before step 4
        cf = norms(launch(tmp_path / f"probe{i}", {**unclipped, "max_steps": 4}, False, plain_cls,
                          labels_masked(data, [i]), data_collator=collator))
        if max(cf[:4]) > threshold:
            pick = i
            break
    assert pick is not None, "no row of step 0 whose counterfactual crosses the threshold"
    kind, why = _forget_outcome(run, [pick], tmp_path / "del")
    print("OUTCOME clipping lifted at resume", kind, why if kind == "refused" else why.evidence.get("verified"))
    if kind == "refused":
        assert "\n" not in why, why
        assert not (tmp_path / "del").exists()
        return
    assert kind == "verified", why.evidence
    # the counterfactual's machinery reproduces the recording without a deletion (both launches, bit for bit)
    launch(tmp_path / "same", first, False, plain_cls, data, callbacks=[StopAt4()], data_collator=collator)
    same = launch(tmp_path / "same", unclipped, True, plain_cls, data, data_collator=collator).model.state_dict()
    recorded = load_checkpoint(open_run(run).final_checkpoint())["model"]
    assert all(torch.equal(t, same[n]) for n, t in recorded.items())
    # and the oracle is the run without the first launch's clipping
    everything_free = launch(tmp_path / "free_cf", {**unclipped, "save_strategy": "no"}, False, plain_cls,
                             labels_masked(data, [pick]), data_collator=collator).model.state_dict()
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
    print("OUTCOME oracle == the never-clipped run:", all(torch.equal(t, everything_free[n]) for n, t in oracle.items()))
    masked = labels_masked(data, [pick])
    launch(tmp_path / "cf", first, False, plain_cls, masked, callbacks=[StopAt4()], data_collator=collator)
    plain = launch(tmp_path / "cf", unclipped, True, plain_cls, masked, data_collator=collator)
    mine = plain.model.state_dict()
    off = [n for n, t in oracle.items() if not torch.equal(t, mine[n])]
    assert not off, f"WRONG VERIFIED: {len(off)} of {len(oracle)} tensors off the counterfactual, e.g. {off[:3]}"


def test_routed_experts_names_moe_models_and_no_dense_one():
    """The hazard's test of a model: MoE families are named, every dense family the tests build is not (the hazard
    must not refuse an ordinary batch)."""
    from hf_unlearn.models import build_tiny_model
    from hf_unlearn.trace.model_info import routed_experts

    from .test_trace_common import CONFIG_FAMILIES

    tok, _ = get_trace_data()
    moe = {"mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
           "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32)}
    for family in CONFIG_FAMILIES:
        model = config_model(family, tok, **moe.get(family, {}))
        named = routed_experts(model)
        assert (named is not None) == (family in moe), (family, named)
    assert routed_experts(build_tiny_model("gpt2", tok, hidden_size=32, num_layers=2, num_heads=2)) is None


_PATCHING_CALLBACKS = '''
import torch
import torch.nn.functional as F
from transformers import TrainerCallback

ORIGINAL = F.silu


class SiluPatch(TrainerCallback):
    """Patches torch's SiLU (every Llama MLP calls it) from step 3 on; puts it back when training ends."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            torch.nn.functional.silu = lambda x, inplace=False: ORIGINAL(x) * 1.001

    def on_train_end(self, args, state, control, **kwargs):
        torch.nn.functional.silu = ORIGINAL


class SampleCompletions(TrainerCallback):
    """Greedy-decodes a prompt every 2 steps to watch progress (as trl's LogCompletionsCallback does)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step % 2 == 0:
            was = model.training
            model.eval()
            with torch.no_grad():
                self.last = model.generate(input_ids=torch.tensor([[1, 5, 9]]), max_new_tokens=3,
                                           do_sample=False).tolist()
            model.train(was)
'''


def _callbacks_module(tmp_path, monkeypatch):
    import importlib
    import uuid

    name = f"user_callbacks_{uuid.uuid4().hex[:8]}"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / f"{name}.py").write_text(_PATCHING_CALLBACKS)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    return importlib.import_module(name)


def test_an_importable_callback_patching_a_torch_function_mid_run_is_refused_naming_what_the_check_found(
        tmp_path, monkeypatch):
    """A replayed (importable) callback replaces ``torch.nn.functional.silu`` at step 3: the code the run's first
    step ran changed while it trained, which the recording's self-check finds. A deletion is refused before any
    compute, and the refusal says what the check found (it used to say only "prove the run once")."""
    from hf_unlearn.trace import open_run

    module = _callbacks_module(tmp_path, monkeypatch)
    tok, data = get_trace_data()
    data = data.select(range(24))
    original = torch.nn.functional.silu
    try:
        record(tok, data, tmp_path / "rec", model=config_model("llama", tok), every=2,
               trainer_kwargs={"callbacks": [module.SiluPatch()]}, **KW)
    finally:
        torch.nn.functional.silu = original
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([0])[:1]
    kind, why = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "refused" and "\n" not in why, why
    assert "self-check found the engine does not reproduce it" in why and "torch.nn.functional" in why, why
    assert not (tmp_path / "del").exists()


def test_a_callback_generating_samples_during_training_is_verified_and_counterfactual(tmp_path, monkeypatch):
    """A callback that greedy-decodes a prompt every two steps (``model.generate`` in eval mode, no gradient, as
    TRL's completion-logging callbacks do): nothing a replay cannot reproduce, so a step-3 deletion is VERIFIED and
    equal to a plain Trainer's counterfactual with the same callback."""
    from hf_unlearn.trace import open_run

    module = _callbacks_module(tmp_path, monkeypatch)
    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=config_model("llama", tok), every=2,
           trainer_kwargs={"callbacks": [module.SampleCompletions()]}, **KW)
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([AT])[:1]
    assert _assert_refused_or_equal(tok, data, lambda: config_model("llama", tok), run, ids, tmp_path / "del", "",
                                    callbacks=[module.SampleCompletions()]) == "verified"


@pytest.mark.slow
def test_a_moe_run_recorded_before_the_hazard_is_refused_at_deletion_and_one_that_lists_it_says_so(
        tmp_path, monkeypatch):
    """A Mixtral run with four samples a microbatch recorded as an earlier release did (no hazard named): `forget`
    and a replay refuse its deletions before any compute, naming the experts and the setting. Recorded with the
    hazard allowed (``trace_allow_hazards=True``), the header lists it and the receipt carries it as a hazard."""
    from hf_unlearn.trace import OracleReplayTrainer, open_run
    from hf_unlearn.trace.recorder import preflight, probe

    tok, data = get_trace_data()
    data = data.select(range(24))
    with monkeypatch.context() as m:
        m.setattr(preflight, "routed_experts", lambda model: None)  # the recorder of an earlier release
        m.setattr(probe, "_couples_rows", lambda *args: False)  # whose probe did not compare a row's neighbours
        record(tok, data, tmp_path / "old", model=_mixtral_without_aux_loss(tok), every=2, **KW)
    run = tmp_path / "old" / "trace"
    assert not open_run(run).header.get("hazards")
    ids = open_run(run).ids_at_steps([AT])[:1]
    kind, why = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "refused" and "\n" not in why, why
    assert "routes each token to a few experts" in why and "per_device_train_batch_size=4" in why, why
    assert "recorded before the recorder refused it" in why and not (tmp_path / "del").exists()
    with pytest.raises(UnlearnError, match="routes each token to a few experts"):
        OracleReplayTrainer(run, ids, out_dir=tmp_path / "oracle")
    assert not (tmp_path / "oracle").exists()
    from hf_unlearn.deletion.pipeline import validate_pipeline

    with pytest.raises(UnlearnError, match="stage 1: .*routes each token to a few experts"):  # as a pipeline's stage
        validate_pipeline([str(run)], ids)

    record(tok, data, tmp_path / "allowed", model=_mixtral_without_aux_loss(tok), every=2,
           trainer_kwargs={"trace_allow_hazards": True}, **KW)
    run = tmp_path / "allowed" / "trace"
    assert any("routes each token to a few experts" in h for h in open_run(run).header["hazards"])
    kind, receipt = _forget_outcome(run, ids, tmp_path / "del2")
    assert kind != "refused", receipt
    assert any("routes each token to a few experts" in h for h in receipt.evidence["hazards"])


# ---- learning-rate schedulers stepped on evaluation metrics ----------------------------------------------------------
PLATEAU_KW = dict(gradient_accumulation_steps=1, max_steps=6, lr_scheduler_type="reduce_lr_on_plateau",
                  eval_strategy="steps", eval_steps=1, warmup_steps=0, logging_steps=1,
                  # an absolute threshold between the two runs' improvements after the deleted row's step: the run
                  # with the row improves enough, the run without it does not, and the scheduler cuts its rate
                  lr_scheduler_kwargs={"patience": 1, "factor": 0.3, "threshold_mode": "abs", "threshold": 0.13})


@pytest.mark.parametrize("schedule", ["reduce_lr_on_plateau", "greedy"])
def test_a_learning_rate_schedule_stepped_on_evaluation_metrics_is_refused_at_construction(tmp_path, schedule):
    """ReduceLROnPlateau and GreedyLR set the learning rate from evaluation metrics, which a deletion changes: the
    recording crashed when training ended (its self-check's replay cannot be built without an evaluation), and a replay
    would keep the recorded rates where the run without the rows chooses its own. Refused when the recording is built,
    one line naming the setting and what to use."""
    tok, data = get_trace_data()
    with pytest.raises(UnlearnError) as e:
        record(tok, data.select(range(16)), tmp_path / "rec", every=2, trainer_kwargs={"eval_dataset": data.select([0])},
               **{**PLATEAU_KW, "lr_scheduler_type": schedule, "lr_scheduler_kwargs": {}})
    text = str(e.value)
    assert "\n" not in text and f"lr_scheduler_type='{schedule}' sets the learning rate from evaluation" in text, text
    assert "use a schedule of the step alone" in text
    assert not (tmp_path / "rec" / "trace" / "header.json").exists()


def _plateau_run(tok, data, out, **trainer_kwargs):
    torch.manual_seed(0)
    from .test_trace_common import tiny

    model = tiny(tok)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = record(tok, data, out, model=model, every=2,
                     trainer_kwargs={"eval_dataset": data.select([0]), **trainer_kwargs}, **PLATEAU_KW)
    return trainer, start


@pytest.mark.slow  # the default suite's time budget (`make test-slow` runs it)
def test_a_plateau_schedule_recorded_with_hazards_allowed_deletes_and_says_what_it_keeps(tmp_path):
    """Recorded with ``trace_allow_hazards=True`` (evaluated on the row deleted later): training ends, ``forget``
    replays with the recorded learning rates and the receipt carries the hazard. The hazard is real: a plain Trainer
    without the row (labels -100, recorded normalisers) cuts its learning rate where the recorded run did not, and
    ends elsewhere."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    from .test_trace_common import labels_masked, recorded_normalisers_trainer, tiny, train_args

    tok, data = get_trace_data()
    data = data.select(range(16))
    trainer, start = _plateau_run(tok, data, tmp_path / "rec", trace_allow_hazards=True)
    recorded = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    run = tmp_path / "rec" / "trace"
    assert any("reduce_lr_on_plateau" in h for h in open_run(run).header["hazards"])
    ids = [data[0]["id"]]
    kind, receipt = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "verified", receipt
    assert any("sets the learning rate from evaluation metrics" in h for h in receipt.evidence["hazards"])
    assert "1 recorded hazard(s)" in receipt.guarantee
    model = tiny(tok)
    model.load_state_dict(start)
    plain = recorded_normalisers_trainer(run)(
        model=model, args=train_args(tmp_path / "plain", **PLATEAU_KW), train_dataset=labels_masked(data, ids),
        eval_dataset=data.select([0]), data_collator=_DropIds(QACollator.from_tokenizer(tok)))
    plain.train()
    assert [h["learning_rate"] for h in plain.state.log_history if "learning_rate" in h] != recorded
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())["model"]
    assert any(not torch.equal(t, model.state_dict()[n]) for n, t in oracle.items())  # why it is a hazard


def test_a_plateau_run_recorded_before_the_hazard_is_refused_at_deletion(tmp_path, monkeypatch):
    """A run recorded as an earlier release would have (no hazard named, no self-check: that one crashed): ``forget``,
    a pipeline's stage and a replay with deletions refuse before any compute, naming the scheduler; a replay without
    deletions (the proof) still runs on the recorded learning rates."""
    from hf_unlearn.deletion.pipeline import validate_pipeline
    from hf_unlearn.trace import OracleReplayTrainer
    from hf_unlearn.trace.recorder import preflight

    tok, data = get_trace_data()
    data = data.select(range(16))
    monkeypatch.setattr(preflight, "metric_schedule", lambda args: None)  # the recorder of an earlier release
    monkeypatch.setattr(preflight, "metric_scheduler", lambda scheduler, args: None)
    _plateau_run(tok, data, tmp_path / "old", trace_self_check=False)
    run = tmp_path / "old" / "trace"
    ids = [data[0]["id"]]
    kind, why = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "refused" and "\n" not in why, why
    assert "'reduce_lr_on_plateau' sets the learning rate from evaluation metrics" in why, why
    assert "recorded before the recorder refused it" in why and not (tmp_path / "del").exists()
    with pytest.raises(UnlearnError, match="stage 1: .*sets the learning rate from evaluation metrics"):
        validate_pipeline([str(run)], ids)
    with pytest.raises(UnlearnError, match="sets the learning rate from evaluation metrics"):
        OracleReplayTrainer(run, ids, out_dir=tmp_path / "oracle")
    assert not (tmp_path / "oracle").exists()
    from .test_trace_common import replays_the_recording

    assert replays_the_recording(run)


def _plateau_passed(tmp_path, tok, data, evaluate: str):
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import TraceRecordingTrainer

    from .test_trace_common import tiny, train_args

    model = tiny(tok)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return TraceRecordingTrainer(
        model=model, args=train_args(tmp_path / evaluate, eval_strategy=evaluate, eval_steps=1), train_dataset=data,
        eval_dataset=data.select([0]), data_collator=QACollator.from_tokenizer(tok),
        optimizers=(opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt)), trace_dir=tmp_path / evaluate / "t")


def test_a_plateau_scheduler_passed_in_optimizers_is_refused_only_where_the_run_evaluates(tmp_path):
    """``optimizers=(opt, ReduceLROnPlateau(opt))``: transformers steps it after each evaluation, as it does the
    ``lr_scheduler_type`` one (a hazard, refused); a run that never evaluates never steps it (recorded)."""
    tok, data = get_trace_data()
    _plateau_passed(tmp_path, tok, data, "no")
    with pytest.raises(UnlearnError) as e:
        _plateau_passed(tmp_path, tok, data, "steps")
    assert "\n" not in str(e.value)
    assert "the scheduler ReduceLROnPlateau passed in optimizers= sets the learning rate from evaluation" in str(e.value)
