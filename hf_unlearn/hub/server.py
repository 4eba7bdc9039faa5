"""A local Hugging Face Hub-compatible HTTP server, a Starlette app on uvicorn (``hf_unlearn.webserver``).

It answers the calls the real ``huggingface_hub`` client makes to publish and download a model repository
(whoami, create repo, preupload, the NDJSON commit endpoint with inline and LFS files, LFS batch/upload/verify,
validate-yaml, repo info, tree, paths-info, refs, branches, tags, commits, and ``resolve`` downloads with ``X-Repo-Commit``,
``ETag`` and ``X-Linked-Etag``), so that ``HfApi``, ``hf_hub_download`` and ``snapshot_download`` work against it
unchanged once ``HF_ENDPOINT`` points here. Tests use it as the Hub; teams use it as an internal model store
(``hf-unlearn hub serve --root DIR --port N --token T``). Large files go through the LFS protocol, so clients must
run with ``HF_HUB_DISABLE_XET=1`` (Xet storage is not served).

Why Starlette on uvicorn, not a hand-written threaded server: slow clients (headers or bodies sent a byte at a time,
many idle sockets) starved the thread-per-connection server one attack after another. On asyncio a held connection
costs a few KB; the limits (``hf_unlearn.webserver.Limits``) bound connections in total and per client, each
request's headers and every read; each route's authentication is decided from the headers before its body is read
(the route table below says which), and the store's file work runs in worker threads that never wait on a client.
It is a single-tenant store: every configured token can read and write every repository (private repositories need
a valid token to be seen).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
from collections import OrderedDict
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote

from ..webserver import BodyError, BodyTooLarge, Limits, WebServer, abort, body_chunks, body_left_unread, read_body
from .store import GITATTRIBUTES, OID_RE, PathTree, RepoStore, StoreError, clean_path

logger = logging.getLogger(__name__)

LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
MAX_BODY_BYTES = 256 * 1024 * 1024  # a commit's NDJSON (inline files are below the LFS threshold, base64-encoded)
MAX_JSON_BYTES = 16 * 1024 * 1024  # every other JSON body
MAX_LFS_BYTES = 1 << 40
MAX_CARD_BYTES = 1024 * 1024  # a card read for its metadata (validate-yaml, repo info)
MAX_CARD_METADATA_BYTES = 64 * 1024  # its YAML front matter: a real card's is a few KB; parsing costs CPU
MAX_YAML_DEPTH = 64  # nesting levels of card metadata (a card needs a handful)
CARD_CACHE_ENTRIES = 256  # parsed card metadata kept per server, by blob id (content-addressed: never stale)
READ_TIMEOUT_S = 60.0  # a connection silent this long while a request (headers or body) is awaited is closed
MAX_CONNECTIONS = 1024  # connections open at once (asyncio: a few KB each); more are answered 503 and closed
MAX_CONNECTIONS_PER_CLIENT = 128  # from one IP address; more are answered 503 and closed
HEADER_DEADLINE_S = 15.0  # a request's line and headers must arrive within this (a byte every few seconds is no way
# to hold a connection: the read timeout is per read); an idle keep-alive connection is closed after it too
DOWNLOAD_CHUNK = 1 << 20  # bytes read (in a worker thread) and sent at a time: fewer hops, the same memory bound
LFS_SUFFIXES = tuple(line.split()[0][1:] for line in GITATTRIBUTES.decode().splitlines())
FAULT_POINTS = ("commit", "lfs-upload", "tag")
_T = r"(models|datasets|spaces)"
_R = r"([^/]+)/([^/]+)"
_PREFIX = r"^/(?:(datasets|spaces)/)?"


class _Abort(Exception):
    """Drop the connection without an answer (a server dying mid-request)."""



def _field(obj, key: str, kind, *, required: bool = False, default=None, where: str = "request body"):
    """``obj[key]`` checked to be a ``kind`` (a type or tuple of types; bools are not ints); 400 otherwise."""
    if not isinstance(obj, dict):
        raise StoreError(400, f"{where} must be a JSON object")
    value = obj.get(key)
    if value is None:
        if required:
            raise StoreError(400, f"{where} lacks {key!r}")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise StoreError(400, f"{where}: {key!r} must be {' or '.join(k.__name__ for k in kinds)}")
    return value


def _size(obj, key: str = "size", *, where: str = "request body", required: bool = True) -> int | None:
    size = _field(obj, key, int, required=required, where=where)
    if size is not None and size < 0:
        raise StoreError(400, f"{where}: {key!r} must not be negative")
    return size


def _parse_json(data: bytes, where: str):
    """``data`` parsed as JSON; 400 for anything that is not JSON, including JSON nested deeper than the parser's
    recursion limit (a few KB of ``[`` would otherwise answer 500). No Hub payload nests more than a few levels."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StoreError(400, f"{where} is not JSON: {e}") from None
    except RecursionError:
        raise StoreError(400, f"{where} is nested too deeply (no Hub request nests more than a few levels)") from None


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise StoreError(400, f"{where}: content is not valid base64") from None


class HubServer:
    """A Hub-compatible server over a :class:`RepoStore` at ``root``.

    ``tokens`` maps access tokens to user names (a bare string is one token for user ``user``). ``port=0`` picks
    a free port (bound at once: :attr:`url` is known before :meth:`start`). Use :meth:`start`/:meth:`stop` (a
    background thread) or :meth:`serve_forever`. The connection limits are :class:`hf_unlearn.webserver.Limits`'.
    """

    def __init__(self, root, tokens: dict[str, str] | str, host: str = "127.0.0.1", port: int = 0, *,
                 max_body_bytes: int = MAX_BODY_BYTES, max_lfs_bytes: int = MAX_LFS_BYTES,
                 read_timeout: float = READ_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
                 header_deadline: float = HEADER_DEADLINE_S,
                 max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT):
        self.store = RepoStore(root)
        self.max_body_bytes, self.max_lfs_bytes = int(max_body_bytes), int(max_lfs_bytes)
        self.tokens = {tokens: "user"} if isinstance(tokens, str) else dict(tokens)
        if not self.tokens:
            raise ValueError("HubServer needs at least one access token")
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        self.limits = Limits(max_connections=int(max_connections), header_deadline=float(header_deadline),
                             read_timeout=float(read_timeout),
                             max_connections_per_client=min(int(max_connections_per_client), int(max_connections)))
        self._secret = secrets.token_bytes(32)
        self._faults: dict[str, int] = {}
        self._faults_lock = threading.Lock()
        self._cards: OrderedDict[str, dict] = OrderedDict()
        self._cards_lock = threading.Lock()
        self.web = WebServer(self._app, host, port, self.limits)

    @property
    def url(self) -> str:
        return self.web.url

    def start(self) -> HubServer:
        self.web.start()
        return self

    def serve_forever(self) -> None:
        self.web.serve_forever()

    def stop(self) -> None:
        self.web.stop()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _app(self, scope, receive, send) -> None:
        from starlette.requests import Request

        if scope["type"] != "http":
            return
        response = await _Call(self, Request(scope, receive)).respond()
        if response is not None:
            await response(scope, receive, send)

    # -- fault injection (tests) ---------------------------------------------------------------------------
    def inject_fault(self, point: str, times: int = 1) -> None:
        """Make the next ``times`` requests at ``point`` die mid-way, dropping the connection unanswered.

        ``"commit"``: after the commit's objects and record are written, before the branch moves (so nothing is
        published). ``"lfs-upload"``: after half of an LFS upload body has been read (nothing is stored).
        ``"tag"``: a tag creation request, before the tag is created.
        """
        if point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {point!r}; choose one of {FAULT_POINTS}")
        with self._faults_lock:
            self._faults[point] = self._faults.get(point, 0) + times

    def _take_fault(self, point: str) -> bool:
        with self._faults_lock:
            if self._faults.get(point, 0) > 0:
                self._faults[point] -= 1
                return True
            return False

    def _sign(self, oid: str, size: int) -> str:
        return hmac.new(self._secret, f"{oid}:{size}".encode(), hashlib.sha256).hexdigest()

    def card_metadata(self, entry) -> dict:
        """The parsed YAML metadata of the card stored as ``entry`` ({} for none, an oversized or hostile one),
        parsed once per blob: every anonymous repo-info call (``snapshot_download`` makes one per reader) would
        otherwise parse it again."""
        with self._cards_lock:
            if entry.oid in self._cards:
                self._cards.move_to_end(entry.oid)
                return self._cards[entry.oid]
        meta: dict = {}
        if entry.size <= MAX_CARD_BYTES:
            with self.store.open_entry(entry) as f:
                text = f.read().decode("utf-8", "replace")
            try:
                parsed = _front_matter(text)
                meta = parsed if isinstance(parsed, dict) else {}
            except Exception:  # an invalid or hostile card (YAML aliases, oversized) is served as "no card data"
                pass
        with self._cards_lock:
            self._cards[entry.oid] = meta
            while len(self._cards) > CARD_CACHE_ENTRIES:
                self._cards.popitem(last=False)
        return meta


async def _thread(fn, *args, **kwargs):
    """``fn`` in a worker thread: the store's file work never blocks the event loop (nor waits on a client)."""
    import functools

    import anyio

    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


class _Call:
    """One request: routed by the table ``_ROUTES`` (method, raw path), authenticated from its headers, then its
    body read (the route says how much), then the handler run in a worker thread; every error is a JSON answer."""

    def __init__(self, hub: HubServer, request):
        self.hub, self.request = hub, request
        self.method = request.method
        self.headers = request.headers
        self.query = {k: v[-1] for k, v in parse_qs(request.scope.get("query_string", b"").decode("latin-1")).items()}
        self.path = request.scope.get("raw_path", request.url.path.encode()).decode("latin-1").partition("?")[0]
        self.user: str | None = None
        self.body = b""

    async def respond(self):
        try:
            response = await self._route()
        except _Abort:
            await abort(self.request)
            return None
        except StoreError as e:
            response = self._json({"error": str(e), **e.extra}, status=e.status, code=e.code)
        except BodyTooLarge as e:
            response = self._json({"error": str(e)}, status=413)
        except BodyError as e:
            response = self._json({"error": str(e)}, status=400)
        except Exception as e:  # a bug must not kill the server; answer 500 and log it
            logger.exception("internal error on %s %s", self.method, self.path)
            response = self._json({"error": f"internal error: {e}"}, status=500)
        if body_left_unread(self.request):  # never read on: the next request would start mid-body
            response.headers["Connection"] = "close"
        return response

    async def _route(self):
        method = self.method
        if method not in ("GET", "HEAD", "POST", "PUT", "DELETE"):  # a JSON 405, not an HTML page
            return self._json({"error": f"method {method} is not allowed"}, status=405,
                              headers={"Allow": "GET, HEAD, POST, PUT, DELETE"})
        for route_method, pattern, name, auth, body in _ROUTES:
            if route_method == method or (route_method == "GET" and method == "HEAD"):
                m = pattern.match(self.path)
                if m:
                    args = [unquote(g) if g is not None else None for g in m.groups()]
                    await _thread(self._authorise, auth, args)  # from the headers: before any byte of the body
                    if name == "lfs_upload":
                        return await self.lfs_upload(*args)
                    if body is not None:
                        await self._read(body)
                    result = await _thread(getattr(self, name), *args)
                    if isinstance(result, _Download):
                        return await result.response(self)
                    return result
        raise StoreError(404, f"no route for {method} {self.path}")

    async def _read(self, kind: str) -> None:
        limit = self.hub.max_body_bytes if kind == "ndjson" else min(self.hub.max_body_bytes, MAX_JSON_BYTES)
        self.body = await read_body(self.request, limit, self.hub.limits.read_timeout)

    @property
    def endpoint(self) -> str:
        """The URL clients reach us at (behind a TLS proxy: its X-Forwarded-Proto and Host)."""
        scheme = self.headers.get("X-Forwarded-Proto") or "http"
        return f"{scheme}://{self.headers.get('Host') or self.hub.url.split('://', 1)[1]}"

    def _json(self, payload, status: int = 200, code: str | None = None, headers: dict | None = None):
        from starlette.responses import Response

        out = {}
        if code:
            out["X-Error-Code"] = code
        if status >= 400:  # printable ASCII only: a client-chosen path in a message must not split the header
            out["X-Error-Message"] = re.sub(r"[^\x20-\x7e]", "?", str(payload.get("error", "")))[:200]
        out.update(headers or {})
        if not any(k.lower() == "content-type" for k in out):
            out["Content-Type"] = "application/json"
        return Response(json.dumps(payload).encode(), status_code=status, headers=out)

    def _json_body(self) -> dict:
        data = _parse_json(self.body or b"{}", "request body")
        if not isinstance(data, dict):
            raise StoreError(400, "JSON body must be an object")
        return data

    # -- auth ----------------------------------------------------------------------------------------------
    def _token_user(self) -> str | None:
        """The user of a valid token, None without a token; a token that is sent but invalid is a 401."""
        auth = self.headers.get("Authorization") or ""
        if not auth:
            return None
        token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        user = self.hub.tokens.get(token)
        if user is None:
            raise StoreError(401, "Invalid credentials in Authorization header")
        return user

    def _require_user(self) -> str:
        user = self._token_user()
        if user is None:
            raise StoreError(401, "Invalid credentials in Authorization header")
        return user

    def _authorise(self, auth: str | None, args: list) -> None:
        """The route's check, from the headers alone: ``user`` (a valid token), ``write`` (a token and an existing
        repository), ``read`` (a repository the caller may see), ``sig`` (checked by the upload) or None."""
        if auth == "user":
            self.user = self._require_user()
        elif auth in ("read", "write"):
            rtype, repo_id = (args[0][:-1] if args[0] else "model"), f"{args[1]}/{args[2]}"
            self.user = self._require_user() if auth == "write" else self._token_user()
            meta = self.hub.store.repo_meta(rtype, repo_id)
            if auth == "read" and meta["private"] and self.user is None:
                raise StoreError(404, f"Repository {repo_id} not found", "RepoNotFound")

    def _repo_url(self, rtype: str, repo_id: str) -> str:
        return f"{self.endpoint}/{'' if rtype == 'model' else rtype + 's/'}{repo_id}"

    # -- account and repos ---------------------------------------------------------------------------------
    def whoami(self):
        user = self.user
        return self._json({"type": "user", "id": hashlib.sha1(user.encode()).hexdigest()[:24], "name": user,
                           "fullname": user, "email": None, "emailVerified": False, "isPro": False, "orgs": [],
                           "auth": {"type": "access_token",
                                    "accessToken": {"displayName": "hf_unlearn local hub", "role": "write"}},
                           "hf_unlearn_hub": {"xet": False}})  # tells hf_unlearn's push to use LFS, not Xet

    def xet_token(self, *_):
        raise StoreError(501, "this Hub server does not serve Xet storage; set HF_HUB_DISABLE_XET=1 before "
                              "huggingface_hub is imported (large files then go through LFS)")

    def create_repo(self):
        user = self.user
        body = self._json_body()
        rtype = _field(body, "type", str, default="model")
        repo_id = f"{_field(body, 'organization', str) or user}/{_field(body, 'name', str, required=True)}"
        visibility = _field(body, "visibility", str)
        private = (visibility == "private") if visibility is not None else bool(_field(body, "private", bool))
        url = self._repo_url(rtype, repo_id)
        if not self.hub.store.create_repo(rtype, repo_id, private=private, author=user):
            raise StoreError(409, f"You already created this {rtype} repo", url=url)
        return self._json({"url": url, "name": repo_id, "id": repo_id})

    def delete_repo(self):
        body = self._json_body()
        repo_id = f"{_field(body, 'organization', str) or self.user}/{_field(body, 'name', str, required=True)}"
        self.hub.store.delete_repo(_field(body, "type", str, default="model"), repo_id)
        return self._json({})

    def validate_yaml(self):  # a token is required (the route table): parsing YAML costs CPU
        body = self._json_body()
        content = _field(body, "content", str, default="")
        if len(content) > MAX_CARD_BYTES:
            raise StoreError(413, f"card content larger than {MAX_CARD_BYTES} bytes")
        errors, warnings = validate_card_metadata(content)
        return self._json({"errors": [{"message": m} for m in errors],
                           "warnings": [{"message": m} for m in warnings]}, status=400 if errors else 200)

    def repo_info(self, rtypes, ns, name, revision=None):
        rtype, repo_id = rtypes[:-1], f"{ns}/{name}"
        meta = self.hub.store.repo_meta(rtype, repo_id)
        sha, files = self.hub.store.files(rtype, repo_id, revision or "main")
        commit = self.hub.store.commit(rtype, repo_id, sha)
        blobs = self.query.get("blobs", "").lower() in ("1", "true")
        siblings = []
        for entry in sorted(files.values(), key=lambda e: e.path):
            s = {"rfilename": entry.path}
            if blobs:
                s.update(size=entry.size, blobId=entry.oid)
                if entry.lfs_oid:
                    s["lfs"] = {"size": entry.size, "sha256": entry.lfs_oid, "pointerSize": entry.tree_item()["lfs"]
                                ["pointerSize"]}
            siblings.append(s)
        entry = files.get("README.md")
        card = {} if entry is None else self.hub.card_metadata(entry)
        info = {"_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "author": ns, "sha": sha,
                "lastModified": commit["date"], "createdAt": meta["created_at"], "private": meta["private"],
                "disabled": False, "gated": False, "downloads": 0, "likes": 0, "tags": card.get("tags") or [],
                "cardData": card, "siblings": siblings, "usedStorage": sum(e.size for e in files.values())}
        if rtype == "model":
            info.update(modelId=repo_id, library_name=card.get("library_name"))
        return self._json(info)

    def tree(self, rtypes, ns, name, revision, subpath):
        rtype, repo_id = rtypes[:-1], f"{ns}/{name}"
        _, files = self.hub.store.files(rtype, repo_id, revision)
        prefix = (subpath or "").strip("/")
        if prefix:
            clean_path(prefix)
        recursive = self.query.get("recursive", "").lower() in ("1", "true")
        base = prefix + "/" if prefix else ""
        items, folders = [], set()
        for entry in files.values():
            if not entry.path.startswith(base):
                continue
            rest = entry.path[len(base):].split("/")
            for depth in range(1, len(rest)):
                if recursive or depth == 1:
                    folders.add(base + "/".join(rest[:depth]))
            if recursive or len(rest) == 1:
                items.append(entry.tree_item())
        if prefix and not items and not folders:
            raise StoreError(404, f"{prefix} does not exist at {revision}", "EntryNotFound")
        items += [{"type": "directory", "oid": hashlib.sha1(p.encode()).hexdigest(), "size": 0, "path": p}
                  for p in folders]
        return self._json(sorted(items, key=lambda i: i["path"]))

    def paths_info(self, rtypes, ns, name, revision):
        """POST paths-info: the tree entries of the given paths (form-encoded ``paths=...``), missing ones left out."""
        rtype, repo_id = rtypes[:-1], f"{ns}/{name}"
        body = self.body
        try:
            form = parse_qs(body.decode("utf-8"), strict_parsing=bool(body))
        except (UnicodeDecodeError, ValueError):
            raise StoreError(400, "paths-info expects a form-encoded body (paths=...)") from None
        _, files = self.hub.store.files(rtype, repo_id, revision)
        tree = PathTree(files)  # built once: each path is then looked up in its own length, not against every file
        items = []
        for path in dict.fromkeys(form.get("paths", [])):
            path = clean_path(path.strip("/"))
            if path in files:
                items.append(files[path].tree_item())
            elif tree.is_folder(path):
                items.append({"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0,
                              "path": path})
        return self._json(items)

    def refs(self, rtypes, ns, name):
        rtype, repo_id = rtypes[:-1], f"{ns}/{name}"
        refs = self.hub.store.refs(rtype, repo_id)
        return self._json({
            "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": s}
                         for n, s in sorted(refs["branches"].items())],
            "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": t["target"]}
                     for n, t in sorted(refs["tags"].items())],
            "converts": [], "pullRequests": [],
        })

    def commits(self, rtypes, ns, name, revision):
        rtype, repo_id = rtypes[:-1], f"{ns}/{name}"
        return self._json([{"id": c["id"], "title": c["message"], "message": c["description"],
                            "authors": [{"user": c["author"]}], "date": c["date"]}
                           for c in self.hub.store.history(rtype, repo_id, revision)])

    def ref_op(self, rtypes, ns, name, kind, ref):
        rtype, repo_id = rtypes[:-1], f"{ns}/{name}"
        if self.method == "DELETE":
            self.hub.store.delete_ref(rtype, repo_id, kind, ref)
        else:
            body = self._json_body()
            if kind == "branch":
                self.hub.store.create_ref(rtype, repo_id, "branch", ref,
                                          _field(body, "startingPoint", str) or "main")
            else:  # POST /tag/{revision} {"tag": name, "message": ...}
                if self.hub._take_fault("tag"):
                    raise _Abort()
                self.hub.store.create_ref(rtype, repo_id, "tag", _field(body, "tag", str, required=True), ref,
                                          _field(body, "message", str, default=""))
        return self._json({})

    # -- uploads -------------------------------------------------------------------------------------------
    def preupload(self, rtypes, ns, name, revision):
        rtype, repo_id = rtypes[:-1], f"{ns}/{name}"
        body = self._json_body()
        sha, files = self.hub.store.files(rtype, repo_id, revision)
        out = []
        for n, f in enumerate(_field(body, "files", list, default=[])):
            where = f"files[{n}]"
            path = clean_path(_field(f, "path", str, required=True, where=where))
            size = _size(f, where=where, required=False) or 0
            sample = _b64(_field(f, "sample", str, default="", where=where), where)
            lfs = size > 0 and (size >= LFS_SIZE_THRESHOLD or path.endswith(LFS_SUFFIXES) or b"\0" in sample)
            entry = files.get(path)
            oid = (entry.lfs_oid or entry.oid) if entry is not None and bool(entry.lfs_oid) == lfs else None
            out.append({"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        return self._json({"files": out, "commitOid": sha})

    def lfs_batch(self, prefix, ns, name):
        repo_id = f"{ns}/{name}"
        body = self._json_body()
        if body.get("operation") != "upload":
            raise StoreError(400, "only the 'upload' LFS operation is served (downloads go through /resolve)")
        verify = f"{self.endpoint}/{prefix + '/' if prefix else ''}{repo_id}.git/info/lfs/objects/verify"
        objects = []
        for n, obj in enumerate(_field(body, "objects", list, default=[])):
            oid = _field(obj, "oid", str, required=True, where=f"objects[{n}]")
            size = _size(obj, where=f"objects[{n}]")
            item = {"oid": oid, "size": size, "authenticated": True}
            if not OID_RE["lfs"].match(oid):
                item["error"] = {"code": 422, "message": f"invalid sha256 oid {oid[:80]!r}"}
            elif size > self.hub.max_lfs_bytes:
                item["error"] = {"code": 413, "message": f"object larger than {self.hub.max_lfs_bytes} bytes"}
            elif not self.hub.store.has_lfs(oid, size):
                href = f"{self.endpoint}/_lfs/{oid}?size={size}&sig={self.hub._sign(oid, size)}"
                item["actions"] = {"upload": {"href": href, "header": {}}, "verify": {"href": verify, "header": {}}}
            objects.append(item)
        return self._json({"transfer": "basic", "objects": objects, "hash_algo": "sha256"},
                          headers={"Content-Type": "application/vnd.git-lfs+json"})

    async def lfs_upload(self, oid):
        """PUT of one LFS object. Authorised by the signature in the URL (like a presigned URL: the client sends
        no token here), checked before the body is read; streamed to disk (in worker threads, a MiB at a time)
        and stored only if the content matches the oid and size."""
        raw = self.query.get("size", "")
        if not raw.isdigit():
            raise StoreError(400, "the upload URL needs a size (a non-negative integer)")
        size = int(raw)
        if not hmac.compare_digest(self.query.get("sig", ""), self.hub._sign(oid, size)):
            raise StoreError(403, "invalid or missing upload signature")
        writer = await _thread(self.hub.store.lfs_writer, max_size=size)
        fault = self.hub._take_fault("lfs-upload")
        try:
            pending = bytearray()
            async for chunk in body_chunks(self.request, min(size, self.hub.max_lfs_bytes),
                                           self.hub.limits.read_timeout):
                pending += chunk
                if len(pending) >= 1 << 20 or fault:
                    await _thread(writer.write, bytes(pending))
                    pending.clear()
                    if fault and writer.size >= size // 2:
                        raise _Abort()
            await _thread(writer.write, bytes(pending))
            await _thread(writer.commit, oid, size)
        except BaseException:
            await asyncio.shield(_thread(writer.abort))
            raise
        return self._json({})

    def lfs_verify(self, prefix, ns, name):
        body = self._json_body()
        oid, size = _field(body, "oid", str, required=True), _size(body)
        if not self.hub.store.has_lfs(oid, size):
            raise StoreError(404, f"LFS object {oid} not found")
        return self._json({})

    def commit(self, rtypes, ns, name, revision):
        rtype, repo_id = rtypes[:-1], f"{ns}/{name}"
        if self.query.get("create_pr") in ("1", "true"):
            raise StoreError(400, "pull requests are not supported by this server")
        header, ops = None, []
        for n, line in enumerate(self.body.splitlines()):
            if not line.strip():
                continue
            where = f"commit payload line {n + 1}"
            item = _parse_json(line, where)
            key = _field(item, "key", str, required=True, where=where)
            value = _field(item, "value", dict, required=True, where=where)
            if key == "header":
                header = {"summary": _field(value, "summary", str, default="update", where=where),
                          "description": _field(value, "description", str, default="", where=where),
                          "parentCommit": _field(value, "parentCommit", str, where=where)}
            elif key == "file":
                path = clean_path(_field(value, "path", str, required=True, where=where))
                content = _field(value, "content", str, required=True, where=where)
                encoding = _field(value, "encoding", str, default="base64", where=where)
                if encoding not in ("base64", "utf-8"):
                    raise StoreError(400, f"{where}: unknown encoding {encoding[:40]!r}")
                data = _b64(content, where) if encoding == "base64" else content.encode("utf-8")
                ops.append(("file", path, data))
            elif key == "lfsFile":
                path = clean_path(_field(value, "path", str, required=True, where=where))
                if _field(value, "algo", str, default="sha256", where=where) != "sha256":
                    raise StoreError(400, f"{where}: unsupported LFS hash algorithm {value.get('algo')!r}")
                oid = _field(value, "oid", str, required=True, where=where)
                if not OID_RE["lfs"].match(oid):
                    raise StoreError(400, f"{where}: invalid LFS oid {oid[:80]!r} (64 lowercase hex digits)")
                size = _size(value, where=where, required=False)
                if size is None:  # a copy of an existing object
                    obj = self.hub.store._object_path("lfs", oid)
                    size = obj.stat().st_size if obj.is_file() else -1
                ops.append(("lfs", path, (oid, size)))
            elif key in ("deletedFile", "deletedFolder"):
                path = clean_path(_field(value, "path", str, required=True, where=where).rstrip("/"))
                ops.append(("delete", path, key == "deletedFolder"))
            else:
                raise StoreError(400, f"unknown commit operation {key[:40]!r} on line {n + 1}")
        if header is None:
            raise StoreError(400, "commit payload has no header line")

        def fault():
            if self.hub._take_fault("commit"):
                raise _Abort()

        sha = self.hub.store.apply_commit(
            rtype, repo_id, revision, message=header["summary"] or "update", description=header["description"],
            author=self.user, operations=ops, parent_commit=header["parentCommit"], before_publish=fault)
        return self._json({"success": True, "commitOid": sha,
                           "commitUrl": f"{self._repo_url(rtype, repo_id)}/commit/{sha}",
                           "pullRequestUrl": None, "hookOutput": ""})

    # -- downloads -----------------------------------------------------------------------------------------
    def resolve(self, prefix, ns, name, revision, path):
        rtype, repo_id = (prefix[:-1] if prefix else "model"), f"{ns}/{name}"
        sha, files = self.hub.store.files(rtype, repo_id, revision)
        entry = files.get(clean_path(path))
        if entry is None:
            raise StoreError(404, f"Entry not found: {path} at {revision}", "EntryNotFound")
        start, end, status = 0, entry.size - 1, 200
        rng = self.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip()) if rng else None
        if m and entry.size > 0:
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), entry.size - 1) if m.group(2) else entry.size - 1
            else:
                start = max(0, entry.size - int(m.group(2) or 0))
            if start >= entry.size or start > end:
                return self._json({"error": "range not satisfiable"}, status=416,
                                  headers={"Content-Range": f"bytes */{entry.size}"})
            status = 206
        length = max(0, end - start + 1)
        f = self._open_object(entry, path)  # before any header: a missing object is an error, not a 200
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(length),
                   "Accept-Ranges": "bytes", "X-Repo-Commit": sha, "ETag": f'"{entry.oid}"'}
        if entry.lfs_oid:
            headers.update({"X-Linked-Etag": f'"{entry.lfs_oid}"', "X-Linked-Size": str(entry.size)})
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end}/{entry.size}"
        headers["Content-Disposition"] = f"inline; filename*=UTF-8''{quote(Path(path).name)}"
        return _Download(f, path, status, headers, start, length)

    def _open_object(self, entry, path: str):
        """The stored object of ``entry``, opened and checked to hold ``entry.size`` bytes: 404 when it is
        missing, 500 when it cannot be read or has another size (a damaged store)."""
        try:
            f = self.hub.store.open_entry(entry)
        except FileNotFoundError:
            raise StoreError(404, f"the stored object of {path} is missing from this server's store",
                             "EntryNotFound") from None
        except OSError as e:
            raise StoreError(500, f"the stored object of {path} cannot be read ({type(e).__name__})") from None
        try:
            size = os.fstat(f.fileno()).st_size
        except OSError:
            size = -1
        if size != entry.size:
            f.close()
            raise StoreError(500, f"the stored object of {path} holds {size} bytes, not {entry.size}")
        return f


class _Download:
    """An opened stored object to send: the headers first, then the bytes a MiB at a time (read in a worker thread;
    each send bounded by the read timeout, so a client that stops taking bytes is cut)."""

    def __init__(self, f, path, status, headers, start, length):
        self.f, self.path, self.status, self.headers, self.start, self.length = f, path, status, headers, start, length

    async def response(self, call: _Call):
        download = self

        class ObjectResponse:
            async def __call__(self, scope, receive, send):
                await download.send(call, send)

        return ObjectResponse()

    async def send(self, call: _Call, send) -> None:
        timeout = call.hub.limits.read_timeout
        try:
            await send({"type": "http.response.start", "status": self.status,
                        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1"))
                                    for k, v in self.headers.items()]})
            left = 0 if call.method == "HEAD" else self.length
            await _thread(self.f.seek, self.start)
            while left > 0:
                chunk = await _thread(self.f.read, min(left, DOWNLOAD_CHUNK))
                if not chunk:
                    raise OSError("object shorter than announced")
                left -= len(chunk)
                await asyncio.wait_for(send({"type": "http.response.body", "body": chunk, "more_body": left > 0}),
                                       timeout)
            if call.method == "HEAD" or self.length == 0:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # headers are out: the only honest answer left is to cut the response short
            logger.exception("reading the stored object of %s failed mid-response", self.path)
            await abort(call.request)
        except asyncio.TimeoutError:  # the client stopped taking bytes
            await abort(call.request)
        finally:
            self.f.close()


# (method, raw-path pattern, handler, authentication decided from the headers before any body byte, body kind)
_ROUTES = [(m, re.compile(p), n, a, b) for m, p, n, a, b in [
    ("GET", r"^/api/whoami-v2$", "whoami", "user", None),
    ("POST", r"^/api/repos/create$", "create_repo", "user", "json"),
    ("DELETE", r"^/api/repos/delete$", "delete_repo", "user", "json"),
    ("POST", r"^/api/validate-yaml$", "validate_yaml", "user", "json"),
    ("GET", rf"^/api/{_T}/{_R}(?:/revision/([^/]+))?$", "repo_info", "read", None),
    ("GET", rf"^/api/{_T}/{_R}/tree/([^/]+)(/.*)?$", "tree", "read", None),
    ("GET", rf"^/api/{_T}/{_R}/refs$", "refs", "read", None),
    ("GET", rf"^/api/{_T}/{_R}/xet-(read|write)-token(?:/.*)?$", "xet_token", None, None),
    ("GET", rf"^/api/{_T}/{_R}/commits/([^/]+)$", "commits", "read", None),
    ("POST", rf"^/api/{_T}/{_R}/(branch|tag)/([^/]+)$", "ref_op", "write", "json"),
    ("DELETE", rf"^/api/{_T}/{_R}/(branch|tag)/([^/]+)$", "ref_op", "write", None),
    ("POST", rf"^/api/{_T}/{_R}/preupload/([^/]+)$", "preupload", "write", "json"),
    ("POST", rf"^/api/{_T}/{_R}/paths-info/([^/]+)$", "paths_info", "read", "json"),
    ("POST", rf"^/api/{_T}/{_R}/commit/([^/]+)$", "commit", "write", "ndjson"),
    ("POST", _PREFIX + r"([^/]+)/([^/]+)\.git/info/lfs/objects/batch$", "lfs_batch", "write", "json"),
    ("POST", _PREFIX + r"([^/]+)/([^/]+)\.git/info/lfs/objects/verify$", "lfs_verify", "write", "json"),
    ("PUT", r"^/_lfs/([0-9a-f]{64})$", "lfs_upload", "sig", "stream"),
    ("GET", _PREFIX + r"([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$", "resolve", "read", None),
]]


def _front_matter(text: str):
    """The parsed YAML block at the top of a card (None if there is none).

    Bounded before it is built: at most ``MAX_CARD_METADATA_BYTES``, no aliases (card metadata never needs them,
    and a few hundred bytes of nested aliases expand to gigabytes: a "billion laughs" document), at most
    ``MAX_YAML_DEPTH`` levels; the event stream is checked first, then the document built with the safe loader
    (libyaml's when PyYAML has it). Raises ``yaml.YAMLError``.

    The event pass uses PyYAML's pure-Python parser: libyaml (0.2.5+) stops deep flow collections with its own
    "exceeded maximum nesting depth" while scanning ahead, before this check sees the events, so which message a
    user got depended on the PyYAML build. 64 KB of metadata parse in about a second at most.
    """
    import yaml

    if len(text) > 4 * MAX_CARD_BYTES:
        raise yaml.YAMLError(f"card larger than {4 * MAX_CARD_BYTES} characters")
    m = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    if not m:
        return None
    block = m.group(1)
    if len(block.encode("utf-8", "replace")) > MAX_CARD_METADATA_BYTES:
        raise yaml.YAMLError(f"card metadata larger than {MAX_CARD_METADATA_BYTES} bytes (a card needs a few KB)")
    depth = 0
    for event in yaml.parse(block, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            raise yaml.YAMLError("YAML aliases are not allowed in card metadata")
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_YAML_DEPTH:
                raise yaml.YAMLError("card metadata is nested too deeply (more levels than a card ever needs)")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return yaml.load(block, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def validate_card_metadata(content: str) -> tuple[list[str], list[str]]:
    """Errors and warnings for a README's YAML metadata, checking what the Hub checks for models."""
    import yaml

    try:
        meta = _front_matter(content)
    except yaml.YAMLError as e:
        return [f"YAML metadata is not valid YAML: {' '.join(str(e).split())}"], []  # one line, whatever PyYAML says
    if meta is None:
        return [], ["Empty or missing yaml metadata in repo card"]
    if not isinstance(meta, dict):
        return ["YAML metadata must be a mapping"], []
    errors = []
    for key in ("tags", "datasets", "language", "base_model"):
        value = meta.get(key)
        if value is not None and not (isinstance(value, str) or
                                      (isinstance(value, list) and all(isinstance(v, str) for v in value))):
            errors.append(f'"{key}" must be a string or a list of strings')
    for key in ("license", "library_name", "pipeline_tag"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            errors.append(f'"{key}" must be a string')
    index = meta.get("model-index")
    if index is not None:
        if not isinstance(index, list):
            errors.append('"model-index" must be a list')
        else:
            for i, model in enumerate(index):
                if not isinstance(model, dict) or not isinstance(model.get("name"), str):
                    errors.append(f'"model-index[{i}].name" must be a string')
                    continue
                for j, res in enumerate(model.get("results") or []):
                    where = f"model-index[{i}].results[{j}]"
                    if not isinstance(res, dict) or not isinstance(res.get("task"), dict) \
                            or not isinstance(res["task"].get("type"), str):
                        errors.append(f'"{where}.task.type" is required')
                        continue
                    ds = res.get("dataset")
                    if not isinstance(ds, dict) or not isinstance(ds.get("name"), str) \
                            or not isinstance(ds.get("type"), str):
                        errors.append(f'"{where}.dataset" needs "name" and "type"')
                    for k, metric in enumerate(res.get("metrics") or []):
                        if not isinstance(metric, dict) or not isinstance(metric.get("type"), str) \
                                or "value" not in metric:
                            errors.append(f'"{where}.metrics[{k}]" needs "type" and "value"')
    return errors, []
