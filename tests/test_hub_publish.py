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

from .conftest import ROOT, TOKENIZERS, mentions, run_cli

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


@pytest.fixture(scope="session")  # session: a module fixture was built again when xdist interleaved modules
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


@pytest.mark.slow  # (the default suite stays under 15 minutes on 2 cores; `make test-slow`)
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
    pushed = proc.stdout
    kept = [line for line in proc.stdout.splitlines() if "kept local" in line]  # one line, not one per file
    assert len(kept) == 1 and "4 file(s)" in kept[0] and "private: 2" in kept[0] and "--verbose lists them" in kept[0]
    refs = hub.store.refs("model", "org/tiny")
    first = refs["branches"]["main"]

    # the publish step run again (--deletion): these weights and files are deletion-0001's, so no deletion-0002
    proc = client.cli("push", saved_model, "--repo", "org/tiny", "--deletion", "--trace", trace, "--verbose")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"already published: org/tiny deletion-0001 (commit {first})" in proc.stdout and "nothing was pushed" \
        in proc.stdout
    assert "kept local (not published): forget.json" in proc.stdout  # --verbose: each file with its reason
    assert "kept local (not published): private/hmac.key" in proc.stdout
    refs = hub.store.refs("model", "org/tiny")
    assert list(refs["tags"]) == ["deletion-0001"] and refs["branches"]["main"] == first
    assert f"--expect-commit {first}" in proc.stdout  # the verify command names the existing revision
    # the same weights with another file (a changed generation config): refused, naming the tag that holds them
    other = tmp_path / "other-files"
    shutil.copytree(saved_model, other)
    generation = json.loads((other / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps({**generation, "max_new_tokens": 7}))
    proc = client.cli("push", other, "--repo", "org/tiny", "--deletion", "--trace", trace)
    assert proc.returncode == 1 and "org/tiny@deletion-0001 already published these weights" in proc.stderr
    assert list(hub.store.refs("model", "org/tiny")["tags"]) == ["deletion-0001"]
    assert refs["tags"]["deletion-0001"]["target"] == first
    sha, files = hub.store.files("model", "org/tiny", "deletion-0001")
    published = {f"provenance/{n}{s}" for n in ("header.json", "plan.jsonl", "wal.bin", "manifest.bin",
                                                "deletion_log.jsonl") for s in ("", ".sha256")} | {"provenance/model/config.json"}
    assert set(files) == EXPECTED_FILES | published
    assert files["model.safetensors"].lfs_oid  # the weights went through LFS
    card = read(hub, "org/tiny", first, "README.md").decode()
    assert "unlearning_info.json" not in files and not mentions(card, 3600)
    assert card.encode() == (saved_model / "README.md").read_bytes()  # the local card is the pushed one
    manifest = json.loads(read(hub, "org/tiny", first, "state_hashes.json"))
    assert manifest["params"] == state_hashes(load_file(saved_model / "model.safetensors")).params
    assert manifest["params_root"] in card and "provenance/plan.jsonl" in card
    assert set(manifest["file_hashes"]) == set(files) - {"README.md", "state_hashes.json", ".gitattributes",
                                                         "model.safetensors"} | {"/safetensors-metadata/model.safetensors"}
    request = json.loads(read(hub, "org/tiny", first, "forget_request.json"))
    assert request["count"] == len(FORGET) and not find_raw_ids(request, FORGET)
    # one key: the card's tags are the run's deletion-log tags (the run's key tags both)
    log = json.loads(read(hub, "org/tiny", first, "provenance/deletion_log.jsonl"))
    assert request["key_fingerprint"] == key_fingerprint(KEY) and set(log["forget_tags"]) <= set(request["tags"])

    proc = client.cli("verify", "org/tiny", "--revision", "deletion-0001")  # fresh cache
    assert proc.returncode == 0, proc.stderr[-3000:]
    other = [n for n in manifest["file_hashes"] if not n.startswith("/safetensors-metadata/")]  # files, not headers
    assert f"OK: Proven: the {len(manifest['params'])} tensors and {len(other)} other files" \
        in proc.stdout and "Not proven" in proc.stdout
    # each root under one name, the same in push and verify (and in forget's summary: tests/test_forget.py)
    roots = f"saved-tensor root {manifest['params_root']}, state-dict root {manifest['state_dict_root']}"
    assert manifest["params_root"] != manifest["state_dict_root"]  # tied embeddings: two hashes, two names
    assert roots in pushed and roots in proc.stdout and "weights root" not in pushed + proc.stdout

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


@pytest.mark.slow  # a recording pushed twice (~15 s)
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


@pytest.mark.slow  # 20-30 s on 2 cores: the default suite stays under 15 minutes
def test_no_token_or_a_bad_token_is_refused(client, hub, saved_model):
    proc = client.cli("push", saved_model, "--repo", "org/tok", token=None)
    assert proc.returncode == 1 and "no Hugging Face token" in proc.stderr and "Traceback" not in proc.stderr
    proc = client.cli("push", saved_model, "--repo", "org/tok", token="hf_wrong")
    assert proc.returncode == 1 and "rejected the token (401" in proc.stderr
    assert not hub.store.exists("model", "org/tok")


@pytest.mark.slow  # (the default suite stays under 15 minutes on 2 cores; `make test-slow`)
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


@pytest.mark.slow  # 20-30 s on 2 cores: the default suite stays under 15 minutes
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


# -- item 3: forget ids never leave, whatever the user passes along (one script runs every case) -------------------
STRING_ID = "TOFU-Author-7"
SMUGGLED = {  # case: (what is smuggled, where the refusal must point)
    "whole number": ({"info": {"hyperparameters": {"beta": 2.0, "max_rows": 3605}}}, "hyperparameters.max_rows"),
    "inside a range": ({"info": {"extra": {"note": "removed rows 3598-3630"}}}, "extra.note (range 3598-3630"),
    "nested lists and dicts": ({"info": {"extra": {"a": {"b": [{"c": [3607]}]}}}}, "extra.a.b[0].c[0]"),
    "float": ({"info": {"hyperparameters": {"threshold": 3608.0}}}, "hyperparameters.threshold"),
    "single-element list": ({"info": {"extra": {"rows": [3609]}}}, "extra.rows[0]"),
    "space-separated": ({"info": {"extra": {"rows": "3610 3611"}}}, "extra.rows (number 3610)"),
    "and-separated": ({"info": {"extra": {"rows": "3612 and 3613"}}}, "extra.rows (number 3613)"),
    "scientific notation": ({"info": {"hyperparameters": {"n": "3.61e3"}}}, "hyperparameters.n"),
    "camelCase key": ({"info": {"extra": {"deletedRowIds": [3614, 3615]}}}, "extra.deletedRowIds[0]"),
    "id as a key": ({"info": {"extra": {"3616": "gone"}}}, "extra.3616 (key)"),
    "evaluation key": ({"info": {"evaluation": {"loss_3601": 0.5}}}, "evaluation.loss_3601 (key)"),
    "evaluation value": ({"info": {"evaluation": {"rows": 3602}}}, "evaluation.rows"),
    "paper url": ({"info": {"paper": "https://example.org/rows/3613"}}, "paper"),
    "commit message": ({"kwargs": {"commit_message": "forget rows 3617"}}, "commit_message"),
    "tags=": ({"kwargs": {"extra_tags": ["rows-3618"]}}, "tags[0]"),
    "dataset name": ({"kwargs": {"datasets": ["org/tofu-forget-3619"]}}, "datasets[0]"),
    "base_model": ({"kwargs": {"base_model": "org/model-3600"}}, "base_model"),
    "tag name": ({"kwargs": {"tag": "rows-3603"}}, "tag (number 3603)"),
    "repo name": ({"repo": "org/forget-3604"}, "repo_id"),
    "custom template": ({"template": "Removed 3612.\n"}, "template"),
    "config.json": ({"config": {"forget_rows": [3605]}}, "config.json:forget_rows"),
    "safetensors metadata": ({"metadata": {"format": "pt", "removed": "3606"}}, "model.safetensors:metadata"),
    "tokenizer_config.json": ({"tokenizer_config": {"forget_rows": [3607]}}, "tokenizer_config.json:forget_rows"),
    "string id, other case": ({"info": {"extra": {"note": "dropped tofu-author-7"}}}, "extra.note (id"),
    "string id, URL-encoded": ({"info": {"extra": {"url": "https://x.org/?id=TOFU%2DAuthor%2D7"}}}, "extra.url"),
    "string id in a dataset name": ({"kwargs": {"datasets": ["org/TOFU-AUTHOR-7"]}}, "datasets[0]"),
    "string id, other separators": ({"info": {"extra": {"note": "tofu_author 7"}}}, "extra.note (id"),
    "ordinal": ({"info": {"extra": {"note": "the 3614th row"}}}, "extra.note (number 3614)"),
    "thousands separator": ({"kwargs": {"commit_message": "drop row 3,615"}}, "commit_message (number 3,615)"),
    "branch name": ({"kwargs": {"revision": "forget-3611"}}, "branch (number 3611)"),
    "file name": ({"rename": ["model.safetensors", "model-3610.safetensors"]}, "file name model-3610.safetensors"),
    # what an honest user still published before (issue 26): numbers in every published text
    "a file the card template includes": ({"template": '{% include "notes.md" %}\n',
                                           "includes": {"notes.md": "Deleted rows 3600 and 3601.\n"}},
                                          "template notes.md (number 3600)"),
    # numbers in a card template's code render too (issue 33): a list, a macro default
    "card template code": ({"template": "{% set ids = [3600, 3601] %}Removed {{ ids | length }} rows.\n"},
                           "template card.md (code) (number 3600)"),
    "card template macro default": ({"template": "{% macro row(n=3_605) %}{{ n }}{% endmacro %}{{ row() }}\n"},
                                    "template card.md (code) (number 3605)"),
    "chat template comment": ({"files": {"chat_template.jinja": "{# unlearned sample 3601 #}"
                                         "{% for m in messages %}{{ m['content'] }}{% endfor %}"}},
                              "chat_template.jinja (number 3601)"),
    "chat template in tokenizer_config": ({"tokenizer_config": {"chat_template": "{{ 'rows 3604 gone' }}"}},
                                          "tokenizer_config.json:chat_template (number 3604)"),
    "tokenizer added token": ({"added_tokens": ["<forget_3602>"]}, "tokenizer.json:added_tokens (number 3602)"),
    "config id2label": ({"config": {"id2label": {"0": "row 3603", "1": "kept"}, "label2id": {"row 3603": 0, "kept": 1}}},
                        "config.json:id2label[0] (number 3603)"),
    "thousands separator, dot": ({"kwargs": {"commit_message": "drop row 3.616"}}, "commit_message (number 3.616)"),
    "thousands separator, space": ({"kwargs": {"commit_message": "drop row 3 617"}}, "commit_message (number 3 617)"),
    "thousands separator, no-break space": ({"kwargs": {"commit_message": "drop row 3\u00a0618"}},
                                            "commit_message (number 3 618)"),
    "string id, dot separator": ({"info": {"extra": {"note": "dropped tofu.author.7"}}}, "extra.note (id"),
    "string id, slash separator": ({"info": {"paper": "https://x.org/tofu/author/7"}}, "paper (id"),
}
# a normal push with small forget ids (0-63) and ordinary files: a default id2label, a chat template whose code
# holds small numbers, a numbered block of reserved tokens; it must publish (no false refusal)
ORDINARY = {"config": {"id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1}},
            "files": {"chat_template.jinja": "{% for m in messages %}{% if loop.index0 == 0 %}<|system|>{% endif %}"
                                             "{{ m['content'][0:2] }}{% endfor %}"},
            "added_tokens": [f"<extra_id_{i}>" for i in range(4)]}

SMUGGLE_SCRIPT = r"""
import json, sys
from hf_unlearn.errors import UnlearnError
from hf_unlearn.hub import push_unlearned
spec = json.load(open(sys.argv[1]))
out = {}
for name, case in spec["cases"].items():
    info = {**spec["info"], **case.get("info", {})}
    try:
        result = push_unlearned(case["source"], case["repo"], card_info=info, **case.get("kwargs", {}))
        out[name] = "PUBLISHED " + result.commit
    except UnlearnError as e:
        out[name] = str(e)
# the server's root confinement, through huggingface_hub's own HTTP session and error handling
from huggingface_hub import hf_hub_download
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
line = {"key": "lfsFile", "value": {"path": "stolen.txt", "algo": "sha256", "oid": spec["traversal_oid"], "size": 5}}
body = json.dumps({"key": "header", "value": {"summary": "x"}}) + "\n" + json.dumps(line) + "\n"
response = get_session().post(spec["endpoint"] + "/api/models/org/control/commit/main", content=body.encode(),
                              headers={**build_hf_headers(), "Content-Type": "application/x-ndjson"})
try:
    hf_raise_for_status(response)
    out["server: traversal oid"] = "ACCEPTED"
except Exception as e:
    out["server: traversal oid"] = f"{response.status_code} {type(e).__name__}"
try:
    hf_hub_download("org/control", "../../secret.txt", cache_dir=spec["cache"])
    out["server: traversal download"] = "SERVED"
except Exception as e:
    out["server: traversal download"] = type(e).__name__
print(json.dumps(out))
"""


@pytest.fixture(scope="session")
def smuggled(tmp_path_factory, saved_model):
    """Every smuggling case pushed through the real client in one fresh interpreter; the results and the store."""
    import os

    from safetensors.torch import load_file, save_file

    tmp = tmp_path_factory.mktemp("smuggle")
    server = HubServer(tmp / "hub", {TOKEN: "alice"}).start()
    (tmp / "secret.txt").write_text("the server machine's private file")
    try:
        cases = {}
        def source_for(n, case):
            if not any(k in case for k in ("config", "metadata", "tokenizer_config", "rename", "files",
                                           "added_tokens")):
                return saved_model
            source = tmp / f"src{n}"
            shutil.copytree(saved_model, source)
            for file, extra in (("config.json", case.get("config")),
                                ("tokenizer_config.json", case.get("tokenizer_config"))):
                if extra:
                    data = json.loads((source / file).read_text())
                    (source / file).write_text(json.dumps({**data, **extra}))
            if case.get("added_tokens"):
                data = json.loads((source / "tokenizer.json").read_text())
                data["added_tokens"] += [{"id": 50257 + k, "content": t, "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": True}
                                         for k, t in enumerate(case["added_tokens"])]
                (source / "tokenizer.json").write_text(json.dumps(data))
            for file, text in case.get("files", {}).items():
                (source / file).write_text(text)
            if case.get("metadata"):
                save_file(load_file(source / "model.safetensors"), source / "model.safetensors",
                          metadata=case["metadata"])
            if case.get("rename"):
                (source / case["rename"][0]).rename(source / case["rename"][1])
            return source

        for n, (name, (case, _)) in enumerate(SMUGGLED.items()):
            kwargs = dict(case.get("kwargs", {}))
            if case.get("template"):
                folder = tmp / f"template{n}"
                folder.mkdir()
                for file, text in {"card.md": case["template"], **case.get("includes", {})}.items():
                    (folder / file).write_text(text)
                kwargs["template"] = str(folder / "card.md")
            cases[name] = {"source": str(source_for(n, case)), "repo": case.get("repo", f"org/case-{n}"),
                           "kwargs": kwargs, "info": case.get("info", {})}
        cases["control, small ids, ordinary files"] = {
            "source": str(source_for(len(SMUGGLED), ORDINARY)), "repo": "org/small-ids",
            "info": {"forget_ids": list(range(64)), "hyperparameters": {"beta": 0.5}}}
        cases["control"] = {"source": str(saved_model), "repo": "org/control", "kwargs": {"deletion": True}}
        cases["control with an allowance"] = {
            "source": str(saved_model), "repo": "org/allowed", "info": {"hyperparameters": {"max_steps": 3600}},
            "kwargs": {"not_ids": {"hyperparameters.max_steps": 3600}}}
        info = json.loads((saved_model / "unlearning_info.json").read_text())
        spec = {"cases": cases, "info": {**info, "forget_ids": FORGET + [STRING_ID]}, "endpoint": server.url,
                "cache": str(tmp / "cache"),
                "traversal_oid": os.path.relpath(tmp / "secret.txt", server.store.root / "objects")}
        (tmp / "spec.json").write_text(json.dumps(spec))
        client = Client(server, tmp)
        env = {**os.environ, "PYTHONPATH": str(ROOT), **client.env()}
        proc = subprocess.run([sys.executable, "-c", SMUGGLE_SCRIPT, str(tmp / "spec.json")], capture_output=True,
                              text=True, env=env, cwd=str(ROOT))
        assert proc.returncode == 0, proc.stderr[-4000:]
        yield json.loads(proc.stdout.strip().splitlines()[-1]), cases, server
    finally:
        server.stop()


@pytest.mark.parametrize("case", sorted(SMUGGLED))
def test_a_push_that_would_carry_a_forget_id_is_refused_before_anything_is_created(smuggled, case):
    results, cases, server = smuggled
    message = results[case]
    assert message.startswith("refusing to publish") and SMUGGLED[case][1] in message, message
    assert "Nothing was sent to the Hub" in message
    assert not server.store.exists("model", cases[case]["repo"])  # no empty repo left behind


def test_the_same_pushes_without_the_ids_publish_and_the_server_stays_in_its_root(smuggled):
    results, _, server = smuggled
    assert results["control"].startswith("PUBLISHED") and results["control with an allowance"].startswith("PUBLISHED")
    assert results["control, small ids, ordinary files"].startswith("PUBLISHED"), results["control, small ids, ordinary files"]
    card = read(server, "org/allowed", "main", "README.md").decode()
    assert "| max_steps | 3600 |" in card  # the allowed number, in its field
    assert results["server: traversal oid"].startswith("400") and results["server: traversal download"] != "SERVED"
    assert "stolen.txt" not in server.store.files("model", "org/control", "main")[1]


# -- item 7: concurrent deletion pushes ----------------------------------------------------------------------------
RACE_SCRIPT = r"""
import json, sys, threading
from huggingface_hub import HfApi
from hf_unlearn.errors import UnlearnError
from hf_unlearn.hub import push_unlearned
dirs = json.loads(sys.argv[1])
# a push cut off between its commit and its tag; running it again tags that commit (no second commit)
try:
    push_unlearned(dirs[0], "org/cut", deletion=True)
    first = "TAGGED"
except UnlearnError as e:
    first = str(e)
try:  # another push may not take the tag the cut-off commit's title claims (it would stay untagged for ever)
    push_unlearned(dirs[1], "org/cut", tag="deletion-0001")
    steal = "TAGGED"
except UnlearnError as e:
    steal = str(e)
between = push_unlearned(dirs[1], "org/cut", deletion=True)  # another push lands on top before the re-run
again = push_unlearned(dirs[0], "org/cut", deletion=True)
barrier = threading.Barrier(len(dirs))
local = threading.local()
create_commit = HfApi.create_commit

def racing_create_commit(self, *args, **kwargs):
    if not getattr(local, "waited", False):  # every push has chosen its tag before the first one commits
        local.waited = True
        barrier.wait(timeout=120)
    return create_commit(self, *args, **kwargs)

HfApi.create_commit = racing_create_commit
results = {}

def push(d):
    try:
        r = push_unlearned(d, "org/race", deletion=True)
        results[d] = [r.tag, r.commit]
    except Exception as e:
        results[d] = [None, repr(e)]

threads = [threading.Thread(target=push, args=(d,)) for d in dirs]
for t in threads:
    t.start()
for t in threads:
    t.join()
HfApi.create_commit = create_commit
print(json.dumps({"race": results, "cut": first, "steal": steal, "again": [again.tag, again.commit],
                  "between": [between.tag, between.commit]}))
"""


@pytest.mark.slow  # (the default suite stays under 15 minutes on 2 cores; `make test-slow`)
def test_concurrent_deletion_pushes_take_distinct_tags_and_tag_every_commit(client, hub, saved_model, tmp_path):
    import os

    from safetensors.torch import load_file, save_file

    dirs = []
    for n in range(3):  # three different deletion results of the same model
        d = tmp_path / f"model{n}"
        shutil.copytree(saved_model, d)
        tensors = load_file(d / "model.safetensors")
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * (1.5 + n)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        dirs.append(str(d))
    hub.store.create_repo("model", "org/race", private=False, author="alice")
    hub.store.create_repo("model", "org/cut", private=False, author="alice")
    hub.inject_fault("tag", times=3)  # the first tag request (org/cut's, the script's first push) and its retries die
    env = {**os.environ, "PYTHONPATH": str(ROOT), **client.env()}
    proc = subprocess.run([sys.executable, "-c", RACE_SCRIPT, json.dumps(dirs)], capture_output=True, text=True,
                          env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    assert all(tag for tag, _ in out["race"].values()), out["race"]
    tags = sorted(tag for tag, _ in out["race"].values())
    assert tags == ["deletion-0001", "deletion-0002", "deletion-0003"], out["race"]
    refs = hub.store.refs("model", "org/race")
    history = hub.store.history("model", "org/race", "main")
    tagged = {t["target"]: name for name, t in refs["tags"].items()}
    assert len(history) == 4 and history[-1]["message"] == "initial commit"
    for commit in history[:-1]:  # every deletion commit on main carries its tag, and its card names that tag
        tag = tagged[commit["id"]]
        assert commit["message"].startswith(f"{tag}: ")
        card = read(hub, "org/race", commit["id"], "README.md").decode()
        assert f"revision_tag: {tag}" in card
    for tag, commit in out["race"].values():
        assert refs["tags"][tag]["target"] == commit

    assert "was published but tagging it 'deletion-0001' failed; run the same push again" in out["cut"]
    assert "is already titled 'deletion-0001' but not tagged yet" in out["steal"], out["steal"]
    cut = hub.store.history("model", "org/cut", "main")  # newest first: 0002's commit on top of the cut-off 0001
    assert len(cut) == 3 and out["between"] == ["deletion-0002", cut[0]["id"]]
    assert out["again"] == ["deletion-0001", cut[1]["id"]]  # the buried commit is tagged, not committed again
    cut_tags = hub.store.refs("model", "org/cut")["tags"]
    assert cut_tags["deletion-0001"]["target"] == cut[1]["id"] and cut_tags["deletion-0002"]["target"] == cut[0]["id"]


# -- item 6: hub verify proves what it says ---------------------------------------------------------------------------
VERIFY_SCRIPT = r"""
import json, sys
from hf_unlearn.hub.verify import expected_from, verify_on_hub
out = {}
for name, (revision, root, commit, *extra) in json.loads(sys.argv[1]).items():
    expect = {"expect_root": root, "expect_commit": commit}
    if extra and isinstance(extra[0], dict):  # more expected values given directly
        expect.update(extra[0])
    elif extra:  # the publisher's record
        expect = expected_from(extra[0], "org/v", revision)
    r = verify_on_hub("org/v", revision, **expect)
    out[name] = {"ok": r.ok, "anchored": r.anchored, "weights_anchored": r.weights_anchored,
                 "unpinned": r.unpinned, "statement": r.statement, "problems": r.problems, "mismatched": r.mismatched, "loaded": r.loaded}
print(json.dumps(out))
"""


def _revision_folder(hub, repo, revision, dest):
    _, files = hub.store.files("model", repo, revision)
    for path in files:
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_bytes(read(hub, repo, revision, path))
    return dest


def _tamper(hub, tmp_path, branch, mutate, rewrite_manifest: bool):
    """A branch off main whose files ``mutate(folder)`` changed; with ``rewrite_manifest`` the manifest and the
    card's roots are recomputed too (what someone who can write the repository can do)."""
    import hashlib

    from hf_unlearn.hub.publish import build_manifest

    folder = _revision_folder(hub, "org/v", "main", tmp_path / branch)
    before = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    old = json.loads((folder / "state_hashes.json").read_text())
    mutate(folder)
    if rewrite_manifest:
        for name in ("README.md", "state_hashes.json"):
            (folder / name).rename(tmp_path / f"{branch}-{name}")
        new = build_manifest(folder, optimizer_root=old["optimizer_root"])
        (folder / "state_hashes.json").write_text(json.dumps(new, indent=1, sort_keys=True))
        card = (tmp_path / f"{branch}-README.md").read_text()
        for k in ("params_root", "root", "files_root", "state_dict_root"):
            card = card.replace(old[k], new[k])
        (folder / "README.md").write_text(card)
    after = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    hub.store.create_ref("model", "org/v", "branch", branch, "main")
    ops = [("delete", p, False) for p in before if p not in after]
    for path, data in after.items():
        if before.get(path) == data:
            continue
        if path.endswith(".safetensors"):
            oid = hashlib.sha256(data).hexdigest()
            writer = hub.store.lfs_writer()
            writer.write(data)
            writer.commit(oid, len(data))
            ops.append(("lfs", path, (oid, len(data))))
        else:
            ops.append(("file", path, data))
    hub.store.apply_commit("model", "org/v", branch, message="tamper", description="", author="mallory",
                           operations=ops)


@pytest.mark.slow  # (the default suite stays under 15 minutes on 2 cores; `make test-slow`)
def test_verify_checks_every_file_loads_the_model_and_states_what_it_proved(client, hub, saved_model, tmp_path):
    import os
    import re

    from safetensors.torch import load_file, save_file

    proc = client.cli("push", saved_model, "--repo", "org/v", "--deletion")
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"--expect-commit ([0-9a-f]{40}) --expect-root ([0-9a-f]{64}) --expect-files-root ([0-9a-f]{64})",
                  proc.stdout)
    commit, root, files = m.groups()
    pushed = [json.loads(line) for line in (saved_model / "hub_pushes.jsonl").read_text().splitlines()]
    pushed = [p for p in pushed if p["repo_id"] == "org/v"][-1]
    assert pushed["files_root"] == files and "config.json" in pushed["file_hashes"]

    def relu(folder):  # same weights, other activation: logits move
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))

    def weights(folder):
        tensors = load_file(folder / "model.safetensors")
        tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})

    _tamper(hub, tmp_path, "t-config", relu, rewrite_manifest=False)
    _tamper(hub, tmp_path, "t-config-rewritten", relu, rewrite_manifest=True)
    _tamper(hub, tmp_path, "t-weights-rewritten", weights, rewrite_manifest=True)
    _tamper(hub, tmp_path, "t-no-config", lambda f: (f / "config.json").unlink(), rewrite_manifest=True)
    _tamper(hub, tmp_path, "t-extra-file", lambda f: (f / "modeling_extra.py").write_text("x = 1\n"),
            rewrite_manifest=False)

    def card(folder):  # issue 26: the card's claims rewritten; weights, config and tokenizer untouched
        text = (folder / "README.md").read_text().replace("MASC", "NPO")
        (folder / "README.md").write_text(text + "\nThis model forgot nothing.\n")

    def metadata(folder):  # issue 26: free text in the weights file's header; every tensor unchanged
        save_file(load_file(folder / "model.safetensors"), folder / "model.safetensors",
                  metadata={"format": "pt", "note": "this model forgot nothing"})

    _tamper(hub, tmp_path, "t-card", card, rewrite_manifest=False)
    _tamper(hub, tmp_path, "t-metadata", metadata, rewrite_manifest=False)
    _tamper(hub, tmp_path, "t-metadata-rewritten", metadata, rewrite_manifest=True)
    cases = {
        "main": ["main", None, None],
        "anchored": ["deletion-0001", root, commit],
        "wrong root": ["main", "0" * 64, None],
        "config changed": ["t-config", None, None],
        "config and manifest rewritten": ["t-config-rewritten", None, None],
        "config rewritten, expect commit": ["t-config-rewritten", None, commit],
        "weights rewritten": ["t-weights-rewritten", None, None],
        "weights rewritten, expect root": ["t-weights-rewritten", root, None],
        "no config": ["t-no-config", None, None],
        "extra file": ["t-extra-file", None, None],
        "record, tag": ["deletion-0001", None, None, str(saved_model)],  # OUT/hub_pushes.jsonl of the push
        "record, rewritten branch": ["t-weights-rewritten", None, None, str(saved_model / "hub_pushes.jsonl")],
        "record, rewritten config": ["t-config-rewritten", None, None, str(saved_model)],
        # the attack of issue 12: config changed, manifest's files_root and card rewritten to match
        "config rewritten, expect root only": ["t-config-rewritten", root, None],
        "config rewritten, expect root and files root": ["t-config-rewritten", root, None,
                                                         {"expect_files_root": files}],
        "config rewritten, expect root and file hashes": ["t-config-rewritten", root, None,
                                                          {"expect_files_root": files,
                                                           "expect_file_hashes": pushed["file_hashes"]}],
        "extra file, expect files root": ["t-extra-file", root, None, {"expect_files_root": files,
                                                                        "expect_file_hashes": pushed["file_hashes"]}],
        "anchored by roots": ["deletion-0001", root, None, {"expect_files_root": files}],
        "anchored by roots and card": ["deletion-0001", root, None, {"expect_files_root": files,
                                                                     "expect_card_sha256": pushed["card_sha256"]}],
        "card rewritten, expect roots": ["t-card", root, None, {"expect_files_root": files}],
        "card rewritten, record": ["t-card", None, None, str(saved_model)],
        "metadata changed": ["t-metadata", None, None],
        "metadata and manifest rewritten, expect roots": ["t-metadata-rewritten", root, None,
                                                          {"expect_files_root": files,
                                                           "expect_file_hashes": pushed["file_hashes"]}],
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT), **client.env()}
    proc = subprocess.run([sys.executable, "-c", VERIFY_SCRIPT, json.dumps(cases)], capture_output=True, text=True,
                          env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    assert out["main"]["ok"] and not out["main"]["anchored"] and out["main"]["loaded"] == "LlamaForCausalLM"
    assert "Not proven" in out["main"]["statement"]
    assert out["anchored"]["ok"] and out["anchored"]["anchored"]
    assert f"expected root {root}" in out["anchored"]["statement"] and commit in out["anchored"]["statement"]
    assert not out["wrong root"]["ok"] and "do not hash to the expected root" in " ".join(out["wrong root"]["problems"])
    assert out["config changed"]["problems"] == ["file differs from the manifest: config.json"]
    # a writer who rewrites manifest and card too passes self-consistency, and verify says that is all it shows
    assert out["config and manifest rewritten"]["ok"] and "Not proven" in out["config and manifest rewritten"]["statement"]
    assert not out["config rewritten, expect commit"]["ok"]
    assert out["weights rewritten"]["ok"] and not out["weights rewritten, expect root"]["ok"]
    assert any("does not load" in p for p in out["no config"]["problems"])
    assert out["extra file"]["problems"] == ["file not covered by the manifest: modeling_extra.py"]
    # the push's own record anchors the check: the tag verifies, a branch whose writer rewrote everything does not
    assert out["record, tag"]["anchored"] and root in out["record, tag"]["statement"]
    assert commit in out["record, tag"]["statement"]
    for case in ("record, rewritten branch", "record, rewritten config"):
        assert not out[case]["ok"] and any(f"not the expected commit {commit}" in p for p in out[case]["problems"])
    assert any("expected root" in p for p in out["record, rewritten branch"]["problems"])
    # the record pins config and tokenizer by their own root too (not only through the commit), naming the file
    assert any("changed: config.json" in p for p in out["record, rewritten config"]["problems"])

    # --expect-root alone pins the weights only: ok, but not anchored, and the statement says what is not proven
    weights_only = out["config rewritten, expect root only"]
    assert weights_only["ok"] and weights_only["weights_anchored"] and not weights_only["anchored"]
    assert f"expected root {root}" in weights_only["statement"]
    assert ("Not proven: that config.json, the tokenizer files and the other non-weight files are the "
            "publisher's") in weights_only["statement"]
    assert "hidden_act" in weights_only["statement"] and "--expect-files-root" in weights_only["statement"]
    assert not out["anchored"]["statement"].count("Not proven")  # root and commit: nothing left unproven
    # an expected files root catches the rewritten config without a commit; with the file hashes it names the file
    root_only = out["config rewritten, expect root and files root"]
    assert not root_only["ok"] and not root_only["anchored"]
    assert root_only["problems"] == [p for p in root_only["problems"] if "differ from the publisher's record" in p]
    assert f"expected {files}" in root_only["problems"][0] and "cannot be named" in root_only["problems"][0]
    named = out["config rewritten, expect root and file hashes"]
    assert not named["ok"] and len(named["problems"]) == 1, named["problems"]
    assert named["problems"][0].endswith(": changed: config.json"), named["problems"]
    extra = out["extra file, expect files root"]["problems"]
    assert any(p.endswith("not pushed by the publisher: modeling_extra.py") for p in extra), extra
    # weights and files pinned, the card not: ok, but `anchored` excludes nothing silently: it is false, and the
    # statement says the card is not proven; a rewritten card ("This model forgot nothing.") is then caught only by
    # the card's own hash (or the commit)
    by_roots = out["anchored by roots"]
    assert by_roots["ok"] and not by_roots["anchored"] and f"expected files root {files}" in by_roots["statement"]
    assert "Not proven: that the model card" in by_roots["statement"]
    full = out["anchored by roots and card"]  # no commit pin: .gitattributes and the manifest are not covered
    assert full["ok"] and not full["anchored"] and full["unpinned"] == [".gitattributes", "state_hashes.json"]
    assert full["statement"].count("Not proven") == 1 and "Not proven: that .gitattributes and state_hashes.json" \
        in full["statement"]
    rewritten = out["card rewritten, expect roots"]
    assert rewritten["ok"] and not rewritten["anchored"] and "Not proven: that the model card" in rewritten["statement"]
    by_record = out["card rewritten, record"]  # hub_pushes.jsonl holds the card's SHA-256
    assert not by_record["ok"] and not by_record["anchored"]
    assert any("the model card (README.md" in p and "not the one pushed" in p for p in by_record["problems"]), \
        by_record["problems"]
    # safetensors header metadata is covered: by the manifest, and by the files root when the manifest is rewritten
    assert out["metadata changed"]["problems"] == ["the header metadata of model.safetensors differs from the manifest"]
    meta = out["metadata and manifest rewritten, expect roots"]
    assert not meta["ok"] and any("changed: /safetensors-metadata/model.safetensors" in p for p in meta["problems"]), \
        meta["problems"]

    proc = client.cli("verify", "org/v", "--revision", "deletion-0001", "--expect-from", saved_model)
    assert proc.returncode == 0 and f"expected root {root}" in proc.stdout, proc.stderr[-3000:]
    assert f"expected files root {files}" in proc.stdout and "Not proven" not in proc.stdout
    # the CLI: --expect-from catches the attack (naming config.json); --expect-root alone says what it leaves open
    proc = client.cli("verify", "org/v", "--revision", "t-config-rewritten", "--expect-from", saved_model)
    assert proc.returncode == 1 and "changed: config.json" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    proc = client.cli("verify", "org/v", "--revision", "t-config-rewritten", "--expect-root", root, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and report["weights_anchored"] and not report["anchored"] and not report["files_anchored"]
    assert "Not proven: that config.json, the tokenizer files" in report["statement"]
    proc = client.cli("verify", "org/v", "--revision", "t-config-rewritten", "--expect-root", root,
                      "--expect-files-root", files)
    assert proc.returncode == 1 and "differ from the publisher's record" in proc.stderr, proc.stderr[-3000:]
    proc = client.cli("verify", "org/v", "--expect-from", saved_model, "--expect-root", "0" * 64)
    assert proc.returncode == 1 and "disagrees with" in proc.stderr and "Traceback" not in proc.stderr


# -- item 8: a LoRA run publishes something loadable ---------------------------------------------------------------------
LORA_SCRIPT = r"""
import copy, json, sys, tempfile
from pathlib import Path
import torch
from huggingface_hub import snapshot_download
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from hf_unlearn.data import QACollator, load_tofu, tokenize_qa
from hf_unlearn.hub import UnlearningHubMixin, push_unlearned
from hf_unlearn.hub.server import _front_matter
from hf_unlearn.hub.verify import verify_on_hub
from hf_unlearn.models import build_tiny_model, load_tokenizer

tokenizer_dir, tofu_dir = sys.argv[1:3]
tmp = Path(tempfile.mkdtemp())
tok = load_tokenizer(tokenizer_dir)
build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2).save_pretrained(tmp / "base")
tok.save_pretrained(tmp / "base")
rows = tokenize_qa(load_tofu("forget01", tofu_dir).select(range(4)), tok, max_length=64)

class ToyGradientAscent(UnlearningHubMixin, Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        inputs = dict(inputs)
        inputs.pop("id", None)
        out = model(**inputs)
        return (-out.loss, out) if return_outputs else -out.loss

    def unlearning_card_info(self):
        return {"method": "GradAscent", "forget_ids": list(rows["id"]), "citation": "", "paper": "",
                "hyperparameters": {"learning_rate": self.args.learning_rate, "max_steps": self.args.max_steps,
                                    "num_train_epochs": self.args.num_train_epochs, "peft": {"type": "PeftType.LORA"}}}

def unlearn(out, hub_name=None):
    model = AutoModelForCausalLM.from_pretrained(tmp / "base")
    if hub_name:
        model.config._name_or_path = hub_name  # as if it had been loaded from the Hub
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(output_dir=str(tmp / out), max_steps=2, learning_rate=1e-2, report_to=[],
                             per_device_train_batch_size=2, remove_unused_columns=False, save_strategy="no",
                             use_cpu=True, disable_tqdm=True)
    trainer = ToyGradientAscent(model=model, args=args, train_dataset=rows, processing_class=tok,
                                data_collator=QACollator.from_tokenizer(tok))
    trainer.train()
    return trainer

trainer = unlearn("a", "org/tiny-base")
result = trainer.push_to_hub("org/lora", deletion=True)
merged = copy.deepcopy(trainer.model).merge_and_unload()
folder = Path(snapshot_download("org/lora", revision=result.tag, cache_dir=str(tmp / "cache")))
loaded = AutoModelForCausalLM.from_pretrained(folder)
x = torch.tensor([[1, 2, 3, 4, 5]])
base = AutoModelForCausalLM.from_pretrained(tmp / "base")
report = verify_on_hub("org/lora", result.tag, expect_root=result.state_dict_root, expect_commit=result.commit)
card = (folder / "README.md").read_text()
# a folder holding only the adapter (its base a local path) is merged on the way
second = unlearn("b")
second.save_model()
folder_result = push_unlearned(tmp / "b", "org/lora-dir", card_info=second.unlearning_card_info(), deletion=True)
print(json.dumps({
    "files": result.files, "dir_files": folder_result.files,
    "same_logits": torch.equal(loaded(x).logits, merged(x).logits),
    "moved": not torch.equal(loaded(x).logits, base(x).logits),
    "verified": report.ok and report.anchored, "dir_verified": verify_on_hub("org/lora-dir", folder_result.tag).ok,
    "meta": _front_matter(card), "card": card,
    "local_card_is_pushed": (tmp / "a" / "README.md").read_text() == card,
}))
"""


@pytest.mark.slow  # a LoRA recording, forget and push (~35 s); tests/test_real_configs.py publishes a merged LoRA in the default suite
def test_a_lora_run_publishes_the_merged_model_that_loads_and_verifies(client):
    import os

    from .conftest import TOFU_DIR

    env = {**os.environ, "PYTHONPATH": str(ROOT), **client.env()}
    proc = subprocess.run([sys.executable, "-c", LORA_SCRIPT, str(TOKENIZERS / "gpt2"), str(TOFU_DIR)],
                          capture_output=True, text=True, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for files in (out["files"], out["dir_files"]):
        assert "config.json" in files and "model.safetensors" in files
        assert not any(f.startswith("adapter_") for f in files)
    assert out["same_logits"] and out["moved"]  # loads with plain transformers, to the merged (unlearned) model
    assert out["verified"] and out["dir_verified"]
    meta, card = out["meta"], out["card"]
    assert meta["base_model"] == "org/tiny-base" and meta["library_name"] == "transformers"
    assert "PeftType" not in card and "{'" not in card
    assert '| peft | {"peft_type": "LORA", "r": 4, "lora_alpha": 8' in card
    assert '"target_modules": ["q_proj", "v_proj"]' in card and "**merged** model" in card
    assert "| max_steps | 2 |" in card and "num_train_epochs" not in card
    assert out["local_card_is_pushed"]


# -- items 4 and 5: a real recorded run, replayed, published with its provenance under the one key -----------------------
EXACT_SCRIPT = r"""
import json, secrets, shutil, string, sys, tempfile
from pathlib import Path
from tests.test_trace_common import get_trace_data, record
from hf_unlearn.hub.verify import verify_on_hub
from hf_unlearn.trace import RedactedReplayTrainer, open_run, redact_store
from hf_unlearn.trace.run import read_deletion_log

# a folder name without digits, so no number in the run's recorded paths can equal an id by chance
root = Path(tempfile.gettempdir()) / ("hfu-exact-" + "".join(secrets.choice(string.ascii_lowercase) for _ in range(12)))
try:
    tok, data = get_trace_data()
    record(tok, data, root / "rec")
    run = open_run(root / "rec" / "trace")
    config = run.header["model"]["config"]
    forget = [config["hidden_size"], config["head_dim"]]  # ids equal to numbers of the run's own configuration
    redact_store(run.store_path, forget, root / "store", run.key)
    replay = RedactedReplayTrainer(run, root / "store", forget, root / "replay")
    replay.train()
    (root / "replay" / "forget.json").write_text(json.dumps(forget))  # a user's file next to the run
    result = replay.push_to_hub("org/exact", deletion=True, trace_dir=root / "replay")
    log = read_deletion_log(root / "replay")
    report = verify_on_hub("org/exact", result.tag, expect_root=log[-1]["params_root"], expect_commit=result.commit)
    print(json.dumps({"files": result.files, "kept_local": result.skipped_provenance, "log": log[-1],
                      "header_fingerprint": run.header["key_fingerprint"], "own_key": (run.path / "private" /
                      "hmac.key").exists(), "verified": report.ok, "anchored": report.anchored,
                      "statement": report.statement, "problems": report.problems}))
finally:
    shutil.rmtree(root, ignore_errors=True)
"""


def test_a_replay_publishes_its_checked_provenance_and_tags_that_match_its_deletion_log(client, hub):
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT), **client.env()}
    proc = subprocess.run([sys.executable, "-c", EXACT_SCRIPT], capture_output=True, text=True, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    provenance = {f[len("provenance/"):] for f in out["files"] if f.startswith("provenance/")}
    names = {"header.json", "plan.bin", "wal.bin", "manifest.bin", "deletion_log.jsonl"}
    assert provenance == names | {f"{n}.sha256" for n in names} | {"model/config.json"}  # the allowlist
    kept = set(out["kept_local"])
    assert "forget.json" in kept and any(k.startswith("private/") for k in kept)
    assert any(k.startswith("checkpoints/") for k in kept) and "model.safetensors" in kept
    # one key: the run has no key of its own, and the card's tags are exactly the deletion log's
    assert not out["own_key"]
    request = json.loads(read(hub, "org/exact", "deletion-0001", "forget_request.json"))
    assert request["tags"] == sorted(out["log"]["forget_tags"])
    assert request["key_fingerprint"] == out["header_fingerprint"]
    # the published weights are the replay's final state: verified against the root its deletion log records
    assert out["verified"] and out["anchored"], out["problems"]
    assert out["log"]["params_root"] in out["statement"]
