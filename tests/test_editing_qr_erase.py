"""QR-Erase on real transformers models: task matrices from adapters and fine-tunes (Llama, GPT-2 Conv1D), the
edit formula checked through the layers' own forward, localisation, dtypes, refusals, the report and the card."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hf_unlearn.editing.decompositions import cpqr_subspace, erase_update
from hf_unlearn.editing.qr_erase import QREraseConfig, qr_erase
from hf_unlearn.editing.report import EditReport
from hf_unlearn.editing.task_matrices import (
    load_task_matrices,
    target_layers,
    task_matrices_from_adapter,
    task_matrices_from_models,
)
from hf_unlearn.errors import UnlearnError
from hf_unlearn.models import build_tiny_model

VOCAB = 96


def tiny(family="llama", layers=3, hidden=32, seed=0, **kw):
    return build_tiny_model(family, vocab_size=VOCAB, hidden_size=hidden, num_layers=layers, num_heads=2, seed=seed,
                            **kw)


def lora(base, seed, r=4, scale=0.05, **config):
    """A PeftModel of a copy of ``base`` with random (non-zero) LoRA factors, as if trained."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear",
                                                          **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def finetuned(base, seed, scale=0.002):
    """A copy of ``base`` with small random changes in every block layer, as if fully fine-tuned."""
    model = copy.deepcopy(base)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in target_layers(model):
            t.module.weight.add_(torch.randn(t.module.weight.shape, generator=g) * scale)
    return model


def merged_delta(peft_model, base):
    """Per-layer ``out x in`` weight change peft itself writes when merging the adapter (the ground truth)."""
    merged = copy.deepcopy(peft_model).merge_and_unload()
    out = {}
    for t, m in zip(target_layers(base), target_layers(merged)):
        out[t.name] = m.weight().detach() - t.weight().detach()
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_adapter_task_matrices_equal_the_weight_change_peft_merges(family, tmp_path):
    base = tiny(family)
    adapter = lora(base, seed=1)
    truth = merged_delta(adapter, base)
    for source in (adapter, tmp_path / "adapter"):
        if source != adapter:
            adapter.save_pretrained(source)
        tm = load_task_matrices(base, source)
        assert tm.kind == "lora" and set(tm) == set(truth)
        for name, delta in truth.items():
            torch.testing.assert_close(tm[name], delta, atol=1e-6, rtol=1e-5)


def test_rslora_rank_and_alpha_patterns_use_peft_scaling():
    base = tiny("llama", layers=2)
    adapter = lora(base, seed=2, use_rslora=True)
    for name, delta in merged_delta(adapter, base).items():
        torch.testing.assert_close(task_matrices_from_adapter(base, adapter)[name], delta, atol=1e-6, rtol=1e-5)
    patterned = lora(base, seed=3, rank_pattern={"q_proj": 2}, alpha_pattern={"down_proj": 3})
    tm = task_matrices_from_adapter(base, patterned)
    for name, delta in merged_delta(patterned, base).items():
        torch.testing.assert_close(tm[name], delta, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_full_finetune_task_matrices_are_out_by_in_differences(family):
    base = tiny(family)
    ft = finetuned(base, seed=4)
    tm = task_matrices_from_models(base, ft)
    for t, f in zip(target_layers(base), target_layers(ft)):
        expected = (f.module.weight - t.module.weight).detach()
        if family == "gpt2":  # Conv1D stores in x out: the task matrix is its transpose
            assert t.transposed and tm[t.name].shape == expected.T.shape
            expected = expected.T
        torch.testing.assert_close(tm[t.name], expected)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_edit_is_the_formula_and_its_output_change_avoids_the_retain_subspace(family):
    base = tiny(family)
    forget, retain = lora(base, seed=5), lora(base, seed=6)
    t_f, t_r = merged_delta(forget, base), merged_delta(retain, base)
    edited, report = qr_erase(copy.deepcopy(base), forget, retain, rank=2, scale=0.7, progress=False)
    x = torch.randn(5, 7, base.config.hidden_size * 4, generator=torch.Generator().manual_seed(0))
    for t, e in zip(target_layers(base), target_layers(edited)):
        q_f = cpqr_subspace(t_f[t.name], rank=2).basis
        q_r = cpqr_subspace(t_r[t.name], rank=2).basis
        expected = t.weight().detach() - 0.7 * erase_update(t_f[t.name], q_f, q_r)
        torch.testing.assert_close(e.weight().detach(), expected, atol=1e-6, rtol=1e-5)
        # through the layer's own forward (Conv1D computes x @ W): the change of every output is orthogonal to the
        # retain subspace, i.e. the projection acts on the output side on both families
        inputs = x[..., : t.shape[1]]
        change = (e.module(inputs) - t.module(inputs)).detach().reshape(-1, t.shape[0])
        assert change.abs().max() > 1e-4
        assert (change @ q_r).abs().max() < 1e-5 * change.abs().max() * t.shape[0]
    assert report.changed_tensors == len(target_layers(base)) and report.selection == "all"
    assert all(e.retain_leak < 1e-5 and e.forget_rank == 2 and e.retain_rank == 2 for e in report.layers)


def blockwise(base, big_block, factor=10.0):
    """Dense task matrices whose energy sits in one block."""
    g = torch.Generator().manual_seed(7)
    return {t.name: torch.randn(t.shape, generator=g) * (factor if t.block == big_block else 1.0)
            for t in target_layers(base)}


def test_localisation_edits_only_the_high_energy_blocks():
    base = tiny("llama", layers=4)
    tm = blockwise(base, big_block=2)
    edited, report = qr_erase(copy.deepcopy(base), tm, rank=3, localize=True, progress=False)
    assert report.selected_blocks == [2] and report.block_energies[2] > 0.25
    assert abs(sum(report.block_energies) - 1) < 1e-9
    for t, e in zip(target_layers(base), target_layers(edited)):
        assert torch.equal(t.module.weight, e.module.weight) == (t.block != 2)
    assert {e.block for e in report.layers} == {2} and report.changed_tensors == 7
    _, top = qr_erase(copy.deepcopy(base), tm, rank=3, top_k_layers=2, progress=False)
    assert len(top.selected_blocks) == 2 and 2 in top.selected_blocks
    _, given = qr_erase(copy.deepcopy(base), tm, rank=3, layers=[0, 3], progress=False, compare_subspaces=False)
    assert given.selected_blocks == [0, 3] and given.selection == "given"
    _, only = qr_erase(copy.deepcopy(base), tm, rank=3, target_modules=["q_proj", "v_proj"], progress=False)
    assert {e.name.rsplit(".", 1)[-1] for e in only.layers} == {"q_proj", "v_proj"}


@pytest.mark.parametrize("method,refs", [("qr", {"svd"}), ("svd", {"qr"}), ("qr-truncated", {"qr", "svd"})])
def test_every_method_reports_its_time_and_angles_to_the_others(method, refs):
    base = tiny("gpt2", layers=2)
    # low-rank task matrices (a LoRA adapter of rank 4): every method finds the same rank-4 column space
    edited, report = qr_erase(copy.deepcopy(base), lora(base, seed=8), method=method, rank=4, progress=False)
    for e in report.layers:
        assert set(e.seconds) == {method, *refs} and set(e.angles) == refs
        assert all(a["max"] < 0.5 for a in e.angles.values())  # degrees
    no_compare = qr_erase(copy.deepcopy(base), lora(base, seed=8), method=method, rank=4, progress=False,
                          compare_subspaces=False)[1]
    assert all(set(e.seconds) == {method} for e in no_compare.layers) and no_compare.seconds_comparison == 0
    assert report.edited_params_root == no_compare.edited_params_root  # comparisons never touch the weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_weights_are_edited_from_float32_decompositions(dtype):
    base = tiny("llama", layers=2)
    tm = blockwise(base, big_block=0, factor=0.01)
    ref_model, ref = qr_erase(copy.deepcopy(base), tm, rank=3, progress=False)
    half_model, half = qr_erase(copy.deepcopy(base).to(dtype), tm, rank=3, progress=False)
    for a, b in zip(target_layers(ref_model), target_layers(half_model)):
        assert b.module.weight.dtype == dtype
        torch.testing.assert_close(b.module.weight.float(), a.module.weight.to(dtype).float(), atol=2e-2, rtol=2e-2)


def test_refusals_before_any_decomposition(monkeypatch):
    import hf_unlearn.editing.qr_erase as qe

    base = tiny("llama")

    def boom(*a, **k):
        raise AssertionError("a decomposition ran before the input was checked")

    monkeypatch.setattr(qe, "decompose", boom)
    cases = [
        (lambda: qr_erase(base, lora(base, 1), rank=33, progress=False), "larger than"),  # 32 x 32 layers
        (lambda: qr_erase(base, tiny("gpt2"), progress=False), "architecture"),
        (lambda: qr_erase(base, tiny("llama", intermediate_size=64), progress=False), "shape"),
        (lambda: qr_erase(base, tiny("llama", seed=3), progress=False), "does not look like a fine-tune"),
        (lambda: qr_erase(base, copy.deepcopy(base), progress=False), "all zero"),
        (lambda: qr_erase(base, lora(tiny("llama", hidden=48), 1), progress=False), "update but"),
        (lambda: qr_erase(base, lora(tiny("gpt2"), 1), progress=False), "does not have"),
        (lambda: qr_erase(base, lora(base, 1), layers=[5], progress=False), "out of range"),
        (lambda: qr_erase(base, lora(base, 1), localize=True, layers=[1]), "pick one"),
        (lambda: qr_erase(base, lora(base, 1), method="lu"), "unknown method"),
        (lambda: qr_erase(base, lora(base, 1), scale=0.0), "scale"),
        (lambda: qr_erase(base, lora(base, 1), target_modules=["c_attn"]), "no layer matches"),
        (lambda: qr_erase(lora(base, 1), lora(base, 2)), "PeftModel"),
        (lambda: qr_erase(base, {"lm_head": torch.zeros(VOCAB, 32)}), "does not have"),
        (lambda: qr_erase(base, 42), "cannot read task matrices"),
    ]
    for call, message in cases:
        with pytest.raises(UnlearnError, match=message):
            call()


def test_adapters_that_are_not_plain_lora_on_block_layers_are_refused(tmp_path):
    from peft import LoraConfig, get_peft_model

    base = tiny("llama")
    head_only = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(UnlearnError, match="does not have"):
        task_matrices_from_adapter(base, head_only)
    dora = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(UnlearnError, match="DoRA"):
        task_matrices_from_adapter(base, dora)
    saving = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with pytest.raises(UnlearnError, match="modules_to_save"):
        task_matrices_from_adapter(base, saving)
    with pytest.raises(UnlearnError, match="not a PEFT adapter"):
        task_matrices_from_adapter(base, tmp_path)


def test_retain_adapter_on_fewer_layers_projects_only_where_it_exists():
    from peft import LoraConfig, get_peft_model

    base = tiny("llama", layers=2)
    retain = get_peft_model(copy.deepcopy(base), LoraConfig(r=2, target_modules=["q_proj"]))
    with torch.no_grad():
        for n, p in retain.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    _, report = qr_erase(copy.deepcopy(base), lora(base, 1), retain, rank=2, progress=False)
    assert {e.name.rsplit(".", 1)[-1] for e in report.layers if e.retain_rank} == {"q_proj"}
    assert len(report.layers) == 14


def test_report_files_card_and_raw_ids(tmp_path):
    from hf_unlearn.hub.cards import render_model_card

    base = tiny("llama", layers=4)
    forget_ids = [1, 3, 17]  # they collide with block indices and ranks on purpose (2 would hit "apache-2.0")
    _, report = qr_erase(copy.deepcopy(base), blockwise(base, 1), lora(base, 2), rank=3, localize=True,
                         forget_ids=forget_ids, progress=False)
    paths = report.save(tmp_path)
    assert {p.name for p in paths.values()} == {"edit_report.json", "edit_report.md", "layer_energies.png"}
    data = json.loads(paths["json"].read_text())
    assert "forget_ids" not in data and data["num_forget"] == 3
    again = EditReport.from_json(paths["json"])
    assert again.selected_blocks == report.selected_blocks and again.layers[0] == report.layers[0]
    assert "| 1 |" in paths["markdown"].read_text()
    info = report.unlearning_card_info()
    assert info["method"] == "QR-Erase" and info["forget_ids"] == forget_ids
    assert "block_1" in info["extra"]["blocks_edited"] and info["hyperparameters"]["rank"] == 3
    card = render_model_card(info, key=b"k" * 32, repo_id="org/edited")  # refuses raw ids; must not refuse here
    assert "QR-Erase" in card and "qr_erase" not in card.split("---")[1]
    assert report.base_params_root in card or report.edited_params_root in json.dumps(info)
    leaked = dict(info, hyperparameters={**info["hyperparameters"], "deleted_rows": forget_ids})
    with pytest.raises(UnlearnError, match="forget ids"):
        render_model_card(leaked, key=b"k" * 32)
    # the editor declares its own numbers (rank 3, block_1, ...) by exact value: another id in those fields, or an
    # id in the user's module names, is still refused
    assert info["not_ids"]["hyperparameters.rank"] == [3]
    for smuggled in (dict(info, hyperparameters={**info["hyperparameters"], "rank": 17}),
                     dict(info, hyperparameters={**info["hyperparameters"], "target_modules": ["q_proj", "17"]}),
                     dict(info, extra={**info["extra"], "num_blocks": 17})):
        with pytest.raises(UnlearnError, match="forget ids"):
            render_model_card(smuggled, key=b"k" * 32)
    with pytest.raises(UnlearnError, match="not an hf_unlearn edit report"):
        (tmp_path / "x.json").write_text("{}")
        EditReport.from_json(tmp_path / "x.json")


def test_config_defaults_and_mutual_exclusions():
    assert QREraseConfig().rank == 16 and QREraseConfig(energy=0.9).rank is None
    assert QREraseConfig(layers=[3, 1, 3]).layers == [1, 3]
    assert QREraseConfig(retain_energy=0.5).retain_rule() == (None, 0.5)
    with pytest.raises(UnlearnError):
        QREraseConfig(rank=4, energy=0.5)
    with pytest.raises(UnlearnError):
        QREraseConfig(top_k_layers=0)
    with pytest.raises(UnlearnError):
        qr_erase(tiny(), {}, config=QREraseConfig(), rank=3)
