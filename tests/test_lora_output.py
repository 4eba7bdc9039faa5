"""A LoRA run's deletion output beyond its merged model: `trace verify OUT` checks `OUT/adapter` (tensors and the
config fields that change numbers) against the replayed state, and `hub verify --expect-from` takes a LoRA run's
replay (the published model is the merged one)."""

from __future__ import annotations

import json
import shutil

import pytest

from .test_real_configs import check_configuration


@pytest.fixture(scope="module")
def lora_out(tmp_path_factory):
    """A LoRA SFTTrainer run (SmolLM2's shape) and `forget --oracle` of a row of an early and of a late step,
    checked against a plain SFTTrainer counterfactual (:func:`check_configuration`): ``(run path, OUT)``."""
    tmp = tmp_path_factory.mktemp("lora-out")
    check_configuration(tmp, "llama_tied", "lora", "sft")
    return tmp / "rec" / "trace", tmp / "out"


def test_forget_cli_on_a_gqa_lora_sftrainer_run_publishes_the_merged_counterfactual(lora_out):
    """SmolLM2's shape (Llama, GQA, tied embeddings, the GPT-2 vocabulary), trace_recording(SFTTrainer) with
    peft_config= LoRA, SDPA: `hf-unlearn forget --oracle` writes the merged model (loadable without peft), the
    adapter beside it and a VERIFIED receipt whose state hashes are the published folder's; the merged model and
    the oracle's state equal a plain SFTTrainer counterfactual bit for bit (the fixture)."""
    from transformers import AutoModelForCausalLM

    from hf_unlearn.hub.publish import build_manifest

    _, out = lora_out
    receipt = json.loads((out / "receipt.json").read_text())
    assert "the published model is the replayed adapter merged into its base" in receipt["guarantee"]
    assert receipt["state_hashes"]["params_root"] == build_manifest(out / "model")["params_root"]
    assert receipt["state_hashes"]["trace_params_root"] != receipt["state_hashes"]["params_root"]  # adapter + base
    info = json.loads((out / "model" / "unlearning_info.json").read_text())
    assert info["extra"]["exact_deletion"]["params_root"] == receipt["state_hashes"]["params_root"]
    loaded = AutoModelForCausalLM.from_pretrained(out / "model")
    assert not any("lora" in n for n in loaded.state_dict())


def _verify(out, capsys) -> tuple[int, str]:
    from hf_unlearn.cli import main

    capsys.readouterr()
    rc = main(["trace", "verify", str(out)])
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_trace_verify_refuses_a_tampered_adapter_naming_what_differs(lora_out, tmp_path, capsys):
    """`trace verify OUT` said VERIFIED with OUT/adapter's weight changed by 1e-3, its lora_alpha doubled or its base
    renamed, though the docs say the adapter merged equals OUT/model; each is NOT VERIFIED now, naming the file and
    the field or tensor. A target_modules list saved in another order (PEFT writes a set) still verifies."""
    import torch
    from safetensors.torch import load_file, save_file

    _, out = lora_out
    rc, text = _verify(out, capsys)
    assert rc == 0 and "VERIFIED" in text, text

    weights = tmp_path / "w"
    shutil.copytree(out, weights, symlinks=True)
    path = weights / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, str(path), metadata={"format": "pt"})
    rc, text = _verify(weights, capsys)
    assert rc == 1 and "adapter_model.safetensors differs from the replayed adapter in 1 tensor(s)" in text, text
    assert name in text

    for field, value in (("lora_alpha", 1234), ("base_model_name_or_path", "org/another-base"), ("r", 64)):
        edited = tmp_path / field
        shutil.copytree(out, edited, symlinks=True)
        config_path = edited / "adapter" / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config[field] = value
        config_path.write_text(json.dumps(config))
        rc, text = _verify(edited, capsys)
        assert rc == 1 and f"adapter_config.json differs from the replayed adapter's in {field}" in text, (field, text)

    reordered = tmp_path / "reordered"
    shutil.copytree(out, reordered, symlinks=True)
    config_path = reordered / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    assert isinstance(config["target_modules"], list) and len(config["target_modules"]) > 1
    config["target_modules"] = list(reversed(config["target_modules"]))
    config_path.write_text(json.dumps(config))
    rc, text = _verify(reordered, capsys)
    assert rc == 0, text
    assert torch.equal(load_file(str(out / "adapter" / "adapter_model.safetensors"))[name],
                       load_file(str(reordered / "adapter" / "adapter_model.safetensors"))[name])


def test_expect_from_a_lora_runs_replay_is_the_published_merged_root(lora_out, tmp_path):
    """`hub verify --expect-from OUT/replay` took the replay's own root (adapter and base) while a LoRA deletion
    publishes the merged model, so every honest LoRA publication checked that way FAILED; the expected root is the
    merged one now, from the deletion log and from the sealed verification record alike. A log edited to another
    root is refused (the run's integrity check), never turned into an expected root."""
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.hub.publish import build_manifest
    from hf_unlearn.hub.verify import expected_from

    _, out = lora_out
    published = build_manifest(out / "model")["params_root"]
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["state_hashes"]["params_root"] == published != receipt["state_hashes"]["trace_params_root"]
    assert expected_from(out / "replay", "org/lora")["expect_root"] == published
    assert expected_from(out / "replay" / "deletion_log.jsonl", "org/lora")["expect_root"] == published
    if (out / "replay" / "verification.json").is_file():
        assert expected_from(out / "replay" / "verification.json", "org/lora")["expect_root"] == published
    edited = tmp_path / "replay"
    shutil.copytree(out / "replay", edited, symlinks=True)
    log = edited / "deletion_log.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    entries[-1]["params_root"] = "0" * 64
    log.write_text("".join(json.dumps(e) + "\n" for e in entries))
    with pytest.raises(UnlearnError, match="refusing to use it: deletion_log.jsonl does not match|not the final state"):
        expected_from(log, "org/lora")


@pytest.mark.slow  # (the default suite stays under 15 minutes on 2 cores; `make test-slow`)
def test_the_adapter_names_the_dtype_its_base_loads_in(lora_out):
    """Merged into a base loaded in another dtype than the run trained it in (from_pretrained's float32 for a base
    trained in bfloat16), the adapter is not OUT/model: its README and the receipt name the recorded dtype."""
    _, out = lora_out
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["evidence"]["output"]["base_dtype"] == "float32"
    readme = (out / "adapter" / "README.md").read_text()
    assert "## Load the base in the dtype it trained in" in readme and "dtype=torch.float32" in readme

