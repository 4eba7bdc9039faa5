"""Any collator, any id: standard transformers collators and string ids work unchanged, and replays rebuild them."""

from __future__ import annotations

import json

import pytest
import torch

from .test_trace_common import delete, get_trace_data, record, tiny, train_args


def _cli(*args):
    from hf_unlearn.cli import main

    return main([str(a) for a in args])


def _fixed_length(data, tok, length: int = 24):
    """Rows cut/padded to one length (what default_data_collator and DataCollatorWithPadding need for labels)."""
    def cut(r):
        ids, labels = r["input_ids"][:length], r["labels"][:length]
        pad = length - len(ids)
        return {"input_ids": ids + [tok.pad_token_id] * pad, "attention_mask": [1] * len(ids) + [0] * pad,
                "labels": labels + [-100] * pad}
    return data.map(cut)


def test_seq2seq_collator_with_digit_only_string_ids(tmp_path, capsys):
    """DataCollatorForSeq2Seq + ids "3600".. : records (bit-identical to Trainer), and the CLI replays it as is."""
    from transformers import DataCollatorForSeq2Seq, Trainer

    tok, data = get_trace_data()
    data = data.select(range(16))  # (map() would cast "3600" back to the column's int64 type)
    data = data.remove_columns("id").add_column("id", [str(3600 + i) for i in range(16)])
    collator = DataCollatorForSeq2Seq(tok)
    kw = dict(max_steps=2)
    recorded = record(tok, data, tmp_path / "rec", every=1, data_collator=collator, **kw)
    plain = tiny(tok)
    Trainer(model=plain, args=train_args(tmp_path / "plain", **kw), train_dataset=data, data_collator=collator).train()
    a, b = plain.state_dict(), recorded.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)

    run = tmp_path / "rec" / "trace"
    header = json.loads((run / "header.json").read_text())
    assert header["collator"]["rebuildable"] and header["dataset"]["id_type"] == "str"
    from hf_unlearn.trace import open_run

    victim = open_run(run).ids_at_steps([1])[0]
    assert isinstance(victim, str) and victim.isdigit()
    legacy = tmp_path / "forget.txt"
    legacy.write_text(victim + "\n")  # the legacy text form reads a digit-only line as an int
    assert _cli("trace", "cost", run, "--forget", legacy) == 1
    assert f"id {int(victim)} is int but the run {run} uses str ids" in capsys.readouterr().err
    typed = tmp_path / "forget.jsonl"
    typed.write_text(json.dumps(victim) + "\n")
    assert _cli("trace", "redact", run, "--forget", typed, "--out", tmp_path / "store") == 0
    assert _cli("trace", "replay", run, "--store", tmp_path / "store", "--forget", typed, "--out", tmp_path / "r") == 0
    assert _cli("trace", "oracle", run, "--forget", typed, "--out", tmp_path / "o") == 0
    capsys.readouterr()
    assert _cli("trace", "verify", tmp_path / "r", tmp_path / "o") == 0
    assert "VERIFIED" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["padding", "language_modeling", "flattening", "default"])
def test_standard_collators_are_rebuilt_by_replays(tmp_path, kind):
    from transformers import (
        DataCollatorForLanguageModeling,
        DataCollatorWithFlattening,
        DataCollatorWithPadding,
        default_data_collator,
    )

    tok, data = get_trace_data()
    data = data.select(range(8))
    collator = {"padding": DataCollatorWithPadding(tok), "language_modeling": DataCollatorForLanguageModeling(tok, mlm=False),
                "flattening": DataCollatorWithFlattening(), "default": default_data_collator}[kind]
    if kind in ("padding", "default"):
        data = _fixed_length(data, tok)
    if kind == "language_modeling":  # labels come from input_ids (pad -> -100); the dummy is all pad tokens
        data = data.remove_columns("labels")
    record(tok, data, tmp_path / "rec", every=1, data_collator=collator, per_device_train_batch_size=2, max_steps=2)
    run = tmp_path / "rec" / "trace"
    header = json.loads((run / "header.json").read_text())
    assert header["collator"]["rebuildable"], header["collator"]
    from hf_unlearn.trace import open_run

    forget = open_run(run).ids_at_steps([1])[:1]
    _, report = delete(run, forget, tmp_path)  # the replay and the oracle rebuild the collator from the trace
    assert report["verified"], report["provenance"]["problems"] or report["params"]["mismatched_tensors"][:3]


def _closure_run(tmp_path, monkeypatch):
    """A run recorded with a collator the trace cannot rebuild (a closure), and a module that can build it."""
    from transformers import DataCollatorForSeq2Seq

    tok, data = get_trace_data()
    data = data.select(range(16))
    tok.save_pretrained(tmp_path / "tok")
    seq2seq = DataCollatorForSeq2Seq(tok)
    record(tok, data, tmp_path / "rec", every=1, data_collator=lambda features: seq2seq(features), max_steps=2)
    (tmp_path / "my_collators.py").write_text(
        "from transformers import AutoTokenizer, DataCollatorForSeq2Seq\n"
        f"TOK = AutoTokenizer.from_pretrained({str(tmp_path / 'tok')!r})\n"
        "def make():\n    return DataCollatorForSeq2Seq(TOK)\n"
        "def make_wrong():\n    return DataCollatorForSeq2Seq(TOK, pad_to_multiple_of=16)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "rec" / "trace"


def test_cli_collator_option_and_a_wrong_collator_is_refused(tmp_path, monkeypatch, capsys):
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run

    run = _closure_run(tmp_path, monkeypatch)
    header = json.loads((run / "header.json").read_text())
    assert not header["collator"]["rebuildable"] and any("--collator" in n for n in header["notes"])
    forget = write_ids(tmp_path / "f.jsonl", open_run(run).ids_at_steps([1])[:1])
    assert _cli("trace", "redact", run, "--forget", forget, "--out", tmp_path / "s") == 0
    replay = ("trace", "replay", run, "--store", tmp_path / "s", "--forget", forget, "--out", tmp_path / "r")
    assert _cli(*replay) == 1
    assert "--collator module:callable" in capsys.readouterr().err and not (tmp_path / "r").exists()
    # a collator that pads differently: every untouched microbatch is compared with the recorded batch, up front
    assert _cli("trace", "oracle", run, "--forget", forget, "--out", tmp_path / "o", "--collator",
                "my_collators:make_wrong()") == 1
    assert "does not collate to the batch the run recorded" in capsys.readouterr().err
    assert _cli(*replay, "--collator", "my_collators:make()") == 0
    assert _cli("trace", "oracle", run, "--forget", forget, "--out", tmp_path / "o", "--collator",
                "my_collators:make()") == 0
    capsys.readouterr()
    assert _cli("trace", "verify", tmp_path / "r", tmp_path / "o") == 0
    assert _cli("trace", "replay", run, "--store", tmp_path / "s", "--forget", forget, "--out", tmp_path / "r2",
                "--collator", "my_collators:nope") == 1
    assert "cannot import it" in capsys.readouterr().err
    # the user's own code failing (at import, or in the factory) is one line naming the option, not a traceback
    (tmp_path / "broken_collators.py").write_text("def make(:\n")
    (tmp_path / "raising_collators.py").write_text("def make():\n    raise RuntimeError('no tokenizer here')\n")
    for ref, says in (("broken_collators:make()", "importing it raised SyntaxError"),
                      ("raising_collators:make()", "calling raising_collators:make() raised RuntimeError: no tokenizer")):
        assert _cli("trace", "oracle", run, "--forget", forget, "--out", tmp_path / "o2", "--collator", ref) == 1
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "o2").exists()


def test_id_carrying_collator_hides_ids_from_the_collator():
    from hf_unlearn.data.collators import IdCarryingCollator

    seen = []

    def collate(features):
        seen.extend(features)
        return {"input_ids": torch.tensor([f["input_ids"] for f in features])}

    batch = IdCarryingCollator(collate)([{"id": "3600", "input_ids": [1, 2]}, {"id": "x", "input_ids": [3, 4]}])
    assert batch["id"] == ["3600", "x"] and all("id" not in f for f in seen)


def test_a_flattened_microbatch_keeps_a_digest_per_row_and_a_changed_kept_row_is_refused(tmp_path, monkeypatch):
    """``DataCollatorWithFlattening`` merges a microbatch into one sequence; its rows are told apart where
    ``position_ids`` restart, so every kept row that shares a microbatch with a deleted one is still compared with
    the row the run trained on. A callback adds a ``set_transform`` at step 3 (with a recorder blind to datasets, as
    if the transform lived where no digest reads) and the deletion takes a row of every microbatch from there on:
    refused before any compute at the first kept row that differs. (A clean deletion through the same collator is
    VERIFIED: test_standard_collators_are_rebuilt_by_replays[flattening].)"""
    from transformers import DataCollatorWithFlattening

    from hf_unlearn.trace import digests, open_run
    from hf_unlearn.trace.rows import split

    from .test_trace_common import config_model
    from .test_trace_digest_attacks import AT, KW, _callbacks, _deletion, _ids, _undo

    tok, data = get_trace_data()
    whole = digests.program_state
    monkeypatch.setattr(digests, "program_state", lambda *a, **k: whole(*a, **{**k, "datasets": {}}))
    try:
        record(tok, data.select(range(24)), tmp_path / "rec", model=config_model("llama", tok), every=2,
               data_collator=DataCollatorWithFlattening(), **KW,
               trainer_kwargs={"callbacks": _callbacks("set_transform", {"set_transform": AT})})
    finally:
        _undo()
    run = tmp_path / "rec" / "trace"
    opened = open_run(run)
    per_step = [e.extra.get("rows") for e in opened.plan if e.j == 0]
    assert all(r and all(len(split(m)) == len(e.slots) for m in r)
               for r, e in zip(per_step, (e for e in opened.plan if e.j == 0))), per_step[:2]
    kind, what = _deletion(tmp_path, run, _ids(run, range(AT, KW["max_steps"])), "del")
    assert kind == "refused", (kind, what)
    assert "is not the row the run trained on" in what, what
