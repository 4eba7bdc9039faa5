"""Forgetting measurements on hand-computed inputs, the report, and `hf-unlearn analyze forgetting` end to end."""

from __future__ import annotations

import json
import math

import pytest

from hf_unlearn.analysis import forgetting as F
from hf_unlearn.errors import UnlearnError


def test_chance_is_the_mean_of_one_over_n_choices():
    assert F.chance_accuracy([2, 4]) == pytest.approx(0.375)
    assert F.chance_accuracy([3, 3, 3]) == pytest.approx(1 / 3)
    with pytest.raises(UnlearnError):
        F.chance_accuracy([])
    with pytest.raises(UnlearnError, match="2 choices"):
        F.chance_accuracy([1, 2])


def test_forget_gap_and_ratio():
    assert F.forget_gap(0.6, 0.5) == pytest.approx(0.1)
    assert F.forget_ratio(0.9, 0.5, 0.5) == pytest.approx(1.0)  # back to chance
    assert F.forget_ratio(0.9, 0.7, 0.5) == pytest.approx(0.5)
    assert F.forget_ratio(0.9, 0.9, 0.5) == pytest.approx(0.0)  # nothing forgotten
    assert F.forget_ratio(0.8, 0.2, 0.5) == pytest.approx(2.0)  # pushed below chance
    assert math.isnan(F.forget_ratio(0.5, 0.3, 0.5))  # never learned: undefined


def test_total_variance_is_the_trace_of_the_covariance():
    # each dimension takes values {0, 2} twice: variance 1 per dimension, trace 2
    assert F.total_variance([[0, 0], [2, 0], [0, 2], [2, 2]]) == pytest.approx(2.0)
    assert F.total_variance([[1, 5, 7], [1, 5, 7]]) == 0.0
    with pytest.raises(UnlearnError, match="rows"):
        F.total_variance([[1.0, 2.0]])


def test_correlation():
    r, p = F.correlation([1, 2, 3, 4], [10, 20, 25, 100], "spearman")
    assert r == pytest.approx(1.0)
    r, _ = F.correlation([1, 2, 3], [3, 2, 1], "pearson")
    assert r == pytest.approx(-1.0)
    assert all(math.isnan(v) for v in F.correlation([1, 2], [1, 2]))  # too few points
    assert all(math.isnan(v) for v in F.correlation([1, 2, 3], [5, 5, 5]))  # constant
    r, _ = F.correlation([1, 2, float("nan"), 3], [1, 2, 9, 3])  # NaNs dropped pairwise
    assert r == pytest.approx(1.0)
    with pytest.raises(UnlearnError, match="method"):
        F.correlation([1, 2, 3], [1, 2, 3], "cosine")


def test_first_stable_step():
    h = [(3, True), (1, False), (5, True), (2, True)]  # any order: sorted -> F@1, T@2, T@3, T@5
    assert F.first_stable_step(h, True) == 2.0
    assert F.first_stable_step([(1, True), (2, False), (3, True)], True) == 3.0
    assert math.isinf(F.first_stable_step([(1, True), (2, False)], True))
    assert F.first_stable_step([(1, True), (2, False)], False) == 2.0
    assert math.isinf(F.first_stable_step([], True))


def test_order_rank_correlation_ranks_never_last():
    learned = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
    forgotten = {"a": 10.0, "b": 20.0, "c": 30.0, "d": math.inf, "z": 1.0}
    rho, _, n = F.order_rank_correlation(learned, forgotten)
    assert n == 4 and rho == pytest.approx(1.0)
    rho, _, _ = F.order_rank_correlation(learned, {"a": math.inf, "b": 3, "c": 2, "d": 1})
    assert rho == pytest.approx(-1.0)
    with pytest.raises(UnlearnError, match="in common"):
        F.order_rank_correlation({"a": 1}, {"b": 1})


def test_cross_task_matrix_and_predictors():
    ft = {"rte": 0.9, "piqa": 0.8}
    chance = {"rte": 0.5, "piqa": 0.5}
    m = F.cross_task_matrix(ft, {"rte": {"rte": 0.5, "piqa": 0.8}, "piqa": {"rte": 0.7, "piqa": 0.65}}, chance)
    assert m == {"rte": {"rte": pytest.approx(1.0), "piqa": pytest.approx(0.0)},
                 "piqa": {"rte": pytest.approx(0.5), "piqa": pytest.approx(0.5)}}
    with pytest.raises(UnlearnError, match="sciq"):
        F.cross_task_matrix(ft, {"rte": {"sciq": 0.3}}, chance)
    out = F.predictor_correlations({"variance": {"a": 1, "b": 2, "c": 3}}, {"a": 0.9, "b": 0.5, "c": 0.1})
    assert out["variance"][0] == pytest.approx(-1.0)


def _fake_result():
    row = {"n_train": 8, "n_test": 8, "chance": 0.5, "acc_base_test": 0.5, "acc_ft_train": 1.0, "acc_ft_test": 0.75,
           "confidence_ft_test": 0.7, "total_variance_last_layer": 12.5, "acc_forgot_train": 0.5,
           "acc_forgot_test": 0.75, "forget_gap_train": 0.0, "forget_gap_test": 0.25, "forget_ratio_train": 1.0,
           "forget_ratio_test": 0.0, "order_spearman": float("nan"), "order_p": float("nan"), "order_n": 8,
           "probe_by_layer": [0.5, 0.9, 0.8], "probe_best": 0.9, "probe_best_layer": 1, "probe_majority": 0.5,
           "acc_forgot_all": 0.625, "never_forgotten_train": 2}
    return {"setup": {"tasks": ["rte", "cola"], "n_train": 8, "n_test": 8, "epochs": 1, "learning_rate": 1e-3,
                      "label_mode": "uniform", "forget_epochs": 1, "forget_learning_rate": 1e-3, "batch_size": 4,
                      "max_length": 48, "seed": 0},
            "tasks": {"rte": row, "cola": {**row, "forget_ratio_test": 0.8, "total_variance_last_layer": 3.0}},
            "cross_task_ratio": {"rte": {"rte": 0.0, "cola": 0.1}, "cola": {"cola": 0.8, "rte": float("nan")}},
            "predictors": {"spearman": {"total_variance_last_layer": (float("nan"), float("nan"))},
                           "pearson": {"total_variance_last_layer": (float("nan"), float("nan"))}},
            "timing_s": {"total": 12.0}}


def test_report_writes_tables_json_and_plots(tmp_path):
    from hf_unlearn.analysis.report import write_report

    report = write_report(_fake_result(), tmp_path)
    text = report.read_text()
    assert "## rte" in text and "## cola" in text
    assert "| forget ratio (train / test) | 1.000 / 0.000 |" in text
    assert "| rte | 0.000 | 0.100 |" in text and "| cola | n/a | 0.800 |" in text
    data = json.loads((tmp_path / "results.json").read_text())  # strict JSON: NaN became null
    assert data["tasks"]["rte"]["order_spearman"] is None
    for png in ("forget_ratio.png", "variance_vs_generalisation.png", "probe_accuracy_by_layer.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # the default suite's time budget (`make test-slow` runs it)
def test_cli_analyze_forgetting_end_to_end(tiny_llama_dir, tmp_path):
    from hf_unlearn.cli import main

    out = tmp_path / "report"
    code = main(["analyze", "forgetting", str(tiny_llama_dir), "--tasks", "rte,cola", "--n-train", "8", "--n-test",
                 "8", "--epochs", "1", "--forget-epochs", "1", "--lr", "1e-3", "--max-length", "40",
                 "--batch-size", "4", "--train-last-layers", "1", "--out", str(out)])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    assert set(data["tasks"]) == {"rte", "cola"} and set(data["cross_task_ratio"]) == {"rte", "cola"}
    for row in data["tasks"].values():
        assert row["n_train"] == 8 and row["n_test"] == 8 and row["chance"] == 0.5
        assert 0 <= row["acc_forgot_test"] <= 1 and len(row["probe_by_layer"]) == 3
    assert "## Cross-task forget ratio" in (out / "report.md").read_text()


def test_cli_reports_bad_tasks_in_one_line(tiny_llama_dir, tmp_path, capsys):
    from hf_unlearn.cli import main

    assert main(["analyze", "forgetting", str(tiny_llama_dir), "--tasks", "nosuchtask", "--out", str(tmp_path)]) == 1
    assert "no task 'nosuchtask'" in capsys.readouterr().err
    assert main(["analyze", "forgetting", str(tiny_llama_dir), "--tasks", ",", "--out", str(tmp_path)]) == 1
    assert "--tasks is empty" in capsys.readouterr().err
    assert main(["analyze", "forgetting", str(tiny_llama_dir), "--n-train", "2", "--out", str(tmp_path)]) == 1
    assert "at least 4" in capsys.readouterr().err


def test_bad_task_file_is_a_clear_error(tmp_path):
    from hf_unlearn.analysis.forgetting_experiment import ForgettingSetup, load_splits

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1, "question": "q", "choices": ["a", "b"], "label": 3}) + "\n")
    with pytest.raises(UnlearnError, match="outside"):
        load_splits(ForgettingSetup(tasks=[str(bad)], n_train=4, n_test=4))
    single = tmp_path / "single.jsonl"
    single.write_text("".join(json.dumps({"id": i, "question": "q", "choices": ["a"], "label": 0}) + "\n"
                              for i in range(10)))
    with pytest.raises(UnlearnError, match="at least 2"):
        load_splits(ForgettingSetup(tasks=[str(single)], n_train=4, n_test=4))
