"""The local Hub-compatible server, spoken to over real HTTP (urllib) in-process: protocol details, auth, atomicity.

The end-to-end tests with the real huggingface_hub client are in test_hub_publish.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import urllib.error
import urllib.request

import pytest

from hf_unlearn.hub.server import HubServer
from hf_unlearn.hub.store import git_blob_id

TOKEN = "hf_local_test_token"


@pytest.fixture
def server(tmp_path):
    srv = HubServer(tmp_path / "hub", {TOKEN: "alice"}).start()
    yield srv
    srv.stop()


def call(server, method, path, body=None, token=TOKEN, headers=None, raw=None):
    """(status, headers, body bytes) of one request; JSON bodies for dicts."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(server.url + path, data=data, method=method, headers=dict(headers or {}))
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def commit(server, repo, lines, branch="main", token=TOKEN):
    payload = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    return call(server, "POST", f"/api/models/{repo}/commit/{branch}", raw=payload, token=token,
                headers={"Content-Type": "application/x-ndjson"})


def file_line(path, data: bytes):
    return {"key": "file", "value": {"path": path, "content": base64.b64encode(data).decode(), "encoding": "base64"}}


def header(summary="msg"):
    return {"key": "header", "value": {"summary": summary, "description": ""}}


def upload_lfs(server, repo, data: bytes) -> str:
    oid = hashlib.sha256(data).hexdigest()
    status, _, body = call(server, "POST", f"/{repo}.git/info/lfs/objects/batch",
                           {"operation": "upload", "transfers": ["basic"], "hash_algo": "sha256",
                            "objects": [{"oid": oid, "size": len(data)}]})
    assert status == 200
    action = json.loads(body)["objects"][0]["actions"]
    put = urllib.request.Request(action["upload"]["href"], data=data, method="PUT")  # no token: signed URL
    with urllib.request.urlopen(put, timeout=10) as r:
        assert r.status == 200
    return oid


def test_whoami_checks_the_token(server):
    assert call(server, "GET", "/api/whoami-v2", token=None)[0] == 401
    status, hdrs, _ = call(server, "GET", "/api/whoami-v2", token="wrong")
    assert status == 401 and "Invalid credentials" in hdrs["X-Error-Message"]
    status, _, body = call(server, "GET", "/api/whoami-v2")
    assert status == 200 and json.loads(body)["name"] == "alice"


def test_create_repo_conflict_carries_the_url(server):
    status, _, body = call(server, "POST", "/api/repos/create", {"name": "m", "organization": "org", "type": "model"})
    assert status == 200 and json.loads(body)["url"] == f"{server.url}/org/m"
    status, _, body = call(server, "POST", "/api/repos/create", {"name": "m", "organization": "org"})
    assert status == 409 and json.loads(body)["url"] == f"{server.url}/org/m"
    assert call(server, "POST", "/api/repos/create", {"name": "x", "organization": "org"}, token=None)[0] == 401


def test_validate_yaml(server):
    ok = call(server, "POST", "/api/validate-yaml", {"content": "---\nlicense: mit\ntags: [a]\n---\nhi", "repoType": "model"})
    assert ok[0] == 200 and json.loads(ok[2])["errors"] == []
    bad = call(server, "POST", "/api/validate-yaml",
               {"content": "---\nlicense: [1]\nmodel-index: [{name: m, results: [{task: {}}]}]\n---\n"})
    messages = [e["message"] for e in json.loads(bad[2])["errors"]]
    assert bad[0] == 400 and any("license" in m for m in messages) and any("task.type" in m for m in messages)
    assert json.loads(call(server, "POST", "/api/validate-yaml", {"content": "no metadata"})[2])["warnings"]


def test_commit_inline_and_lfs_then_resolve_headers(server):
    call(server, "POST", "/api/repos/create", {"name": "m", "organization": "org"})
    big = bytes(range(256)) * 4096
    oid = upload_lfs(server, "org/m", big)
    status, _, body = commit(server, "org/m", [header(), file_line("config.json", b'{"a": 1}'),
                                               {"key": "lfsFile", "value": {"path": "w/model.safetensors",
                                                                            "algo": "sha256", "oid": oid,
                                                                            "size": len(big)}}])
    assert status == 200
    sha = json.loads(body)["commitOid"]

    status, hdrs, data = call(server, "GET", "/org/m/resolve/main/config.json", token=None)
    assert status == 200 and data == b'{"a": 1}'
    assert hdrs["X-Repo-Commit"] == sha and hdrs["ETag"] == f'"{git_blob_id(data)}"' and "X-Linked-Etag" not in hdrs
    status, hdrs, _ = call(server, "HEAD", "/org/m/resolve/main/w/model.safetensors")
    assert status == 200 and hdrs["X-Linked-Etag"] == f'"{oid}"' and int(hdrs["Content-Length"]) == len(big)
    status, hdrs, data = call(server, "GET", "/org/m/resolve/main/w/model.safetensors", headers={"Range": "bytes=10-"})
    assert status == 206 and data == big[10:]

    info = json.loads(call(server, "GET", f"/api/models/org/m/revision/{sha}?blobs=true")[2])
    siblings = {s["rfilename"]: s for s in info["siblings"]}
    assert info["sha"] == sha and siblings["w/model.safetensors"]["lfs"]["sha256"] == oid
    tree = json.loads(call(server, "GET", "/api/models/org/m/tree/main?recursive=true")[2])
    assert {t["path"]: t["type"] for t in tree} == {".gitattributes": "file", "config.json": "file",
                                                    "w": "directory", "w/model.safetensors": "file"}
    assert call(server, "GET", "/org/m/resolve/main/missing.txt")[1]["X-Error-Code"] == "EntryNotFound"
    assert call(server, "GET", "/org/m/resolve/nope/config.json")[1]["X-Error-Code"] == "RevisionNotFound"


def test_tags_are_refs_and_are_append_only(server):
    call(server, "POST", "/api/repos/create", {"name": "m", "organization": "org"})
    sha = json.loads(commit(server, "org/m", [header(), file_line("a.txt", b"1")])[2])["commitOid"]
    assert call(server, "POST", "/api/models/org/m/tag/main", {"tag": "deletion-0001", "message": "m"})[0] == 200
    assert call(server, "POST", "/api/models/org/m/tag/main", {"tag": "deletion-0001"})[0] == 409
    refs = json.loads(call(server, "GET", "/api/models/org/m/refs")[2])
    assert refs["tags"] == [{"name": "deletion-0001", "ref": "refs/tags/deletion-0001", "targetCommit": sha}]
    assert call(server, "GET", "/org/m/resolve/deletion-0001/a.txt")[2] == b"1"


def test_commit_fault_publishes_nothing_and_retry_succeeds(server):
    call(server, "POST", "/api/repos/create", {"name": "m", "organization": "org"})
    before = server.store.refs("model", "org/m")
    server.inject_fault("commit")
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        commit(server, "org/m", [header(), file_line("a.txt", b"new")])
    assert server.store.refs("model", "org/m") == before
    assert call(server, "GET", "/org/m/resolve/main/a.txt")[0] == 404
    assert commit(server, "org/m", [header(), file_line("a.txt", b"new")])[0] == 200
    assert call(server, "GET", "/org/m/resolve/main/a.txt")[2] == b"new"


def test_lfs_upload_is_checked_and_signed(server):
    call(server, "POST", "/api/repos/create", {"name": "m", "organization": "org"})
    data = b"x" * 1000
    oid = hashlib.sha256(data).hexdigest()
    body = json.loads(call(server, "POST", "/org/m.git/info/lfs/objects/batch",
                           {"operation": "upload", "objects": [{"oid": oid, "size": 1000}]})[2])
    href = body["objects"][0]["actions"]["upload"]["href"]
    with pytest.raises(urllib.error.HTTPError) as e:  # wrong content for the oid: refused, nothing stored
        urllib.request.urlopen(urllib.request.Request(href, data=b"y" * 1000, method="PUT"), timeout=10)
    assert e.value.code == 400 and not server.store.has_lfs(oid)
    with pytest.raises(urllib.error.HTTPError) as e:  # unsigned URL
        urllib.request.urlopen(urllib.request.Request(href.split("&sig=")[0], data=data, method="PUT"), timeout=10)
    assert e.value.code == 403
    # a commit may not reference an object that was never uploaded
    status, _, _ = commit(server, "org/m", [header(), {"key": "lfsFile", "value": {
        "path": "m.safetensors", "algo": "sha256", "oid": oid, "size": 1000}}])
    assert status == 422


def test_private_repo_is_hidden_without_a_token(server):
    call(server, "POST", "/api/repos/create", {"name": "p", "organization": "org", "visibility": "private"})
    assert call(server, "GET", "/api/models/org/p", token=None)[1]["X-Error-Code"] == "RepoNotFound"
    assert call(server, "GET", "/api/models/org/p")[0] == 200


def test_cli_serve(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    from .conftest import ROOT

    with socket.socket() as s:  # a free port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "hf_unlearn", "hub", "serve", "--root", str(tmp_path / "store"),
                             "--port", str(port), "--token", "t1", "--token", "t2", "--user", "team"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in line
        for token in ("t1", "t2"):
            req = urllib.request.Request(f"http://127.0.0.1:{port}/api/whoami-v2",
                                         headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=10) as r:
                assert json.loads(r.read())["name"] == "team"
        assert (tmp_path / "store" / "repos").is_dir()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
