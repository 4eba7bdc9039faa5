"""The dummy's zero influence is evidence on every replayed microbatch (issue #31): a loss whose term on every token
grows with the step passes the construction probe (step 0) and gave a VERIFIED deletion in which the dummy row had
trained the model. Replays and the oracle now check the dummies' gradient on every microbatch that holds one."""

from __future__ import annotations

import json

import pytest
import torch

from hf_unlearn.trace.dummies import DummyInfluenceError

from .test_trace_common import delete, get_trace_data, record
from .trace_dummy_trainers import GrowingEveryTokenTrainer

KW = dict(gradient_accumulation_steps=1, max_steps=4)


def _model(family: str, tok):
    from hf_unlearn.models import build_tiny_model

    return build_tiny_model(family, tok, hidden_size=32, num_layers=2, num_heads=2, seed=0)


def _record_growing(tmp_path, family: str):
    from hf_unlearn.trace import trace_recording

    tok, data = get_trace_data()
    data = data.select(range(16))
    from hf_unlearn.data import QACollator

    trainer = trace_recording(GrowingEveryTokenTrainer)(
        model=_model(family, tok), args=_args(tmp_path / "rec"), train_dataset=data,
        data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=1, trace_checkpoint_retention="even")
    trainer.train()  # the construction probe (global step 0) found no gradient on the dummy: recorded
    return tok, data, tmp_path / "rec" / "trace"


def _args(out):
    from .test_trace_common import train_args

    return train_args(out, **KW)


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2"])
def test_a_loss_that_weights_the_dummy_later_is_refused_at_that_microbatch(tmp_path, family, monkeypatch):
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store
    from hf_unlearn.trace import replay as replay_module

    tok, data, run = _record_growing(tmp_path, family)
    header = json.loads((run / "header.json").read_text())
    assert header["fidelity"]["recording"]["reproduced"] and not header["hazards"]
    opened = open_run(run)
    early, late = opened.ids_at_steps([0])[:1], opened.ids_at_steps([2])[:1]
    # step 0: the term is 0 * ..., the dummy has exactly zero gradient: a deletion there replays and verifies
    _, report = delete(run, early, tmp_path / "early")
    assert report["verified"]
    # a late deletion: the replay (suffix from checkpoint 2) stops at step 2's microbatch, before its optimizer step
    redact_store(opened.store_path, late, tmp_path / "late" / "store", opened.key)
    replay = RedactedReplayTrainer(run, tmp_path / "late" / "store", late, tmp_path / "late" / "replay")
    mb = next(e.mb for e in opened.plan if e.step == 2)
    with pytest.raises(DummyInfluenceError, match=rf"at optimizer step 2, microbatch {mb} \(loss [0-9.]+\): "
                                                  r"GrowingEveryTokenTrainer.compute_loss gives tokens"):
        replay.train()
    assert not (tmp_path / "late" / "replay").exists()  # no half-written output run
    # the oracle (a full replay from step 0) of both rows passes step 0's dummy and stops at the first one with weight
    with pytest.raises(DummyInfluenceError, match="at optimizer step 2"):
        OracleReplayTrainer(run, early + late).train()
    # without the check the same late deletion is still not VERIFIED: the oracle trains the deleted row itself (its
    # tokens kept, labels ignored), whose tokens this loss weights, so replay (a dummy there) and oracle differ; the
    # check is what names the cause, before the step
    monkeypatch.setattr(replay_module, "watch_dummy_gradient", lambda model, mask: _NoWatch())
    _, report = delete(run, late, tmp_path / "unchecked")
    assert not report["identical"] and not report["verified"]


class _NoWatch:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_cli_forget_names_the_step_and_the_loss(tmp_path, capsys):
    from hf_unlearn.cli import main
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.trace import open_run

    _, _, run = _record_growing(tmp_path, "gpt_neox")
    write_ids(tmp_path / "ids.jsonl", open_run(run).ids_at_steps([3])[:1])
    code = main(["forget", str(run), "--ids", str(tmp_path / "ids.jsonl"), "--out", str(tmp_path / "out"), "--oracle",
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "non-zero gradient" in err and "at optimizer step 3" in err and "(loss " in err
    assert "VERIFIED" not in err and not (tmp_path / "out").exists()


def test_the_check_locates_dummies_whatever_the_padding_side(tmp_path):
    """Left padding puts the dummy's tokens elsewhere in the collated batch: located by collating twice, so a labels-
    weighted loss is never refused and the mask covers exactly the dummy row's tokens."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.trace import ReplayTrainer, open_run

    tok, data = get_trace_data()
    record(tok, data.select(range(8)), tmp_path / "rec", every=1, max_steps=2, gradient_accumulation_steps=1)
    run = open_run(tmp_path / "rec" / "trace")
    forget = run.ids_at_steps([1])[:1]
    replay = ReplayTrainer(run, forget_ids=forget, start="full")
    from hf_unlearn.trace.dummies import dummy_positions

    e = next(e for e in run.plan if e.step == 1)
    assert replay._holds_dummy(e) and not replay._holds_dummy(next(x for x in run.plan if x.step == 0))
    marked = []
    feats, dummy_pos = replay._rows(e, keep_dummies=True, marked=marked)
    masks = []
    for side in ("right", "left"):
        collator = QACollator.from_tokenizer(tok, padding_side=side)
        batch = collator(feats)
        mask = dummy_positions(batch, collator(marked))
        assert int(mask.sum()) == len(feats[dummy_pos[0]]["input_ids"])
        assert bool(mask[dummy_pos[0]].any()) and not bool(mask[[i for i in range(len(feats)) if i not in dummy_pos]].any())
        masks.append(mask)
    assert not torch.equal(masks[0], masks[1])  # the dummy's tokens sit elsewhere with left padding: found both ways


def test_a_loss_reading_the_deleted_rows_tokens_is_not_verified_the_oracle_being_the_counterfactual(tmp_path, capsys):
    """ATTACK (a tester's wrong VERIFIED): the loss is scaled by how often a word occurs in the microbatch's inputs.
    The construction probe's row lacks the word and a dummy gets exactly zero gradient, so the replay and the oracle
    (both with a dummy in the deleted row's place) agreed and a deletion of a row holding the word was VERIFIED, 21/21
    tensors off the counterfactual (the row's tokens kept, its labels ignored). The oracle now trains the deleted
    rows themselves without weight: it is the engine-free counterfactual bit for bit, the replay is not, and the
    deletion is NOT VERIFIED; a row without the word is VERIFIED and equal to its counterfactual."""
    from hf_unlearn.cli import main
    from hf_unlearn.data import QACollator
    from hf_unlearn.data.ids import write_ids
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import open_run, trace_recording

    from .test_trace_common import labels_masked, recorded_normalisers_trainer, tiny, train_args
    from .test_trace_pipeline import _final, _same
    from .trace_dummy_trainers import WORD, InputWeightedTrainer

    tok, data = get_trace_data()
    data = data.select(range(16))
    trace_recording(InputWeightedTrainer)(
        model=tiny(tok), args=_args(tmp_path / "rec"), train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
        trace_checkpoint_steps=2, trace_checkpoint_retention="even").train()
    run = tmp_path / "rec" / "trace"
    step2 = open_run(run).ids_at_steps([2])
    rows = {r["id"]: r["input_ids"] for r in data}
    holding, lacking = [i for i in step2 if WORD in rows[i]][:1], [i for i in step2 if WORD not in rows[i]][:1]
    assert holding and lacking

    def counterfactual(ids, name):
        model = tiny(tok)
        recorded_normalisers_trainer(run, base=InputWeightedTrainer)(
            model=model, args=train_args(tmp_path / name, **KW), train_dataset=labels_masked(data, ids),
            data_collator=_DropIds(QACollator.from_tokenizer(tok))).train()
        return model.state_dict()

    for ids, name, verified in ((holding, "holding", False), (lacking, "lacking", True)):
        write_ids(tmp_path / f"{name}.jsonl", ids)
        code = main(["forget", str(run), "--ids", str(tmp_path / f"{name}.jsonl"), "--out", str(tmp_path / name),
                     "--oracle", "--no-progress"])
        out = capsys.readouterr().out
        cf = counterfactual(ids, f"cf-{name}")
        assert not _same(_final(tmp_path / name / "oracle"), cf), name  # the oracle is the counterfactual
        assert (code == 0) is verified and ("VERIFIED bit-identical" in out) is verified, name
        assert bool(_same(_final(tmp_path / name / "replay"), cf)) is not verified, name
        receipt = json.loads((tmp_path / name / "receipt.json").read_text())
        assert receipt["evidence"]["verified"] is verified

    # ATTACK (a tester's): a second request from the unverified deletion's replay (a row without the word) was
    # VERIFIED against its own oracle, both starting from the first request's dummy, every tensor off the
    # counterfactual of both requests: the run's sealed verdict says NOT verified, so it is refused before compute
    code = main(["forget", str(tmp_path / "holding" / "replay"), "--ids", str(tmp_path / "lacking.jsonl"), "--out",
                 str(tmp_path / "chained"), "--oracle", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "is the output of an exact deletion that was NOT verified" in err
    assert not (tmp_path / "chained").exists()


def test_a_collator_that_labels_the_tokens_deleted_rows_go_into_the_oracle_whole_labels_ignored_once_collated(
        tmp_path):
    """ATTACK (a tester's wrong VERIFIED): ``DataCollatorForLanguageModeling`` over rows without a labels column
    builds the labels from the tokens, so a deleted row cannot be masked before collation; the oracle kept the dummy
    there and the word-weighted loss was VERIFIED with every tensor off. The oracle now puts the row in whole and
    ignores its labels once collated (located as the dummies are): it equals the engine-free counterfactual (the same
    collator, the row's labels -100 after collation), the replay does not, NOT VERIFIED; a row without the word is
    VERIFIED and equal to its counterfactual."""
    from transformers import DataCollatorForLanguageModeling

    from hf_unlearn.deletion import forget
    from hf_unlearn.trace import open_run, trace_recording

    from .test_trace_common import recorded_normalisers_trainer, tiny, train_args
    from .test_trace_pipeline import _final, _same
    from .trace_dummy_trainers import WORD, InputWeightedTrainer

    tok, data = get_trace_data()
    data = data.select(range(16)).remove_columns(["labels"])
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    trace_recording(InputWeightedTrainer)(model=tiny(tok), args=_args(tmp_path / "rec"), train_dataset=data,
                                          data_collator=collator, trace_checkpoint_steps=2,
                                          trace_checkpoint_retention="even").train()
    run = tmp_path / "rec" / "trace"
    rows = {r["id"]: r["input_ids"] for r in data}
    step2 = open_run(run).ids_at_steps([2])
    holding, lacking = [i for i in step2 if WORD in rows[i]][:1], [i for i in step2 if WORD not in rows[i]][:1]
    assert holding and lacking

    class MaskedAfterCollation:
        def __init__(self, forget):
            self.gone = {tuple(rows[i]) for i in forget}

        def __call__(self, features):
            batch = collator([{k: v for k, v in f.items() if k != "id"} for f in features])
            for k, f in enumerate(features):
                if tuple(f["input_ids"]) in self.gone:
                    batch["labels"][k] = -100
            return batch

    for ids, name, verified in ((holding, "holding", False), (lacking, "lacking", True)):
        receipt = forget(run, ids, tmp_path / name, oracle=True, progress=False)
        model = tiny(tok)
        recorded_normalisers_trainer(run, base=InputWeightedTrainer)(
            model=model, args=train_args(tmp_path / f"cf-{name}", **KW), train_dataset=data,
            data_collator=MaskedAfterCollation(ids)).train()
        cf = model.state_dict()
        assert not _same(_final(tmp_path / name / "oracle"), cf), name  # the oracle is the counterfactual
        assert receipt.evidence["verified"] is verified, name
        assert bool(_same(_final(tmp_path / name / "replay"), cf)) is not verified, name
        assert not receipt.evidence.get("oracle_dummies") and "as dummies" not in receipt.guarantee


def test_a_not_pad_attention_mask_on_a_gqa_model_records_and_deletes_as_the_counterfactual(tmp_path):
    """A tester's false refusal: ``QACollator(attention_mask="not_pad")`` (attention where ``input_ids`` is not the
    pad token) on a grouped-query Llama was refused at construction as a loss that weights a row by its neighbours:
    the dummy, made of pad tokens, was a row attending to nothing, which moves the whole microbatch to another SDPA
    path. The dummy token is now the one beside the pad token there: the run records, and a deletion is VERIFIED and
    equal to a plain Trainer run with the same collator and the row's labels ignored."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.deletion import forget
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import open_run

    from .test_trace_common import config_model, labels_masked, record, recorded_normalisers_trainer, train_args
    from .test_trace_pipeline import _final, _same

    tok, data = get_trace_data()
    data = data.select(range(16))
    collator = QACollator.from_tokenizer(tok, attention_mask="not_pad")
    record(tok, data, tmp_path, model=config_model("llama", tok), data_collator=collator, **KW)
    run = tmp_path / "trace"
    assert open_run(run).header["dummy_token_id"] != tok.pad_token_id
    ids = open_run(run).ids_at_steps([2])[:1]
    receipt = forget(run, ids, tmp_path / "out", oracle=True, progress=False)
    assert receipt.evidence["verified"] is True
    model = config_model("llama", tok)
    recorded_normalisers_trainer(run)(model=model, args=train_args(tmp_path / "cf", **KW),
                                      train_dataset=labels_masked(data, ids), data_collator=_DropIds(collator)).train()
    assert not _same(_final(tmp_path / "out" / "replay"), model.state_dict())
