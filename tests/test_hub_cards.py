"""Model cards, keyed tags, the state-hash manifest, provenance selection and local verification (no network)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from hf_unlearn.errors import UnlearnError
from hf_unlearn.hub.cards import check_card_metadata, find_raw_ids, render_model_card
from hf_unlearn.hub.keys import key_fingerprint, keyed_tag, keyed_tags, load_key

from .conftest import ROOT

KEY = bytes(range(32))
FORGET = list(range(3600, 3640))


def card_info(**over):
    info = dict(method="MASC", hyperparameters={"beta": 2.0, "rho": 0.1, "top_k": 8}, forget_ids=FORGET,
                citation="@inproceedings{masc2025, title={MASC}}", paper="https://arxiv.org/abs/2501.00001",
                evaluation={"forget_rouge_l": 0.12, "retain_rouge_l": 0.81})
    info.update(over)
    return info


def test_keyed_tags_are_keyed_and_typed(tmp_path, monkeypatch):
    assert keyed_tag(7, KEY) == keyed_tag(7, KEY) != keyed_tag("7", KEY)
    assert keyed_tag(7, KEY) != keyed_tag(7, bytes(32))
    assert keyed_tags([3, 1, 2, 1], KEY) == sorted({keyed_tag(i, KEY) for i in (1, 2, 3)})
    assert len(key_fingerprint(KEY)) == 16 and key_fingerprint(KEY) != key_fingerprint(bytes(32))
    monkeypatch.delenv("HF_UNLEARN_TAG_KEY", raising=False)
    key = load_key(tmp_path / "k")  # created once (mode 0600), then the same key
    assert load_key(tmp_path / "k") == key and (tmp_path / "k").stat().st_mode & 0o777 == 0o600
    with pytest.raises(UnlearnError, match="int or str"):
        keyed_tag(1.5, KEY)


def test_card_metadata_and_body(tmp_path):
    from huggingface_hub import ModelCard

    manifest = {"params": {"a": "0" * 64}, "params_root": "1" * 64, "root": "2" * 64, "not_saved": ["lm_head.weight"]}
    text = render_model_card(card_info(), key=KEY, repo_id="org/tiny-masc", base_model="HuggingFaceTB/SmolLM2-135M",
                             datasets=["locuslab/TOFU"], manifest=manifest, tag="deletion-0003")
    card = ModelCard(text)  # huggingface_hub parses the metadata
    data = card.data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M" and data["library_name"] == "transformers"
    assert {"unlearning", "masc"} <= set(data["tags"]) and data["datasets"] == ["locuslab/TOFU"]
    assert data["license"] == "apache-2.0" and data["hf_unlearn"]["params_root"] == "1" * 64
    results = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert results == {"forget_rouge_l": 0.12, "retain_rouge_l": 0.81}
    body = card.text
    assert "| beta | 2.0 |" in body and "samples to forget: **40**" in body
    assert keyed_tags(FORGET, KEY)[0] in body and key_fingerprint(KEY) in body
    assert "hf-unlearn hub verify org/tiny-masc --revision deletion-0003" in body
    assert "@inproceedings{masc2025" in body and "transformers" in body and "Exact deletion" not in body
    assert not find_raw_ids(text, FORGET)


def test_exact_deletion_card_shows_roots_and_verification():
    exact = {"params_root": "a" * 64, "optimizer_root": "b" * 64, "verified": True,
             "verification": "bit-identical to the trace oracle"}
    text = render_model_card(card_info(extra={"exact_deletion": exact}), key=KEY)
    assert "## Exact deletion" in text and "a" * 64 in text and "b" * 64 in text
    assert "**passed** (bit-identical to the trace oracle)" in text and "exact-deletion" in text


@pytest.mark.parametrize("over, where", [
    ({"extra": {"deleted_rows": [3600, 3601]}}, "extra.deleted_rows"),
    ({"hyperparameters": {"forget_ids": [3605]}}, "hyperparameters.forget_ids"),
    ({"extra": {"note": "removed rows 3600, 3601, 3602"}}, "extra.note"),
    ({"forget_ids": ["piqa-17", "piqa-18"], "hyperparameters": {"comment": "dropped piqa-17"}}, "comment"),
])
def test_card_with_raw_ids_is_refused(over, where):
    with pytest.raises(UnlearnError, match=f"refusing to publish.*forget ids at .*{where}"):
        render_model_card(card_info(**over), key=KEY)


def test_a_number_equal_to_an_id_needs_a_per_field_allowance():
    info = card_info(hyperparameters={"max_steps": 3600, "layers": [0, 1]})
    with pytest.raises(UnlearnError, match=r"hyperparameters.max_steps \(number 3600\).*not_ids=\{'hyperparameters"
                                           r".max_steps': 3600\}.*--not-id hyperparameters.max_steps=3600"):
        render_model_card(info, key=KEY)
    text = render_model_card(info, key=KEY, not_ids={"hyperparameters.max_steps": 3600})
    assert "| max_steps | 3600 |" in text
    # the allowance is for that field and that number only
    for not_ids in ({"hyperparameters.max_steps": 3601}, {"hyperparameters.seed": 3600}):
        with pytest.raises(UnlearnError, match="max_steps"):
            render_model_card(info, key=KEY, not_ids=not_ids)
    with pytest.raises(UnlearnError, match="string ids are never allowed"):
        render_model_card(info, key=KEY, not_ids={"hyperparameters.max_steps": "piqa-17"})


def test_manifest_covers_saved_tensors_with_the_library_hash(tmp_path, tiny_llama):
    from safetensors.torch import load_file

    from hf_unlearn.hub.publish import build_manifest
    from hf_unlearn.trace.hashing import state_hashes

    tiny_llama.save_pretrained(tmp_path)
    manifest = build_manifest(tmp_path, state_dict_names=list(tiny_llama.state_dict()))
    saved = load_file(tmp_path / "model.safetensors")
    expected = state_hashes(saved)
    assert manifest["params"] == expected.params and manifest["params_root"] == expected.params_root
    assert manifest["not_saved"] == ["lm_head.weight"]  # tied to the embeddings, saved once
    full = state_hashes(tiny_llama)  # the trainer-side hashes list the tied name too, with the same bytes
    assert set(full.params) - set(manifest["params"]) == {"lm_head.weight"}
    assert all(full.params[n] == h for n, h in manifest["params"].items())


def test_verify_folder_names_tampered_tensors(tmp_path, tiny_llama):
    import torch
    from safetensors.torch import load_file, save_file

    from hf_unlearn.hub.publish import build_manifest
    from hf_unlearn.hub.verify import verify_folder

    tiny_llama.save_pretrained(tmp_path)
    manifest = build_manifest(tmp_path)
    (tmp_path / "state_hashes.json").write_text(json.dumps(manifest))
    (tmp_path / "README.md").write_text(render_model_card(card_info(), key=KEY, manifest=manifest))
    report = verify_folder(tmp_path)
    assert report.ok and report.checked == len(manifest["params"]), report.summary()

    tensors = load_file(tmp_path / "model.safetensors")
    for name in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight"):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] += 1e-3
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    report = verify_folder(tmp_path)
    assert not report.ok and report.mismatched == ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    assert "tensor differs: model.norm.weight" in report.summary() and "saved-tensor root" in report.summary()
    assert torch.equal(tensors["model.embed_tokens.weight"], tiny_llama.model.embed_tokens.weight.detach())


@pytest.mark.parametrize("smuggled", ["adapter_model.safetensors", "sub/model.safetensors", ".hidden/x.safetensors"])
def test_verify_folder_refuses_safetensors_files_it_does_not_hash_per_tensor(tmp_path, tiny_llama, smuggled):
    """An adapter (which transformers would apply on load) or a subfolder's weights slipped into a revision: they
    are not hashed per tensor, so they must be covered by file hash like everything else, or verify fails."""
    import torch
    from safetensors.torch import save_file

    from hf_unlearn.hub.publish import build_manifest
    from hf_unlearn.hub.verify import verify_folder

    tiny_llama.save_pretrained(tmp_path)
    manifest = build_manifest(tmp_path)
    (tmp_path / "state_hashes.json").write_text(json.dumps(manifest))
    (tmp_path / "README.md").write_text(render_model_card(card_info(), key=KEY, manifest=manifest))
    (tmp_path / smuggled).parent.mkdir(parents=True, exist_ok=True)
    save_file({"x": torch.zeros(2)}, tmp_path / smuggled)
    report = verify_folder(tmp_path, load=False)
    assert f"file not covered by the manifest: {smuggled}" in report.problems, report.summary()


def fake_run(folder, key=KEY, ids=(3600, 3601, 3602, 3603)):
    """A run folder as the trace code writes it (header, plan, WAL, manifest, deletion log, sidecars, private/)."""
    from hf_unlearn.trace.plan import PlanEntry
    from hf_unlearn.trace.run import FORMAT, write_sidecar
    from hf_unlearn.trace.tags import ids_digest, tag
    from hf_unlearn.trace.wal import WalRecord, manifest_bytes

    folder.mkdir(parents=True, exist_ok=True)
    tags = [tag(key, i) for i in ids]
    header = {"format": FORMAT, "created": "2025-01-15T10:00:00Z", "sealed": True, "key_fingerprint": key_fingerprint(key),
              "model": {"config": {"pad_token_id": 3600, "vocab_size": 3601, "id2label": {"3602": "LABEL_3602"},
                                   "_name_or_path": "HuggingFaceTB/SmolLM2-135M"}},
              "training_args": {"output_dir": "/runs/unlearning", "max_steps": 3603, "seed": 3600}}
    (folder / "header.json").write_text(json.dumps(header))
    entry = PlanEntry(mb=0, step=0, j=0, end=True, seed=3600, lr=1e-3, norm=3601.0, norm_dtype="int64", accum=1,
                      slots=tags[:2] + [None], lens=[3602, 3603, 12])
    (folder / "plan.jsonl").write_text(entry.to_line())
    (folder / "wal.bin").write_bytes(WalRecord(ids_digest(key, entry.slots), 3600, 1e-3, 0, 3, 1).pack())
    (folder / "manifest.bin").write_bytes(manifest_bytes(entry.slots))
    (folder / "deletion_log.jsonl").write_text(json.dumps({
        "time": "2025-01-15T10:00:00Z", "request": 1, "mode": "replay", "forget_tags": tags[:2], "start_step": 0,
        "steps_replayed": 1, "params_root": "a" * 64, "optimizer_root": "b" * 64, "parent_run": "trace",
        "fidelity": "engine reproduced recorded steps 0..3601 (the recording's self-check)"}) + "\n")
    for name in ("header.json", "plan.jsonl", "wal.bin", "manifest.bin", "deletion_log.jsonl"):
        write_sidecar(folder / name)
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text(json.dumps({
        "model_type": "llama", "pad_token_id": 3600, "hidden_size": 3601, "id2label": {"3602": "LABEL_3602"},
        "_name_or_path": "HuggingFaceTB/SmolLM2-135M", "transformers_version": "5.24.0"}))
    (folder / "private" / "store").mkdir(parents=True)
    (folder / "private" / "hmac.key").write_bytes(key)
    (folder / "private" / "hmac.key").chmod(0o600)
    (folder / "private" / "meta.json").write_text("{}")
    (folder / "checkpoints" / "step-00000001").mkdir(parents=True)
    (folder / "checkpoints" / "step-00000001" / "hashes.json").write_text("{}")
    return folder


def test_provenance_is_an_allowlist_checked_against_the_schema(tmp_path):
    from hf_unlearn.hub.leaks import IdScanner
    from hf_unlearn.hub.provenance import SchemaError, select_provenance

    run = fake_run(tmp_path / "run")
    (run / "forget.json").write_text(json.dumps([3600, 3601]))  # the user's own file in the trace folder
    scanner = IdScanner([3600, 3601, 3602, 3603])
    keep, skipped, hits = select_provenance(run, scanner)
    files = ("header.json", "plan.jsonl", "wal.bin", "manifest.bin", "deletion_log.jsonl")
    assert sorted(keep) == sorted(files + tuple(f + ".sha256" for f in files) + ("model/config.json",))
    assert hits == []  # configuration numbers (pad_token_id, seeds, lengths) equal to ids are not ids
    assert set(skipped) == {"forget.json", "private/hmac.key", "private/meta.json", "checkpoints/step-00000001/hashes.json"}

    from hf_unlearn.trace.run import write_sidecar

    def refused(edit, match, resign=True):
        bad = fake_run(tmp_path / f"bad{len(list(tmp_path.iterdir()))}")
        edit(bad)
        for name in ("header.json", "plan.jsonl", "wal.bin", "manifest.bin", "deletion_log.jsonl"):
            if resign and (bad / name).is_file():  # a careful forger keeps the sidecars consistent
                write_sidecar(bad / name)
        with pytest.raises(UnlearnError, match=match):
            _, _, found = select_provenance(bad, scanner)
            scanner.refuse(found, "the push")

    def plan_with(**over):
        def edit(folder):
            line = json.loads((folder / "plan.jsonl").read_text())
            (folder / "plan.jsonl").write_text(json.dumps({**line, **over}) + "\n")
        return edit

    refused(plan_with(slots=[3600, None]), "plan.jsonl.*slots")  # raw ids where tags belong
    refused(plan_with(ids=[3600]), "fields a plan entry does not have")
    refused(plan_with(extra={"note": "rows 3600-3603"}), "plan.jsonl:extra.*range")
    refused(lambda f: (f / "wal.bin").write_bytes((f / "wal.bin").read_bytes()[:-1] + b"x"), "wal.bin.*CRC")
    refused(lambda f: (f / "manifest.bin").write_bytes(b"123"), "manifest.bin")
    refused(lambda f: (f / "header.json").write_text(json.dumps({"ids": [3600]})), "not a run header")
    refused(lambda f: (f / "header.json").write_text((f / "header.json").read_text().replace(
        "/runs/unlearning", "/runs/forget-3600")), "header.json:training_args.output_dir")
    refused(lambda f: (f / "deletion_log.jsonl").write_text(json.dumps({"time": "now", "forget_tags": []}) + "\n"),
            "deletion_log.jsonl.*time")
    refused(lambda f: (f / "deletion_log.jsonl").write_text(json.dumps({"forget_ids": [3600]}) + "\n"),
            "deletion_log.jsonl:forget_ids")
    refused(lambda f: (f / "plan.jsonl.sha256").write_text("3600 ids\n"), "sidecar", resign=False)
    refused(lambda f: (f / "plan.jsonl").write_text((f / "plan.jsonl").read_text() + "\n"),
            r"plan.jsonl.sha256.*digest is not the SHA-256 of plan.jsonl", resign=False)  # a stale sidecar

    def header_with(edit):
        def apply(folder):
            header = json.loads((folder / "header.json").read_text())
            edit(header)
            (folder / "header.json").write_text(json.dumps(header))
        return apply

    # numbers the trace code did not write are scanned: a key it has no such field for, a custom TrainingArguments field
    refused(header_with(lambda h: h.update(forgotten_rows=[3600, 3601])), r"header.json:forgotten_rows\[0\] \(number 3600")
    refused(header_with(lambda h: h["training_args"].update(forget_rows=[3602])),
            r"header.json:training_args.forget_rows\[0\] \(number 3602")
    refused(lambda f: (f / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "rows": [3601]})),
            "model/config.json:rows")
    with pytest.raises(SchemaError):
        bad = fake_run(tmp_path / "badjson")
        (bad / "deletion_log.jsonl").write_text("{not json\n")
        select_provenance(bad, scanner)


def test_cli_push_refuses_raw_ids_before_any_network(tmp_path, capsys):
    from hf_unlearn.cli import main
    from hf_unlearn.hub.publish import save_card_info

    save_card_info(tmp_path, card_info(extra={"deleted_rows": [3600, 3601]}))
    # no server listens on this endpoint: the refusal must come first
    assert main(["hub", "push", str(tmp_path), "--repo", "org/x", "--endpoint", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert "refusing to publish" in err and "extra.deleted_rows" in err and "Traceback" not in err


def test_templates_ship_with_a_non_editable_install(tmp_path):
    src = tmp_path / "src"  # what a source checkout ships: the package, the templates, the build files
    for name in ("hf_unlearn", "model_cards"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
                    "--target", str(target), str(src)], check=True, capture_output=True)
    assert (target / "hf_unlearn" / "model_cards" / "unlearned_model.md").is_file()
    assert not (target / "hf_unlearn" / "model_cards").is_symlink()
    code = ("import hf_unlearn.hub.cards as c; assert c.TEMPLATES_DIR.is_relative_to(%r), c.TEMPLATES_DIR; "
            "print(c.render_model_card({'method': 'M', 'hyperparameters': {}, 'forget_ids': [1], 'citation': '', "
            "'paper': ''}, key=b'k' * 32)[:3])" % str(target))
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip() == "---", out.stderr[-2000:]


def test_trainer_mixin_writes_the_card_and_keeps_raw_ids_local(tmp_path, tiny_llama, gpt2_tokenizer):
    from transformers import Trainer, TrainingArguments

    from hf_unlearn.hub import UnlearningHubMixin
    from hf_unlearn.hub.cards import check_card_metadata

    class Toy(UnlearningHubMixin, Trainer):
        def unlearning_card_info(self):
            return card_info()

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = Toy(model=tiny_llama, args=args, processing_class=gpt2_tokenizer)
    trainer.save_model()
    text = trainer.create_model_card(model_name="org/toy", dataset_name="locuslab/TOFU", tags=["demo"],
                                     finetuned_from="HuggingFaceTB/SmolLM2-135M")
    meta = check_card_metadata((tmp_path / "README.md").read_text())
    assert text.startswith("---") and {"demo", "masc", "unlearning"} <= set(meta["tags"])
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M" and meta["hf_unlearn"]["params_root"]
    assert json.loads((tmp_path / "unlearning_info.json").read_text())["forget_ids"] == FORGET  # local only
    assert not find_raw_ids(text, FORGET)


def test_card_details_base_model_index_ties_peft_values_and_the_step_budget(tmp_path):
    from peft import LoraConfig

    from hf_unlearn.hub.cards import public_value
    from hf_unlearn.hub.publish import _base_model

    manifest = {"params": {"a": "0" * 64}, "params_root": "1" * 64, "root": "2" * 64, "not_saved": ["lm_head.weight"],
                "state_dict_root": "3" * 64, "file_hashes": {"config.json": "4" * 64}, "files_root": "5" * 64}
    lora = LoraConfig(r=4, target_modules=["v_proj", "q_proj"])
    hyper = {"max_steps": 10, "num_train_epochs": 3.0, "peft": {"type": lora.peft_type, "modules": lora.target_modules}}
    text = render_model_card(card_info(hyperparameters=hyper, evaluation={"forget_quality": 0.5}), key=KEY,
                             manifest=manifest)
    meta = check_card_metadata(text)
    assert meta["model-index"][0]["results"][0]["metrics"][0]["type"] == "forget_quality"  # even without datasets
    assert "\n\nTied weights are stored once" in text and "`lm_head.weight`." in text
    assert '{"type": "LORA", "modules": ["q_proj", "v_proj"]}' in text and "PeftType" not in text
    assert "| max_steps | 10 |" in text and "num_train_epochs" not in text
    assert meta["hf_unlearn"]["state_dict_root"] == "3" * 64 and meta["hf_unlearn"]["files_root"] == "5" * 64
    assert public_value({"s": {3, 1}, "t": (1, 2)}) == {"s": [1, 3], "t": [1, 2]}
    epochs = render_model_card(card_info(hyperparameters={"max_steps": -1, "num_train_epochs": 3.0}), key=KEY)
    assert "| num_train_epochs | 3.0 |" in epochs and "max_steps" not in epochs
    # base_model: the first Hub id known (argument, card info, adapter, model config, the trace header), never a path
    staging, trace = tmp_path / "staging", tmp_path / "trace"
    staging.mkdir()
    trace.mkdir()
    (staging / "config.json").write_text(json.dumps({"_name_or_path": str(tmp_path)}))
    (trace / "header.json").write_text(json.dumps({"model": {"config": {"_name_or_path": "org/recorded-base"}}}))
    info = {"extra": {}}
    assert _base_model(staging, None, info, None, None) is None
    assert _base_model(staging, None, info, None, trace) == "org/recorded-base"
    assert _base_model(staging, None, info, {"base_model": "org/adapter-base"}, trace) == "org/adapter-base"
    assert _base_model(staging, "org/given", info, None, trace) == "org/given"


def test_expected_values_come_from_the_publishers_records(tmp_path):
    from hf_unlearn.hub.verify import expected_from

    out = tmp_path / "out"
    out.mkdir()
    c1, c2, c3 = "1" * 40, "2" * 40, "3" * 40
    pushes = [{"repo_id": "org/m", "tag": "deletion-0001", "commit": c1, "params_root": "p1", "state_dict_root": "s1"},
              {"repo_id": "org/other", "tag": "deletion-0001", "commit": c3, "params_root": "p3", "state_dict_root": "s3"},
              {"repo_id": "org/m", "tag": "deletion-0002", "commit": c2, "params_root": "p2", "state_dict_root": "s2"}]
    (out / "hub_pushes.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pushes))
    assert expected_from(out, "org/m", "deletion-0001") == {"expect_root": "s1", "expect_commit": c1}
    assert expected_from(out / "hub_pushes.jsonl", "org/m", c2) == {"expect_root": "s2", "expect_commit": c2}
    assert expected_from(out, "org/m") == expected_from(out, "org/m", "main") == {"expect_root": "s2",
                                                                                  "expect_commit": c2}
    with pytest.raises(UnlearnError, match="no push of org/m tagged or committed as 'deletion-0003'"):
        expected_from(out, "org/m", "deletion-0003")  # never falls back to another push's values
    with pytest.raises(UnlearnError, match="records no push of org/nope"):
        expected_from(out, "org/nope")

    run = fake_run(tmp_path / "run")  # a deletion log: the last request's root (no commit: the log never saw one)
    with open(run / "deletion_log.jsonl", "a") as f:
        f.write(json.dumps({"request": 2, "params_root": "c" * 64, "forget_tags": []}) + "\n")
    assert expected_from(run, "org/m", "deletion-0002") == {"expect_root": "c" * 64}
    replay = tmp_path / "replay"
    replay.mkdir()
    # a verdict is believed only under the seal `trace verify` put on it (tests/test_trace_verification_seal.py):
    # one written by hand, as records were before verdicts were sealed, gives no root
    (replay / "verification.json").write_text(json.dumps({"identical": True, "roots": {"a": {"params": "d" * 64}}}))
    with pytest.raises(UnlearnError, match="not taking the expected root from it: it carries no seal .*trace verify"):
        expected_from(replay, "org/m")

    for name, text, match in [("deletion_log.jsonl", '{"request": 1}\n', "no params_root"),
                              ("verification.json", "{}", "carries no seal"),
                              ("hub_pushes.jsonl", "not json\n", "not valid JSON")]:
        bad = tmp_path / f"bad-{name}"
        bad.mkdir()
        (bad / name).write_text(text)
        with pytest.raises(UnlearnError, match=match):
            expected_from(bad, "org/m")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnlearnError, match="holds no hub_pushes.jsonl"):
        expected_from(tmp_path / "empty", "org/m")


def test_expected_values_include_the_pushed_files_root_and_a_forged_record_is_refused(tmp_path):
    """A push record's files_root (config, tokenizer, every non-weight file) is expected too, with the per-file
    hashes that let verify name a changed file; hashes that are not those of the root are refused, not trusted."""
    from hf_unlearn.hub.publish import files_root
    from hf_unlearn.hub.verify import expected_from

    hashes = {"config.json": "a" * 64, "tokenizer.json": "b" * 64}
    push = {"repo_id": "org/m", "tag": "deletion-0001", "commit": "1" * 40, "state_dict_root": "s1",
            "files_root": files_root(hashes), "file_hashes": hashes}
    older = {**push, "tag": "deletion-0002", "commit": "2" * 40}
    del older["file_hashes"]  # a record from before file hashes were logged: the root alone
    push["card_sha256"] = "c" * 64  # newer records hold the card's hash
    out = tmp_path / "out"
    out.mkdir()
    (out / "hub_pushes.jsonl").write_text(json.dumps(push) + "\n" + json.dumps(older) + "\n")
    assert expected_from(out, "org/m", "deletion-0001") == {
        "expect_root": "s1", "expect_commit": "1" * 40, "expect_files_root": files_root(hashes),
        "expect_file_hashes": hashes, "expect_card_sha256": "c" * 64}
    assert expected_from(out, "org/m", "deletion-0002") == {
        "expect_root": "s1", "expect_commit": "2" * 40, "expect_files_root": files_root(hashes)}
    for forged, match in [({**push, "file_hashes": {**hashes, "config.json": "c" * 64}}, "not those of its files_root"),
                          ({**push, "files_root": "not-a-root"}, "malformed files_root"),
                          ({**push, "card_sha256": "README"}, "malformed card_sha256"),
                          ({**push, "file_hashes": ["config.json"]}, "not those of its files_root")]:
        (out / "hub_pushes.jsonl").write_text(json.dumps(forged) + "\n")
        with pytest.raises(UnlearnError, match=match):
            expected_from(out, "org/m", "deletion-0001")


def test_verify_names_the_non_weight_files_that_differ_from_the_record(tmp_path):
    """verify_folder with an expected files root: config.json changed while manifest and card were rewritten to match
    fails, naming config.json when the record has per-file hashes; with --expect-root alone it is ok but says the
    config is not proven. (No model is loaded: load=False makes the report not ok, so only the messages are read.)"""
    from hf_unlearn.hub.publish import files_root
    from hf_unlearn.hub.verify import VerifyReport, verify_folder

    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_act": "relu"}')
    (folder / "tokenizer.json").write_text("{}")
    (folder / "state_hashes.json").write_text(json.dumps({"params": {}}))
    pushed = {"config.json": "0" * 64, "tokenizer.json": hashlib.sha256(b"{}").hexdigest()}
    report = verify_folder(folder, expect_root="r" * 64, expect_files_root=files_root(pushed),
                           expect_file_hashes=pushed, load=False)
    differ = [p for p in report.problems if "differ from the publisher's record" in p]
    assert len(differ) == 1 and differ[0].endswith(": changed: config.json"), report.problems
    with pytest.raises(UnlearnError, match="record is inconsistent"):
        verify_folder(folder, expect_files_root="f" * 64, expect_file_hashes=pushed, load=False)

    weights_only = VerifyReport(source="org/m", checked=3, files_checked=2, loaded="LlamaForCausalLM",
                                expect_root="r" * 64)
    assert weights_only.ok and weights_only.weights_anchored and not weights_only.anchored
    assert "Not proven: that config.json, the tokenizer files" in weights_only.statement
    pinned = VerifyReport(source="org/m", checked=3, loaded="LlamaForCausalLM", expect_root="r" * 64,
                          expect_files_root="f" * 64)  # the card is outside the files root: not anchored, said so
    assert not pinned.anchored and "Not proven: that the model card" in pinned.statement
    pinned.expect_card_sha256 = "c" * 64  # weights, files and card pinned, not .gitattributes and the manifest
    assert not pinned.anchored and "Not proven: that .gitattributes and state_hashes.json" in pinned.statement
    pinned.expect_commit = "a" * 40  # a commit covers every published byte
    assert pinned.anchored and "Not proven" not in pinned.statement
    nothing = VerifyReport(source="org/m", checked=3, loaded="LlamaForCausalLM")
    assert not nothing.anchored and "Not proven: that these are the weights, config and tokenizer" in nothing.statement


@pytest.mark.parametrize("license", ["apache-2.0", "cc-by-4.0", "llama3.1", "gpl-3.0"])
def test_a_licence_identifiers_version_is_not_an_id(license):
    # forget ids 2, 3 and 4 are in "apache-2.0", "gpl-3.0", "cc-by-4.0": a licence name cannot carry an id
    text = info = card_info(forget_ids=[2, 3, 4, 3600], hyperparameters={"beta": 2.5, "rho": 0.1, "top_k": 8})
    text = render_model_card(info, key=KEY, license=license)
    assert f"license: {license}" in text


@pytest.mark.parametrize("license", ["LicenseRef-3600", "mit OR other-3600", "gpl-3600", "3600"])
def test_a_licence_that_is_not_an_identifier_is_scanned_in_full(license):
    with pytest.raises(UnlearnError, match=r"forget ids at license \(number 3600\)"):
        render_model_card(card_info(), key=KEY, license=license)


def test_a_trainers_own_numbers_pass_the_id_scanner_only_at_their_exact_values():
    """A replay of 2 steps deleting sample 2 states `total_steps: 2`: declared by the trainer (own_numbers), it
    publishes; the same field with another value, or the id anywhere undeclared, is still refused."""
    from hf_unlearn.hub.cards import checked_card_info
    from hf_unlearn.hub.leaks import own_numbers

    hyper, extra = {"start_step": 1, "block_7": {"rank": 4}}, {"total_steps": 2, "segments_replayed": 1}
    declared = {**own_numbers(hyper, "hyperparameters"), **own_numbers(extra, "extra")}
    assert declared["hyperparameters.block_7"] == [7] and declared["hyperparameters.block_7.rank"] == [4]
    info = {"method": "m", "hyperparameters": hyper, "forget_ids": [1, 2, 4, 7], "citation": "", "paper": "",
            "extra": extra, "not_ids": declared}
    checked_card_info(info)
    with pytest.raises(UnlearnError, match="extra.total_steps"):
        checked_card_info({**info, "extra": {**extra, "total_steps": 7}})
    with pytest.raises(UnlearnError, match="extra.note"):
        checked_card_info({**info, "extra": {**extra, "note": "rows 2 and 7"}})
