"""`hf-unlearn edit task-matrices` and `hf-unlearn edit qr-erase` as a user runs them, then `hub push/verify`."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_unlearn.cli import main

from .conftest import TOFU_DIR, mentions, run_cli


def one_line_error(stderr: str, message: str) -> bool:
    """The CLI's error is one line naming the problem (progress bars of model loading may precede it)."""
    last = stderr.strip().splitlines()[-1]
    return last.startswith("hf-unlearn: error:") and message in last and "Traceback" not in stderr


@pytest.fixture(scope="module")
def task_folder(tmp_path_factory, tiny_llama_dir):
    """LoRA task matrices of the tiny Llama from 4 forget01 rows and 8 retain99 rows (the CLI, in-process)."""
    out = tmp_path_factory.mktemp("tm") / "TM"
    assert main(["edit", "task-matrices", str(tiny_llama_dir), "--forget-split", "forget01", "--tofu", str(TOFU_DIR),
                 "--out", str(out), "--lora", "--lora-r", "4", "--epochs", "1", "--batch-size", "4", "--lr", "1e-2",
                 "--max-length", "48", "--max-forget-rows", "4", "--max-retain-rows", "8"]) == 0
    return out


def test_task_matrices_folder(task_folder, tiny_llama_dir):
    manifest = json.loads((task_folder / "task_matrices.json").read_text())
    assert manifest["kind"] == "lora" and manifest["forget_ids"] == [3960, 3961, 3962, 3963]
    assert manifest["retain_split"] == "retain99" and manifest["num_retain"] == 8
    assert len(manifest["forget_fingerprint"]) == 64 and manifest["forget_fingerprint"] != manifest["retain_fingerprint"]
    for sub in ("forget", "retain"):
        assert (task_folder / sub / "adapter_config.json").is_file()
        assert not (task_folder / sub / "_trainer").exists()
    assert not list(task_folder.parent.glob(".*partial"))


def test_qr_erase_cli_saves_a_plain_model_report_and_card(task_folder, tiny_llama_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from hf_unlearn.editing.task_matrices import target_layers

    out = tmp_path / "edited"
    assert main(["edit", "qr-erase", str(tiny_llama_dir), "--task-matrices", str(task_folder), "--out", str(out),
                 "--rank", "2", "--top-k-layers", "1", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "edited 7 layers in 1 of 2 blocks" in printed and "largest principal angle to the svd" in printed
    for name in ("config.json", "model.safetensors", "tokenizer.json", "edit_report.json", "edit_report.md",
                 "layer_energies.png", "README.md", "unlearning_info.json"):
        assert (out / name).is_file(), name
    report = json.loads((out / "edit_report.json").read_text())
    assert report["device"] == "cpu"
    block = report["selected_blocks"][0]
    edited, base = AutoModelForCausalLM.from_pretrained(out), AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    for e, b in zip(target_layers(edited), target_layers(base)):
        assert torch.equal(e.module.weight, b.module.weight) == (b.block != block)
    info = json.loads((out / "unlearning_info.json").read_text())
    assert info["forget_ids"] == [3960, 3961, 3962, 3963]  # local only; the card carries keyed tags
    card = (out / "README.md").read_text()
    assert "QR-Erase" in card and not mentions(card, 3960)


def test_qr_erase_on_a_base_folder_without_tokenizer_files_needs_none(task_folder, tiny_llama_dir, tmp_path, capsys):
    """The edit works on weights only: a base folder holding no tokenizer files is edited (it used to fail with
    transformers' "Couldn't instantiate the backend tokenizer"), and a tokenizer is copied only when present."""
    base = tmp_path / "weights-only"
    shutil.copytree(tiny_llama_dir, base, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    out = tmp_path / "edited"
    assert main(["edit", "qr-erase", str(base), "--task-matrices", str(task_folder), "--out", str(out),
                 "--rank", "2", "--top-k-layers", "1", "--device", "cpu"]) == 0
    assert "holds no tokenizer files" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and not list(out.glob("tokenizer*"))


def test_another_base_is_refused_and_nothing_is_written(task_folder, tmp_path, capsys, gpt2_tokenizer):
    from hf_unlearn.models import build_tiny_model

    other = tmp_path / "other-base"  # same architecture and shapes, other weights: the TM hash must refuse it
    build_tiny_model("llama", gpt2_tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=1).save_pretrained(other)
    gpt2_tokenizer.save_pretrained(other)
    out = tmp_path / "edited"
    capsys.readouterr()
    assert main(["edit", "qr-erase", str(other), "--task-matrices", str(task_folder), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert one_line_error(err, "computed against another base")
    assert not out.exists() and not list(tmp_path.glob(".*partial"))


def test_swapped_task_files_or_a_manifest_without_the_base_hash_are_refused(task_folder, tiny_llama_dir, tmp_path):
    from hf_unlearn.editing.qr_erase import qr_erase
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.models import load_model

    model = load_model(tiny_llama_dir)
    swapped = tmp_path / "swapped"
    shutil.copytree(task_folder, swapped)
    shutil.copy(swapped / "retain" / "adapter_model.safetensors", swapped / "forget" / "adapter_model.safetensors")
    with pytest.raises(UnlearnError, match="not the forget task model recorded"):
        qr_erase(model, swapped, progress=False)
    stripped = tmp_path / "stripped"
    shutil.copytree(task_folder, stripped)
    manifest = json.loads((stripped / "task_matrices.json").read_text())
    del manifest["base_params_root"]
    (stripped / "task_matrices.json").write_text(json.dumps(manifest))
    with pytest.raises(UnlearnError, match="records no base weight hash"):
        qr_erase(model, stripped, progress=False)
    # the untouched folder still edits (and the refusals above changed nothing)
    _, report = qr_erase(model, task_folder, rank=2, progress=False, compare_subspaces=False)
    assert report.num_forget == 4 and report.retain_task["kind"] == "lora"


def test_cli_errors_are_one_line(tiny_llama_dir, task_folder, tmp_path, capsys):
    out = tmp_path / "e"
    cases = [
        (["--task-matrices", str(task_folder), "--rank", "99"], "larger than"),
        (["--task-matrices", str(task_folder), "--energy", "1.5"], "energy"),
        (["--forget-adapter", str(tmp_path)], "not a PEFT adapter"),
        (["--task-matrices", str(task_folder), "--device", "cuda:99"], "no such CUDA device"),
        (["--task-matrices", str(task_folder), "--device", "banana"], "not a torch device"),
        (["--task-matrices", str(task_folder), "--device", "meta"], "only cpu and cuda"),
    ]
    for extra, message in cases:
        assert main(["edit", "qr-erase", str(tiny_llama_dir), "--out", str(out), *extra]) == 1
        err = capsys.readouterr().err
        assert one_line_error(err, message), err
        assert not out.exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    assert main(["edit", "qr-erase", str(tiny_llama_dir), "--task-matrices", str(task_folder), "--out",
                 str(tmp_path / "full")]) == 1
    assert "not empty" in capsys.readouterr().err and (tmp_path / "full" / "x").read_text() == "keep me"


@pytest.mark.slow  # two full fine-tunes and a Hub publish (~25 s)
def test_full_finetune_models_from_folders_and_hub_publish(tiny_llama_dir, tmp_path):
    """--forget-model/--retain-model folders, --method svd; `hub push` publishes the result with the editor's card."""
    from hf_unlearn.hub.server import HubServer
    from hf_unlearn.models import load_model

    dirs = {}
    for name, seed in (("forget", 1), ("retain", 2)):
        model = load_model(tiny_llama_dir)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".layers." in n and p.dim() == 2:
                    p.add_(torch.randn(p.shape, generator=g) * 1e-3)
        dirs[name] = tmp_path / name
        model.save_pretrained(dirs[name])
    ids = tmp_path / "ids.jsonl"
    ids.write_text("3600\n3601\n")
    out = tmp_path / "edited"
    assert main(["edit", "qr-erase", str(tiny_llama_dir), "--forget-model", str(dirs["forget"]), "--retain-model",
                 str(dirs["retain"]), "--out", str(out), "--method", "svd", "--energy", "0.5", "--localize",
                 "--forget-ids", str(ids)]) == 0
    assert (out / "model.safetensors").is_file()
    report = json.loads((out / "edit_report.json").read_text())
    assert report["method"] == "svd" and report["forget_task"]["kind"] == "full" and report["num_forget"] == 2

    server = HubServer(tmp_path / "hub", {"tok": "alice"}).start()
    try:
        env = {"HF_ENDPOINT": server.url, "HF_HOME": str(tmp_path / "hf_home"), "HF_TOKEN": "tok",
               "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        push = run_cli("hub", "push", out, "--repo", "alice/edited", "--deletion", env=env)
        assert push.returncode == 0, push.stderr[-2000:]
        _, files = server.store.files("model", "alice/edited", "deletion-0001")
        assert "README.md" in files and "unlearning_info.json" not in files and "edit_report.json" not in files
        with server.store.open_entry(files["README.md"]) as f:
            card = f.read().decode()
        assert "UNLEARN (SVD)" in card and not mentions(card, 3600)
    finally:
        server.stop()
    shutil.rmtree(tmp_path / "hf_home", ignore_errors=True)
