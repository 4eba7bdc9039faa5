"""Exact deletion on the configurations users train, end to end through the CLI, each compared bit for bit with an
engine-free counterfactual the test builds itself (a plain Trainer / SFTTrainer / DPOTrainer).

The models have real shapes: grouped-query attention (``num_key_value_heads < num_attention_heads``), the GPT-2
tokenizer's 50,257-token vocabulary, tied (SmolLM2's Llama shape) and untied (Qwen2) embeddings, Gemma and GPT-NeoX;
LoRA (with and without ``modules_to_save``) and full fine-tuning; SDPA and eager attention; fp32 and bf16 autocast.
A fast subset runs by default; the whole matrix, the request service and the real SmolLM2-135M are ``slow``.

What each counterfactual keeps, as the deletion contract says: the recorded plan (order, slots, seeds, learning
rates, normalisers); the deleted rows' labels are all ignored (SFT, Trainer) or their pair's completion mask is zeroed
(DPO: the pair keeps its slot in the mean over the microbatch's pairs).
"""

from __future__ import annotations

import functools
import itertools
import json
import warnings

import pytest
import torch

from .conftest import TOFU_DIR, TOKENIZERS

pytest.importorskip("trl")
pytest.importorskip("peft")
warnings.filterwarnings("ignore", message=".*not sealed.*")
warnings.filterwarnings("ignore", category=FutureWarning)

FAMILIES = ("llama_tied", "qwen2", "gemma3", "gpt_neox")
ADAPTERS = ("full", "lora", "lora_mts")
TRAINERS = ("trainer", "sft", "dpo")
ATTENTIONS = ("sdpa", "eager")
PRECISIONS = ("fp32", "bf16")


@functools.cache
def gpt2():
    from hf_unlearn.models import load_tokenizer

    return load_tokenizer(TOKENIZERS / "gpt2")


@functools.cache
def smollm2_folder():
    """The real SmolLM2-135M-Instruct (GQA: 9 query heads, 3 key/value heads; tied embeddings), de-quantised once
    from the shared GGUF into a save_pretrained folder (removed at exit), with its tokenizer."""
    import atexit
    import shutil
    import tempfile
    from pathlib import Path

    from hf_unlearn.models import load_model, load_tokenizer

    from .conftest import SMOLLM2_DIR

    pytest.importorskip("gguf")
    gguf = sorted(SMOLLM2_DIR.glob("*.gguf"))[0].name
    folder = Path(tempfile.mkdtemp(prefix="smollm2_"))
    atexit.register(shutil.rmtree, folder, True)
    # the library's own GGUF path: de-quantised into a plain model of its class, EOS as the pad token
    load_model(SMOLLM2_DIR, gguf_file=gguf, dtype=torch.float32).save_pretrained(folder)
    load_tokenizer(SMOLLM2_DIR, gguf_file=gguf).save_pretrained(folder)
    return folder


def tokenizer(family: str):
    """The GPT-2 tokenizer (50,257 tokens) for the config-built shapes; SmolLM2's own for SmolLM2."""
    if family == "smollm2":
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(smollm2_folder())
    return gpt2()


def real_shape(family: str, attn: str = "sdpa", seed: int = 0, **overrides):
    """A small model of a real family's shape over the GPT-2 vocabulary: 4 query heads sharing 2 key/value heads
    (GQA; GPT-NeoX has none), Llama with tied embeddings as SmolLM2, Qwen2 untied; or the real SmolLM2-135M."""
    from .test_trace_common import config_model

    if family == "smollm2":
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(smollm2_folder(), attn_implementation=attn)
    tok = gpt2()
    gqa = {"num_attention_heads": 4, "num_key_value_heads": 2}
    kwargs = {"llama_tied": dict(gqa, tie_word_embeddings=True), "qwen2": dict(gqa, tie_word_embeddings=False),
              "gemma3": dict(gqa, head_dim=8, sliding_window=16), "gpt_neox": {"num_attention_heads": 4}}[family]
    model = config_model("llama" if family == "llama_tied" else family, tok, seed=seed, **{**kwargs, **overrides})
    model.config._attn_implementation = attn  # as from_pretrained(..., attn_implementation=attn) sets it
    return model


def lora_config(family: str, adapter: str):
    from peft import LoraConfig

    if adapter == "full":
        return None
    targets = ["query_key_value"] if family == "gpt_neox" else ["q_proj", "v_proj"]
    if adapter == "vera":
        from peft import VeraConfig

        return VeraConfig(r=8, target_modules=targets, task_type="CAUSAL_LM")
    mts = ["lm_head"] if adapter == "lora_mts" and family not in ("llama_tied", "gemma3") else None
    if adapter == "lora_mts" and mts is None:  # a tied head cannot be a separate trainable copy: the last norm instead
        mts = ["norm"]
    init = {"init_lora_weights": "pissa"} if adapter == "pissa" else {}
    return LoraConfig(r=4, lora_alpha=8, target_modules=targets, modules_to_save=mts, task_type="CAUSAL_LM", **init)


# ---- data: real text, real tokenizer --------------------------------------------------------------------------------
@functools.cache
def tofu_rows(n: int = 24):
    from hf_unlearn.data import load_tofu

    return load_tofu("full", TOFU_DIR).select(range(n))


def sft_rows(tok=None, n: int = 24):
    from datasets import Dataset

    rows = tofu_rows(n)
    return Dataset.from_dict({"id": [f"tofu-{i}" for i in rows["id"]], "prompt": rows["question"],
                              "completion": [" " + a for a in rows["answer"]]})


def qa_rows(tok=None, n: int = 24):
    from hf_unlearn.data import tokenize_qa

    return tokenize_qa(tofu_rows(n), tok or gpt2(), max_length=96)


WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "his", "old", "red", "house", "by", "sea")


def equal_and_unequal_pairs(tok=None, n: int = 12):
    """Preference pairs of single-token words: pairs 0, 2, 4, ... have chosen and rejected rows of one length (36
    tokens with EOS), pairs 1, 3, ... a rejected row two tokens shorter. A microbatch of an even and an odd pair
    holds exactly one padded row, the odd pair's rejected one: a dummy that did not keep that row's length would
    leave the microbatch without padding, which with GQA and SDPA (rows over 32 tokens, on this CPU stack) changes
    the even pair's gradient in the last bits."""
    import random

    from datasets import Dataset

    rnd = random.Random(0)

    def words(k):
        return " " + " ".join(rnd.choice(WORDS) for _ in range(k))

    prompts = ["The" + words(19) for _ in range(n)]
    chosen = [words(15) for _ in range(n)]
    rejected = [words(15 if i % 2 == 0 else 13) for i in range(n)]
    return Dataset.from_dict({"id": [f"pair-{i}" for i in range(n)], "prompt": prompts, "chosen": chosen,
                              "rejected": rejected})


# ---- recording ------------------------------------------------------------------------------------------------------
def common_args(out, precision: str = "fp32", **kw) -> dict:
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                learning_rate=5e-3, warmup_steps=1, max_grad_norm=1.0, report_to=[], save_strategy="no", use_cpu=True,
                seed=0, disable_tqdm=True, logging_steps=100, bf16=precision == "bf16")
    base.update(kw)
    return base


def config_for(kind: str, out, precision: str, **kw):
    from transformers import TrainingArguments
    from trl import DPOConfig, SFTConfig

    args = common_args(out, precision, **kw)
    if kind == "sft":
        return SFTConfig(**args, max_length=96, dataset_num_proc=None)
    if kind == "dpo":
        return DPOConfig(**args, max_length=64, dataset_num_proc=None)
    return TrainingArguments(**args)


def trainer_for(kind: str, recording: bool):
    from transformers import Trainer
    from trl import DPOTrainer, SFTTrainer

    from hf_unlearn.trace import trace_recording

    cls = {"trainer": Trainer, "sft": SFTTrainer, "dpo": DPOTrainer}[kind]
    return trace_recording(cls) if recording else cls


def data_for(kind: str, family: str = ""):
    return {"trainer": qa_rows, "sft": sft_rows, "dpo": equal_and_unequal_pairs}[kind](tokenizer(family))


def trainer_kwargs(kind: str, family: str, adapter: str) -> dict:
    from hf_unlearn.data import QACollator

    tok = tokenizer(family)
    kw = {"processing_class": tok} if kind != "trainer" else {"data_collator": QACollator.from_tokenizer(tok)}
    peft = lora_config(family, adapter)
    if peft is not None:
        kw["peft_config"] = peft
    return kw


def base_model(kind: str, family: str, attn: str, folder):
    """The starting model; a DPO run's is saved and loaded back (its reference is that folder, or the adapter
    disabled for LoRA), loaded with the attention implementation under test."""
    if kind != "dpo":
        return real_shape(family, attn)
    from transformers import AutoModelForCausalLM

    if not (folder / "config.json").is_file():
        real_shape(family, attn).save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn)


def record(tmp_path, family, adapter, kind, attn="sdpa", precision="fp32", model=None, **kw):
    """Record one configuration into ``tmp_path/rec/trace`` (``model``: a full fine-tune of that model); returns the
    recording trainer."""
    if model is not None:
        extra = trainer_kwargs(kind, family, adapter)
    elif kind == "trainer" and adapter != "full":
        from peft import get_peft_model

        model = get_peft_model(real_shape(family, attn), lora_config(family, adapter))
        extra = {"data_collator": trainer_kwargs(kind, family, "full")["data_collator"]}
    else:
        model, extra = base_model(kind, family, attn, tmp_path / "base"), trainer_kwargs(kind, family, adapter)
    trainer = trainer_for(kind, True)(model=model, args=config_for(kind, tmp_path / "rec", precision, **kw),
                                      train_dataset=data_for(kind, family), trace_checkpoint_steps=2,
                                      trace_checkpoint_retention="even", **extra)
    trainer.train()
    return trainer


# ---- the engine-free counterfactuals --------------------------------------------------------------------------------
def counterfactual(tmp_path, recorder, family, adapter, kind, forget, attn="sdpa", precision="fp32", **kw):
    """A plain trainer of the same kind, no recording and no replay engine: the deleted rows without weight (labels
    ignored, or a pair's completion mask zeroed) and the recording's normalisers. Returns the trained trainer."""
    from hf_unlearn.trace import open_run

    from .test_trace_common import labels_masked, recorded_normalisers_trainer
    from .test_trace_dpo import MaskedPairs

    run_dir = tmp_path / "rec" / "trace"
    args = config_for(kind, tmp_path / "cf", precision, **kw)
    if kind == "dpo":
        class KeepIds(trainer_for("dpo", False)):
            def _set_signature_columns_if_needed(self):
                super()._set_signature_columns_if_needed()
                self._signature_columns = [*self._signature_columns, "id"]

        trainer = KeepIds(model=base_model(kind, family, attn, tmp_path / "base"), args=args,
                          train_dataset=data_for(kind, family), **trainer_kwargs(kind, family, adapter))
        trainer.data_collator = MaskedPairs(trainer.data_collator, forget)
    elif kind == "sft":
        from .test_trace_sft import recorded_normalisers

        prepared = recorder.train_dataset
        masked = prepared.map(lambda r: {"labels": [-100] * len(r["labels"]) if r["id"] in forget else r["labels"]})
        args = config_for(kind, tmp_path / "cf", precision, dataset_kwargs={"skip_prepare_dataset": True}, **kw)
        trainer = recorded_normalisers(open_run(run_dir))(model=real_shape(family, attn), args=args,
                                                          train_dataset=masked, **trainer_kwargs(kind, family, adapter))
    else:
        model = real_shape(family, attn)
        if adapter != "full":
            from peft import get_peft_model

            model = get_peft_model(model, lora_config(family, adapter))
        trainer = recorded_normalisers_trainer(run_dir)(
            model=model, args=args, train_dataset=labels_masked(data_for(kind, family), forget),
            **trainer_kwargs(kind, family, "full"))
    trainer.train()
    return trainer


def published_weights_equal(trainer, model_dir) -> tuple[bool, list[str]]:
    """The model published in ``model_dir``, loaded with ``from_pretrained`` (which maps names a model renames on
    save, e.g. GPT-NeoX's ``lm_head`` saved as ``embed_out``), equals the counterfactual's model (a LoRA adapter
    merged as ``merge_and_unload`` merges it) bit for bit; returns (equal, names that differ or are missing)."""
    from transformers import AutoModelForCausalLM

    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    state = model.state_dict()
    saved = AutoModelForCausalLM.from_pretrained(model_dir, dtype=next(model.parameters()).dtype).state_dict()
    bad = sorted(n for n in state.keys() | saved.keys()
                 if n not in state or n not in saved or not torch.equal(state[n], saved[n]))
    return (not bad and bool(saved)), bad


def forget_cli(run_dir, forget, out, *extra) -> dict:
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids

    ids = write_ids(out.parent / f"{out.name}-ids.jsonl", forget)
    assert main(["forget", str(run_dir), "--ids", str(ids), "--out", str(out), "--no-progress", *extra]) == 0
    return json.loads((out / "receipt.json").read_text())


def check_configuration(tmp_path, family, adapter, kind, attn="sdpa", precision="fp32", **kw):
    """Record, `hf-unlearn forget --oracle` one row of an early and one of a late step, `trace verify`, and compare
    the oracle's full state (parameters and optimizer moments) and the published model with the counterfactual."""
    from hf_unlearn.cli import main
    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace.verification import load_state

    from .test_trace_sft import state_of

    recorder = record(tmp_path, family, adapter, kind, attn, precision, **kw)
    run = open_run(tmp_path / "rec" / "trace")
    assert run.header["model"].get("attn_implementation") == attn
    forget = run.ids_at_steps([0])[-1:] + run.ids_at_steps([2])[:1]
    receipt = forget_cli(run.path, forget, tmp_path / "out", "--oracle")
    assert receipt["ok"] and receipt["evidence"]["verified"] is True, receipt["evidence"].get("oracle")
    out = tmp_path / "out"
    assert main(["trace", "verify", str(out / "replay"), str(out / "oracle")]) == 0
    cf = counterfactual(tmp_path, recorder, family, adapter, kind, forget, attn, precision, **kw)
    assert compare_states(state_of(cf), load_state(out / "oracle"))["identical"]
    equal, bad = published_weights_equal(cf, out / "model")
    assert equal, bad[:5]
    if adapter != "full":  # the merged model is published; the replayed adapter is kept beside it
        assert (out / "adapter" / "adapter_model.safetensors").is_file()
        assert receipt["evidence"]["output"]["kind"] == "merged adapter"
        from huggingface_hub import ModelCard  # the adapter names the recorded base (here none: built from a config),
        # in its config and in PEFT's card, never the run's weightless RUN/model

        base = json.loads((run.path / "model" / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == base
        card = ModelCard.load(out / "adapter" / "README.md")
        assert card.data.base_model == base and str(run.path) not in str(card)
    return receipt


# ---- the fast subset (default suite) --------------------------------------------------------------------------------
# (a LoRA SFTTrainer run through `forget --oracle`: tests/test_lora_output.py, which checks its output too)


def deleted_odd_pairs(run):
    """The odd pair of every microbatch (of the first 3 steps) that holds one odd and one even pair of
    :func:`equal_and_unequal_pairs`: its shorter rejected row is the microbatch's only padded row."""
    odd = [[int(i.split("-")[1]) % 2 == 1 for i in run.ids_at_steps([s])] for s in range(3)]
    found = [run.ids_at_steps([s])[2 * j + (not flags[2 * j])] for s, flags in enumerate(odd)
             for j in range(len(flags) // 2) if flags[2 * j] != flags[2 * j + 1]]
    assert found, "no microbatch of an even and an odd pair"
    return found


def test_dpo_on_a_gqa_sdpa_model_records_and_deletes_exactly(tmp_path):
    """DPOTrainer on a GQA model with SDPA (Qwen2's shape) is recorded (it was refused at construction), and a pair
    deleted from a microbatch whose only padded row is that pair's shorter row equals a plain DPOTrainer run whose
    deleted pair has no completion token, bit for bit (the dummy pair keeps the pair's own row lengths); the receipt
    says what the DPO counterfactual keeps."""
    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace import preference as pref
    from hf_unlearn.trace.verification import load_state

    from .test_trace_sft import state_of

    recorder = record(tmp_path, "qwen2", "full", "dpo", max_steps=3)
    run = open_run(tmp_path / "rec" / "trace")
    assert run.header["dataset"][pref.PAIR_ROWS] and any(n >> 32 for e in run.plan for n in e.lens)
    forget = deleted_odd_pairs(run)
    receipt = forget_cli(run.path, forget, tmp_path / "out", "--oracle")
    assert receipt["evidence"]["verified"] is True
    assert "each deleted pair keeps its slot" in receipt["guarantee"] and "normaliser" in receipt["guarantee"]
    assert "not an output of" not in receipt["guarantee"]  # the reference is the run's own starting folder
    cf = counterfactual(tmp_path, recorder, "qwen2", "full", "dpo", forget, max_steps=3)
    assert compare_states(state_of(cf), load_state(tmp_path / "out" / "oracle"))["identical"]


@pytest.mark.slow  # a recording, a forget with its oracle and a counterfactual (~25 s of CPU)
def test_dpo_gqa_sdpa_the_older_prompt_only_dummy_is_not_the_counterfactual(tmp_path, monkeypatch):
    """The power of the comparison above: on the same data, a run recorded with the older prompt-only dummy (as long
    as the pair's longer row in both rows; runs recorded before dataset.pair_rows) is VERIFIED, replay == oracle, but
    its oracle is not the plain DPOTrainer counterfactual: the microbatch lost its only padded row, and with GQA and
    SDPA the other pair's gradient changed in the last bits."""
    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace import preference as pref
    from hf_unlearn.trace.verification import load_state

    from .test_trace_sft import state_of

    monkeypatch.setattr(pref.PreferenceTraceMixin, "_pair_rows_recorded", lambda self: False)
    recorder = record(tmp_path, "qwen2", "full", "dpo", max_steps=3)
    monkeypatch.undo()
    run = open_run(tmp_path / "rec" / "trace")
    assert not run.header["dataset"][pref.PAIR_ROWS]
    forget = deleted_odd_pairs(run)
    receipt = forget_cli(run.path, forget, tmp_path / "out", "--oracle")
    assert receipt["evidence"]["verified"] is True
    cf = counterfactual(tmp_path, recorder, "qwen2", "full", "dpo", forget, max_steps=3)
    assert not compare_states(state_of(cf), load_state(tmp_path / "out" / "oracle"))["identical"]


def test_the_guarantee_line_names_what_a_dpo_counterfactual_keeps_and_a_reference_from_outside():
    """The receipt's guarantee line of a DPO deletion says the pair keeps its slot and the normaliser; a stage whose
    reference is neither its parent's output nor its own start (ref_model= another model) is named with its root,
    with what the deletion does not change; an SFT-only deletion says nothing of pairs."""
    from types import SimpleNamespace

    from hf_unlearn.deletion.forgetting import EXACT, ForgetReceipt
    from hf_unlearn.deletion.preference_terms import preference_terms

    sft = SimpleNamespace(header={"lineage": {"start_root": "a" * 64}})
    own = SimpleNamespace(header={"lineage": {"start_root": "b" * 64},
                                  "reference_model": {"kind": "initial", "params_root": "b" * 64}})
    other = SimpleNamespace(header={"lineage": {"start_root": "c" * 64},
                                    "reference_model": {"kind": "model", "params_root": "d" * 64}})
    assert preference_terms([sft]) is None
    terms = preference_terms([sft, own, other])
    assert terms == {"stages": [2, 3], "outside_references": [{"stage": 3, "params_root": "d" * 64}]}

    def line(evidence):
        return ForgetReceipt(mode=EXACT, method="exact", source="", output_dir="", request={}, state_hashes={},
                             model_dir="", evidence={"verified": True, **evidence}).guarantee

    text = line({"pipeline": [{}], "preference": terms})
    assert "DPO stage(s) 2, 3: each deleted pair keeps its slot" in text and "(the recorded normaliser)" in text
    assert "the DPO reference model of stage 3 (params root dddddddddddddddd...) is not an output of this pipeline" \
        in text
    assert "keeps its slot" not in line({})


def test_a_replays_own_step_ranges_are_not_taken_for_forget_ids():
    """A replay's card info lists the steps whose fingerprints matched as ranges (``[0, 7]``): a deletion of id 7
    (a DPO run of 8 steps on rows 0..15, deleting at its last step) was refused after the replay and the oracle had
    run ("would carry forget ids at extra.fingerprints_matched.controls[1]"). The replay's own numbers in lists are
    declared as not ids; a 7 anywhere else is still refused."""
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.hub.cards import checked_card_info
    from hf_unlearn.hub.leaks import own_numbers

    counts = {"segments_replayed": 8, "fingerprints_matched": {"state": [0, 1], "controls": [0, 7]}}
    info = {"method": "trace-preserving replay", "hyperparameters": {}, "forget_ids": [7], "extra": counts,
            "citation": "", "paper": "",
            "not_ids": own_numbers(counts, "extra")}
    assert own_numbers(counts, "extra")["extra.fingerprints_matched.controls"] == [0, 7]
    checked_card_info(info)
    with pytest.raises(UnlearnError, match="forget ids"):
        checked_card_info({**info, "extra": {**counts, "note": [7]}})


# ---- the matrix (slow) ----------------------------------------------------------------------------------------------
MATRIX = [c for c in itertools.product(FAMILIES, ADAPTERS, TRAINERS, ATTENTIONS, PRECISIONS)]


@pytest.mark.slow  # 144 configurations, each a recording, a forget with its oracle and a counterfactual (~15 s each)
@pytest.mark.parametrize("family,adapter,kind,attn,precision", MATRIX, ids=["-".join(c) for c in MATRIX])
def test_matrix_forget_oracle_trace_verify_equal_the_counterfactual(tmp_path, family, adapter, kind, attn, precision):
    check_configuration(tmp_path, family, adapter, kind, attn, precision)


# ---- a pipeline whose DPO stage loads its model with other settings than its parent was saved with -----------------
@pytest.mark.slow  # two recordings, a two-stage forget with oracles and a two-stage counterfactual (~45 s of CPU each)
@pytest.mark.parametrize("load", ["eager", "bf16", "fp32_from_bf16"])
def test_a_dpo_stage_loaded_with_other_settings_than_its_parent_deletes_a_stage_1_row_as_the_counterfactual(
        tmp_path, load):
    """Stage 1: a full fine-tune (Trainer, Qwen2 GQA shape, SDPA, fp32; or bf16 weights for ``fp32_from_bf16``)
    saved with save_model; stage 2: DPOTrainer on the model loaded from that folder with attn_implementation="eager"
    (or dtype=torch.bfloat16; or dtype=torch.float32 from the bf16 parent), ref_model=None (TRL loads the reference
    with the policy's settings). The stage keeps its lineage (found by weights: a bf16 load
    is the parent's output cast, recorded as such). A stage-1 deletion replays stage 2 from the new parent, cast as
    recorded, with the new parent as the reference loaded as the recorded reference was (eager, or bf16), not as the
    parent was saved: VERIFIED, `trace verify OUT` agrees, and the final model equals a plain Trainer then a plain
    DPOTrainer chain, each loaded as the user loaded it."""
    from transformers import AutoModelForCausalLM

    from hf_unlearn.cli import main
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.checkpoints import full_model_state, load_checkpoint
    from hf_unlearn.trace.run import list_checkpoints

    from .test_trace_common import labels_masked, recorded_normalisers_trainer
    from .test_trace_sft import state_of

    settings = {"eager": {"attn_implementation": "eager"}, "bf16": {"dtype": torch.bfloat16},
                "fp32_from_bf16": {"dtype": torch.float32}}[load]
    start = torch.bfloat16 if load == "fp32_from_bf16" else torch.float32  # stage 1's weights
    kw = dict(max_steps=3)
    # weights of a trained model's scale (initializer_range 0.3): the reference's attention kernel shows in its
    # per-pair log-probabilities (at 0.02, eager and SDPA differ in the last bit of single tokens only, and the
    # sums over a completion round it away)
    s1 = record(tmp_path / "s1", "qwen2", "full", "trainer", model=real_shape("qwen2", initializer_range=0.3).to(start), **kw)
    s1.save_model(str(tmp_path / "s1" / "rec"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "s1" / "rec", **settings)
    s2 = trainer_for("dpo", True)(model=loaded, args=config_for("dpo", tmp_path / "s2", "fp32", **kw),
                                  train_dataset=data_for("dpo"), processing_class=gpt2(), trace_checkpoint_steps=2,
                                  trace_checkpoint_retention="even")
    s2.train()
    run1, run2 = open_run(tmp_path / "s1" / "rec" / "trace"), open_run(tmp_path / "s2" / "trace")
    ref, lineage = run2.header["reference_model"], run2.header["lineage"]
    assert lineage["parent"]["run_id"] == run1.header["run_id"]  # lineage kept, whatever the dtype
    assert lineage["parent"].get("cast") == {"bf16": "bfloat16", "fp32_from_bf16": "float32"}.get(load)
    assert ref["params_root"] == lineage["start_root"]
    assert ref["attn_implementation"] == ("eager" if load == "eager" else "sdpa")
    forget = run1.ids_at_steps([1])[:1]
    receipt = forget_cli(run2.path, forget, tmp_path / "out", "--oracle")
    assert receipt["evidence"]["verified"] is True and receipt["evidence"]["pipeline"][1]["reference_replaced"]
    assert main(["trace", "verify", str(tmp_path / "out")]) == 0

    cf1 = recorded_normalisers_trainer(run1.path)(
        model=real_shape("qwen2", initializer_range=0.3).to(start), args=config_for("trainer", tmp_path / "cf1", "fp32", **kw),
        train_dataset=labels_masked(data_for("trainer"), forget), **trainer_kwargs("trainer", "qwen2", "full"))
    cf1.train()
    cf1.save_model(str(tmp_path / "cf1"))
    cf2 = trainer_for("dpo", False)(
        model=AutoModelForCausalLM.from_pretrained(tmp_path / "cf1", **settings),
        args=config_for("dpo", tmp_path / "cf2", "fp32", **kw), train_dataset=data_for("dpo"),
        processing_class=gpt2())
    cf2.train()
    want = state_of(cf2)["model"]
    for role in ("replay", "oracle"):
        folder = tmp_path / "out" / "stage-2" / role
        cps = list_checkpoints(folder)
        got = full_model_state(load_checkpoint(cps[max(cps)]))
        assert not [n for n in want if not torch.equal(got[n], want[n])], role
    assert published_weights_equal(cf2, tmp_path / "out" / "model")[0]


# ---- a single LoRA run through publishing and the request service ----------------------------------------------------
@pytest.mark.slow  # a DPO LoRA recording, a published forget with its oracle and two served batches (~60 s of CPU)
def test_a_dpo_lora_run_is_published_merged_and_served_by_the_request_service(tmp_path):
    """trace_recording(DPOTrainer) with peft_config= (the reference is the adapter disabled), SmolLM2's shape:
    `forget --oracle --repo` publishes the merged model to a local Hub and `hub verify` of the download passes; the
    request service serves two batches (the second from the first batch's replay), each a loadable merged model
    whose receipt covers the published folder."""
    from transformers import AutoModelForCausalLM

    from hf_unlearn import forget
    from hf_unlearn.deletion import DeletionLedger
    from hf_unlearn.demo import local_hub
    from hf_unlearn.hub.publish import build_manifest
    from hf_unlearn.trace import open_run

    record(tmp_path, "llama_tied", "lora", "dpo")
    run = open_run(tmp_path / "rec" / "trace")
    assert run.header["reference_model"]["kind"] == "adapter_disabled"
    ids = run.ids_at_steps([3])[:1]
    with local_hub(tmp_path / "hub") as (server, token):
        receipt = forget(run.path, ids, tmp_path / "out", oracle=True, repo="org/lora", endpoint=server.url,
                         token=token, progress=False, log=lambda m: None)
        assert receipt.ok and receipt.evidence["verified"] is True and receipt.published["verify_ok"]
        assert receipt.published["params_root"] == receipt.state_hashes["params_root"]
        _, files = server.store.files("model", "org/lora", "deletion-0001")
        assert "model.safetensors" in files and not any("adapter" in f for f in files)
    # the adapter kept beside it loads as a user loads an adapter (it named the replay's RUN/model, a config without
    # weights: from_pretrained failed) and merges to the published model
    from peft import AutoPeftModelForCausalLM

    merged = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "out" / "adapter").merge_and_unload().state_dict()
    published = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model").state_dict()
    assert merged.keys() == published.keys() and all(torch.equal(merged[n], published[n]) for n in merged)

    ledger = DeletionLedger(run.path, tmp_path / "ledger")
    ledger.add(run.ids_at_steps([1])[:1], received="2026-11-01")
    first = ledger.serve_exact(oracle=True, now="2026-11-02", progress=False, log=lambda m: None)
    ledger.add(run.ids_at_steps([2])[:1], received="2026-11-03")
    second = ledger.serve_exact(oracle=True, now="2026-11-04", progress=False, log=lambda m: None)
    for batch in (first, second):
        r = batch.forget_receipt
        assert r.ok and r.evidence["verified"] is True
        assert r.state_hashes["params_root"] == build_manifest(r.model_dir)["params_root"]
        AutoModelForCausalLM.from_pretrained(r.model_dir)
    assert ledger.served_model() == tmp_path / "ledger" / "batches" / "batch-0002" / "model"


# ---- the real SmolLM2-135M -------------------------------------------------------------------------------------------
@pytest.mark.slow  # the real 135M-parameter model: a recording, forget --oracle and a counterfactual (minutes of CPU)
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_smollm2_135m_lora_forget_oracle_equals_the_counterfactual(tmp_path, kind):
    """SmolLM2-135M-Instruct (de-quantised from the shared GGUF; GQA 9/3 heads, tied embeddings, 49,152 tokens) with
    a LoRA adapter, SFTTrainer or DPOTrainer (adapter-disabled reference), SDPA: `forget --oracle` VERIFIED, and the
    oracle's state and the published merged model equal a plain trainer's counterfactual bit for bit."""
    check_configuration(tmp_path, "smollm2", "lora", kind, max_steps=3)


# ---- a LoRA run recorded data-parallel (DDP, 2 processes) through forget ---------------------------------------------
@pytest.mark.slow  # a recording, a forget with its oracle and a counterfactual (~30 s of CPU)
def test_a_vera_adapter_is_merged_published_and_equal_to_the_counterfactual(tmp_path):
    """VeRA merges like LoRA (``merge_and_unload``): the recorder merged it for its output root, and `forget` then
    refused it before compute as an adapter "which cannot be merged" (a hand-kept list of tuners). One predicate
    decides now: VERIFIED, the merged model published and equal to the plain ``Trainer`` counterfactual."""
    check_configuration(tmp_path, "qwen2", "vera", "trainer")


@pytest.mark.slow  # a recording, a forget with its oracle and a counterfactual (~20 s)
def test_a_pissa_lora_is_merged_published_and_equal_to_the_counterfactual(tmp_path):
    """PiSSA (``init_lora_weights="pissa"``) computes the adapter from an SVD of the base's weights; a replay rebuilt
    the model with uninitialised base weights and ran that SVD on them (``linalg.svd: non-finite values``) in the
    recording's proof or in ``forget``, at random. Rebuilt with PEFT's default initialisation now (a checkpoint holds
    the weights), the deletion is VERIFIED and equal to the counterfactual."""
    check_configuration(tmp_path, "llama_tied", "pissa", "sft")


def test_a_weight_dependent_lora_initialisation_is_not_run_on_a_rebuilt_model(tmp_path, monkeypatch):
    """The rule behind the test above, deterministic: a rebuilt model never runs PiSSA's SVD, and its adapter config
    still says ``pissa`` (what is saved and published names the recorded initialisation)."""
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import LoraLayer

    from hf_unlearn.trace.run_model import model_from_run

    model = get_peft_model(real_shape("llama_tied"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                init_lora_weights="pissa", task_type="CAUSAL_LM"))
    model.base_model.model.config.save_pretrained(tmp_path / "model")
    model.peft_config["default"].save_pretrained(str(tmp_path / "model" / "adapter"))

    def no_svd(*args, **kwargs):
        raise AssertionError("PiSSA's SVD ran on a rebuilt model")

    monkeypatch.setattr(LoraLayer, "pissa_init", no_svd)
    info = {"class": "LlamaForCausalLM", "module": "transformers", "dtype": "float32", "attn_implementation": "sdpa",
            "peft": {"adapter_name": "default"}, "layout": {"buffers": {}}}
    rebuilt = model_from_run(SimpleNamespace(header={"model": info}, path=tmp_path), weights_follow=True)
    assert rebuilt.peft_config["default"].init_lora_weights == "pissa"
    assert set(rebuilt.state_dict()) == set(model.state_dict())


def test_a_lora_bias_on_layers_without_a_bias_is_refused_when_the_trainer_is_built(tmp_path):
    """``lora_bias=True`` on Llama's bias-free projections trained to the end, then the recording's sealing merged the
    adapter to hash the output and PEFT refused (``Impossible to merge LoRA with lora_bias=True``): the run was lost.
    Refused at construction now, naming the setting."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(real_shape("llama_tied"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                lora_bias=True, task_type="CAUSAL_LM"))
    from hf_unlearn.errors import UnlearnError

    with pytest.raises(UnlearnError, match="lora_bias=True on layers without a bias"):
        record(tmp_path, "llama_tied", "full", "trainer", model=model)
    assert not (tmp_path / "rec" / "trace").exists()


def test_dpos_copy_of_a_peft_models_adapter_is_named_with_what_to_do():
    """A ``PeftModel`` given to ``DPOTrainer`` with ``ref_model=None``: trl copies its adapter into a second one named
    ``ref``; the refusal said "record runs with one adapter" to a user who made one. It names trl's copy and the two
    ways out now."""
    from peft import LoraConfig, get_peft_model

    from hf_unlearn.trace.model_info import peft_and_base

    model = get_peft_model(real_shape("llama_tied"), LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    model.add_adapter("ref", LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    why = peft_and_base(model)[0]["why"]
    assert "DPOTrainer copied the PeftModel's adapter into 'ref'" in why and "peft_config=" in why


def test_a_prompt_tuning_adapter_is_refused_when_the_trainer_is_built(tmp_path):
    """Prompt tuning adds virtual tokens, no weight update: the recording trained every step and then crashed in its
    seal (``merge_and_unload`` on the base, a traceback). Refused at construction now, naming what to use."""
    import peft
    from transformers import Trainer, TrainingArguments

    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import trace_recording

    model = peft.get_peft_model(real_shape("qwen2"), peft.PromptTuningConfig(num_virtual_tokens=4,
                                                                              task_type="CAUSAL_LM"))
    with pytest.raises(UnlearnError, match="PROMPT_TUNING adapter adds virtual tokens .* cannot be merged"):
        trace_recording(Trainer)(model=model, args=TrainingArguments(**common_args(tmp_path / "rec")),
                                 train_dataset=qa_rows(), **trainer_kwargs("trainer", "qwen2", "full"))
    assert not (tmp_path / "rec" / "trace").exists()


@pytest.mark.slow  # two processes: a recording, forget with its oracle and a counterfactual, under one launch (~60 s)
def test_a_lora_run_recorded_with_ddp_is_deleted_by_forget_under_its_launch_as_the_counterfactual(tmp_path):
    """`torchrun --nproc_per_node 2` on CPU (gloo): a PEFT LoRA model (GQA Llama) recorded by a data-parallel
    Trainer; `forget(..., oracle=True)` of a late row under the same launch is VERIFIED (both processes replay their
    share from checkpoint 2), the main process publishes the merged model, and the oracle's state and the published
    model equal a plain DDP Trainer's counterfactual (the row's labels -100, the recorded normalisers and seeds) bit
    for bit; the deletion changed the state."""
    from .trace_lora_distributed import launch

    result = launch(tmp_path)
    assert result["world_size"] == 2 and result["peft"] and all(r == [2, 2] for r in result["ranks"])
    assert result["ok"] and result["verified"] is True and result["start_checkpoint"] == 2
    assert result["output"] == "merged adapter"
    assert result["oracle_is_counterfactual"] and result["published_is_counterfactual"]
    assert result["differs_from_recording"]


# ---- a LoRA SFT run interrupted and resumed (resume_from_checkpoint=True), gradient checkpointing, evaluation -------
@pytest.mark.slow  # two recordings (one interrupted and resumed), a proof and two forgets with oracles (~90 s of CPU)
def test_a_resumed_lora_sft_run_is_deleted_verified_as_the_uninterrupted_run(tmp_path):
    """SFTTrainer with peft_config= (LoRA, modules_to_save), gradient checkpointing and evaluation every 3 steps,
    killed after step 5 (of 6) and resumed with resume_from_checkpoint=True (the Trainer's checkpoint-4). The resume
    keeps the guards' fingerprint of step 3 (the first process wrote it with step 4's first entry; it was lost, and
    every deletion of a resumed run ran its replay and oracle, then said NOT VERIFIED): once proven, `forget
    --oracle` of an early row is VERIFIED and its replay equals the same deletion from an uninterrupted recording."""
    from transformers import TrainerCallback

    from hf_unlearn.cli import main
    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace.guards import guard_coverage
    from hf_unlearn.trace.verification import load_state

    class Crash(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                raise KeyboardInterrupt

    rows = sft_rows(n=28)

    def trainer(out, callbacks=()):
        args = config_for("sft", out, "fp32", max_steps=6, save_strategy="steps", save_steps=2,
                          gradient_checkpointing=True, eval_strategy="steps", eval_steps=3)
        return trainer_for("sft", True)(model=real_shape("qwen2"), args=args, train_dataset=rows.select(range(24)),
                                        eval_dataset=rows.select(range(24, 28)), trace_checkpoint_steps=2,
                                        callbacks=list(callbacks), **trainer_kwargs("sft", "qwen2", "lora_mts"))

    with pytest.raises(KeyboardInterrupt):
        trainer(tmp_path / "rec", [Crash()]).train()
    trainer(tmp_path / "rec").train(resume_from_checkpoint=True)
    trainer(tmp_path / "full").train()
    run = open_run(tmp_path / "rec" / "trace")
    assert guard_coverage(run.plan, run.header) is None
    assert main(["trace", "prove", str(run.path), "--no-progress"]) == 0
    forget = run.ids_at_steps([1])[:1]
    receipt = forget_cli(run.path, forget, tmp_path / "out", "--oracle")
    assert receipt["ok"] and receipt["evidence"]["verified"] is True
    forget_cli(tmp_path / "full" / "trace", forget, tmp_path / "out-full", "--oracle")
    assert compare_states(load_state(tmp_path / "out" / "replay"), load_state(tmp_path / "out-full" / "replay"))[
        "identical"]


# ---- a LoRA run that evaluated and kept its best checkpoint (load_best_model_at_end) ---------------------------------
@pytest.mark.slow  # a recording with evaluation and two forgets with oracles (~25 s of CPU)
def test_a_lora_run_that_kept_its_best_checkpoint_deletes_a_row_trained_after_it_verified(tmp_path):
    """Trainer + peft LoRA (Qwen2's shape), evaluation and saving every 2 steps, load_best_model_at_end (the best:
    the first evaluation, at step 2, where the trace kept a checkpoint). A row of step 1 is deleted by replaying to
    the kept step; a row of step 5 was never seen by the kept model: nothing to replay, and VERIFIED (it was NOT
    VERIFIED: the replay's plan, cut at the kept step, lost the recording's fingerprint of step 1, which the
    recording wrote with step 2's first entry)."""
    from peft import get_peft_model
    from transformers import TrainingArguments

    from hf_unlearn.trace import open_run

    tok = gpt2()
    model = get_peft_model(real_shape("qwen2"), lora_config("qwen2", "lora"))
    args = TrainingArguments(**common_args(tmp_path / "rec", max_steps=6, save_strategy="steps", save_steps=2,
                                           eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                                           metric_for_best_model="eval_loss", greater_is_better=True))
    trainer = trainer_for("trainer", True)(model=model, args=args, train_dataset=qa_rows(tok, 24),
                                           eval_dataset=qa_rows(tok, 28).select(range(24, 28)),
                                           trace_checkpoint_steps=2, **trainer_kwargs("trainer", "qwen2", "full"))
    trainer.train()
    run = open_run(tmp_path / "rec" / "trace")
    assert run.header["kept_model"]["step"] == 2
    for step in (1, 5):
        receipt = forget_cli(run.path, run.ids_at_steps([step])[:1], tmp_path / f"out-{step}", "--oracle")
        assert receipt["ok"] and receipt["evidence"]["verified"] is True, receipt["evidence"]["oracle"]["problems"]
