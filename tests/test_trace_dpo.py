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


def counterfactual(tmp_path, tok, data, base, forget, family="llama", trainer_cls=None, **kw):
    """A plain DPOTrainer (``trainer_cls``: that subclass; no recording, no replay engine) whose deleted pairs have no
    completion token."""
    from trl import DPOTrainer

    class KeepIds(trainer_cls or DPOTrainer):
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

    tok, data = pairs(n=12)
    base = tmp_path / "base"
    record_dpo(tmp_path / "rec", tok, data, base, max_steps=3)
    run_dir = tmp_path / "rec" / "trace"
    run = open_run(run_dir)
    header = run.header
    assert header["trainer"]["class"] == "trl.trainer.dpo_trainer:DPOTrainer"
    ref = header["reference_model"]
    assert ref["kind"] == "initial" and ref["source"]["kind"] == "folder"
    assert set(ref["source"]["files"]) >= {"config.json", "model.safetensors"}
    assert str(tmp_path) not in json.dumps(header)  # the reference folder's path stays in private/
    assert {len(e.slots) for e in run.plan} == {2} and {e.accum for e in run.plan} == {2}  # the whole normaliser

    plain = DPOTrainer(model=saved_model(base, tok), args=dpo_config(tmp_path / "plain", max_steps=3), train_dataset=data,
                       processing_class=tok)
    plain.train()
    assert compare_states(state_of(plain), load_checkpoint(run.final_checkpoint()))["identical"]

    forget = run.ids_at_steps([0])[:1] + run.ids_at_steps([2])[-1:]
    replay, oracle, report = forget_and_verify(run_dir, forget, tmp_path)
    assert report["verified"], report["provenance"]
    assert report["optimizer"]["identical"] and report["params"]["identical"]
    assert replay.compute_loss.__func__ is DPOTrainer.compute_loss and replay.ref_model is not None
    from hf_unlearn.trace.reference import load_reference_model, reference_root

    assert reference_root(load_reference_model(tmp_path / "replay")) == ref["params_root"]  # a next request's reference
    cf = counterfactual(tmp_path, tok, data, base, forget, max_steps=3)
    assert compare_states(cf, load_state(tmp_path / "oracle"))["identical"]
    assert not compare_states(state_of(plain), load_state(tmp_path / "oracle"))["identical"]  # the deletion changed it


def test_dpo_a_changed_reference_folder_is_refused_never_verified(tmp_path, capsys):
    """The reference is bound by its files' SHA-256 and its params root: a reference folder rewritten after the
    recording (other weights) is refused by the oracle before any compute; the repack baseline (Trainer's own loss) is
    refused for a DPO run before the oracle runs; inspect prints the reference."""
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import OracleReplayTrainer, open_run
    from hf_unlearn.trace.reference import load_reference_model

    tok, data = pairs(string_ids=True, n=8)
    base = tmp_path / "base"
    record_dpo(tmp_path / "rec", tok, data, base, family="gpt2", max_steps=2)
    run = open_run(tmp_path / "rec" / "trace")
    assert load_reference_model(run) is not None
    from hf_unlearn.models import build_tiny_model

    forget = run.ids_at_steps([1])[:1]
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids

    ids = str(write_ids(tmp_path / "f.jsonl", forget))
    assert main(["trace", "oracle", str(run.path), "--forget", ids, "--out", str(tmp_path / "b"), "--baselines"]) != 0
    assert "not defined for DPO runs" in capsys.readouterr().err and not (tmp_path / "b").exists()  # before compute
    build_tiny_model("gpt2", tok, hidden_size=32, num_layers=2, num_heads=2, seed=7).save_pretrained(base)
    with pytest.raises(UnlearnError, match="model.safetensors has changed since the run was recorded"):
        OracleReplayTrainer(run, forget, out_dir=tmp_path / "oracle")
    assert not (tmp_path / "oracle").exists()
    assert main(["trace", "inspect", str(run.path)]) == 0  # inspect reads the header, not the reference's files
    assert "DPO reference model: the policy's own folder" in capsys.readouterr().out
    import json

    from hf_unlearn.trace.run import write_sidecar

    header = json.loads((run.path / "header.json").read_text())  # rebinding the reference without the run key
    header["reference_model"]["params_root"] = "0" * 64
    (run.path / "header.json").write_text(json.dumps(header, indent=1, sort_keys=True))
    write_sidecar(run.path / "header.json")
    with pytest.raises(Exception, match="controls_mac does not match"):
        open_run(run.path)


def test_dpo_refuses_what_it_cannot_replay_and_online_trainers_before_any_compute(tmp_path):
    """Loss types whose deleted pair would change other pairs' computation (aot, aot_unpaired, sft), a reference
    precomputed into the dataset or synced with the policy, a PeftModel whose adapter TRL copies as the reference, a
    DPO recording without the pair dummies, and trainers that generate their own data (GRPO, RLOO, online DPO): each
    refused by name, before training."""
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

    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(saved_model(tmp_path / "base", tok), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(UnlearnError, match=r"it has 2 adapters \(\['default', 'ref'\]\)"):  # TRL's copy as reference
        trace_recording(DPOTrainer)(model=adapted, args=dpo_config(tmp_path / "rec"), train_dataset=data,
                                    processing_class=tok)

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


def test_dpo_a_loss_reading_a_deleted_pairs_tokens_is_not_verified_the_oracle_being_the_counterfactual(tmp_path,
                                                                                                        monkeypatch):
    """ATTACK: DPO's loss scaled by how often a word occurs in the microbatch's inputs (from step 1 on: the
    construction probe passes). The replay's dummy pair lacks the deleted pair's words; the oracle now trains the
    deleted pair itself with its completion masks zeroed, which is the engine-free counterfactual bit for bit, so the
    two differ and the deletion is not VERIFIED (with a dummy pair in the oracle too, they agreed: a wrong
    VERIFIED)."""
    import collections

    from trl import DPOTrainer

    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace.verification import load_state

    from .trace_dummy_trainers import InputWeightedDPOTrainer

    tok, data = pairs(n=8)
    tokens = {r["id"]: tok(r["chosen"] + r["rejected"], add_special_tokens=False)["input_ids"] for r in data}
    word = collections.Counter(t for ids in tokens.values() for t in ids).most_common(1)[0][0]
    monkeypatch.setattr(InputWeightedDPOTrainer, "word", word)  # this process's class: the replays rebuild it
    record_dpo(tmp_path / "rec", tok, data, tmp_path / "base", trainer_cls=InputWeightedDPOTrainer, max_steps=3)
    run = open_run(tmp_path / "rec" / "trace")
    forget = [i for i in run.ids_at_steps([2]) if word in tokens[i]][:1]
    assert forget
    _, oracle, report = forget_and_verify(tmp_path / "rec" / "trace", forget, tmp_path)
    assert not report["identical"] and not report["verified"]
    assert oracle.replay_stats["deleted_rows_trained_masked"] >= 1

    cf = counterfactual(tmp_path, tok, data, tmp_path / "base", forget, trainer_cls=InputWeightedDPOTrainer,
                        max_steps=3)
    assert compare_states(cf, load_state(tmp_path / "oracle"))["identical"]  # the oracle: the counterfactual
    assert issubclass(InputWeightedDPOTrainer, DPOTrainer)


@pytest.mark.slow  # a LoRA recording, replay, oracle and a plain counterfactual run (about 30 s of CPU)
def test_dpo_lora_peft_config_reference_is_the_base_with_the_adapter_disabled(tmp_path):
    """peft_config= LoRA, ref_model=None, GPT-2, string ids: TRL's reference is the policy with its adapter disabled
    (the frozen base the checkpoints hold, nothing to load); replay == oracle == a plain DPOTrainer counterfactual."""
    from peft import LoraConfig

    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace.reference import load_reference_model, reference_root
    from hf_unlearn.trace.verification import load_state

    tok, data = pairs(string_ids=True)
    lora = dict(peft_config=LoraConfig(r=4, target_modules=["c_attn"]), learning_rate=1e-2)
    recorder = record_dpo(tmp_path / "rec", tok, data, tmp_path / "base", family="gpt2", **lora)
    run = open_run(tmp_path / "rec" / "trace")
    ref = run.header["reference_model"]
    assert ref["kind"] == "adapter_disabled" and run.header["model"]["peft"]
    assert ref["params_root"] == reference_root(saved_model(tmp_path / "base", tok, "gpt2"))  # the base's weights
    assert load_reference_model(run) is None and recorder.ref_model is None
    forget = run.ids_at_steps([0])[-1:] + run.ids_at_steps([2])[:1]
    assert isinstance(forget[0], str)
    assert forget_and_verify(run.path, forget, tmp_path)[2]["verified"]
    cf = counterfactual(tmp_path, tok, data, tmp_path / "base", forget, family="gpt2",
                        peft_config=LoraConfig(r=4, target_modules=["c_attn"]), learning_rate=1e-2)
    assert compare_states(cf, load_state(tmp_path / "oracle"))["identical"]


@pytest.mark.slow  # two DPO recordings, replays and oracles (about a minute of CPU)
def test_dpo_explicit_reference_a_recorded_runs_output_folder_or_stored_in_the_run(tmp_path):
    """ref_model= the save_pretrained folder of an earlier recorded run: referenced there by its files' SHA-256 and
    its params root, replay == oracle; replay and oracle given another reference (load_reference_model(run, override=),
    as a pipeline stage with a new parent) agree and their output runs record that reference; a reference changed in
    memory after loading is stored in the run instead, and a tampered stored copy is refused."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store, verify
    from hf_unlearn.trace.reference import REFERENCE_DIR, load_reference_model, reference_root

    tok, data = pairs(n=8)
    first = record_dpo(tmp_path / "first", tok, data, tmp_path / "base", max_steps=2)
    first.save_model(str(tmp_path / "first" / "model"))
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path / "first" / "model")
    record_dpo(tmp_path / "second", tok, data, tmp_path / "base", ref_model=ref_model, max_steps=2)
    run = open_run(tmp_path / "second" / "trace")
    ref = run.header["reference_model"]
    assert ref["kind"] == "model" and ref["source"]["kind"] == "folder"
    assert ref["params_root"] == reference_root(ref_model) != reference_root(saved_model(tmp_path / "base", tok))
    first_run = open_run(tmp_path / "first" / "trace")  # the lineage link: the first run's output, by its weights
    assert ref["params_root"] == json.loads((first_run.final_checkpoint() / "hashes.json").read_text())["params_root"]
    assert reference_root(load_reference_model(run)) == ref["params_root"]
    forget = run.ids_at_steps([1])[:1]
    assert forget_and_verify(run.path, forget, tmp_path / "a")[2]["verified"]
    assert load_reference_model(run, override=ref_model) is ref_model
    new_parent = load_reference_model(run, override=tmp_path / "base")  # as a pipeline replays a later stage
    assert reference_root(new_parent) != ref["params_root"]
    early = run.ids_at_steps([0])[:1]  # from step 0: every step sees the new reference
    redact_store(run.store_path, early, tmp_path / "o" / "store", run.key)
    RedactedReplayTrainer(run, tmp_path / "o" / "store", early, tmp_path / "o" / "replay", ref_model=new_parent).train()
    OracleReplayTrainer(run, early, out_dir=tmp_path / "o" / "oracle",
                        ref_model=load_reference_model(run, override=tmp_path / "base")).train()
    assert verify(tmp_path / "o" / "replay", tmp_path / "o" / "oracle")["verified"]
    replayed = open_run(tmp_path / "o" / "replay")
    assert replayed.header["reference_model"]["params_root"] == reference_root(new_parent)
    assert replayed.header["reference_model"]["replaced_params_root"] == ref["params_root"]
    assert reference_root(load_reference_model(replayed)) == reference_root(new_parent)  # a later request loads it

    changed = AutoModelForCausalLM.from_pretrained(tmp_path / "first" / "model")
    with torch.no_grad():
        changed.model.norm.weight.mul_(1.5)  # changed after loading: no folder holds these weights
    record_dpo(tmp_path / "third", tok, data, tmp_path / "base", ref_model=changed, max_steps=2)
    run = open_run(tmp_path / "third" / "trace")
    assert run.header["reference_model"]["source"]["kind"] == "stored"
    assert (run.path / REFERENCE_DIR / "model.safetensors").is_file()
    assert forget_and_verify(run.path, forget, tmp_path / "b")[2]["verified"]
    from safetensors.torch import load_file, save_file

    stored = run.path / REFERENCE_DIR / "model.safetensors"
    tensors = load_file(stored)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
    save_file(tensors, stored, metadata={"format": "pt"})
    with pytest.raises(UnlearnError, match="has changed since the run was recorded"):
        OracleReplayTrainer(run, forget, out_dir=tmp_path / "c")


LOSS_OPTIONS = [dict(loss_type=["hinge"]), dict(loss_type=["ipo"]), dict(loss_type=["robust"], label_smoothing=0.1),
                dict(loss_type=["exo_pair"], label_smoothing=1e-3), dict(loss_type=["nca_pair"]),
                dict(loss_type=["bco_pair"]), dict(loss_type=["sppo_hard"]), dict(loss_type=["apo_zero"]),
                dict(loss_type=["apo_down"]), dict(loss_type=["discopop"]), dict(loss_type=["sigmoid_norm"]),
                dict(loss_type=["sigmoid", "hinge"], loss_weights=[1.0, 0.5]), dict(ld_alpha=0.5),
                dict(f_divergence_type="js_divergence"), dict(f_divergence_type="forward_kl"),
                dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.5), dict(use_weighting=True)]


@pytest.mark.slow  # 17 short recordings with a replay, an oracle and a counterfactual each (about 3 minutes of CPU)
@pytest.mark.parametrize("options", LOSS_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_dpo_every_supported_loss_type_and_option_replays_exactly(tmp_path, options):
    """Each per-pair loss type and option the docs list as exact: replay == oracle (VERIFIED) == a plain DPOTrainer
    whose deleted pairs have no completion token, bit for bit."""
    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace.verification import load_state

    tok, data = pairs(n=8)
    record_dpo(tmp_path / "rec", tok, data, tmp_path / "base", max_steps=2, **options)
    run = open_run(tmp_path / "rec" / "trace")
    forget = run.ids_at_steps([1])[:1]
    assert forget_and_verify(run.path, forget, tmp_path)[2]["verified"]
    cf = counterfactual(tmp_path, tok, data, tmp_path / "base", forget, max_steps=2, **options)
    assert compare_states(cf, load_state(tmp_path / "oracle"))["identical"]


@pytest.mark.slow  # a fresh `hf-unlearn forget` process (imports, replay and oracle): about a minute of CPU
def test_cli_forget_oracle_on_a_dpo_run(tmp_path):
    """`hf-unlearn forget RUN --ids FILE --oracle` (a fresh process: DPOTrainer and its reference rebuilt from the run
    alone): VERIFIED receipt."""
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run

    from .conftest import run_cli

    tok, data = pairs(string_ids=True, n=8)
    record_dpo(tmp_path / "rec", tok, data, tmp_path / "base", max_steps=2)
    run = tmp_path / "rec" / "trace"
    forget = write_ids(tmp_path / "f.jsonl", open_run(run).ids_at_steps([0])[:1] + open_run(run).ids_at_steps([1])[-1:])
    proc = run_cli("forget", run, "--ids", forget, "--out", tmp_path / "out", "--no-progress", "--oracle")
    assert proc.returncode == 0, proc.stderr[-2000:]
    receipt = json.loads((tmp_path / "out" / "receipt.json").read_text())
    assert receipt["evidence"]["verified"] is True


@pytest.mark.parametrize("name,why", [("KTOTrainer", "pairs each prompt with the completion of another row"),
                                      ("RewardTrainer", "pads and pools its pairs its own way"),
                                      ("DistillationTrainer", "samples from the model being trained")])
def test_trl_trainers_a_recording_does_not_know_are_refused_when_wrapped(name, why):
    """``trace_recording(KTOTrainer)`` and ``trace_recording(RewardTrainer)`` crashed deep in the trainer's
    construction (a ``_prepare_dataset`` signature the recorder does not take); TRL's on-policy distillation trains on
    what the model generates. Each is refused when wrapped, in one line, and so is a user's subclass of one."""
    import trl

    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import trace_recording

    cls = getattr(trl, name)
    for wrapped in (cls, type(f"My{name}", (cls,), {})):
        with pytest.raises(UnlearnError) as e:
            trace_recording(wrapped)
        text = str(e.value)
        assert "\n" not in text and why in text and f"{wrapped.__qualname__}" in text, text
