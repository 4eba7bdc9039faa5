"""``hf-unlearn forget RUN --oracle`` end to end on every architecture the tests build, tied and untied heads (issue
#31): GPT-NeoX saves its untied ``lm_head`` as ``embed_out``, which made the receipt's internal check refuse every
Pythia deletion after printing VERIFIED."""

from __future__ import annotations

import json

import pytest
import torch

from .test_trace_common import config_model, get_trace_data, record


def _model(name: str, tok, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_unlearn.models import build_tiny_model

    if name in ("llama", "gpt2", "gpt_neox"):
        torch.manual_seed(0)
        return build_tiny_model(name, tok, hidden_size=32, num_layers=2, num_heads=2)
    if name == "pythia-from_pretrained":  # a Pythia-style checkpoint on disk (embed_out.weight), loaded as users do
        config_model("gpt_neox", tok, rotary_pct=0.25, use_parallel_residual=True,
                     tie_word_embeddings=False).save_pretrained(tmp_path / "pythia")
        return AutoModelForCausalLM.from_pretrained(tmp_path / "pythia")
    family, overrides = {"gpt_neox-tied": ("gpt_neox", {"tie_word_embeddings": True}), "mistral": ("mistral", {}),
                         "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}),
                         "gemma3": ("gemma3", {"head_dim": 16, "sliding_window": 8}),
                         # fused expert tensors, saved split per expert (transformers' weight conversion)
                         "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
                         "qwen2_moe": ("qwen2_moe", {"num_experts": 4, "num_experts_per_tok": 2,
                                                     "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32})
                         }[name]
    return config_model(family, tok, **overrides)


FAST = ["gpt_neox", "pythia-from_pretrained", "llama", "mixtral"]
SLOW = ["gpt_neox-tied", "gpt2", "mistral", "qwen2-untied", "gemma3", "qwen2_moe"]


@pytest.mark.parametrize("name", FAST + [pytest.param(n, marks=pytest.mark.slow) for n in SLOW])
def test_cli_forget_saves_the_verified_state_on_every_architecture(tmp_path, name, capsys):
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.hub.publish import build_manifest
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    tok, data = get_trace_data()
    moe = name in ("mixtral", "qwen2_moe")  # one sample per microbatch: several would share an expert's gradient sum
    record(tok, data.select(range(8)), tmp_path / "rec", model=_model(name, tok, tmp_path), every=1, max_steps=2,
           **(dict(per_device_train_batch_size=1, gradient_accumulation_steps=4) if moe else
              dict(gradient_accumulation_steps=1)))
    run = tmp_path / "rec" / "trace"
    write_ids(tmp_path / "ids.jsonl", open_run(run).ids_at_steps([1])[:1])
    code = main(["forget", str(run), "--ids", str(tmp_path / "ids.jsonl"), "--out", str(tmp_path / "out"), "--oracle",
                 "--no-progress"])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    assert "VERIFIED bit-identical" in out.out
    receipt = json.loads((tmp_path / "out" / "receipt.json").read_text())
    assert receipt["ok"] and receipt["evidence"]["verified"] is True
    # what from_pretrained loads from OUT/model is the replayed state, tensor for tensor, under the model's own names
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "model").state_dict()
    replayed = load_checkpoint(open_run(tmp_path / "out" / "replay").final_checkpoint())
    state = {**replayed["model"], **{dup: replayed["model"][src] for dup, src in replayed.get("tied", {}).items()}}
    assert set(loaded) == set(state)
    assert all(torch.equal(loaded[n], state[n]) for n in state)
    manifest = build_manifest(tmp_path / "out" / "model")
    assert receipt["state_hashes"]["trace_params_root"] in (manifest["params_root"], manifest["state_dict_root"])
    if name.startswith(("gpt_neox", "pythia")) and "tied" not in name:
        assert manifest["renamed"] == {"embed_out.weight": "lm_head.weight"}  # saved under the checkpoint name
    if name in ("mixtral", "qwen2_moe"):  # the fused experts saved one tensor per expert, hashed as loaded
        assert any(".experts.gate_up_proj" in n for n in manifest["converted"]["held"])
        assert receipt["state_hashes"]["trace_params_root"] == manifest["state_dict_root"]


def test_hub_verify_loads_a_renamed_head_without_a_problem(tmp_path):
    """The published manifest of a GPT-NeoX model names embed_out.weight; loading gives lm_head.weight: the load
    check maps the name and still checks the bytes (through the state-dict root)."""
    from hf_unlearn.hub.publish import build_manifest
    from hf_unlearn.hub.verify import VerifyReport, _check_loads

    tok, _ = get_trace_data()
    model = _model("gpt_neox", tok, tmp_path)
    model.save_pretrained(tmp_path / "m")
    manifest = build_manifest(tmp_path / "m")
    report = VerifyReport(source=str(tmp_path / "m"))
    _check_loads(tmp_path / "m", manifest, report)
    assert report.problems == [] and report.state_dict_root == manifest["state_dict_root"]
    forged = {**manifest, "state_dict_root": "0" * 64}
    report = VerifyReport(source=str(tmp_path / "m"))
    _check_loads(tmp_path / "m", forged, report)
    assert any("state-dict root" in p for p in report.problems)  # one name per root (hub.publish.ROOT_NAMES)


def test_hub_verify_loads_split_experts_and_sees_one_expert_edited(tmp_path):
    """A Mixtral model holds each layer's experts fused (``experts.gate_up_proj``) and saves them one tensor per
    expert: the manifest's state-dict root is the model's own state (what a trace hashes), the load check passes,
    and one expert's saved weight edited is named by the saved-tensor hash and the state-dict root."""
    from safetensors.torch import load_file, save_file

    from hf_unlearn.hub.publish import build_manifest
    from hf_unlearn.hub.verify import VerifyReport, _check_loads
    from hf_unlearn.trace.hashing import state_hashes

    tok, _ = get_trace_data()
    model = _model("mixtral", tok, tmp_path)
    model.save_pretrained(tmp_path / "m")
    manifest = build_manifest(tmp_path / "m")
    assert manifest["state_dict_root"] == state_hashes(model).params_root
    saved = manifest["converted"]["saved"]
    assert saved and all(n in manifest["params"] for n in saved) and all("experts.gate_up_proj" not in n
                                                                          for n in manifest["params"])
    report = VerifyReport(source=str(tmp_path / "m"))
    _check_loads(tmp_path / "m", manifest, report)
    assert report.problems == [] and report.state_dict_root == manifest["state_dict_root"]
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(path)
    name = next(n for n in saved if n.endswith("experts.1.w3.weight"))
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] += 1.0
    save_file(tensors, path, metadata={"format": "pt"})
    report = VerifyReport(source=str(tmp_path / "m"))
    _check_loads(tmp_path / "m", manifest, report)
    assert any("state-dict root" in p for p in report.problems), report.problems
