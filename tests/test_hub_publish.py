"""Publishing through the real huggingface_hub client against the local Hub server, over real HTTP.

Fixture design: ``hub`` starts a :class:`HubServer` on 127.0.0.1 (a free port) in a thread of the test process;
``client`` runs every huggingface_hub user (the CLI, or a Python script) in a fresh interpreter whose environment
(HF_ENDPOINT, a fresh HF_HOME, HF_TOKEN, HF_HUB_OFFLINE=0, HF_HUB_DISABLE_XET=1) is set before huggingface_hub is
first imported there. The test process itself never talks to the Hub through huggingface_hub, so the order of
imports in the test session (conftest sets HF_HUB_OFFLINE=1) cannot matter.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys

import pytest

from hf_unlearn.hub.cards import find_raw_ids
from hf_unlearn.hub.server import HubServer

from .conftest import ROOT, TOKENIZERS, run_cli

TOKEN = "hf_unlearn_test_token"
FORGET = list(range(3600, 3620))
EXPECTED_FILES = {".gitattributes", "README.md", "config.json", "generation_config.json", "model.safetensors",
                  "state_hashes.json", "forget_request.json", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture
def hub(tmp_path):
    server = HubServer(tmp_path / "hub-store", {TOKEN: "alice"}).start()
    yield server
    server.stop()


class Client:
    """Runs huggingface_hub users in fresh interpreters configured for the local hub."""

    def __init__(self, server: HubServer, tmp_path):
        self.server, self.tmp_path, self.n = server, tmp_path, itertools.count()

    def env(self, token: str | None = TOKEN, xet_off: bool = True) -> dict[str, str]:
        return {"HF_ENDPOINT": self.server.url, "HF_HOME": str(self.tmp_path / f"hf_home_{next(self.n)}"),
                "HF_TOKEN": token or "", "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1" if xet_off else "0",
                "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                "HF_UNLEARN_KEY_FILE": str(self.tmp_path / "tag.key")}

    def cli(self, *args, token: str | None = TOKEN, xet_off: bool = True):
        return run_cli("hub", *args, env=self.env(token, xet_off))

    def script(self, code: str) -> dict:
        """Run ``code`` (which prints one JSON line last) and return that JSON."""
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env()}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=str(ROOT))
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def client(hub, tmp_path):
    return Client(hub, tmp_path)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory, tiny_llama_dir):
    """A trainer-like output dir: tiny Llama (hidden 32, tied embeddings), GPT-2 tokenizer, unlearning_info.json."""
    from hf_unlearn.hub.publish import save_card_info

    out = tmp_path_factory.mktemp("unlearned")
    shutil.copytree(tiny_llama_dir, out, dirs_exist_ok=True)
    save_card_info(out, {"method": "MASC", "hyperparameters": {"beta": 2.0, "rho": 0.1}, "forget_ids": FORGET,
                         "citation": "", "paper": "", "evaluation": {"forget_rouge_l": 0.1}})
    return out


def read(server, repo, revision, path) -> bytes:
    _, files = server.store.files("model", repo, revision)
    with server.store.open_entry(files[path]) as f:
        return f.read()


def test_push_tag_download_verify_then_a_second_deletion(client, hub, saved_model, tmp_path):
    from safetensors.torch import load_file, save_file

    from hf_unlearn.hub.keys import key_fingerprint
    from hf_unlearn.hub.publish import save_card_info
    from hf_unlearn.trace.hashing import state_hashes

    from .test_hub_cards import KEY, fake_run

    # provenance: a run folder (its own key, as runs recorded before the one key have) plus a user's raw-id file
    trace = fake_run(tmp_path / "trace", key=KEY)
    (trace / "forget.json").write_text(json.dumps(FORGET))
    proc = client.cli("push", saved_model, "--repo", "org/tiny", "--revision", "deletion-0001",
                      "--dataset", "locuslab/TOFU", "--trace", trace)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kept local (not published): forget.json" in proc.stdout
    assert "kept local (not published): private/hmac.key" in proc.stdout
    refs = hub.store.refs("model", "org/tiny")
    first = refs["branches"]["main"]
    assert refs["tags"]["deletion-0001"]["target"] == first
    sha, files = hub.store.files("model", "org/tiny", "deletion-0001")
    published = {f"provenance/{n}{s}" for n in ("header.json", "plan.jsonl", "wal.bin", "manifest.bin",
                                                "deletion_log.jsonl") for s in ("", ".sha256")}
    assert set(files) == EXPECTED_FILES | published
    assert files["model.safetensors"].lfs_oid  # the weights went through LFS
    card = read(hub, "org/tiny", first, "README.md").decode()
    assert "unlearning_info.json" not in files and "3600" not in card
    assert card.encode() == (saved_model / "README.md").read_bytes()  # the local card is the pushed one
    manifest = json.loads(read(hub, "org/tiny", first, "state_hashes.json"))
    assert manifest["params"] == state_hashes(load_file(saved_model / "model.safetensors")).params
    assert manifest["params_root"] in card and "provenance/plan.jsonl" in card
    assert set(manifest["file_hashes"]) == set(files) - {"README.md", "state_hashes.json", ".gitattributes",
                                                         "model.safetensors"}
    request = json.loads(read(hub, "org/tiny", first, "forget_request.json"))
    assert request["count"] == len(FORGET) and not find_raw_ids(request, FORGET)
    # one key: the card's tags are the run's deletion-log tags (the run's key tags both)
    log = json.loads(read(hub, "org/tiny", first, "provenance/deletion_log.jsonl"))
    assert request["key_fingerprint"] == key_fingerprint(KEY) and set(log["forget_tags"]) <= set(request["tags"])

    proc = client.cli("verify", "org/tiny", "--revision", "deletion-0001")  # fresh cache
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"OK: Proven: the {len(manifest['params'])} tensors and {len(manifest['file_hashes'])} other files" \
        in proc.stdout and "Not proven" in proc.stdout

    # a second deletion request: new weights and a larger forget set -> its own commit and the next tag
    second = tmp_path / "second"
    shutil.copytree(saved_model, second)
    tensors = load_file(second / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 0.5
    save_file(tensors, second / "model.safetensors", metadata={"format": "pt"})
    info = json.loads((second / "unlearning_info.json").read_text())
    save_card_info(second, {**info, "forget_ids": FORGET + [3700, 3701]})
    proc = client.cli("push", second, "--repo", "org/tiny", "--deletion")
    assert proc.returncode == 0 and "tag deletion-0002" in proc.stdout, proc.stderr[-3000:]
    refs = hub.store.refs("model", "org/tiny")
    assert refs["tags"]["deletion-0001"]["target"] == first != refs["tags"]["deletion-0002"]["target"]
    history = [c["message"] for c in hub.store.history("model", "org/tiny", "main")]
    assert history[0].startswith("deletion-0002") and history[1].startswith("deletion-0001")
    assert json.loads(read(hub, "org/tiny", "deletion-0002", "forget_request.json"))["count"] == len(FORGET) + 2
    assert "provenance/plan.jsonl" not in hub.store.files("model", "org/tiny", "deletion-0002")[1]  # one model, whole
    proc = client.cli("push", second, "--repo", "org/tiny", "--revision", "deletion-0002")
    assert proc.returncode == 1 and "already has a tag 'deletion-0002'" in proc.stderr


def test_trainer_mixin_push_and_python_api_roundtrip(client, hub):
    code = f"""
import json, tempfile
from transformers import Trainer, TrainingArguments
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from hf_unlearn.hub import UnlearningHubMixin
from hf_unlearn.hub.verify import verify_on_hub
from hf_unlearn.models import build_tiny_model, load_tokenizer
from hf_unlearn.trace.hashing import state_hashes

class ToyUnlearner(UnlearningHubMixin, Trainer):
    def unlearning_card_info(self):
        return {{"method": "GradAscent", "hyperparameters": {{"lr": self.args.learning_rate}},
                 "forget_ids": [5, 6, 7], "citation": "", "paper": ""}}

tok = load_tokenizer({str(TOKENIZERS / "gpt2")!r})
model = build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2)
args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], learning_rate=1e-4)
trainer = ToyUnlearner(model=model, args=args, processing_class=tok)
result = trainer.push_to_hub("org/mixin", tag="deletion-0001")
api = HfApi()
info = api.model_info("org/mixin", revision="deletion-0001", files_metadata=True)
refs = api.list_repo_refs("org/mixin")
folder = snapshot_download("org/mixin", revision="deletion-0001", cache_dir=tempfile.mkdtemp())
from transformers import AutoModelForCausalLM
loaded = AutoModelForCausalLM.from_pretrained(folder)
config = hf_hub_download("org/mixin", "config.json", cache_dir=tempfile.mkdtemp())
report = verify_on_hub("org/mixin", "deletion-0001")
print(json.dumps({{
    "commit": result.commit, "info_sha": info.sha, "tags": [t.name for t in refs.tags],
    "lfs": [s.rfilename for s in info.siblings if s.lfs], "card_tags": info.card_data.tags,
    "same_weights": state_hashes(loaded).params == state_hashes(model).params,
    "config_ok": json.load(open(config))["hidden_size"] == 32, "verified": report.ok,
}}))
"""
    out = client.script(code)
    assert out["commit"] == out["info_sha"] and out["tags"] == ["deletion-0001"]
    assert out["lfs"] == ["model.safetensors"] and {"unlearning", "gradascent"} <= set(out["card_tags"])
    assert out["same_weights"] and out["config_ok"] and out["verified"]


def test_no_token_or_a_bad_token_is_refused(client, hub, saved_model):
    proc = client.cli("push", saved_model, "--repo", "org/tok", token=None)
    assert proc.returncode == 1 and "no Hugging Face token" in proc.stderr and "Traceback" not in proc.stderr
    proc = client.cli("push", saved_model, "--repo", "org/tok", token="hf_wrong")
    assert proc.returncode == 1 and "rejected the token (401" in proc.stderr
    assert not hub.store.exists("model", "org/tok")


def test_server_failing_mid_upload_publishes_nothing_and_a_retry_succeeds(client, hub, saved_model):
    hub.store.create_repo("model", "org/flaky", private=False, author="alice")
    before = hub.store.refs("model", "org/flaky")
    hub.inject_fault("lfs-upload")  # the weights' upload is cut halfway (the client retries it)
    hub.inject_fault("commit")  # then the server dies while committing, before the branch moves
    proc = client.cli("push", saved_model, "--repo", "org/flaky", "--revision", "deletion-0001")
    assert proc.returncode == 1 and "nothing was published" in proc.stderr, proc.stderr[-3000:]
    assert hub._faults == {"lfs-upload": 0, "commit": 0}
    assert hub.store.refs("model", "org/flaky") == before  # no half-published revision, no tag
    assert set(hub.store.files("model", "org/flaky", "main")[1]) == {".gitattributes"}
    assert not list((hub.store.root / "objects" / "tmp").iterdir())  # the torn upload left no object

    proc = client.cli("push", saved_model, "--repo", "org/flaky", "--revision", "deletion-0001")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(hub.store.files("model", "org/flaky", "deletion-0001")[1]) == EXPECTED_FILES


def test_tampered_weights_on_the_hub_fail_verification(client, hub, saved_model):
    from safetensors.torch import load_file, save_file

    # without HF_HUB_DISABLE_XET: the push learns from whoami that this hub serves LFS only
    proc = client.cli("push", saved_model, "--repo", "org/tamper", "--revision", "deletion-0001", xet_off=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # someone replaces the weights on main, keeping the card and the manifest
    tensors = load_file(saved_model / "model.safetensors")
    for name in ("model.layers.1.self_attn.v_proj.weight", "model.embed_tokens.weight"):
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[3] += 0.25
    path = saved_model.parent / "tampered.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    writer = hub.store.lfs_writer()
    data = path.read_bytes()
    writer.write(data)
    import hashlib

    oid = hashlib.sha256(data).hexdigest()
    writer.commit(oid, len(data))
    hub.store.apply_commit("model", "org/tamper", "main", message="tamper", description="", author="mallory",
                           operations=[("lfs", "model.safetensors", (oid, len(data)))])

    proc = client.cli("verify", "org/tamper")
    assert proc.returncode == 1
    assert "tensor differs: model.embed_tokens.weight" in proc.stderr
    assert "tensor differs: model.layers.1.self_attn.v_proj.weight" in proc.stderr
    assert "tensor differs: model.norm.weight" not in proc.stderr
    assert client.cli("verify", "org/tamper", "--revision", "deletion-0001").returncode == 0  # the tag is intact
