"""``verification.json`` is believed only under the seal ``trace verify`` put on it for this very replay.

One tiny recorded run (the trace tests' shared one), one deletion replayed three times (A and B with the fresh start
probed: the same final roots; C without the probe: a fresh start unproven) and one oracle. Every forgery of A's
verdict (an edited verdict, dropped unproven steps, B's file copied in, with or without A's run id written into it,
another oracle's run id, the seal removed, a file from before verdicts were sealed) is reported not verified by the
replay's card and refused by each reader that publishes or takes a root from it: the provenance publisher (what
``push_unlearned(trace_dir=...)`` runs before uploading), ``forget``'s publishing view and
``hub verify --expect-from``.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_unlearn.errors import UnlearnError

from .test_trace_common import get_recorded, ids_at_step

VF = "verification.json"


@functools.cache
def _deletion() -> SimpleNamespace:
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store, verify
    from hf_unlearn.trace.proof import prove_fresh_start

    root = Path(tempfile.mkdtemp(prefix="seal_tests_"))
    import atexit

    atexit.register(shutil.rmtree, root, True)
    run = open_run(get_recorded())
    forget = ids_at_step(run.path, 6)[:2]
    redact_store(run.store_path, forget, root / "store", run.key)
    probed = prove_fresh_start(run, forget)  # step 6 is affected: the replay's fresh start is probed, as forget does
    trainers = {}
    for name, proven in (("a", probed), ("b", probed), ("c", None)):
        trainers[name] = RedactedReplayTrainer(run, root / "store", forget, root / name, proven_start=proven)
        trainers[name].train()
    OracleReplayTrainer(run, forget, out_dir=root / "oracle").train()
    for name in ("b", "c"):
        verify(root / name, root / "oracle")
    return SimpleNamespace(root=root, forget=forget, a=trainers["a"], A=root / "a", B=root / "b", C=root / "c",
                           oracle=root / "oracle")


@pytest.fixture
def d():
    """The deletion, with A's verdict as ``trace verify`` wrote it (each test may forge it)."""
    from hf_unlearn.trace import verify

    d = _deletion()
    assert verify(d.A, d.oracle)["verified"]
    return d


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _write(path: Path, verdict: dict) -> None:
    path.write_text(json.dumps(verdict, indent=1))


def _honest_but_not_verified(d, edit: dict) -> None:
    """A's own sealed NOT VERIFIED verdict (a replay compared with another replay, not an oracle), then edited."""
    from hf_unlearn.trace import verify

    assert not verify(d.A, d.B)["verified"]
    _write(d.A / VF, {**_read(d.A / VF), **edit})


def _copied_from_b(d, own_run_id: bool = False) -> None:
    theirs = _read(d.B / VF)  # the same run, the same request, the same final roots: only the replay differs
    assert theirs["verified"] and theirs["roots"] == _read(d.A / VF)["roots"]
    if own_run_id:
        theirs["run_id"] = _read(d.A / VF)["run_id"]
    _write(d.A / VF, theirs)


def _unproven_dropped(d) -> None:
    """C's honest verdict names its unproven fresh start; copied to A with the unproven steps and starts emptied."""
    theirs = _read(d.C / VF)
    assert not theirs["verified"] and theirs["unproven_starts"], theirs
    _write(d.A / VF, {**theirs, "run_id": _read(d.A / VF)["run_id"], "unproven_steps": [], "unproven_starts": [],
                      "verified": True, "verdict": "VERIFIED bit-identical to the oracle"})


def _edit_own(d, **edit) -> None:
    _write(d.A / VF, {**_read(d.A / VF), **edit})


def _old_format(d) -> None:
    """As ``trace verify`` wrote it before verdicts were sealed: the same fields, no run id, no seal."""
    old = _read(d.A / VF)
    for k in ("mac", "run_id"):
        old.pop(k)
    _write(d.A / VF, old)


NOT_OURS = "does not carry this replay's seal (edited, or copied from another replay)"
NO_SEAL = "carries no seal (written before verdicts were sealed, or its seal was removed)"
FORGERIES = {
    "verified false->true": (lambda d: _honest_but_not_verified(d, {"verified": True, "provenance_problems": [],
                                                                     "verdict": "VERIFIED bit-identical to the oracle"}),
                             NOT_OURS),
    "unproven steps dropped": (_unproven_dropped, NOT_OURS),
    "copied from another replay (same roots)": (_copied_from_b, NOT_OURS),
    "copied, with this replay's run id written in": (lambda d: _copied_from_b(d, own_run_id=True), NOT_OURS),
    "another oracle's run id": (lambda d: _edit_own(d, oracle_run_id=_read(d.B / VF)["run_id"]), NOT_OURS),
    "seal removed": (lambda d: _edit_own(d, mac=None), NO_SEAL),
    "written before verdicts were sealed": (_old_format, NO_SEAL),
}


def _refusals(d, tmp_path) -> dict[str, str]:
    """What each reader that believes a verdict says of A's file: the card's text, and each refusal's one line."""
    from hf_unlearn.deletion.publishing import _provenance_view
    from hf_unlearn.hub.leaks import IdScanner
    from hf_unlearn.hub.provenance import select_provenance
    from hf_unlearn.hub.verify import expected_from

    exact = d.a.unlearning_card_info()["extra"]["exact_deletion"]
    assert exact["verified"] is False
    said = {"card": exact["verification"]}
    for reader, call in (("publish", lambda: select_provenance(d.A, IdScanner(d.forget))),
                         ("forget view", lambda: _provenance_view(d.A, tmp_path / "view")),
                         ("expect-from", lambda: expected_from(d.A / VF, "org/m"))):  # the folder: its log
        with pytest.raises(UnlearnError) as e:
            call()
        said[reader] = str(e.value)
        assert "\n" not in said[reader] and "trace verify" in said[reader], said[reader]
    assert not (tmp_path / "view").exists()  # refused before anything was copied
    return said


def test_the_honest_verdict_is_believed_by_every_reader(d, tmp_path):
    from hf_unlearn.deletion.publishing import _provenance_view
    from hf_unlearn.hub.leaks import IdScanner
    from hf_unlearn.hub.provenance import select_provenance
    from hf_unlearn.hub.verify import expected_from
    from hf_unlearn.trace.verification import sealed_verdict

    verdict, why = sealed_verdict(d.A)
    assert why is None and verdict["verified"] and verdict["run_id"] == _read(d.A / "header.json")["run_id"]
    assert len(verdict["mac"]) == 64 and verdict["oracle_run_id"] == _read(d.oracle / "header.json")["run_id"]
    exact = d.a.unlearning_card_info()["extra"]["exact_deletion"]
    assert exact["verified"] is True and exact["verification"] == "bit-identical to the trace oracle"
    assert expected_from(d.A / VF, "org/m") == {"expect_root": exact["params_root"]}
    publish, _, hits = select_provenance(d.A, IdScanner(d.forget))
    assert VF in publish and hits == []
    assert (_provenance_view(d.A, tmp_path / "view") / VF).read_bytes() == (d.A / VF).read_bytes()
    # published without the replay's key or checkpoints (forget's view): the seal still checks under the one key
    publish, _, _ = select_provenance(tmp_path / "view", IdScanner(d.forget))
    assert VF in publish


def test_an_honest_verdict_that_is_not_verified_says_so_and_can_be_published(d):
    from hf_unlearn.hub.leaks import IdScanner
    from hf_unlearn.hub.provenance import select_provenance
    from hf_unlearn.trace import verify

    assert not verify(d.A, d.B)["verified"]  # B is a replay, not an oracle
    exact = d.a.unlearning_card_info()["extra"]["exact_deletion"]
    assert exact["verified"] is False
    assert exact["verification"] == "not verified: bit-identical to the oracle but NOT VERIFIED (provenance)"
    assert VF in select_provenance(d.A, IdScanner(d.forget))[0]  # a sealed record of a failure is the truth


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_forged_verdict_is_not_believed_by_any_reader(d, tmp_path, forgery):
    forge, why = FORGERIES[forgery]
    forge(d)
    said = _refusals(d, tmp_path)
    assert said["card"] == (f"not verified: verification.json {why}: run `hf-unlearn trace verify REPLAY_DIR "
                            "ORACLE_DIR` again (it only compares the two folders)"), said["card"]
    assert said["publish"].startswith(f"refusing to publish provenance/verification.json: it {why}; run `hf-unlearn "
                                      "trace verify"), said["publish"]
    assert said["forget view"].startswith(f"refusing to publish {d.A / VF}: it {why}"), said["forget view"]
    assert said["expect-from"].startswith(f"{d.A / VF}: not taking the expected root from it: it {why}")


def test_without_the_run_key_the_seal_cannot_be_checked_and_nothing_is_claimed(d, tmp_path, monkeypatch):
    """A copy of the folders on a machine without the key (the run key is the library's one key here)."""
    from hf_unlearn.trace.verification import sealed_verdict

    assert not (d.A / "private" / "hmac.key").exists()
    monkeypatch.delenv("HF_UNLEARN_TAG_KEY", raising=False)
    monkeypatch.setenv("HF_UNLEARN_KEY_FILE", str(tmp_path / "keys" / "id_tag.key"))  # another machine's (none)
    why = "cannot have its seal checked here (the replay's run key is not on this machine, or is refused)"
    assert sealed_verdict(d.A) == (None, why)
    said = _refusals(d, tmp_path)
    assert why in said["card"] and why in said["publish"] and why in said["expect-from"]


def test_a_forged_verdict_is_refused_before_the_push_uploads_anything(d, tmp_path):
    """The real push (the replay's output folder with its provenance, to a local Hub): the honest verdict is
    published and the card says verified; B's verdict copied in refuses the push, and so does a card info edited to
    say verified over a sealed NOT VERIFIED verdict: the repository gets nothing."""
    from hf_unlearn.demo import local_hub
    from hf_unlearn.hub.publish import push_unlearned

    d.a.save_model()
    with local_hub(tmp_path / "hub") as (server, token):
        result = push_unlearned(d.A, "org/sealed", card_info=d.a.unlearning_card_info(), trace_dir=d.A,
                                endpoint=server.url, token=token, local_dir=tmp_path / "pushed")
        assert f"provenance/{VF}" in result.files and "bit-identical to the trace oracle" in result.card
        _copied_from_b(d)
        with pytest.raises(UnlearnError, match=rf"refusing to publish provenance/{VF}: it {NOT_OURS[:30]}"):
            push_unlearned(d.A, "org/forged", card_info=d.a.unlearning_card_info(), trace_dir=d.A,
                           endpoint=server.url, token=token, local_dir=tmp_path / "refused")
        from hf_unlearn.hub.store import StoreError

        with pytest.raises(StoreError):  # no repository, no commit: the refusal came before the upload
            server.store.files("model", "org/forged", "main")
        # the card info is the publisher's file (unlearning_info.json): a card that says verified while the
        # replay's own sealed verdict does not is refused too
        from hf_unlearn.trace import verify

        assert not verify(d.A, d.B)["verified"]
        info = d.a.unlearning_card_info()
        assert info["extra"]["exact_deletion"]["verified"] is False
        info["extra"]["exact_deletion"].update(verified=True, verification="bit-identical to the trace oracle")
        with pytest.raises(UnlearnError, match=rf"the card says the deletion was verified, but {d.A} holds no {VF} "
                                               "that says VERIFIED; run `hf-unlearn trace verify"):
            push_unlearned(d.A, "org/claimed", card_info=info, trace_dir=d.A, endpoint=server.url, token=token,
                           local_dir=tmp_path / "claimed")
        with pytest.raises(StoreError):
            server.store.files("model", "org/claimed", "main")
    assert not (tmp_path / "refused").exists()


def test_a_verdict_about_another_state_than_the_final_checkpoint_is_not_believed(d, tmp_path):
    """Sealed for this replay, but its roots are not the replay's final checkpoint's (the folder changed after
    verify): the seal binds the roots, and the readers compare them with the checkpoint the folder holds."""
    from .test_trace_common import write_sealed_verdict

    verdict = _read(d.A / VF)
    write_sealed_verdict(d.A, {**verdict, "roots": {**verdict["roots"], "a": {"params": "0" * 64,
                                                                              "optimizer": "1" * 64}}})
    said = _refusals(d, tmp_path)
    why = "is about another state than the replay's final checkpoint (the replay changed after verify)"
    assert why in said["card"] and why in said["publish"] and why in said["expect-from"]
