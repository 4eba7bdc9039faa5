"""UnlearningStoppingCallback: any unlearning trainer stops at a forget target on held-out rows and keeps that model.

The monitor-mode tests prove what the benchmark relies on: a run stopped by the callback is exactly the prefix of the
same run at its full budget, and monitoring changes nothing in the fixed-budget run.
"""

from __future__ import annotations

import json

import pytest
import torch

from hf_unlearn.errors import UnlearnError
from hf_unlearn.eval.stopping import TARGET_METRICS, UnlearningStoppingCallback

from .methods_helpers import FORGET_IDS, memorised_model, tiny_data

COMMON = dict(report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", logging_steps=1,
              per_device_train_batch_size=2, learning_rate=1e-3, max_steps=8)
NEVER = -1.0  # a violation rate is never <= -1: the callback checks at every scheduled step and never fires


def _graddiff(tmp_path, callbacks=(), **kw):
    from hf_unlearn.methods import GradDiffConfig, GradDiffTrainer

    tok, forget, retain = tiny_data()
    args = GradDiffConfig(output_dir=str(tmp_path), **{**COMMON, "validation_fraction": 0.5, **kw})
    return GradDiffTrainer(model=memorised_model(), args=args, forget_dataset=forget, retain_dataset=retain,
                           processing_class=tok, callbacks=list(callbacks))


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_stop_mode_is_the_prefix_of_the_full_run_and_monitoring_changes_nothing(tmp_path):
    from transformers import AutoModelForCausalLM

    # the trajectory of the held-out violation rate, checked every 2 steps without firing
    probe = UnlearningStoppingCallback("violation_rate", NEVER, eval_steps=2, save_checkpoint=False)
    full = _graddiff(tmp_path / "probe", [probe])
    full.train()
    values = {h["step"]: h["violation_rate"] for h in probe.history}
    assert sorted(values) == [2, 4, 6, 8] and probe.reached_step is None
    target = min(values[2], values[4])  # first reached at step 2 or 4, before the cap
    expected = next(s for s in sorted(values) if values[s] <= target)

    plain = _graddiff(tmp_path / "plain")  # no callback at all
    plain.train()
    monitor = UnlearningStoppingCallback("violation_rate", target, eval_steps=2, mode="monitor",
                                         save_checkpoint="target")  # one write: the model that reached the target
    monitored = _graddiff(tmp_path / "monitor", [monitor])
    monitored.train()
    stop = UnlearningStoppingCallback("violation_rate", target, eval_steps=2, mode="stop")
    stopped = _graddiff(tmp_path / "stop", [stop])
    stopped.train()

    assert monitor.reached_step == stop.reached_step == expected
    assert stopped.state.global_step == expected and monitored.state.global_step == 8
    assert monitor.reached_seconds is not None and 0 < monitor.check_seconds
    # monitoring leaves the fixed-budget run bit-identical to a run without the callback
    final_plain, final_monitored = _params(plain.model), _params(monitored.model)
    assert all(torch.equal(final_plain[n], final_monitored[n]) for n in final_plain)
    # the stop-mode model is the checkpoint the monitor kept at the same step, bit for bit
    kept = AutoModelForCausalLM.from_pretrained(monitor.best_model_path)
    kept_params, stopped_params = _params(kept), _params(stopped.model)
    assert all(torch.equal(kept_params[n], stopped_params[n]) for n in stopped_params)
    assert not all(torch.equal(kept_params[n], final_monitored[n]) for n in kept_params)  # and not the final model
    saved = json.loads((tmp_path / "monitor" / "stopping_checkpoint" / "unlearning_eval.json").read_text())
    assert saved["summary"]["violation_rate"] == pytest.approx(values[expected])


def test_never_reached_keeps_the_best_checkpoint_and_says_so(tmp_path):
    from transformers import AutoModelForCausalLM

    cb = UnlearningStoppingCallback("forget_probability", 0.0, eval_steps=3)  # probability 0 is never reached
    trainer = _graddiff(tmp_path, [cb], max_steps=7)
    trainer.train()
    assert cb.reached_step is None and trainer.state.global_step == 7
    assert [h["step"] for h in cb.history] == [3, 6, 7]  # the cap is always checked
    best = min(cb.history, key=lambda h: h["forget_probability"])
    assert cb.best_step == best["step"] and cb.best_score == pytest.approx(best["forget_probability"])
    kept = AutoModelForCausalLM.from_pretrained(cb.best_model_path)
    rescored = UnlearningStoppingCallback("forget_probability", 0.0).bind(trainer).evaluate(kept, None, 0)
    assert rescored.summary["forget_probability"] == pytest.approx(cb.best_score, rel=1e-5)
    logged = [h for h in trainer.state.log_history if "unlearn/forget_probability" in h]
    assert len(logged) == 3 and not any("forget_loss" in h for h in logged)
    assert all("forget_loss" in h for h in trainer.state.log_history if "loss" in h)  # method metrics stay in their lines


def test_scores_agree_with_the_tofu_evaluation_and_masc(tmp_path):
    """The callback's forget probability and truth ratio are evaluate_tofu's; its violation rate is MASC's."""
    from hf_unlearn.eval.tofu import evaluate_tofu
    from hf_unlearn.methods import MASCConfig, MASCTrainer

    from .conftest import TOFU_DIR

    tok, forget, retain = tiny_data()
    model = memorised_model()
    held = forget.select([1, 3])
    ids = list(held["id"])
    result = evaluate_tofu(model, tok, forget_ids=ids, retain_ids=[0], tofu_path=TOFU_DIR, max_new_tokens=1,
                           max_items={"real_authors": 1, "world_facts": 1, "holdout": 1}, max_length=96,
                           progress=False)
    scores = {}
    for metric in TARGET_METRICS:
        cb = UnlearningStoppingCallback(metric, 0.5, eval_dataset=held, tokenizer=tok, tofu_path=TOFU_DIR,
                                        max_length=96, k=5)
        scores[metric] = cb.evaluate(model, tok, 0).summary
    assert scores["forget_probability"]["forget_probability"] == pytest.approx(result.summary["forget_probability"],
                                                                               rel=1e-4)
    assert scores["truth_ratio"]["truth_ratio"] == pytest.approx(result.summary["forget_truth_ratio"], rel=1e-4)
    args = MASCConfig(output_dir=str(tmp_path), **{**COMMON, "probe_size": 1}, k=5)
    masc = MASCTrainer(model=model, args=args, forget_dataset=forget.select([0, 2]), retain_dataset=retain,
                       processing_class=tok, eval_forget_dataset=held)
    masc.confirm_dataset = held  # both held-out rows
    assert scores["violation_rate"]["violation_rate"] == pytest.approx(masc.violation_rate("confirm")[0])
    assert scores["violation_rate"]["rows"] == 2


def test_rows_the_model_trains_on_cannot_certify_a_held_out_stop(tmp_path):
    _, forget, _ = tiny_data()
    cb = UnlearningStoppingCallback("violation_rate", 0.2, eval_dataset=forget)  # every forget row, trained ones too
    with pytest.raises(UnlearnError, match="are trained on"):
        _graddiff(tmp_path, [cb])


def test_bad_settings_and_missing_rows_are_one_line_errors(tmp_path):
    with pytest.raises(UnlearnError, match="unknown stopping metric 'rouge'"):
        UnlearningStoppingCallback("rouge", 0.2)
    with pytest.raises(UnlearnError, match="mode must be 'stop' or 'monitor'"):
        UnlearningStoppingCallback(mode="early")
    with pytest.raises(UnlearnError, match="save_checkpoint must be True, False or 'target'"):
        UnlearningStoppingCallback(save_checkpoint="best")
    cb = UnlearningStoppingCallback("violation_rate", 0.2, eval_steps=1)
    trainer = _graddiff(tmp_path, [cb], validation_fraction=0.0)
    with pytest.raises(UnlearnError, match="no held-out forget rows: set validation_fraction"):
        trainer.train()
    tok, forget, _ = tiny_data()
    unlabeled = forget.remove_columns("labels")
    with pytest.raises(UnlearnError, match="input_ids but no labels"):
        UnlearningStoppingCallback(eval_dataset=unlabeled, tokenizer=tok).evaluate(memorised_model(), tok, 0)


def test_truth_ratio_needs_perturbed_answers(tmp_path):
    from datasets import Dataset

    from .conftest import TOFU_DIR

    tok = tiny_data()[0]
    rows = Dataset.from_dict({"id": [200_001], "question": ["Who?"], "answer": ["Someone."]})  # a real_authors id
    cb = UnlearningStoppingCallback("truth_ratio", 0.7, eval_dataset=rows, tokenizer=tok, tofu_path=TOFU_DIR)
    with pytest.raises(UnlearnError, match="truth_ratio needs paraphrased and perturbed answers"):
        cb.evaluate(memorised_model(), tok, 0)


def test_state_survives_checkpoint_resume_with_the_held_out_rows(tmp_path):
    kw = dict(save_strategy="steps", save_steps=4, restore_callback_states_from_checkpoint=True)
    first_cb = UnlearningStoppingCallback("violation_rate", NEVER, eval_steps=2, save_checkpoint=False)
    _graddiff(tmp_path, [first_cb], max_steps=4, **kw).train()
    resumed_cb = UnlearningStoppingCallback("violation_rate", NEVER, eval_steps=2, save_checkpoint=False)
    resumed = _graddiff(tmp_path, [resumed_cb], max_steps=6, **kw)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    restored = [cb for cb in resumed.callback_handler.callbacks if isinstance(cb, UnlearningStoppingCallback)]
    assert len(restored) == 1 and restored[0] is not resumed_cb  # re-created from the checkpoint's state
    assert [h["step"] for h in restored[0].history] == [2, 4, 6]
    assert restored[0].history[:2] == first_cb.history
    assert restored[0].trainer is resumed and restored[0].eval_dataset is resumed.eval_forget_dataset


def test_cli_stops_any_method_on_held_out_rows(tmp_path, capsys):
    from hf_unlearn.cli import main

    from .conftest import TOFU_DIR

    model_dir = tmp_path / "model"
    memorised_model().save_pretrained(model_dir)
    tiny_data()[0].save_pretrained(model_dir)
    base = ["unlearn", "grad_diff", str(model_dir), "--forget-split", "forget01", "--tofu", str(TOFU_DIR),
            "--max-forget-rows", "4", "--max-retain-rows", "4", "--batch-size", "2", "--lr", "1e-3",
            "--max-steps", "4"]
    assert main([*base, "--out", str(tmp_path / "x"), "--stop-metric", "violation_rate", "--stop-target", "0.2"]) == 1
    assert "add --validation-fraction" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main([*base, "--out", str(out), "--validation-fraction", "0.5", "--stop-metric", "forget_probability",
                 "--stop-target", "0.0", "--stop-every", "2"]) == 0
    assert "never reached 0" in capsys.readouterr().out
    info = json.loads((out / "unlearning.json").read_text())
    assert info["stopping"]["metric"] == "forget_probability" and info["stopping"]["checks"] == 2
    assert (out / "stopping_checkpoint" / "config.json").exists()


def test_cli_metric_list_is_the_callbacks():
    from hf_unlearn.commands.unlearn import TARGET_METRIC_NAMES

    assert tuple(TARGET_METRICS) == TARGET_METRIC_NAMES
    assert FORGET_IDS  # the tiny forget rows have TOFU ids, so truth_ratio finds their perturbed answers


# ------------------------------------------------------------------ accelerate: the same decision on every process


def _distributed_stop(out_dir):
    """Run by each of 2 CPU processes (gloo): GradDiff with the stopping callback; write what this process decided."""
    from .conftest import write_rank_record

    cb = UnlearningStoppingCallback("forget_probability", 1.0, eval_steps=2, save_checkpoint=False)  # reached at once
    trainer = _graddiff(out_dir, [cb], per_device_train_batch_size=1)
    trainer.train()
    write_rank_record(out_dir, trainer, reached=cb.reached_step, step=trainer.state.global_step, history=cb.history)


@pytest.mark.slow
def test_every_process_stops_at_the_same_step(tmp_path):
    from .conftest import run_on_two_processes

    records = run_on_two_processes("tests.test_stopping_callback", "_distributed_stop", tmp_path)
    assert all(r["world"] == 2 for r in records)
    assert records[0]["reached"] == records[1]["reached"] == records[0]["step"] == records[1]["step"] == 2
    assert records[0]["history"] == records[1]["history"]  # identical weights, identical scores


@pytest.mark.parametrize("name", sorted(__import__("hf_unlearn.methods.registry", fromlist=["METHODS"]).METHODS))
def test_every_registered_method_holds_out_rows_and_stops_on_them(name, tmp_path):
    from hf_unlearn.methods.registry import get_method

    spec = get_method(name)
    tok, forget, retain = tiny_data()
    cb = UnlearningStoppingCallback("violation_rate", 1.0, eval_steps=1, save_checkpoint=False)  # reached at once
    args = spec.make_config(output_dir=str(tmp_path), **{**COMMON, "max_steps": 3}, validation_fraction=0.5)
    trainer = spec.trainer_class(model=memorised_model(), args=args, forget_dataset=forget, retain_dataset=retain,
                                 processing_class=tok, callbacks=[cb])
    held = set(trainer.held_out_forget_ids)
    assert len(held) == 2 and not held & set(trainer.trained_forget_ids)
    trainer.train()
    assert cb.reached_step == trainer.state.global_step == 1 and cb.history[0]["rows"] == 2
