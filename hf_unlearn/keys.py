"""Every key of the library: the one id-tagging (HMAC) key, runs' own HMAC keys, and the Ed25519 signing key.

This module imports nothing of ``trace/`` or ``hub/`` (both import it): the tag function itself is
:func:`hf_unlearn.trace.tags.tag`; ``hub/keys.py`` and ``trace/tags.py`` re-export the names that used to live there.

The id-tagging key.

One key serves everything that names a sample: model cards (``forget_request.json``), trace plans, WALs and
deletion logs. A tag is the first 8 bytes of HMAC-SHA256(key, canonical id) (:func:`hf_unlearn.trace.tags.tag`),
so a card's tags can be matched one to one against the ``forget_tags`` of a run's deletion log. Whoever holds the
key can check that a given sample was deleted; nobody else can enumerate the ids or learn which rows were removed.

Where the key comes from: ``$HF_UNLEARN_TAG_KEY`` (hex), else the file ``$HF_UNLEARN_KEY_FILE``, default
``~/.cache/hf_unlearn/id_tag.key``, created on first use (32 random bytes, mode 0600, in a 0700 folder). Like ssh
with a private key, a key file that group or others may read is refused. The key's fingerprint (a hash of the
key, never the key) is published with every tag set and recorded in every run's header, so it is always known
which key a tag was made with. Rotation (:func:`rotate_key`) archives the old key next to the new one as
``id_tag.<fingerprint>.key``; :func:`find_key` finds it again by fingerprint, so older runs keep working.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat
from pathlib import Path

from .errors import UnlearnError

KEY_ENV = "HF_UNLEARN_TAG_KEY"
KEY_FILE_ENV = "HF_UNLEARN_KEY_FILE"
KEY_BYTES = 32
MIN_KEY_BYTES = 16
TAG_FORMAT = "hf_unlearn.id_tag.v2"  # hex of HMAC-SHA256(key, canonical id)[:8], the trace's tag function
TAG_HEX_CHARS = 16


def default_key_path() -> Path:
    return Path(os.environ.get(KEY_FILE_ENV) or Path.home() / ".cache" / "hf_unlearn" / "id_tag.key")


def key_fingerprint(key: bytes) -> str:
    """A public name for the key (a hash of it), so published tags and recorded runs say which key made them."""
    return hashlib.sha256(b"hf_unlearn.key-fingerprint\0" + key).hexdigest()[:16]


def read_key_file(path: str | os.PathLike) -> bytes:
    """Read a key file, refusing one that group or others may read (or write), that is not a regular file, or that
    belongs to another user: a key others can read makes every published tag reversible for them."""
    path = Path(path)
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise UnlearnError(f"no key file at {path}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnlearnError(f"the key {path} is not a regular file (a symlink or device is refused)")
    if os.name == "posix":
        if st.st_mode & 0o077:
            raise UnlearnError(f"the key file {path} is accessible by group or others (mode "
                               f"{stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}` (keys others can read "
                               "are refused, as ssh does)")
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise UnlearnError(f"the key file {path} belongs to another user (uid {st.st_uid}); use your own key")
    key = path.read_bytes()
    if len(key) < MIN_KEY_BYTES:
        raise UnlearnError(f"the key file {path} holds {len(key)} bytes; it needs at least {MIN_KEY_BYTES}")
    return key


def write_key_file(path: str | os.PathLike, key: bytes) -> bool:
    """Create ``path`` holding ``key`` (mode 0600, folder 0700) atomically; False if it already exists.

    The key is written to a private temporary file and linked into place (a hard link is created only if the name
    is free, atomically), so a concurrent reader never sees a half-written key and processes creating the key at
    once (every process of a launch, first use) end with one key, the file's: each then reads the file. Where the
    file system has no hard links, a lock file serialises the creators and the key is renamed into place.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
            return _rename_if_free(tmp, path)
        return True
    finally:
        tmp.unlink(missing_ok=True)


_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS, errno.EXDEV}


def _rename_if_free(tmp: Path, path: Path) -> bool:
    """``tmp`` renamed to ``path`` unless that exists, under an exclusive lock on ``.NAME.lock`` (file systems
    without hard links): the check and the rename are one step for every creator taking the lock."""
    lock = os.open(path.parent / f".{path.name}.lock", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        try:
            import fcntl
        except ImportError:  # Windows: NTFS has hard links, so this path is not taken there
            fcntl = None
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists() or path.is_symlink():
            return False
        os.replace(tmp, path)
        return True
    finally:
        os.close(lock)  # releases the lock


def load_key(path: str | os.PathLike | None = None, *, create: bool = True) -> bytes:
    """The library's key: ``$HF_UNLEARN_TAG_KEY`` (hex), else the key file (created if missing and ``create``)."""
    env = os.environ.get(KEY_ENV)
    if env and path is None:
        try:
            key = bytes.fromhex(env)
        except ValueError:
            raise UnlearnError(f"{KEY_ENV} must be hex (e.g. `python -c 'import secrets; "
                               "print(secrets.token_hex(32))'`)") from None
        if len(key) < MIN_KEY_BYTES:
            raise UnlearnError(f"{KEY_ENV} is too short: use at least {MIN_KEY_BYTES} bytes "
                               f"({2 * MIN_KEY_BYTES} hex characters)")
        return key
    path = Path(path) if path is not None else default_key_path()
    if not path.exists() and not path.is_symlink():
        if not create:
            raise UnlearnError(f"no tag key at {path}; set {KEY_ENV} or {KEY_FILE_ENV}")
        write_key_file(path, secrets.token_bytes(KEY_BYTES))
    return read_key_file(path)


def archived_key_path(fingerprint: str, path: str | os.PathLike | None = None) -> Path:
    current = Path(path) if path is not None else default_key_path()
    return current.with_name(f"{current.stem}.{fingerprint}{current.suffix or '.key'}")


def find_key(fingerprint: str) -> bytes | None:
    """The key with this fingerprint: the current key, else one archived by :func:`rotate_key`; None if neither."""
    try:
        current = load_key(create=False)
    except UnlearnError as e:
        if "accessible by" in str(e) or "another user" in str(e):
            raise
        current = None
    if current is not None and key_fingerprint(current) == fingerprint:
        return current
    archived = archived_key_path(fingerprint)
    if archived.exists():
        key = read_key_file(archived)
        if key_fingerprint(key) == fingerprint:
            return key
    return None


def rotate_key(path: str | os.PathLike | None = None) -> tuple[str, str, Path]:
    """Archive the current key as ``id_tag.<fingerprint>.key`` and create a new one; (old, new fingerprint, archive).

    Published tags keep their meaning (they name the old fingerprint); runs recorded with the old key find it in
    the archive. Not possible with ``$HF_UNLEARN_TAG_KEY`` (rotate the variable yourself).
    """
    if os.environ.get(KEY_ENV) and path is None:
        raise UnlearnError(f"the key comes from {KEY_ENV}; rotate it by setting a new value (keep the old one)")
    path = Path(path) if path is not None else default_key_path()
    old = load_key(path, create=False)
    old_fp = key_fingerprint(old)
    archive = archived_key_path(old_fp, path)
    if not write_key_file(archive, old) and read_key_file(archive) != old:
        raise UnlearnError(f"{archive} exists and holds another key; move it away first")
    path.unlink()
    new = secrets.token_bytes(KEY_BYTES)
    if not write_key_file(path, new):
        raise UnlearnError(f"{path} was re-created concurrently; run the rotation again")
    return old_fp, key_fingerprint(new), archive


def load_or_create_key(path: str | os.PathLike, key: bytes | None = None) -> bytes:
    """A run's own HMAC key at ``path``: read it, or create it (random, or ``key``) if it does not exist yet."""
    path = Path(path)
    if path.exists():
        existing = read_key_file(path)  # refused if group/others may read it
        if key is not None and key != existing:
            raise UnlearnError(f"{path} holds a different HMAC key than the one passed; use a fresh trace_dir")
        return existing
    key = key if key is not None else secrets.token_bytes(KEY_BYTES)
    if not write_key_file(path, key):  # 0600 from its creation, never briefly readable by others
        return load_or_create_key(path, key)
    return key


# -- Ed25519 signing key: receipts and ledger heads that anyone holding the public key can check ------------------
SIGNING_KEY_ENV = "HF_UNLEARN_SIGNING_KEY_FILE"
SIGNATURE_FORMAT = "ed25519"


def default_signing_key_path() -> Path:
    return Path(os.environ.get(SIGNING_KEY_ENV) or default_key_path().with_name("signing_ed25519.pem"))


def load_signing_key(path: str | os.PathLike | None = None, *, create: bool = True):
    """The Ed25519 private key (PEM, mode 0600, refused if others may read it), created on first use."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path) if path is not None else default_signing_key_path()
    if not path.exists() and not path.is_symlink():
        if not create:
            raise UnlearnError(f"no signing key at {path}; set {SIGNING_KEY_ENV} to your Ed25519 key (PEM)")
        pem = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption())
        write_key_file(path, pem)  # False: another process created it first; read that one
    try:
        key = serialization.load_pem_private_key(read_key_file(path), password=None)
    except ValueError as e:
        raise UnlearnError(f"{path} is not a PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UnlearnError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def public_key_pem(private_key) -> str:
    """The public half, as PEM text: what an auditor is given."""
    from cryptography.hazmat.primitives import serialization

    return private_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                 serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def load_public_key(path_or_pem: str | os.PathLike):
    """An Ed25519 public key from a PEM file (or PEM text)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    text = str(path_or_pem)
    if "-----BEGIN" not in text:
        try:
            text = Path(path_or_pem).read_text()
        except OSError as e:
            raise UnlearnError(f"cannot read the public key {path_or_pem}: {e.strerror or e}") from None
    try:
        key = serialization.load_pem_public_key(text.encode())
    except ValueError:
        raise UnlearnError(f"{path_or_pem} is not a PEM public key (`hf-unlearn requests public-key` prints "
                           "yours)") from None
    if not isinstance(key, Ed25519PublicKey):
        raise UnlearnError(f"{path_or_pem} is a {type(key).__name__}, not an Ed25519 public key")
    return key


def public_key_fingerprint(public_key) -> str:
    """A short public name of a signing key (hash of its raw bytes), recorded beside every signature."""
    from cryptography.hazmat.primitives import serialization

    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(b"hf_unlearn.signing-key\0" + raw).hexdigest()[:16]


def sign(private_key, message: bytes) -> str:
    """The Ed25519 signature of ``message``, hex."""
    return private_key.sign(message).hex()


def signature_ok(public_key, message: bytes, signature_hex: str) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        public_key.verify(bytes.fromhex(signature_hex), message)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def public_key_hex(public_key) -> str:
    """The raw 32 bytes of an Ed25519 public key, hex: how a ledger names its signing key inside its own records."""
    from cryptography.hazmat.primitives import serialization

    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def public_key_from_hex(value: str):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(value))
    except (ValueError, TypeError):
        raise UnlearnError(f"{value!r} is not a raw Ed25519 public key (64 hex characters)") from None


def archived_signing_key_path(fingerprint: str, path: str | os.PathLike | None = None) -> Path:
    current = Path(path) if path is not None else default_signing_key_path()
    return current.with_name(f"{current.stem}.{fingerprint}{current.suffix or '.pem'}")


def find_signing_key(fingerprint: str):
    """The Ed25519 private key with this public fingerprint: the current one, else one archived by
    :func:`rotate_signing_key`; None if neither."""
    current = load_signing_key(create=False) if default_signing_key_path().exists() else None
    if current is not None and public_key_fingerprint(current.public_key()) == fingerprint:
        return current
    archived = archived_signing_key_path(fingerprint)
    if archived.exists():
        key = load_signing_key(archived, create=False)
        if public_key_fingerprint(key.public_key()) == fingerprint:
            return key
    return None


def rotate_signing_key(path: str | os.PathLike | None = None) -> tuple[str, str, Path]:
    """Archive the signing key as ``signing_ed25519.<fingerprint>.pem`` and create a new one; returns (old, new
    fingerprint, archive). A ledger signed with the old key hands over to the new one with a ``key`` record signed by
    the old key at its next append, so signatures made before stay verifiable with either public key."""
    path = Path(path) if path is not None else default_signing_key_path()
    old = load_signing_key(path, create=False)
    old_fp = public_key_fingerprint(old.public_key())
    archive = archived_signing_key_path(old_fp, path)
    if not write_key_file(archive, read_key_file(path)) and read_key_file(archive) != read_key_file(path):
        raise UnlearnError(f"{archive} exists and holds another key; move it away first")
    path.unlink()
    new = load_signing_key(path, create=True)
    return old_fp, public_key_fingerprint(new.public_key()), archive
