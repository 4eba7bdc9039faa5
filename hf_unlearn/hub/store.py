"""On-disk storage of a Hub-compatible repository store: content-addressed objects, commits and refs.

Why a store of its own: the local Hub server (``server.py``) must publish a revision atomically. Every commit
first writes its file objects (content-addressed, so a half-finished upload leaves only unreferenced garbage),
then the commit record, and only then moves the ref with one ``os.replace``: a reader sees the old revision or the
whole new one, never a half-published one. The store knows nothing about HTTP.

Layout under ``root``::

    objects/blobs/ab/<git sha1>       regular files (git blob id)
    objects/lfs/ab/<sha256>           large files (LFS object id)
    repos/<type>s/<ns>/<name>/repo.json      {"private", "created_at"}
    repos/<type>s/<ns>/<name>/refs.json      {"branches": {name: sha}, "tags": {name: {"target", "message"}}}
    repos/<type>s/<ns>/<name>/commits/<sha>.json
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..utils import atomic_write_bytes, atomic_write_text, file_mode

REPO_TYPES = ("model", "dataset", "space")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
OID_RE = {"blobs": re.compile(r"^[0-9a-f]{40}$"), "lfs": re.compile(r"^[0-9a-f]{64}$")}  # git sha1 / LFS sha256
MAX_PATH_CHARS = 1000
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"
GITATTRIBUTES = "".join(
    f"*.{ext} filter=lfs diff=lfs merge=lfs -text\n"
    for ext in ("bin", "safetensors", "pt", "pth", "ckpt", "gguf", "h5", "msgpack", "npy", "npz", "onnx", "zip")
).encode()


class StoreError(Exception):
    """A request the store refuses; ``status`` and ``code`` become the HTTP status and ``X-Error-Code``."""

    def __init__(self, status: int, message: str, code: str | None = None, **extra):
        super().__init__(message)
        self.status, self.code, self.extra = status, code, extra


def git_blob_id(data: bytes) -> str:
    """The git object id of a blob (what the Hub calls a regular file's ``oid``)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(oid: str, size: int) -> bytes:
    return LFS_POINTER.format(oid=oid, size=size).encode()


@dataclass(frozen=True)
class Entry:
    """One file of a revision: its git blob id and size, and for LFS files the sha256 and real size."""

    path: str
    oid: str
    size: int
    lfs_oid: str | None = None

    def to_dict(self) -> dict:
        return {"oid": self.oid, "size": self.size, "lfs_oid": self.lfs_oid}

    def tree_item(self) -> dict:
        item = {"type": "file", "oid": self.oid, "size": self.size, "path": self.path}
        if self.lfs_oid:
            item["lfs"] = {"oid": self.lfs_oid, "size": self.size,
                           "pointerSize": len(lfs_pointer(self.lfs_oid, self.size))}
        return item


class RepoStore:
    """Repositories, their commits and refs, and the object store, all under one directory."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        (self.root / "objects" / "blobs").mkdir(parents=True, exist_ok=True)
        (self.root / "objects" / "lfs").mkdir(parents=True, exist_ok=True)
        (self.root / "repos").mkdir(parents=True, exist_ok=True)
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    # -- objects -------------------------------------------------------------------------------------------
    def _object_path(self, kind: str, oid: str) -> Path:
        """Where object ``oid`` lives; ``oid`` must be a lowercase hex digest (client input never becomes a path
        otherwise), and the result is checked to lie inside the store."""
        if not isinstance(oid, str) or not OID_RE[kind].match(oid):
            raise StoreError(400, f"invalid {'LFS' if kind == 'lfs' else 'blob'} oid {str(oid)[:80]!r}: expected "
                                  f"{64 if kind == 'lfs' else 40} lowercase hex digits")
        return self._confined(self.root / "objects" / kind / oid[:2] / oid)

    def _confined(self, path: Path) -> Path:
        """``path`` if it resolves inside the store's root (defence in depth behind the name/oid checks)."""
        if not path.resolve().is_relative_to(self.root.resolve()):
            raise StoreError(400, "path outside the store")
        return path

    def has_lfs(self, oid: str, size: int | None = None) -> bool:
        path = self._object_path("lfs", oid)
        return path.is_file() and (size is None or path.stat().st_size == size)

    def put_blob(self, data: bytes) -> str:
        oid = git_blob_id(data)
        path = self._object_path("blobs", oid)
        if not path.exists():
            atomic_write_bytes(path, data)
        return oid

    def lfs_writer(self, max_size: int | None = None) -> LfsWriter:
        return LfsWriter(self, max_size)

    def open_entry(self, entry: Entry):
        kind, oid = ("lfs", entry.lfs_oid) if entry.lfs_oid else ("blobs", entry.oid)
        return open(self._object_path(kind, oid), "rb")

    # -- repos ---------------------------------------------------------------------------------------------
    def _repo_dir(self, repo_type: str, repo_id: str) -> Path:
        if repo_type not in REPO_TYPES:
            raise StoreError(400, f"unknown repo type {repo_type!r}")
        parts = repo_id.split("/") if isinstance(repo_id, str) else []
        if len(parts) != 2 or not all(_NAME_RE.match(p) and ".." not in p for p in parts):
            raise StoreError(400, f"invalid repo id {str(repo_id)[:200]!r}: expected 'namespace/name' (letters, "
                                  "digits, '-', '_', '.')")
        return self._confined(self.root / "repos" / f"{repo_type}s" / parts[0] / parts[1])

    def lock(self, repo_type: str, repo_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(f"{repo_type}:{repo_id}", threading.Lock())

    def exists(self, repo_type: str, repo_id: str) -> bool:
        return (self._repo_dir(repo_type, repo_id) / "refs.json").is_file()

    def repo_meta(self, repo_type: str, repo_id: str) -> dict:
        d = self._repo_dir(repo_type, repo_id)
        if not (d / "refs.json").is_file():
            raise StoreError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return json.loads((d / "repo.json").read_text())

    def create_repo(self, repo_type: str, repo_id: str, *, private: bool, author: str) -> bool:
        """Create a repo with an initial commit holding ``.gitattributes``; False if it already exists."""
        d = self._repo_dir(repo_type, repo_id)
        with self.lock(repo_type, repo_id):
            if (d / "refs.json").is_file():
                return False
            atomic_write_text(d / "repo.json", json.dumps({"private": bool(private), "created_at": _now()}))
            files = {".gitattributes": self._regular_entry(".gitattributes", GITATTRIBUTES).to_dict()}
            sha = self._write_commit(d, parent=None, files=files, message="initial commit", description="",
                                     author=author)
            self._write_refs(d, {"branches": {"main": sha}, "tags": {}})
            return True

    def delete_repo(self, repo_type: str, repo_id: str) -> None:
        import shutil

        d = self._repo_dir(repo_type, repo_id)
        with self.lock(repo_type, repo_id):
            if not (d / "refs.json").is_file():
                raise StoreError(404, f"Repository {repo_id} not found", "RepoNotFound")
            os.unlink(d / "refs.json")  # the repo disappears atomically; the rest is cleanup
            shutil.rmtree(d, ignore_errors=True)

    # -- refs and commits ----------------------------------------------------------------------------------
    def refs(self, repo_type: str, repo_id: str) -> dict:
        d = self._repo_dir(repo_type, repo_id)
        try:
            return json.loads((d / "refs.json").read_text())
        except FileNotFoundError:
            raise StoreError(404, f"Repository {repo_id} not found", "RepoNotFound") from None

    def resolve(self, repo_type: str, repo_id: str, revision: str) -> str:
        """The commit sha of a branch, a tag or a (full) commit sha."""
        refs = self.refs(repo_type, repo_id)
        if revision in refs["branches"]:
            return refs["branches"][revision]
        if revision in refs["tags"]:
            return refs["tags"][revision]["target"]
        for prefix in ("refs/heads/", "refs/tags/"):
            if revision.startswith(prefix):
                return self.resolve(repo_type, repo_id, revision[len(prefix):])
        if _SHA_RE.match(revision) and (self._repo_dir(repo_type, repo_id) / "commits" / f"{revision}.json").is_file():
            return revision
        raise StoreError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def commit(self, repo_type: str, repo_id: str, sha: str) -> dict:
        path = self._repo_dir(repo_type, repo_id) / "commits" / f"{sha}.json"
        return json.loads(path.read_text())

    def files(self, repo_type: str, repo_id: str, revision: str) -> tuple[str, dict[str, Entry]]:
        sha = self.resolve(repo_type, repo_id, revision)
        raw = self.commit(repo_type, repo_id, sha)["files"]
        return sha, {p: Entry(p, v["oid"], v["size"], v.get("lfs_oid")) for p, v in raw.items()}

    def history(self, repo_type: str, repo_id: str, revision: str) -> list[dict]:
        sha = self.resolve(repo_type, repo_id, revision)
        out = []
        while sha:
            c = self.commit(repo_type, repo_id, sha)
            out.append({"id": sha, **{k: c[k] for k in ("message", "description", "date", "author")}})
            sha = c["parent"]
        return out

    def create_ref(self, repo_type: str, repo_id: str, kind: str, name: str, target: str, message: str = "") -> None:
        """Add a branch or a tag; refs are never silently moved (409 if the name exists)."""
        if not _NAME_RE.match(name):
            raise StoreError(400, f"invalid {kind} name {name!r}")
        d = self._repo_dir(repo_type, repo_id)
        with self.lock(repo_type, repo_id):
            refs = self.refs(repo_type, repo_id)
            sha = self.resolve(repo_type, repo_id, target)
            if name in refs["branches"] or name in refs["tags"]:
                raise StoreError(409, f"Reference {name} already exists")
            if kind == "branch":
                refs["branches"][name] = sha
            else:
                refs["tags"][name] = {"target": sha, "message": message}
            self._write_refs(d, refs)

    def delete_ref(self, repo_type: str, repo_id: str, kind: str, name: str) -> None:
        d = self._repo_dir(repo_type, repo_id)
        with self.lock(repo_type, repo_id):
            refs = self.refs(repo_type, repo_id)
            table = refs["branches" if kind == "branch" else "tags"]
            if name not in table or (kind == "branch" and name == "main"):
                raise StoreError(404, f"{kind} {name} not found", "RevisionNotFound")
            del table[name]
            self._write_refs(d, refs)

    def apply_commit(self, repo_type: str, repo_id: str, branch: str, *, message: str, description: str,
                     author: str, operations: list[tuple[str, str, object]], parent_commit: str | None = None,
                     before_publish=None) -> str:
        """Apply ``operations`` to ``branch`` as one commit and move the branch; returns the new commit sha.

        operations: ("file", path, bytes) | ("lfs", path, (sha256, size)) | ("delete", path, is_folder).
        ``before_publish`` (tests' fault injection) runs after objects and the commit record are written and
        before the ref moves: if it raises, the branch is untouched.
        """
        d = self._repo_dir(repo_type, repo_id)
        with self.lock(repo_type, repo_id):
            refs = self.refs(repo_type, repo_id)
            if branch not in refs["branches"]:
                if branch in refs["tags"] or _SHA_RE.match(branch):
                    raise StoreError(400, f"cannot commit to {branch!r}: only branches can receive commits")
                raise StoreError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            head = refs["branches"][branch]
            if parent_commit and parent_commit != head:
                raise StoreError(412, f"A commit has happened since {parent_commit}: the head of {branch} is {head}")
            files = _Files(self.commit(repo_type, repo_id, head)["files"])
            for kind, path, value in operations:
                path = clean_path(path)
                if kind == "file":
                    files.put(path, self._regular_entry(path, value).to_dict())
                elif kind == "lfs":
                    oid, size = value
                    if not self.has_lfs(oid, size):
                        raise StoreError(422, f"LFS object {oid} for {path} was not uploaded (or has the wrong size)")
                    files.put(path, Entry(path, git_blob_id(lfs_pointer(oid, size)), size, oid).to_dict())
                elif value:  # folder deletion
                    if not files.delete_folder(path.rstrip("/")):
                        raise StoreError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                elif not files.delete(path):
                    raise StoreError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
            files = files.entries
            sha = self._write_commit(d, parent=head, files=files, message=message, description=description,
                                     author=author)
            if before_publish is not None:
                before_publish()
            refs["branches"][branch] = sha
            self._write_refs(d, refs)
            return sha

    # -- internals -----------------------------------------------------------------------------------------
    def _regular_entry(self, path: str, data: bytes) -> Entry:
        return Entry(path, self.put_blob(data), len(data))

    def _write_commit(self, d: Path, *, parent, files, message, description, author) -> str:
        record = {"parent": parent, "files": files, "message": message, "description": description,
                  "author": author, "date": _now()}
        body = json.dumps(record, sort_keys=True)
        sha = hashlib.sha1(f"commit {len(body)}\0{body}".encode()).hexdigest()
        atomic_write_text(d / "commits" / f"{sha}.json", body)
        return sha

    def _write_refs(self, d: Path, refs: dict) -> None:
        atomic_write_text(d / "refs.json", json.dumps(refs, indent=1, sort_keys=True))


class PathTree:
    """The folders of a set of repository paths, as a trie: adding, removing and looking up a path costs its
    length, and a folder's files are found without a pass over every path, so a request's cost stays linear in
    what it names and what it touches (a per-path scan of every file made ``paths-info`` quadratic)."""

    def __init__(self, paths=()):
        self.root: dict = {}
        for path in paths:
            self.add(path)

    def add(self, path: str) -> None:
        node = self.root
        for part in path.split("/"):
            node = node.setdefault(part, {})
        node[""] = path  # "" is never a part of a clean path: it marks a file and keeps its full path

    def _trail(self, path: str) -> list[dict] | None:
        trail = [self.root]
        for part in path.split("/"):
            node = trail[-1].get(part)
            if node is None:
                return None
            trail.append(node)
        return trail

    def is_folder(self, path: str) -> bool:
        trail = self._trail(path)
        return trail is not None and any(k != "" for k in trail[-1])

    def files_under(self, folder: str) -> list[str]:
        trail = self._trail(folder)
        out, stack = [], [trail[-1]] if trail else []
        while stack:
            node = stack.pop()
            out += [v for k, v in node.items() if k == "" and v != folder]
            stack += [v for k, v in node.items() if k != ""]
        return out

    def remove(self, path: str) -> None:
        trail = self._trail(path)
        if trail is None:
            return
        trail[-1].pop("", None)
        parts = path.split("/")
        for k in range(len(parts), 0, -1):  # drop the folders it leaves empty
            if trail[k]:
                break
            del trail[k - 1][parts[k - 1]]


class _Files:
    """A revision's files while a commit changes them (a folder deletion costs the files it removes)."""

    def __init__(self, entries: dict):
        self.entries = dict(entries)
        self.tree = PathTree(self.entries)

    def put(self, path: str, entry: dict) -> None:
        if path not in self.entries:
            self.tree.add(path)
        self.entries[path] = entry

    def delete(self, path: str) -> bool:
        if self.entries.pop(path, None) is None:
            return False
        self.tree.remove(path)
        return True

    def delete_folder(self, folder: str) -> bool:
        gone = self.tree.files_under(folder)
        for path in gone:
            self.delete(path)
        return bool(gone)


class LfsWriter:
    """Streams an upload into a temporary file and moves it into the object store only if its sha256 and size
    match what the client announced: a torn or corrupted upload never becomes an object."""

    def __init__(self, store: RepoStore, max_size: int | None = None):
        self.store = store
        self.max_size = max_size
        tmp_dir = store.root / "objects" / "tmp"
        tmp_dir.mkdir(parents=True, exist_ok=True)
        fd, self.tmp = tempfile.mkstemp(dir=tmp_dir, suffix=".part")
        os.fchmod(fd, file_mode())  # readable as a plain file would be (mkstemp makes it owner-only)
        self.file = os.fdopen(fd, "wb")
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        if self.max_size is not None and self.size + len(chunk) > self.max_size:
            self.abort()
            raise StoreError(413, f"upload is larger than its announced size ({self.max_size} bytes)")
        self.file.write(chunk)
        self.sha.update(chunk)
        self.size += len(chunk)

    def commit(self, oid: str, size: int) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if self.sha.hexdigest() != oid or self.size != size:
            self.abort()
            raise StoreError(400, f"uploaded content does not match oid {oid} / size {size} "
                                  f"(got sha256 {self.sha.hexdigest()}, {self.size} bytes)")
        path = self.store._object_path("lfs", oid)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self.tmp, path)

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


def clean_path(path) -> str:
    """A file path inside a repository, refused (400) unless it is already clean: relative, '/'-separated, no
    empty, '.' or '..' part, no backslash or control character (NUL included), at most 1000 characters."""
    ok = (isinstance(path, str) and 0 < len(path) <= MAX_PATH_CHARS and not _CONTROL.search(path)
          and "\\" not in path and all(p not in ("", ".", "..") for p in path.split("/")))
    if not ok:
        raise StoreError(400, f"invalid path in repo: {str(path)[:200]!r} (relative, '/'-separated, no '.', '..', "
                              "empty parts, backslashes or control characters)")
    return path


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
