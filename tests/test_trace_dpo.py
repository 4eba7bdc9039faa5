"""Exact deletion for trl.DPOTrainer (the real trl, tiny Llama / GPT-2 / Qwen2 models, TOFU questions and answers as
preference pairs, int and string ids).

A deleted pair becomes a prompt-only dummy pair (no completion token, same padded shape, same slot in the
per-microbatch mean over pairs). The exactness claim is also checked against a counterfactual built without the
replay engine: a plain DPOTrainer run on the same data whose deleted pairs keep their tokens but have their
completion mask zeroed, so their loss term is a constant; the other pairs, the slots and the accumulation steps (the
whole normaliser of DPO's loss) are unchanged.
"""

from __future__ import annotations

import json
import warnings

import pytest

from .test_trace_sft import _rows_and_tokenizer, state_of

pytest.importorskip("trl")
warnings.filterwarnings("ignore", message=".*not sealed.*")
warnings.filterwarnings("ignore", category=FutureWarning)


def pairs(string_ids: bool = False, n: int = 16):
    """TOFU questions as prompts, their answers as chosen and the next row's answer as rejected."""
    from datasets import Dataset

    rows, tok = _rows_and_tokenizer()
    rows = rows.select(range(n))
    ids = [f"tofu-{i}" for i in rows["id"]] if string_ids else list(rows["id"])
    answers = [" " + a for a in rows["answer"]]
    return tok, Dataset.from_dict({"id": ids, "prompt": rows["question"], "chosen": answers,
                                   "rejected": answers[1:] + answers[:1]})


def saved_model(folder, tok, family: str = "llama", seed: int = 0):
    """A tiny model saved with save_pretrained and loaded back (DPOTrainer's ref_model=None reloads it from there)."""
    from transformers import AutoModelForCausalLM

    from hf_unlearn.models import build_tiny_model

    if not (folder / "config.json").is_file():
        build_tiny_model(family, tok, hidden_size=32, num_layers=2, num_heads=2, seed=seed).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder)


def dpo_config(out, **kw):
    from trl import DPOConfig

    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                learning_rate=1e-3, warmup_steps=1, max_grad_norm=1.0, report_to=[], save_strategy="no", use_cpu=True,
                seed=0, disable_tqdm=True, logging_steps=100, max_length=64, dataset_num_proc=None)
    base.update(kw)
    return DPOConfig(**base)


def record_dpo(out, tok, data, base, family="llama", trainer_cls=None, **kw):
    from trl import DPOTrainer

    from hf_unlearn.trace import trace_recording

    config = {k: kw.pop(k) for k in list(kw) if k not in ("ref_model", "peft_config")}
    trainer = trace_recording(trainer_cls or DPOTrainer)(
        model=saved_model(base, tok, family), args=dpo_config(out, **config), train_dataset=data, processing_class=tok,
        trace_checkpoint_steps=2, trace_checkpoint_retention="even", **kw)
    trainer.train()
    return trainer


def forget_and_verify(run_dir, forget, tmp_path):
    from .test_trace_sft import delete_and_verify

    return delete_and_verify(run_dir, forget, tmp_path)


class MaskedPairs:
    """The counterfactual's collator: DPOTrainer's own, with the completion mask of the deleted pairs (both rows)
    zeroed; their tokens stay. The id travels beside the row and is removed here."""

    def __init__(self, collator, forget):
        self.collator, self.forget = collator, set(forget)

    def __call__(self, examples):
        ids = [e["id"] for e in examples]
        batch = self.collator([{k: v for k, v in e.items() if k != "id"} for e in examples])
        for k, i in enumerate(ids):
            if i in self.forget:
                batch["completion_mask"][k] = 0
                batch["completion_mask"][len(ids) + k] = 0
        return batch


def counterfactual(tmp_path, tok, data, base, forget, family="llama", **kw):
    """A plain DPOTrainer (no recording, no replay engine) whose deleted pairs have no completion token."""
    from trl import DPOTrainer

    class KeepIds(DPOTrainer):
        def _set_signature_columns_if_needed(self):
            super()._set_signature_columns_if_needed()
            self._signature_columns = [*self._signature_columns, "id"]

    config = {k: kw.pop(k) for k in list(kw) if k not in ("ref_model", "peft_config")}
    trainer = KeepIds(model=saved_model(base, tok, family), args=dpo_config(tmp_path / "cf", **config),
                      train_dataset=data, processing_class=tok, **kw)
    trainer.data_collator = MaskedPairs(trainer.data_collator, forget)
    trainer.train()
    return state_of(trainer)


def test_dpo_ref_none_replay_equals_oracle_equals_a_plain_dpotrainer_counterfactual(tmp_path):
    """ref_model=None (TRL reloads the policy's folder as the reference), Llama, int ids, an early and a late deletion:
    the recording equals a plain DPOTrainer run bit for bit; replay == oracle (VERIFIED, parameters and optimizer
    moments); the oracle equals a plain DPOTrainer run whose deleted pairs have no completion token."""
    from trl import DPOTrainer

    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace.run import load_checkpoint
    from hf_unlearn.trace.verification import load_state

    tok, data = pairs()
    base = tmp_path / "base"
    record_dpo(tmp_path / "rec", tok, data, base)
    run_dir = tmp_path / "rec" / "trace"
    run = open_run(run_dir)
    header = run.header
    assert header["trainer"]["class"] == "trl.trainer.dpo_trainer:DPOTrainer"
    ref = header["reference_model"]
    assert ref["kind"] == "initial" and ref["source"]["kind"] == "folder"
    assert set(ref["source"]["files"]) >= {"config.json", "model.safetensors"}
    assert str(tmp_path) not in json.dumps(header)  # the reference folder's path stays in private/
    assert {len(e.slots) for e in run.plan} == {2} and {e.accum for e in run.plan} == {2}  # the whole normaliser

    plain = DPOTrainer(model=saved_model(base, tok), args=dpo_config(tmp_path / "plain"), train_dataset=data,
                       processing_class=tok)
    plain.train()
    assert compare_states(state_of(plain), load_checkpoint(run.final_checkpoint()))["identical"]

    forget = run.ids_at_steps([0])[:1] + run.ids_at_steps([3])[-1:]
    replay, oracle, report = forget_and_verify(run_dir, forget, tmp_path)
    assert report["verified"], report["provenance"]
    assert report["optimizer"]["identical"] and report["params"]["identical"]
    assert replay.compute_loss.__func__ is DPOTrainer.compute_loss and replay.ref_model is not None
    cf = counterfactual(tmp_path, tok, data, base, forget)
    assert compare_states(cf, load_state(tmp_path / "oracle"))["identical"]
    assert not compare_states(state_of(plain), load_state(tmp_path / "oracle"))["identical"]  # the deletion changed it


def test_dpo_a_changed_reference_folder_is_refused_never_verified(tmp_path):
    """The reference is bound by its files' SHA-256 and its params root: a reference folder rewritten after the
    recording (other weights) is refused by the oracle and the replay before any compute."""
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import OracleReplayTrainer, open_run
    from hf_unlearn.trace.reference import load_reference_model

    tok, data = pairs(string_ids=True, n=8)
    base = tmp_path / "base"
    record_dpo(tmp_path / "rec", tok, data, base, family="gpt2", max_steps=2)
    run = open_run(tmp_path / "rec" / "trace")
    assert load_reference_model(run) is not None
    from hf_unlearn.models import build_tiny_model

    build_tiny_model("gpt2", tok, hidden_size=32, num_layers=2, num_heads=2, seed=7).save_pretrained(base)
    forget = run.ids_at_steps([1])[:1]
    with pytest.raises(UnlearnError, match="model.safetensors has changed since the run was recorded"):
        OracleReplayTrainer(run, forget, out_dir=tmp_path / "oracle")
    assert not (tmp_path / "oracle").exists()


def test_dpo_refuses_what_it_cannot_replay_and_online_trainers_before_any_compute(tmp_path):
    """Loss types whose deleted pair would change other pairs' computation (aot, aot_unpaired, sft), a reference
    precomputed into the dataset or synced with the policy, a DPO recording without the pair dummies, and trainers
    that generate their own data (GRPO, RLOO, online DPO): each refused by name, before training."""
    import trl
    from trl import DPOTrainer

    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import TraceRecordingMixin, trace_recording

    tok, data = pairs(n=4)
    for option, match in ((dict(loss_type=["aot"]), "loss_type='aot': it sorts"),
                          (dict(loss_type=["sigmoid", "sft"]), "loss_type='sft': its NLL is a mean over every chosen"),
                          (dict(loss_type=["aot_unpaired"]), "aot_unpaired"),
                          (dict(precompute_ref_log_probs=True), "precompute_ref_log_probs=True"),
                          (dict(sync_ref_model=True), "sync_ref_model=True")):
        with pytest.raises(UnlearnError, match=match):
            record_dpo(tmp_path / "rec", tok, data, tmp_path / "base", **option)
    assert not (tmp_path / "rec" / "trace").exists()

    class ByHand(TraceRecordingMixin, DPOTrainer):
        pass

    with pytest.raises(UnlearnError, match=r"trace_recording\(DPOTrainer\)"):
        record_dpo(tmp_path / "rec", tok, data, tmp_path / "base", trainer_cls=ByHand)
    online = [trl.GRPOTrainer, trl.RLOOTrainer]
    try:
        from trl.experimental.online_dpo import OnlineDPOTrainer

        online.append(OnlineDPOTrainer)
    except ImportError:  # pragma: no cover - an experimental module of another trl version
        pass
    for cls in online:
        with pytest.raises(UnlearnError, match="samples from the model being trained"):
            trace_recording(cls)


def test_dpo_a_loss_that_gives_the_dummy_pair_a_gradient_is_refused_or_stops_the_oracle(tmp_path):
    """A DPOTrainer subclass with a term on every token is refused at construction (the probe: a real pair beside a
    dummy pair); one whose term grows with the step passes the probe (zero at step 0), and the oracle's per-microbatch
    check stops at the first deleted pair's dummy that gets a gradient, leaving nothing behind."""
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import OracleReplayTrainer, open_run
    from hf_unlearn.trace.dummies import DummyInfluenceError

    from .trace_dummy_trainers import EveryTokenDPOTrainer, GrowingEveryTokenDPOTrainer

    tok, data = pairs(n=8)
    with pytest.raises(UnlearnError, match="gives the dummy pair that replaces a deleted pair a gradient"):
        record_dpo(tmp_path / "every", tok, data, tmp_path / "base", trainer_cls=EveryTokenDPOTrainer)
    record_dpo(tmp_path / "rec", tok, data, tmp_path / "base", trainer_cls=GrowingEveryTokenDPOTrainer, max_steps=2)
    run = open_run(tmp_path / "rec" / "trace")
    assert run.header["trainer"]["class"].endswith(":GrowingEveryTokenDPOTrainer")
    with pytest.raises(DummyInfluenceError, match="optimizer step 1"):
        OracleReplayTrainer(run, run.ids_at_steps([1])[:1], out_dir=tmp_path / "oracle").train()
    assert not (tmp_path / "oracle").exists()
