"""MASCTrainer and its stopping callback: stops by itself, saves its curve, survives checkpoint/resume."""

from __future__ import annotations

import json
import math

import pytest
from transformers import TrainerControl, TrainerState

from hf_unlearn.methods.masc import STOPPING_JSON, STOPPING_PLOT, MASCStoppingCallback

from .methods_helpers import answer_loss, memorised_model, tiny_data

COMMON = dict(report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=1,
              per_device_train_batch_size=4, learning_rate=1e-3, k=5)


class FakeTrainer:
    """Serves scripted violation rates to the callback."""

    def __init__(self, probe, confirm, n=100):
        self.rates = {"probe": list(probe), "confirm": list(confirm)}
        self.n = n
        self.calls = []
        self.metrics = []

    def violation_rate(self, which):
        self.calls.append(which)
        return self.rates[which].pop(0), self.n

    def record_metrics(self, metrics):
        self.metrics.append(metrics)


def _step(cb, step):
    state, control = TrainerState(), TrainerControl()
    state.global_step = step
    cb.on_step_end(None, state, control)
    return control


# ------------------------------------------------------------------ the callback's rule (scripted rates)


def test_probe_every_n_steps_then_confirm_then_stop():
    fake = FakeTrainer(probe=[0.9, 0.15, 0.1], confirm=[0.3, 0.18])
    cb = MASCStoppingCallback(alpha=0.2, probe_steps=2).bind(fake)
    assert not _step(cb, 1).should_training_stop and fake.calls == []
    assert not _step(cb, 2).should_training_stop and fake.calls == ["probe"]  # 0.9 > alpha: no confirmation
    assert not _step(cb, 4).should_training_stop  # probe 0.15 passes, confirmation 0.3 does not
    assert _step(cb, 6).should_training_stop  # probe 0.1, confirmation 0.18 <= 0.2
    assert fake.calls == ["probe", "probe", "confirm", "probe", "confirm"]
    assert cb.stopped_step == 6
    assert [(h["step"], h["kind"]) for h in cb.history] == [(2, "probe"), (4, "probe"), (4, "confirm"), (6, "probe"),
                                                            (6, "confirm")]
    assert fake.metrics[-1] == {"probe_violation_rate": 0.1, "confirm_violation_rate": 0.18}


def test_hoeffding_bound_splits_delta_over_the_checks_and_delays_the_stop():
    fake = FakeTrainer(probe=[0.1, 0.1, 0.1], confirm=[0.1, 0.1, 0.1], n=20)
    cb = MASCStoppingCallback(alpha=0.2, probe_steps=2, hoeffding_delta=0.1).bind(fake)
    assert not _step(cb, 2).should_training_stop  # check 1 spends 0.1 * 6/pi^2: 0.1 + sqrt(log(1/0.0608)/40) > 0.2
    delta_1 = 0.1 * 6 / math.pi ** 2
    assert cb.history[-1]["delta"] == pytest.approx(delta_1)
    assert cb.history[-1]["upper_bound"] == pytest.approx(0.1 + math.sqrt(math.log(1 / delta_1) / 40))
    assert not _step(cb, 4).should_training_stop
    assert cb.history[-1]["delta"] == pytest.approx(delta_1 / 4)  # check 2: a quarter of check 1's share
    fake.n = 1000  # enough examples: 0.1 + sqrt(log(1/(delta_1/9))/2000) = 0.15 <= 0.2
    assert _step(cb, 6).should_training_stop and cb.history[-1]["delta"] == pytest.approx(delta_1 / 9)


def _cap_step(cb, step, max_steps):
    state, control = TrainerState(), TrainerControl()
    state.global_step, state.max_steps = step, max_steps
    cb.on_step_end(None, state, control)
    return control, state


def test_the_cap_gets_a_final_confirmation_and_a_pass_there_is_a_stop():
    fake = FakeTrainer(probe=[0.5], confirm=[0.15])
    cb = MASCStoppingCallback(alpha=0.2, probe_steps=2).bind(fake)
    _cap_step(cb, 2, 3)
    control, _ = _cap_step(cb, 3, 3)  # off schedule, but the cap: confirmation straight away, no probe
    assert fake.calls == ["probe", "confirm"] and control.should_training_stop
    assert cb.stopped_step == 3 and "<= alpha" in cb.stop_reason


def test_the_cap_without_the_rule_firing_warns_and_reports_why(tmp_path, caplog):
    import logging

    from transformers import TrainingArguments

    fake = FakeTrainer(probe=[0.1], confirm=[0.3, 0.25])
    cb = MASCStoppingCallback(alpha=0.2, probe_steps=2).bind(fake)
    _cap_step(cb, 2, 4)  # probe passes, confirmation 0.3 does not
    control, state = _cap_step(cb, 4, 4)  # the cap is on schedule: confirmation only (0.25 > alpha)
    assert fake.calls == ["probe", "confirm", "confirm"] and not control.should_training_stop
    assert cb.stopped_step is None
    with caplog.at_level(logging.WARNING, logger="hf_unlearn.methods.masc"):
        cb.on_train_end(TrainingArguments(output_dir=str(tmp_path), report_to=[]), state, control)
    assert "did not stop by its rule" in caplog.text and "step cap 4" in caplog.text
    report = json.loads((tmp_path / STOPPING_JSON).read_text())
    assert report["stopped"] is False and report["stopped_step"] is None
    assert report["reason"].startswith("step cap 4 reached before the rule fired") and "0.2500 > alpha" in report["reason"]


def test_a_stop_by_another_callback_is_not_reported_as_the_rule(tmp_path):
    from transformers import TrainingArguments

    cb = MASCStoppingCallback(alpha=0.2, probe_steps=5).bind(FakeTrainer([], []))
    state, control = TrainerState(), TrainerControl()
    state.global_step, state.max_steps = 3, 10
    cb.on_train_end(TrainingArguments(output_dir=str(tmp_path), report_to=[]), state, control)
    report = json.loads((tmp_path / STOPPING_JSON).read_text())
    assert not report["stopped"] and "another callback" in report["reason"]


def test_state_round_trip_keeps_the_curve_and_a_stop():
    fake = FakeTrainer(probe=[0.5, 0.1], confirm=[0.1])
    cb = MASCStoppingCallback(alpha=0.2, probe_steps=1).bind(fake)
    _step(cb, 1), _step(cb, 2)
    restored = MASCStoppingCallback.from_state(json.loads(json.dumps(cb.state())))
    assert restored.history == cb.history and restored.stopped_step == 2 and restored.alpha == 0.2
    assert _step(restored, 3).should_training_stop  # resumed after the stop: stops at once, no evaluation needed


def test_unbound_callback_is_a_clear_error():
    from hf_unlearn.errors import UnlearnError

    with pytest.raises(UnlearnError, match="not bound"):
        _step(MASCStoppingCallback(probe_steps=1), 1)


# ------------------------------------------------------------------ MASC on a tiny model that memorised its rows


def _masc(tmp_path, model=None, **kw):
    from hf_unlearn.methods import MASCConfig, MASCTrainer

    tok, forget, retain = tiny_data()
    args = MASCConfig(output_dir=str(tmp_path), **{**COMMON, **kw})
    return MASCTrainer(model=model if model is not None else memorised_model(), args=args, forget_dataset=forget,
                       retain_dataset=retain, processing_class=tok)


def test_masc_stops_by_itself_and_saves_its_curve(tmp_path):
    _, forget, retain = tiny_data()
    trainer = _masc(tmp_path, max_steps=60, probe_steps=2, probe_size=2, alpha=0.2)
    assert trainer.violation_rate("confirm")[0] > 0.9  # memorised: nearly every active token is dominant
    forget_before, retain_before = answer_loss(trainer.model, forget), answer_loss(trainer.model, retain)
    trainer.train()
    assert trainer.stopped_step is not None and trainer.stopped_step < 60
    assert trainer.state.global_step == trainer.stopped_step
    confirm = [h for h in trainer.violation_history if h["kind"] == "confirm"]
    assert confirm[-1]["violation_rate"] <= 0.2 and confirm[-1]["step"] == trainer.stopped_step
    assert trainer.violation_rate("confirm")[0] <= 0.2  # the saved model is the one that passed
    report = json.loads((tmp_path / STOPPING_JSON).read_text())
    assert report["stopped"] and report["stopped_step"] == trainer.stopped_step and report["history"]
    assert (tmp_path / STOPPING_PLOT).stat().st_size > 1000
    forget_gain = answer_loss(trainer.model, forget) - forget_before
    retain_gain = answer_loss(trainer.model, retain) - retain_before
    assert forget_gain > 1.0 and forget_gain > 3 * retain_gain
    info = trainer.unlearning_card_info()
    assert info["extra"]["stopped_step"] == trainer.stopped_step and info["evaluation"]["masc_violation_rate"] <= 0.2


def test_probe_and_confirmation_rows_are_disjoint_trained_rows_without_a_held_out_split(tmp_path):
    trainer = _masc(tmp_path, probe_size=1)
    probe, confirm = set(trainer.probe_dataset["id"]), set(trainer.confirm_dataset["id"])
    assert len(probe) == 1 and not probe & confirm and probe | confirm == set(trainer.forget_ids)
    assert trainer.certified_rows == "trained"


def test_held_out_rows_are_never_trained_on_and_are_all_the_rule_reads(tmp_path):
    seen = []
    trainer = _masc(tmp_path, probe_size=1, validation_fraction=0.5, max_steps=4, probe_steps=2, alpha=1e-6)
    original = trainer.compute_loss

    def spy(model, inputs, *a, **kw):
        seen.extend(inputs["id"].tolist())
        return original(model, inputs, *a, **kw)

    trainer.compute_loss = spy
    held = set(trainer.held_out_forget_ids)
    assert len(held) == 2 and trainer.certified_rows == "held-out"
    assert set(trainer.trained_forget_ids) | held == set(tiny_data()[1]["id"]) == set(trainer.forget_ids)
    probe, confirm = set(trainer.probe_dataset["id"]), set(trainer.confirm_dataset["id"])
    assert len(probe) == 1 and not probe & confirm and probe | confirm == held
    trainer.train()
    assert seen and not set(seen) & held  # 4 steps x 2 rows of the 2 trained rows, none held out


def test_eval_forget_dataset_must_be_held_out_and_given_once(tmp_path):
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.methods import MASCConfig, MASCTrainer

    tok, forget, retain = tiny_data()
    args = MASCConfig(output_dir=str(tmp_path), **COMMON, probe_size=1)
    trainer = MASCTrainer(model=memorised_model(), args=args, forget_dataset=forget.select([0, 1]),
                          retain_dataset=retain, processing_class=tok, eval_forget_dataset=forget.select([2, 3]))
    assert set(trainer.confirm_dataset["id"]) | set(trainer.probe_dataset["id"]) == set(forget.select([2, 3])["id"])
    with pytest.raises(UnlearnError, match=r"1 id\(s\) of eval_forget_dataset are also in the forget set"):
        MASCTrainer(model=memorised_model(), args=args, forget_dataset=forget.select([0, 1, 2]), retain_dataset=retain,
                    processing_class=tok, eval_forget_dataset=forget.select([2, 3]))
    both = MASCConfig(output_dir=str(tmp_path), **COMMON, probe_size=1, validation_fraction=0.5)
    with pytest.raises(UnlearnError, match="eval_forget_dataset= or validation_fraction, not both"):
        MASCTrainer(model=memorised_model(), args=both, forget_dataset=forget.select([0, 1]), retain_dataset=retain,
                    processing_class=tok, eval_forget_dataset=forget.select([2, 3]))
    with pytest.raises(UnlearnError, match="confirm_dataset= is now eval_forget_dataset="):
        MASCTrainer(model=memorised_model(), args=args, forget_dataset=forget, retain_dataset=retain,
                    processing_class=tok, confirm_dataset=forget)


def test_a_probe_that_would_leave_no_confirmation_rows_is_refused(tmp_path):
    from hf_unlearn.errors import UnlearnError

    with pytest.raises(UnlearnError, match="probe_size=4 leaves no confirmation rows among the 4 trained forget rows"):
        _masc(tmp_path, probe_size=4)
    with pytest.raises(UnlearnError, match="among the 2 held-out forget rows.*hold out more rows"):
        _masc(tmp_path, probe_size=2, validation_fraction=0.5)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_probe_is_not_the_first_rows_trained_on(tmp_path, seed):
    """The probe used to be drawn with the Trainer's shuffle seed: exactly the rows of the first two steps."""
    from hf_unlearn.data import load_tofu, tokenize_qa
    from hf_unlearn.methods import MASCConfig, MASCTrainer

    from .conftest import TOFU_DIR

    tok = tiny_data()[0]
    forget = tokenize_qa(load_tofu("full", TOFU_DIR).select(range(40)), tok, max_length=96)
    args = MASCConfig(output_dir=str(tmp_path), **COMMON, seed=seed, retain_loss="none")
    trainer = MASCTrainer(model=memorised_model(), args=args, forget_dataset=forget, processing_class=tok)
    loader = iter(trainer.get_train_dataloader())
    first_two_steps = {i for _ in range(2) for i in next(loader)["id"].tolist()}
    probe = set(trainer.probe_dataset["id"])
    assert len(probe) == len(first_two_steps) == 8
    assert probe != first_two_steps and len(probe & first_two_steps) < 6
    # the held-out split has its own stream too: not the probe, not the first batches
    assert trainer.probe_size == 8  # the default without held-out rows
    held_out = MASCTrainer(model=memorised_model(), args=MASCConfig(output_dir=str(tmp_path), **COMMON, seed=seed,
                                                                    retain_loss="none", validation_fraction=0.2),
                           forget_dataset=forget, processing_class=tok)
    held = held_out.held_out_forget_ids
    assert len(held) == 8 and set(held) != first_two_steps and set(held) != probe
    # the default with held-out rows: probe on the training batches, confirm on every held-out row
    assert held_out.probe_size == 0 and held_out.probe_dataset is None
    assert sorted(held_out.confirm_dataset["id"]) == sorted(held)


def test_probe_size_zero_probes_on_the_training_batches_and_confirms_on_all_forget_rows(tmp_path):
    trainer = _masc(tmp_path, max_steps=60, probe_steps=2, probe_size=0, alpha=0.2)
    assert trainer.probe_dataset is None and sorted(trainer.confirm_dataset["id"]) == sorted(trainer.forget_ids)
    trainer.train()
    assert trainer.stopped_step is not None and trainer.stopped_step < 60
    probes = [h for h in trainer.violation_history if h["kind"] == "probe"]
    assert all(h["n"] == 2 * 4 for h in probes)  # the forget rows of the last probe_steps training batches
    confirms = [h for h in trainer.violation_history if h["kind"] == "confirm"]
    assert confirms[-1]["n"] == len(trainer.forget_ids) and confirms[-1]["violation_rate"] <= 0.2
    assert trainer.violation_rate("probe") == (0.0, 0)  # nothing trained since the last check


def test_masc_learning_rate_stays_constant_until_it_stops(tmp_path):
    trainer = _masc(tmp_path, max_steps=3, probe_steps=100, learning_rate=1e-3, probe_size=2, alpha=1e-6)
    assert trainer.args.lr_scheduler_type == "constant"  # a decay to 0 at the cap would stall the last steps
    trainer.train()
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert len(logged) == 3 and all(lr == pytest.approx(1e-3) for lr in logged + trainer.lr_scheduler.get_last_lr())


@pytest.mark.parametrize("extra", [{"competitors": "reference", "retain_loss": "ce"}, {"active_tokens": "all"}])
def test_masc_variants_lower_the_violation_rate(tmp_path, extra):
    trainer = _masc(tmp_path, max_steps=4, probe_steps=100, probe_size=2, alpha=1e-6, **extra)
    before = trainer.violation_rate("confirm")[0]
    trainer.train()
    assert trainer.violation_rate("confirm")[0] < before


def test_masc_at_its_cap_reports_no_stop_on_a_real_run(tmp_path, caplog):
    import logging

    trainer = _masc(tmp_path, max_steps=3, probe_steps=2, probe_size=0, alpha=1e-6)
    with caplog.at_level(logging.WARNING, logger="hf_unlearn.methods.masc"):
        trainer.train()
    assert trainer.stopped_step is None and trainer.state.global_step == 3
    assert [(h["step"], h["kind"]) for h in trainer.violation_history] == [(2, "probe"), (3, "confirm")]
    report = json.loads((tmp_path / STOPPING_JSON).read_text())
    assert report["reason"].startswith("step cap 3 reached") and report["certified_rows"] == "trained"
    assert "did not stop by its rule" in caplog.text
    assert trainer.unlearning_card_info()["extra"]["stop_reason"] == report["reason"]


def test_callback_state_survives_checkpoint_resume(tmp_path):
    # alpha tiny: never stops; a checkpoint at step 4 carries the probes of steps 2 and 4
    kw = dict(probe_steps=2, probe_size=2, alpha=1e-6, save_strategy="steps", save_steps=4)
    first = _masc(tmp_path, max_steps=4, **kw)
    first.train()
    saved = json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text())
    assert [h["step"] for h in saved["stateful_callbacks"]["MASCStoppingCallback"]["attributes"]["history"]] == [2, 4]

    resumed = _masc(tmp_path, max_steps=6, **kw)
    original_callback = resumed.stopping_callback
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert resumed.stopping_callback is not original_callback  # re-created from the checkpoint, then re-bound
    assert [h["step"] for h in resumed.violation_history] == [2, 4, 6]
    assert resumed.violation_history[:2] == first.violation_history
    callbacks = [cb for cb in resumed.callback_handler.callbacks if isinstance(cb, MASCStoppingCallback)]
    assert callbacks == [resumed.stopping_callback]


# ------------------------------------------------------------------ accelerate: the same decision on every process


def _distributed_masc(out_dir):
    """Run by each of 2 CPU processes (gloo): train MASC, write what this process decided."""
    from .conftest import write_rank_record

    trainer = _masc(out_dir, max_steps=40, probe_steps=2, probe_size=2, alpha=0.2, per_device_train_batch_size=2)
    trainer.train()
    write_rank_record(out_dir, trainer, stopped_step=trainer.stopped_step, history=trainer.violation_history)


@pytest.mark.slow
def test_stopping_decision_is_identical_on_every_process(tmp_path):
    from .conftest import run_on_two_processes

    records = run_on_two_processes("tests.test_methods_masc", "_distributed_masc", tmp_path)
    assert all(r["world"] == 2 for r in records)
    assert records[0]["stopped_step"] is not None
    assert records[0]["stopped_step"] == records[1]["stopped_step"]
    assert records[0]["history"] == records[1]["history"]  # rates reduced across processes: bit-identical
    # each process scored one of the 2 probe (and 2 confirmation) rows; the counts are the sums over both
    assert all(h["n"] == 2 for h in records[0]["history"])
