"""The one key policy: permissions refused as ssh does, atomic creation, rotation, and how runs find their key."""

from __future__ import annotations

import json
import threading

import pytest

from hf_unlearn.errors import UnlearnError
from hf_unlearn.hub.keys import find_key, key_fingerprint, keyed_tag, load_key, rotate_key
from hf_unlearn.trace.tags import recording_key, run_key, tag


@pytest.fixture
def key_file(tmp_path, monkeypatch):
    path = tmp_path / "keys" / "id_tag.key"
    monkeypatch.setenv("HF_UNLEARN_KEY_FILE", str(path))
    monkeypatch.delenv("HF_UNLEARN_TAG_KEY", raising=False)
    return path


def test_a_key_others_can_read_is_refused(key_file):
    key = load_key()
    assert key_file.stat().st_mode & 0o777 == 0o600 and key_file.parent.stat().st_mode & 0o777 == 0o700
    for mode in (0o644, 0o640, 0o604, 0o660):
        key_file.chmod(mode)
        with pytest.raises(UnlearnError, match=f"accessible by group or others \\(mode {mode:04o}\\).*chmod 600"):
            load_key()
    key_file.chmod(0o600)
    assert load_key() == key
    link = key_file.with_name("link.key")
    link.symlink_to(key_file)
    with pytest.raises(UnlearnError, match="not a regular file"):
        load_key(link)


def _first_uses(n: int) -> list:
    """The keys ``n`` threads get from ``load_key()`` when they all call it at once."""
    keys, barrier = [], threading.Barrier(n)

    def first_use():
        barrier.wait()
        keys.append(load_key())

    threads = [threading.Thread(target=first_use) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return keys


def test_concurrent_first_use_creates_one_key(key_file):
    keys = _first_uses(8)
    assert len(keys) == 8 and len(set(keys)) == 1 and key_file.read_bytes() == keys[0]
    assert [p.name for p in key_file.parent.iterdir()] == ["id_tag.key"]  # no temporary file left


def test_processes_creating_the_key_at_once_end_with_one_key(key_file, tmp_path):
    """Six interpreters (the processes of a launch on first use) wait for one moment and then create the key at once:
    each returns the key the file holds, one key."""
    import os
    import subprocess
    import sys
    import time

    go = time.time() + 3  # every interpreter is up by then; each spins until it, then loads the key
    code = ("import sys,time\nfrom hf_unlearn.keys import load_key\n"
            f"while time.time() < {go}: pass\nprint(load_key().hex())")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "HF_UNLEARN_KEY_FILE": str(key_file)}) for _ in range(6)]
    keys = {p.communicate(timeout=60)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert keys == {key_file.read_bytes().hex()}
    assert key_file.stat().st_mode & 0o777 == 0o600 and key_file.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in key_file.parent.iterdir()] == ["id_tag.key"]


def test_without_hard_links_creators_still_end_with_one_key(key_file, monkeypatch):
    """On a file system without hard links (os.link fails with EPERM) the creators take a lock and rename the key
    into place only if the name is free: eight threads at once, one key, mode 0600."""
    import errno
    import os

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    keys = _first_uses(8)
    assert len(keys) == 8 and len(set(keys)) == 1 and key_file.read_bytes() == keys[0]
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in key_file.parent.iterdir()) == [".id_tag.key.lock", "id_tag.key"]


def test_cards_and_trace_tags_are_the_same_tags():
    key = b"k" * 32
    assert keyed_tag(3600, key) == tag(key, 3600) and keyed_tag("3600", key) != keyed_tag(3600, key)


def test_rotation_archives_the_old_key_and_runs_still_find_it(key_file, tmp_path):
    old = load_key()
    run = tmp_path / "run"
    run.mkdir()
    assert recording_key(run) == old and not (run / "private").exists()  # new runs keep no key of their own
    (run / "header.json").write_text(json.dumps({"key_fingerprint": key_fingerprint(old)}))
    old_fp, new_fp, archive = rotate_key()
    assert old_fp == key_fingerprint(old) != new_fp and archive.read_bytes() == old
    assert archive.stat().st_mode & 0o777 == 0o600 and load_key() != old
    assert find_key(old_fp) == old and run_key(run) == old  # the archived key, found by fingerprint
    archive.unlink()
    with pytest.raises(UnlearnError, match=f"recorded with the key of fingerprint {old_fp}.*HF_UNLEARN_KEY_FILE"):
        run_key(run)
    assert run_key(run, required=False) is None  # inspect still works without the key


def test_a_run_with_its_own_key_keeps_using_it(key_file, tmp_path):
    """Runs recorded before the one key (private/hmac.key, no fingerprint in the header) are not migrated."""
    run = tmp_path / "legacy"
    (run / "private").mkdir(parents=True)
    own = bytes(range(32))
    (run / "private" / "hmac.key").write_bytes(own)
    (run / "private" / "hmac.key").chmod(0o600)
    (run / "header.json").write_text(json.dumps({"format": "hf_unlearn.trace.v1"}))
    assert run_key(run) == own != load_key()
    assert recording_key(run) == own  # resuming it keeps its key
    (run / "private" / "hmac.key").chmod(0o644)
    with pytest.raises(UnlearnError, match="chmod 600"):
        run_key(run)
    (run / "private" / "hmac.key").chmod(0o600)
    (run / "header.json").write_text(json.dumps({"key_fingerprint": "0" * 16}))  # the header names another key
    with pytest.raises(UnlearnError, match="restore the run's own key"):
        run_key(run)


def test_key_cli_shows_and_rotates(key_file, capsys):
    from hf_unlearn.cli import main

    key = load_key()
    assert main(["hub", "key"]) == 0
    assert f"key {key_fingerprint(key)} from {key_file}" in capsys.readouterr().out
    assert main(["hub", "key", "--rotate"]) == 0
    out = capsys.readouterr().out
    assert f"old key {key_fingerprint(key)} archived" in out and load_key() != key
