"""Redaction, replay and the oracle: bit-exact deletion for every deletion geometry."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from transformers import Trainer

from hf_unlearn.trace.proof import prove_fresh_start

from .test_trace_common import copy_run, delete, get_recorded, get_trace_data, ids_at_step, record


@pytest.mark.parametrize("where,start_step", [("early", 0), ("middle", 4), ("late", 6)])
def test_local_deletion_replays_a_suffix_bit_exactly(tmp_path, where, start_step):
    recorded = get_recorded()
    step = {"early": 0, "middle": 4, "late": 7}[where]
    forget = ids_at_step(recorded, step)[:2]
    replay, report = delete(recorded, forget, tmp_path)
    assert replay.replay_stats["start_step"] == start_step
    assert replay.replay_stats["segments_replayed"] == 8 - start_step
    assert report["verified"] and report["identical"], report["params"]["mismatched_tensors"][:5] + report["optimizer"]["mismatched_tensors"][:5]
    assert report["params"]["mismatched_elements"] == report["optimizer"]["mismatched_elements"] == 0
    assert report["roots"]["a"] == report["roots"]["b"]
    info = replay.unlearning_card_info()
    assert info["forget_ids"] == forget and info["extra"]["start_step"] == start_step and info["extra"]["exact"]
    # ... and the deletion changed the model: the oracle differs from the original run.
    from hf_unlearn.trace.verification import compare_states, load_state

    assert not compare_states(load_state(tmp_path / "oracle"), load_state(recorded))["identical"]


def test_random_deletion_with_baselines(tmp_path):
    """Random 5 ids: replay == oracle; the naive filter and repack counterfactuals both differ from it."""
    recorded = get_recorded()
    from hf_unlearn.trace import filter_counterfactual, repack_counterfactual
    from hf_unlearn.trace.verification import compare_states, load_state

    forget = random.Random(0).sample(range(64), 5)
    replay, report = delete(recorded, forget, tmp_path)
    assert report["verified"]
    oracle = load_state(tmp_path / "oracle")
    filt = compare_states(filter_counterfactual(recorded, forget), oracle)
    repack = compare_states(repack_counterfactual(recorded, forget, tmp_path / "repack"), oracle)
    for cmp in (filt, repack):
        assert not cmp["identical"] and cmp["params"]["mismatched_elements"] > 0 and cmp["params"]["l2"] > 0



class CountingTrainer(Trainer):
    """A loss that keeps state across calls: every 8th row it has seen weighs double (a sample-count schedule)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.rows_seen = getattr(self, "rows_seen", 0) + inputs["input_ids"].shape[0]
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        scale = 2.0 if self.rows_seen % 8 == 0 else 1.0
        return (loss[0] * scale, loss[1]) if return_outputs else loss * scale


def test_a_step_whose_every_row_is_deleted_steps_on_zero_gradients_as_the_plain_run(tmp_path):
    """Every row of optimizer step 5 deleted: the plain ``Trainer`` with those rows' labels masked still calls the
    loss on them and steps AdamW on zero gradients (its moments decay, its step count grows). The engine skipped that
    step (a VERIFIED step-5 deletion off the engine-free counterfactual in every tensor); it runs the dummies and steps
    now: VERIFIED and equal to the counterfactual, AdamW stepped 8 times in 8 steps."""
    recorded = get_recorded()
    from hf_unlearn.trace import replay_cost
    from hf_unlearn.trace.run import load_checkpoint, open_run
    from hf_unlearn.trace.verification import load_state

    from .test_trace_common import tiny
    from .test_trace_fidelity import independent_counterfactual

    forget = ids_at_step(recorded, 5)  # all 8 rows of optimizer step 5
    cost = replay_cost(open_run(recorded), forget)
    assert cost["segments_emptied"] == 1 and cost["start_checkpoint"] == 4
    replay, report = delete(recorded, forget, tmp_path)
    assert report["verified"]
    assert replay.replay_stats["optimizer_steps_taken"] == replay.replay_stats["segments_replayed"] == 4
    final = load_checkpoint(tmp_path / "replay" / "checkpoints" / "step-00000008")
    steps = {float(s["step"]) for s in final["optimizer"]["state"].values()}
    assert steps == {8.0}  # AdamW stepped in every one of 8 logical steps
    from hf_unlearn.trace.plan import read_plan

    plan = read_plan(tmp_path / "replay")
    assert [e.step for e in plan] == [e // 2 for e in range(16)]
    assert all(s is None for e in plan if e.step == 5 for s in e.slots)
    tok, data = get_trace_data()
    plain = independent_counterfactual(tok, data, tiny(tok), recorded, forget, tmp_path / "plain")
    oracle = load_state(tmp_path / "oracle")["model"]
    assert not [n for n, t in oracle.items() if not torch.equal(t, plain[n])]


def test_replay_reads_only_the_redacted_store(tmp_path):
    """The original store is moved away before the replay; the replay still matches the oracle."""
    recorded = get_recorded()
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store, verify

    run_dir = copy_run(recorded, tmp_path / "run")
    forget = ids_at_step(run_dir, 6)[:3]
    run = open_run(run_dir)
    redact_store(run.store_path, forget, tmp_path / "store", run.key)
    OracleReplayTrainer(run, forget, out_dir=tmp_path / "oracle").train()
    proven_start = prove_fresh_start(run, forget)  # step 6 affected: its fresh start probed with the original store
    assert {k: v for k, v in proven_start.items() if k != "issued"} == {"checkpoint": 6, "proven_by": "probe"}
    shutil.move(run_dir / "private" / "store", tmp_path / "original_store_elsewhere")
    with pytest.warns(UserWarning, match="store is absent"):
        RedactedReplayTrainer(run_dir, tmp_path / "store", forget, tmp_path / "replay", proven_start=proven_start).train()
    assert verify(tmp_path / "replay", tmp_path / "oracle")["verified"]
    from hf_unlearn.trace.store import load_store

    assert not set(forget) & set(load_store(tmp_path / "replay" / "private" / "store")["id"])


def test_sequential_requests_equal_one_oracle_of_the_union(tmp_path):
    """Request 2 suffix-replays from request 1's output run; the result is the oracle of both requests."""
    recorded = get_recorded()
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store, verify
    from hf_unlearn.trace.run import read_deletion_log
    from hf_unlearn.trace.tags import tag

    first, second = ids_at_step(recorded, 5)[:2], ids_at_step(recorded, 6)[:2]
    run = open_run(recorded)
    redact_store(run.store_path, first, tmp_path / "s1", run.key)
    RedactedReplayTrainer(run, tmp_path / "s1", first, tmp_path / "r1").train()
    run1 = open_run(tmp_path / "r1")
    redact_store(run1.store_path, second, tmp_path / "s2", run1.key)
    # step 6 affected: the fresh start at checkpoint 6 (no proof covers it) probed from request 1's output run
    r2 = RedactedReplayTrainer(run1, tmp_path / "s2", second, tmp_path / "r2",
                               proven_start=prove_fresh_start(run1, second))
    r2.train()
    assert r2.replay_stats["start_step"] == 6
    OracleReplayTrainer(run, first + second, out_dir=tmp_path / "oracle").train()
    assert verify(tmp_path / "r2", tmp_path / "oracle")["verified"]
    log = read_deletion_log(tmp_path / "r2")
    assert [e["request"] for e in log] == [1, 2]
    assert log[1]["forget_tags"] == sorted(tag(run.key, i) for i in second)
    assert log[0]["params_root"] != log[1]["params_root"]
    text = (tmp_path / "r2" / "deletion_log.jsonl").read_text()
    assert all(f'"{i}"' not in text and f" {i}," not in text for i in first + second)
    # the log is append-only: request 1's line is kept byte for byte
    assert text.startswith((tmp_path / "r1" / "deletion_log.jsonl").read_text())
    assert open_run(tmp_path / "r2").report.ok


def test_redaction_receipt(tmp_path):
    recorded = get_recorded()
    from hf_unlearn.trace import open_run, redact_store
    from hf_unlearn.trace.store import load_store

    run = open_run(recorded)
    receipt = redact_store(run.store_path, [3, 4], tmp_path / "s", run.key)
    assert receipt["rows_before"] == 64 and receipt["rows_after"] == 62
    assert "0 of 2 deleted ids present" in receipt["checks"]["id_column_scanned"]
    assert json.loads((tmp_path / "s" / "redaction_receipt.json").read_text())["store_sha256"] == receipt["store_sha256"]
    assert "3" not in json.dumps(receipt["deleted_tags"]) or len(receipt["deleted_tags"][0]) == 16
    store = load_store(tmp_path / "s")
    assert len(store) == 62 and {3, 4}.isdisjoint(store["id"])
    raw = b"".join(f.read_bytes() for f in (tmp_path / "s").glob("*.arrow"))
    original = load_store(run.store_path)
    deleted_tokens = torch.tensor(original[3]["input_ids"], dtype=torch.int32).numpy().tobytes()
    assert deleted_tokens not in raw


def test_string_ids_and_string_forget_list(tmp_path):
    """Ids may be strings (as hf_unlearn.load_task gives): recorded, redacted, replayed and verified the same way."""
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store, verify

    tok, data = get_trace_data()
    data = data.map(lambda r: {"id": f"row-{r['id']}"}).select(range(32))
    record(tok, data, tmp_path / "run", max_steps=3)
    run = open_run(tmp_path / "run" / "trace")
    forget = run.ids_at_steps([2])[:2]
    assert all(isinstance(i, str) for i in forget)
    redact_store(run.store_path, forget, tmp_path / "store", run.key)
    RedactedReplayTrainer(run, tmp_path / "store", forget, tmp_path / "replay",
                          proven_start=prove_fresh_start(run, forget)).train()  # step 2 affected: its start probed
    OracleReplayTrainer(run, forget, out_dir=tmp_path / "oracle").train()
    assert verify(tmp_path / "replay", tmp_path / "oracle")["verified"]
    # no raw string id in any publishable file (private/ and tensor/Arrow binaries aside): plan, header, WAL,
    # manifest, deletion log, receipt, sidecars, collator and model folders of the run, the replay and the oracle
    import re

    scanned = 0
    for root in (tmp_path / "run" / "trace", tmp_path / "store", tmp_path / "replay", tmp_path / "oracle"):
        for f in root.rglob("*"):
            if f.is_file() and "private" not in f.relative_to(root).parts and f.suffix not in (".pt", ".arrow"):
                scanned += 1
                assert not re.search(rb"row-\d", f.read_bytes()), f"raw id in {f}"
    assert scanned > 20


def test_replay_model_card_states_roots_and_verdict(tmp_path, monkeypatch):
    """A replay is an UnlearningHubMixin trainer: its card carries the state-hash roots and the oracle verdict."""
    from hf_unlearn.hub.cards import check_card_metadata, find_raw_ids
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store, verify

    run_dir = copy_run(get_recorded(), tmp_path / "run")
    forget = ids_at_step(run_dir, 6)[:2]
    run = open_run(run_dir)
    redact_store(run.store_path, forget, tmp_path / "store", run.key)
    OracleReplayTrainer(run, forget, out_dir=tmp_path / "oracle").train()
    replay = RedactedReplayTrainer(run_dir, tmp_path / "store", forget, tmp_path / "replay",
                                   proven_start=prove_fresh_start(run, forget))  # step 6 affected: its start probed
    replay.train()
    pending = replay.unlearning_card_info()["extra"]["exact_deletion"]
    assert not pending["verified"] and "trace verify" in pending["verification"]
    assert verify(tmp_path / "replay", tmp_path / "oracle")["verified"]
    replay.save_model()
    text = replay.create_model_card(model_name="org/replayed")
    meta = check_card_metadata(text)
    assert "exact-deletion" in meta["tags"]
    exact = replay.unlearning_card_info()["extra"]["exact_deletion"]
    assert exact["verified"] and exact["params_root"] in text and "passed" in text
    assert not find_raw_ids(text, forget)


@pytest.mark.slow  # a recording, two deletions and two plain counterfactuals (~17 s); the whole-step case stays default
def test_a_microbatch_of_deleted_rows_still_runs_the_loss_as_the_plain_run(tmp_path):
    """One row per microbatch, accumulation 4, a loss that counts the rows it has seen (:class:`CountingTrainer`):
    deleting a row leaves a microbatch of a dummy only. The engine skipped it, so the counter ran one row behind the
    plain run's (which calls the loss on the masked row) and every later 8th row weighed double at the wrong place:
    VERIFIED at step 0 and 1 with every tensor off the engine-free counterfactual. Now the dummy's microbatch runs:
    VERIFIED and equal."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.trace import open_run, trace_recording
    from hf_unlearn.trace.verification import load_state

    from .test_trace_common import labels_masked, recorded_normalisers_trainer, tiny, train_args

    tok, data = get_trace_data()
    data = data.select(range(16))
    kw = dict(per_device_train_batch_size=1, gradient_accumulation_steps=4, max_steps=4)
    trace_recording(CountingTrainer)(model=tiny(tok), args=train_args(tmp_path / "rec", **kw), train_dataset=data,
                                     data_collator=QACollator.from_tokenizer(tok), trace_checkpoint_steps=2,
                                     trace_checkpoint_retention="even").train()
    run = tmp_path / "rec" / "trace"
    for step in (0, 1):
        forget = open_run(run).ids_at_steps([step])[:1]
        replay, report = delete(run, forget, tmp_path / f"del{step}")
        assert report["verified"]
        model = tiny(tok)
        recorded_normalisers_trainer(run, base=CountingTrainer)(
            model=model, args=train_args(tmp_path / f"plain{step}", **kw), train_dataset=labels_masked(data, forget),
            data_collator=_DropIds(QACollator.from_tokenizer(tok))).train()
        oracle = load_state(tmp_path / f"del{step}" / "oracle")["model"]
        plain = model.state_dict()
        assert not [n for n, t in oracle.items() if not torch.equal(t, plain[n])], step
