"""Attacks on the DPO verdict: ways a user (careless or not) could get VERIFIED for a DPO deletion whose output is not
what a plain trl.DPOTrainer without the deleted pairs' contribution gives (docs/trl.md), each with its outcome.

Each test names the attack, what happened before the fix (when it fooled the verdict) and what happens now.
"""

from __future__ import annotations

import warnings

import pytest

from .test_trace_dpo import counterfactual, dpo_config, forget_and_verify, pairs, saved_model

pytest.importorskip("trl")
warnings.filterwarnings("ignore", message=".*not sealed.*")
warnings.filterwarnings("ignore", category=FutureWarning)

from trl import DPOTrainer  # noqa: E402 - after the importorskip


class TokenMeanDPOTrainer(DPOTrainer):
    """A careless 'per-token' DPO: the loss divided by the microbatch's attention-mask tokens (times the pairs)."""

    def _compute_loss(self, model, inputs, return_outputs):
        loss = super()._compute_loss(model, inputs, return_outputs)
        return loss * inputs["completion_mask"].shape[0] / inputs["attention_mask"].sum()


def recorder(out, tok, data, base, ref_model=None, callbacks=None, trainer_cls=None, model=None, **config):
    """A DPO recording (not trained yet) with trainer arguments kept apart from the DPOConfig's."""
    from hf_unlearn.trace import trace_recording

    return trace_recording(trainer_cls or DPOTrainer)(
        model=model or saved_model(base, tok), ref_model=ref_model, args=dpo_config(out, **{"max_steps": 2, **config}),
        train_dataset=data, processing_class=tok, callbacks=callbacks, trace_checkpoint_steps=2,
        trace_checkpoint_retention="even", trace_self_check="all")  # proven: deletions can be VERIFIED


def test_a_reference_changed_in_memory_is_refused_before_training(tmp_path):
    """Attack: ref_model= a model loaded from a folder whose rotary inv_freq (a non-persistent buffer: no params root
    sees it) was halved in memory, or that carries a forward hook. Before: the run referenced the folder (same
    params root), replays reloaded it unchanged, and a step-0 deletion printed VERIFIED while the oracle differed from
    a plain DPOTrainer with the recorded reference. Now: the reference's log-probabilities on a probe
    (forward_sha256) differ from a reload's, so the recording refuses when training starts, before any step."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_unlearn.errors import UnlearnError

    tok, data = pairs(n=4)
    base = tmp_path / "base"
    saved_model(base, tok)
    buffer = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        buffer.model.rotary_emb.inv_freq.mul_(0.5)
    hooked = AutoModelForCausalLM.from_pretrained(base)
    hooked.model.norm.register_forward_hook(lambda module, args, out: out * 1.5)
    trainer = recorder(tmp_path / "rec0", tok, data, base, ref_model=buffer)
    with pytest.raises(UnlearnError, match="computes other log-probabilities than a reload of its weights"):
        trainer.train()
    assert trainer.state.global_step == 0 and not (tmp_path / "rec0" / "trace" / "reference").exists()
    # the hook: refused as the recording is built (tests/test_trace_dpo_reference_code.py), before training
    with pytest.raises(UnlearnError, match=r"the reference model carries a hook or function a replay does not run "
                                           r"\(model\.norm\.forward_hooks"):
        recorder(tmp_path / "rec1", tok, data, base, ref_model=hooked)
    assert not (tmp_path / "rec1" / "trace").exists()


@pytest.mark.slow  # a recording, replay, oracle and plain counterfactual (about 30 s of CPU each)
@pytest.mark.parametrize("how", ["ref_model", "model_init_kwargs"])
def test_a_reference_loaded_with_config_overrides_is_stored_and_replays_exactly(tmp_path, how):
    """Attack: a reference with the folder's weights (same params root) but another config: ref_model=
    from_pretrained(folder, rms_norm_eps=0.5), or ref_model=None with DPOConfig(model_init_kwargs={"rms_norm_eps":
    0.5}) (TRL warns the kwargs are ignored for an instantiated policy, yet loads its reference with them). Before:
    the run referenced the folder and replays loaded its config, so replay == oracle (VERIFIED) on a reference the run
    never trained against. Now: a reload of the folder does not give the recorded forward_sha256, so the reference is
    stored in the run (config included): replay == oracle == a plain DPOTrainer with that reference whose deleted
    pair has no completion token."""
    from transformers import AutoModelForCausalLM

    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace.verification import load_state

    tok, data = pairs(n=8)
    base = tmp_path / "base"
    saved_model(base, tok)

    def given():
        if how == "ref_model":
            return dict(ref_model=AutoModelForCausalLM.from_pretrained(base, rms_norm_eps=0.5))
        return dict(model_init_kwargs={"rms_norm_eps": 0.5})

    recorder(tmp_path / "rec", tok, data, base, **given()).train()
    run = open_run(tmp_path / "rec" / "trace")
    record = run.header["reference_model"]
    assert record["source"]["kind"] == "stored" and record["forward_sha256"]
    assert record["kind"] == ("model" if how == "ref_model" else "initial")
    forget = run.ids_at_steps([0])[:1]
    assert forget_and_verify(run.path, forget, tmp_path)[2]["verified"]
    cf = counterfactual(tmp_path, tok, data, base, forget, max_steps=2, **given())
    assert compare_states(cf, load_state(tmp_path / "oracle"))["identical"]


def test_a_reference_or_beta_edited_during_training_is_sealed_not_reproducible(tmp_path):
    """Attack: a callback (not importable, so not replayed) scales the reference's final norm, or sets trainer.beta
    (a beta schedule), after the first optimizer step, where the self-check (step 0..1) cannot see it; the policy's
    guards watch neither. Before: replays loaded the unedited reference / rebuilt beta from the config, and a step-0
    deletion printed VERIFIED (tried: "controls at steps 0..2" matched). Now: the recorder watches DPOTrainer's loss
    settings (beta, label_smoothing, loss types and weights, ..., the reference object) at every microbatch and
    recomputes the reference's probe log-probabilities when training ends; a change seals the run as not reproduced,
    and replays and the oracle refuse it before any compute."""
    import torch
    from transformers import TrainerCallback

    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import OracleReplayTrainer, open_run

    def edit_reference(trainer):
        with torch.no_grad():
            trainer.ref_model.model.norm.weight.mul_(2.0)

    def beta_schedule(trainer):
        trainer.beta = 5.0

    class Edit(TrainerCallback):  # defined here: not importable, so not replayed
        def __init__(self, edit):
            self.edit, self.trainer = edit, None

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                self.edit(self.trainer)

    tok, data = pairs(n=8)
    for edit, why in ((edit_reference, "DPO reference model changed during training"),
                      (beta_schedule, "DPOTrainer's beta changed during training .before optimizer step 1: 0.1 -> 5.0")):
        out = tmp_path / edit.__name__
        callback = Edit(edit)
        callback.trainer = recorder(out, tok, data, tmp_path / "base", callbacks=[callback])
        callback.trainer.train()
        run = open_run(out / "trace")
        assert run.header["fidelity"]["recording"]["reproduced"] is False
        with pytest.raises(UnlearnError, match=why):
            OracleReplayTrainer(run, run.ids_at_steps([0])[:1], out_dir=out / "oracle")
        assert not (out / "oracle").exists()


class NonEmptyPairsDPOTrainer(DPOTrainer):
    """A loss that couples pairs: the mean over the microbatch's pairs that have a completion token."""

    def _compute_loss(self, model, inputs, return_outputs):
        loss = super()._compute_loss(model, inputs, return_outputs)
        mask = inputs["completion_mask"]
        pairs = mask.shape[0] // 2
        non_empty = ((mask[:pairs].sum(1) + mask[pairs:].sum(1)) > 0).sum()
        return loss * pairs / non_empty


def test_a_loss_that_couples_the_pairs_of_a_microbatch_is_refused_at_construction(tmp_path):
    """Attack: a DPOTrainer subclass whose loss is a mean over the microbatch's non-empty pairs. The dummy pair gets
    no gradient (its tokens have no label), so a zero-gradient probe passes, but deleting a pair re-weights the others.
    The probe compares the real pair's gradient beside the dummy with its gradient beside a real pair of the same row
    lengths, bit for bit; they differ, and the recording is refused at construction."""
    from hf_unlearn.errors import UnlearnError

    tok, data = pairs(n=4)
    with pytest.raises(UnlearnError, match="weights a pair by what the other pairs of its microbatch hold"):
        recorder(tmp_path / "rec", tok, data, tmp_path / "base", trainer_cls=NonEmptyPairsDPOTrainer)


@pytest.mark.slow  # a recording, replay, oracle and a plain counterfactual run (~10 s of CPU)
def test_a_loss_divided_by_the_attention_tokens_deletes_as_its_counterfactual(tmp_path):
    """A DPOTrainer subclass whose loss is divided by the microbatch's attention-mask tokens. Before, the dummy pair's
    two rows were both as long as the deleted pair's longer one, so that normaliser differed from the run with the
    pair's completion masked: replay == oracle VERIFIED, and the oracle was not the counterfactual (then it was
    refused at construction). The dummy now keeps the pair's own row lengths, so its attention tokens, as the
    counterfactual keeps the deleted pair's tokens: recorded, VERIFIED, and equal to a plain run of the subclass
    whose deleted pair has no completion token, bit for bit."""
    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace.verification import load_state

    from .test_trace_dpo import MaskedPairs
    from .test_trace_sft import state_of

    tok, data = pairs(n=8)
    recorder(tmp_path / "rec", tok, data, tmp_path / "base", trainer_cls=TokenMeanDPOTrainer, max_steps=2).train()
    run = open_run(tmp_path / "rec" / "trace")
    forget = run.ids_at_steps([0])[:1]
    assert forget_and_verify(run.path, forget, tmp_path)[2]["verified"]

    class KeepIds(TokenMeanDPOTrainer):
        def _set_signature_columns_if_needed(self):
            super()._set_signature_columns_if_needed()
            self._signature_columns = [*self._signature_columns, "id"]

    cf = KeepIds(model=saved_model(tmp_path / "base", tok), args=dpo_config(tmp_path / "cf", max_steps=2),
                 train_dataset=data, processing_class=tok)
    cf.data_collator = MaskedPairs(cf.data_collator, forget)
    cf.train()
    assert compare_states(state_of(cf), load_state(tmp_path / "oracle"))["identical"]


@pytest.mark.slow  # the default suite's time budget (`make test-slow` runs it)
def test_a_recording_resumed_with_another_reference_is_refused(tmp_path):
    """Attack: a DPO recording crashes after step 3 and is resumed from checkpoint-2 with ref_model= another model.
    Before: accepted; the resumed header recorded only the new reference, so every replay ran all steps against it
    although steps 0-1 trained against the first (a step-0 deletion then did not verify: tried, no false VERIFIED,
    but a run no replay reproduces, accepted silently). Now: refused when the resumed training starts, naming the reference; resumed
    with the same reference (ref_model=None), the run completes."""
    from transformers import TrainerCallback

    from hf_unlearn.errors import UnlearnError

    class Crash(TrainerCallback):  # defined here: not importable, so not replayed
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    tok, data = pairs(n=12)
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    recorder(tmp_path / "rec", tok, data, tmp_path / "base", callbacks=[Crash()], **kw).train()
    checkpoint = str(tmp_path / "rec" / "checkpoint-2")
    other = saved_model(tmp_path / "other", tok, seed=1)
    resumed = recorder(tmp_path / "rec", tok, data, tmp_path / "base", ref_model=other, **kw)
    with pytest.raises(UnlearnError, match="recorded against another DPO reference model than the one it is resumed"):
        resumed.train(resume_from_checkpoint=checkpoint)
    resumed = recorder(tmp_path / "rec", tok, data, tmp_path / "base", **kw)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert resumed.state.global_step == 4


@pytest.mark.slow  # a bf16 recording, replay, oracle and plain counterfactual (about 30 s of CPU)
def test_bf16_and_a_step_whose_every_pair_is_deleted_replay_as_documented(tmp_path):
    """Attack: a bf16 model (ref_model=None: TRL loads the reference in the policy's dtype) and a deletion of every
    pair of step 0, so both of its microbatches are dummies only, and of the first microbatch of step 1 (a step with
    weighted pairs and a microbatch of dummies only). A plain DPOTrainer whose deleted pairs have no completion token
    runs those microbatches and steps AdamW on zero gradients at step 0; the engine skipped both (a step count off the
    plain run). Outcome: replay == oracle VERIFIED == the plain bf16 DPOTrainer that steps; one that skips step 0
    differs."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace.verification import load_state

    from .test_trace_dpo import MaskedPairs
    from .test_trace_sft import state_of

    tok, data = pairs(n=8)
    base = tmp_path / "base"
    saved_model(base, tok)

    def bf16():
        return AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)

    recorder(tmp_path / "rec", tok, data, base, model=bf16()).train()
    run = open_run(tmp_path / "rec" / "trace")
    assert run.header["reference_model"]["dtype"] == "bfloat16"
    forget = run.ids_at_steps([0]) + run.ids_at_steps([1])[:2]
    from hf_unlearn.trace.tags import tag

    gone = {tag(run.key, i) for i in forget}
    emptied = [(e.step, set(e.slots) <= gone) for e in run.plan]
    assert emptied == [(0, True), (0, True), (1, True), (1, False)]  # step 0 emptied; step 1: one microbatch of dummies
    assert forget_and_verify(run.path, forget, tmp_path)[2]["verified"]

    def plain(skip: set):
        class Counterfactual(DPOTrainer):
            def _set_signature_columns_if_needed(self):
                super()._set_signature_columns_if_needed()
                self._signature_columns = [*self._signature_columns, "id"]

            def create_optimizer(self, *args, **kwargs):
                optimizer = super().create_optimizer(*args, **kwargs)
                step = optimizer.step

                def maybe_step(*a, **kw):  # the engine's old skip of a step whose every pair is deleted
                    return None if self.state.global_step in skip else step(*a, **kw)

                optimizer.step = maybe_step
                return optimizer

        trainer = Counterfactual(model=bf16(), args=dpo_config(tmp_path / f"cf{len(skip)}", max_steps=2),
                                 train_dataset=data, processing_class=tok)
        trainer.data_collator = MaskedPairs(trainer.data_collator, forget)
        trainer.train()
        return state_of(trainer)

    oracle = load_state(tmp_path / "oracle")
    assert compare_states(plain(set()), oracle)["identical"]  # AdamW stepped on zero gradients at step 0
    assert not compare_states(plain({0}), oracle)["identical"]


@pytest.mark.slow  # two processes (accelerate launch, gloo): a recording, replay, oracle and counterfactual (~1.5 min)
def test_a_data_parallel_dpo_run_replays_exactly(tmp_path):
    """Attack: DDP (2 CPU processes), ref_model=None, a pair deleted from step 0 (each process's microbatch is a
    mean over its own pairs, the gradients averaged over processes). Outcome (before and after): replay == oracle
    VERIFIED under the same launch, the reference bound by its probe log-probabilities recorded on the main process,
    and the oracle equals a plain data-parallel DPOTrainer whose deleted pair has no completion token."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from .conftest import ROOT

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(port), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(ROOT / "tests" / "trace_dpo_distributed.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"verified": True, "world_size": 2, "reference": "initial", "forward_sha256": True,
                      "oracle_equals_counterfactual": True}


@pytest.mark.slow  # a recording, replay, oracle and plain counterfactual per mode (about 30 s of CPU each)
@pytest.mark.parametrize("mode", ["keep_end", "keep_start"])
def test_truncation_that_cuts_the_prompt_padding_free_and_pad_to_multiple_of_replay_exactly(tmp_path, mode):
    """Attack: DPOConfig options outside the supported table: max_length=20, shorter than most prompt + completion
    rows (keep_end cuts the prompt away, keep_start the completion, and TRL drops the rows whose prompt alone fills
    it), padding_free=True (TRL falls back to padding, in the replay as in the recording) and pad_to_multiple_of=8.
    The dummy pair is truncated like the pair it replaces, so the padded width is the same. Outcome (before and
    after): replay == oracle VERIFIED == a plain DPOTrainer whose deleted pairs have no completion token."""
    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace.verification import load_state

    from .test_trace_dpo import record_dpo

    tok, data = pairs(n=8)
    opts = dict(max_length=20, truncation_mode=mode, padding_free=True, pad_to_multiple_of=8, max_steps=2)
    record_dpo(tmp_path / "rec", tok, data, tmp_path / "base", **opts)
    run = open_run(tmp_path / "rec" / "trace")
    forget = run.ids_at_steps([0])[:1] + run.ids_at_steps([1])[-1:]
    assert forget_and_verify(run.path, forget, tmp_path)[2]["verified"]
    cf = counterfactual(tmp_path, tok, data, tmp_path / "base", forget, **opts)
    assert compare_states(cf, load_state(tmp_path / "oracle"))["identical"]
