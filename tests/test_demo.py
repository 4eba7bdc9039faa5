"""`hf-unlearn demo`: every stage, offline, with no data folder; runnable twice in the same folder; no empty folders."""

from __future__ import annotations

import json
import os

import pytest

from hf_unlearn.cli import main
from hf_unlearn.errors import UnlearnError


def _no_data_dir(monkeypatch):
    """The demo needs no data folder: the TOFU rows ship inside the package."""
    monkeypatch.delenv("HF_UNLEARN_DATA_DIR", raising=False)


def _empty_dirs(root) -> list[str]:
    return [d for d, subdirs, files in os.walk(root) if not subdirs and not files]


@pytest.fixture(scope="session")  # session: a module fixture was built again when xdist interleaved modules
def small_demo(tmp_path_factory):
    """The whole demo at a small size (3 authors, short fine-tune): exact deletion, MASC, local Hub, verify."""
    import io
    from contextlib import redirect_stdout

    saved = os.environ.pop("HF_UNLEARN_DATA_DIR", None)
    out = tmp_path_factory.mktemp("demo") / "demo_output"
    buf = io.StringIO()
    try:
        with redirect_stdout(buf):
            code = main(["demo", "--authors", "3", "--epochs", "12", "--no-baselines", "--no-progress",
                         "--out", str(out)])
    finally:
        if saved is not None:
            os.environ["HF_UNLEARN_DATA_DIR"] = saved
    return code, buf.getvalue(), out


@pytest.mark.slow  # the whole demo (~95 s on one core); each stage has its own default tests
def test_demo_runs_every_stage(small_demo):
    code, out_text, out = small_demo
    assert code == 0, out_text[-3000:]
    stats = json.loads((out / "demo_summary.json").read_text())
    # record: the fine-tune memorised the authors
    assert stats["loss_after"]["forget"] < stats["loss_before"]["forget"] / 3
    # exact deletion, verified bit for bit against the oracle
    assert stats["deletion"]["identical"] is True and "VERIFIED bit-identical" in out_text
    # after the deletion the forgotten author is back near the untrained loss; the retained ones stay learned
    assert stats["deletion"]["loss"]["forget"] > stats["deletion"]["loss"]["retain"] + 1.0
    # MASC on another author, evaluated before and after
    masc = stats["masc"]
    assert masc["author"] == 1
    assert masc["after"]["forget"]["probability"] < masc["before"]["forget"]["probability"]
    # both models published to the local Hub as successive deletion tags, and verified after a fresh download
    tags = [stats[k]["receipt"]["published"]["tag"] for k in ("deletion", "masc")]
    assert tags == ["deletion-0001", "deletion-0002"]
    assert all(stats[k]["receipt"]["published"]["verify_ok"] for k in ("deletion", "masc"))
    names = [s["name"] for s in stats["stages"]]
    for stage in ("record", "deletion request", "exact deletion", "MASC", "card + state hashes", "push (local Hub)",
                  "hub verify"):
        assert stage in names
    assert "[5/5] summary" in out_text
    assert _empty_dirs(out) == []
    assert (out / "requests" / "author-2.jsonl").read_text().splitlines()[0] == "40"


@pytest.mark.slow  # the demo run again (~20 s)
def test_demo_runs_again_in_the_same_folder_and_refuses_foreign_ones(small_demo, tmp_path, monkeypatch, capsys):
    _no_data_dir(monkeypatch)
    code, _, out = small_demo
    assert code == 0
    args = ["demo", "--authors", "3", "--epochs", "2", "--no-baselines", "--no-masc", "--no-publish",
            "--no-progress"]
    assert main([*args, "--out", str(out)]) == 0  # the earlier demo output is replaced
    assert not (out / "unlearn-masc").exists() and not (out / "hub").exists()
    assert _empty_dirs(out) == []
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("keep me")
    assert main([*args, "--out", str(foreign)]) == 1
    err = capsys.readouterr().err
    assert "is not an earlier output of this command" in err and "--overwrite" not in err  # the demo has none
    assert (foreign / "thesis.tex").read_text() == "keep me"
    (foreign / "demo_summary.json").write_text('{"my": "notes"}')  # a file of the marker's name, not a demo's
    assert main([*args, "--out", str(foreign)]) == 1
    assert "not a demo summary" in capsys.readouterr().err
    assert (foreign / "thesis.tex").read_text() == "keep me"


def test_demo_options_are_checked_before_anything_runs(tmp_path):
    from hf_unlearn.demo import DemoConfig, run_demo

    for bad, match in ((dict(authors=3, forget_authors=3), "forget-authors"), (dict(epochs=0), "must be > 0"),
                       (dict(authors=2), "--authors >= 3")):
        with pytest.raises(UnlearnError, match=match):
            run_demo(DemoConfig(output_dir=str(tmp_path / "o"), **bad))
        assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_the_default_demo(tmp_path, monkeypatch, capsys):
    """`hf-unlearn demo` exactly as the README runs it (minutes on 2 cores)."""
    _no_data_dir(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert main(["demo"]) == 0
    text = capsys.readouterr().out
    assert "VERIFIED bit-identical" in text and "hub verify" in text
    stats = json.loads((tmp_path / "demo_output" / "demo_summary.json").read_text())
    assert stats["deletion"]["baselines"]["filter"]["l2"] > 0 and stats["deletion"]["baselines"]["repack"]["l2"] > 0


def test_the_repack_baseline_shows_a_bar_of_its_steps_and_is_silent_under_no_progress(tmp_path, capsys):
    """The demo's repack baseline (a plain Trainer retraining, 75 s in the demo) had a clock and no bar: it counts
    its optimizer steps now, as the replays do; --no-progress keeps it silent."""
    from hf_unlearn.demo import step_bar
    from hf_unlearn.trace.replay import repack_counterfactual

    from .test_trace_common import get_recorded, ids_at_step

    run = get_recorded()
    forget = ids_at_step(run, 1)[:1]
    capsys.readouterr()
    state = repack_counterfactual(run, forget, tmp_path / "quiet", callbacks=[step_bar("repack", False)])
    assert state["step"] == 8 and "repack" not in capsys.readouterr().err
    repack_counterfactual(run, forget, tmp_path / "bar", callbacks=[step_bar("repack baseline", True)])
    err = capsys.readouterr().err
    assert "repack baseline:" in err and "0/8 [" in err and "step/s" in err, err[-2000:]  # 8 optimizer steps
