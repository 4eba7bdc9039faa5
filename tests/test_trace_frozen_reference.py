"""A LoRA (any partly frozen) recording references its frozen tensors where the base was loaded from, by default:
a local folder, the Hugging Face cache, or the GGUF file load_model de-quantised. File, revision and SHA-256 are
recorded, checked on every load, and a moved or changed base is refused in one line. Only what there is nothing to
reference for (a model built from a config) is stored in the run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hf_unlearn.errors import UnlearnError

from .conftest import SMOLLM2_DIR
from .test_trace_common import delete, get_trace_data, ids_at_step, record, tiny

LORA = {"r": 2, "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}


def lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(**LORA))


def frozen_record(run: Path) -> dict:
    return json.loads((run / "checkpoints" / "frozen" / "hashes.json").read_text())


def stored_frozen_tensors(run: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(run / "checkpoints" / "frozen" / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory):
    """A LoRA recording (8 steps) on a base loaded with from_pretrained from a local folder, no option passed."""
    from transformers import AutoModelForCausalLM

    tok, data = get_trace_data()
    work = tmp_path_factory.mktemp("frozen_ref")
    tiny(tok).save_pretrained(work / "base")
    model = lora(AutoModelForCausalLM.from_pretrained(work / "base"))
    record(tok, data, work / "rec", model=model)
    return work / "rec" / "trace", work / "base"


def test_a_lora_recording_references_its_base_by_default_and_stores_no_frozen_bytes(folder_run):
    run, base = folder_run
    rec = frozen_record(run)
    assert rec["params"] and set(rec["source"]["tensors"]) == set(rec["params"])  # every frozen tensor referenced
    assert stored_frozen_tensors(run) == []  # none copied into the run
    source = rec["source"]
    assert source["kind"] == "safetensors" and Path(source["path"]) == base.resolve()
    import hashlib

    digest = hashlib.sha256((base / "model.safetensors").read_bytes()).hexdigest()
    assert source["files"] == {"model.safetensors": {"size": (base / "model.safetensors").stat().st_size,
                                                     "sha256": digest}}
    frozen_bytes = (base / "model.safetensors").stat().st_size
    assert sum(f.stat().st_size for f in run.rglob("*") if f.is_file()) < frozen_bytes  # the run: the LoRA only


def test_the_referenced_run_replays_bit_for_bit(folder_run, tmp_path):
    run, _ = folder_run
    _, report = delete(run, ids_at_step(run, 6)[:2], tmp_path)
    assert report["verified"], report


def test_a_moved_or_changed_base_is_refused_in_one_line(folder_run, tmp_path):
    from hf_unlearn.trace.checkpoints import load_checkpoint

    run, base = folder_run
    step = sorted((run / "checkpoints").glob("step-*"))[-1]
    moved = base.with_name("base-moved")
    base.rename(moved)
    try:
        with pytest.raises(UnlearnError, match=r"model\.safetensors is missing: the run references its frozen base"):
            load_checkpoint(step)
        # forget refuses before any compute (it redacted the store and probed the environment first)
        from hf_unlearn import forget

        lines = []
        with pytest.raises(UnlearnError, match=r"model\.safetensors is missing: the run references its frozen base"):
            forget(run, ids_at_step(run, 1)[:1], tmp_path / "out", oracle=True, progress=False, log=lines.append)
        assert not lines and not (tmp_path / "out").exists(), lines
    finally:
        moved.rename(base)
    saved = base / "model.safetensors.orig"
    shutil.copy2(base / "model.safetensors", saved)
    try:
        data = bytearray((base / "model.safetensors").read_bytes())
        data[-1] ^= 1  # one bit of one frozen tensor
        (base / "model.safetensors").write_bytes(bytes(data))
        with pytest.raises(UnlearnError, match="has changed since the run was recorded") as e:
            load_checkpoint(step)
        assert "\n" not in str(e.value)
    finally:
        shutil.move(saved, base / "model.safetensors")
    assert load_checkpoint(step)["model"]  # restored: loads again


def test_a_model_built_from_a_config_stores_its_frozen_tensors(tmp_path):
    tok, data = get_trace_data()
    record(tok, data, tmp_path / "rec", model=lora(tiny(tok)), max_steps=2)
    run = tmp_path / "rec" / "trace"
    rec = frozen_record(run)
    assert "source" not in rec and sorted(stored_frozen_tensors(run)) == sorted(rec["params"])


def test_a_frozen_tensor_changed_after_loading_is_stored_not_referenced(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    tok, data = get_trace_data()
    tiny(tok).save_pretrained(tmp_path / "base")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with torch.no_grad():
        loaded.model.layers[0].mlp.up_proj.weight.mul_(0.5)  # no longer what the folder holds
    record(tok, data, tmp_path / "rec", model=lora(loaded), max_steps=2)
    run = tmp_path / "rec" / "trace"
    assert stored_frozen_tensors(run) == ["base_model.model.model.layers.0.mlp.up_proj.weight"]
    assert len(frozen_record(run)["source"]["tensors"]) == len(frozen_record(run)["params"]) - 1


def test_a_base_loaded_in_another_dtype_than_its_files_stores_its_frozen_tensors(tmp_path):
    """A bf16 folder (as SmolLM2's and most Hub snapshots are saved) loaded with dtype=torch.float32 for LoRA: every
    value casts exactly, and the match compared values only, so every frozen tensor was referenced in the bf16 file
    while the checkpoints hashed fp32 tensors; the self-check failed ("modified after it was saved") and no deletion
    of the run could load a checkpoint. The dtype is compared too: the tensors are stored, and the run replays."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_unlearn.trace.checkpoints import load_checkpoint

    tok, data = get_trace_data()
    tiny(tok).to(torch.bfloat16).save_pretrained(tmp_path / "base")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    record(tok, data, tmp_path / "rec", model=lora(loaded), max_steps=2)
    run = tmp_path / "rec" / "trace"
    assert "source" not in frozen_record(run) and sorted(stored_frozen_tensors(run)) == sorted(
        frozen_record(run)["params"])
    assert load_checkpoint(sorted((run / "checkpoints").glob("step-*"))[-1])["model"]
    fidelity = json.loads((run / "header.json").read_text())["fidelity"]
    assert fidelity["recording"].get("reproduced") is True, fidelity["recording"]


@pytest.mark.slow  # SmolLM2-135M de-quantised twice and trained two steps: minutes on 2 cores (`pytest -m slow`)
@pytest.mark.skipif(not any(SMOLLM2_DIR.glob("*.gguf")), reason=f"no GGUF file in {SMOLLM2_DIR}")
def test_a_gguf_base_is_referenced_by_the_file_and_its_deterministic_dequantisation(tmp_path):
    """A base de-quantised from GGUF: the run references the .gguf (its SHA-256); loading a checkpoint
    de-quantises it again and the tensors' recorded hashes hold (de-quantisation is deterministic)."""
    from hf_unlearn import load_model, load_tokenizer, tokenize_qa
    from hf_unlearn.data import QACollator
    from hf_unlearn.data.embedded import load_embedded_tofu
    from hf_unlearn.trace import TraceRecordingTrainer
    from hf_unlearn.trace.checkpoints import verify_checkpoint_files

    from .test_trace_common import train_args

    tok = load_tokenizer(SMOLLM2_DIR)
    model = lora(load_model(SMOLLM2_DIR))
    data = tokenize_qa(load_embedded_tofu().select(range(8)), tok, max_length=96)
    TraceRecordingTrainer(model=model, args=train_args(tmp_path / "rec", max_steps=2, per_device_train_batch_size=2),
                          train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
                          trace_checkpoint_steps=1, trace_self_check=False).train()
    run = tmp_path / "rec" / "trace"
    rec = frozen_record(run)
    assert rec["source"]["kind"] == "gguf" and set(rec["source"]["files"]) == {next(SMOLLM2_DIR.glob("*.gguf")).name}
    assert set(rec["source"]["tensors"]) == set(rec["params"]) and stored_frozen_tensors(run) == []
    from hf_unlearn.trace import base_source

    base_source._LIVE.clear()  # the recording process's own tensors: forgotten, so the file is de-quantised again
    base_source._dequantized.cache_clear()
    for step in sorted((run / "checkpoints").glob("step-*")):
        verify_checkpoint_files(step)  # every frozen tensor de-quantised again, hash for hash
    changed = tmp_path / "changed.gguf"  # the same check refuses another file in its place
    shutil.copy(rec["source"]["path"] + "/" + next(iter(rec["source"]["files"])), changed)
    with open(changed, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    rec["source"]["path"] = str(tmp_path)
    rec["source"]["files"] = {"changed.gguf": rec["source"]["files"][next(iter(rec["source"]["files"]))]}
    with pytest.raises(UnlearnError, match="changed.gguf has changed since the run was recorded"):
        base_source.check_files(rec["source"])


def test_only_a_folder_from_pretrained_reads_counts_as_the_weights_source(tmp_path):
    """A run's ``model/`` holds a config and ``buffers.safetensors``: a model whose ``_name_or_path`` points there was
    not loaded from weights in it, so nothing is referenced (a reference would bind a file that holds no weights)."""
    import torch
    from safetensors.torch import save_file

    from hf_unlearn.trace.base_source import loaded_from

    model = tiny(get_trace_data()[0])
    buffers_only = tmp_path / "model"
    buffers_only.mkdir()
    save_file({"rotary": torch.zeros(2)}, str(buffers_only / "buffers.safetensors"))
    model.config._name_or_path = str(buffers_only)
    assert loaded_from(model) is None
    model.save_pretrained(tmp_path / "weights")
    model.config._name_or_path = str(tmp_path / "weights")
    assert loaded_from(model) == {"kind": "safetensors", "path": str((tmp_path / "weights").resolve()), "revision": None}


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_base_as_qlora_loads_it_is_refused_before_training(tmp_path, bits):
    """QLoRA: the base loaded with ``BitsAndBytesConfig(load_in_4bit=True)``, LoRA on it. The recording trained, then
    its self-check's replay (which rebuilds the base from its files, unquantized) crashed loading the quantized state
    with a multi-page traceback. Refused when the recording is built, one line naming the quantization and what to
    load instead; nothing written."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes (the eval extra)")
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tok, data = get_trace_data()
    tiny(tok).save_pretrained(tmp_path / "base")
    quant = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
             if bits == 4 else BitsAndBytesConfig(load_in_8bit=True))
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quant, device_map="cpu")
    with pytest.raises(UnlearnError) as e:
        record(tok, data, tmp_path / "rec", model=lora(base), max_steps=2)
    text = str(e.value)
    assert "\n" not in text and f"loaded quantized (bitsandbytes {bits}-bit, as QLoRA does)" in text, text
    assert "load the base in bf16 or fp32" in text
    assert not (tmp_path / "rec" / "trace" / "header.json").exists()
