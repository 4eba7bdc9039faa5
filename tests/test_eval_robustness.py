"""evaluate_robustness / `hf-unlearn eval robustness` on a tiny memorised model, gradient ascent and the exact deletion
of the same rows, all produced by the library here: the relearning attack brings back what gradient ascent hid, and
not what exact deletion removed."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hf_unlearn.errors import UnlearnError
from hf_unlearn.eval.robustness import evaluate_robustness, recovery_fraction, split_relearn_rows, tofu_robustness_rows

from .conftest import TOFU_DIR

N_ROWS, FORGET_IDS = 30, list(range(20, 30))  # author 0 is kept, half of author 1 is forgotten


MAX_LENGTH = 128


@pytest.fixture(scope="session")  # session: a module fixture was built again when xdist interleaved modules
def models(tmp_path_factory):
    """``(tokenizer, fine-tuned, gradient ascent, exact deletion)``; the fine-tune is recorded so that the exact
    deletion is the library's trace-preserving replay without the forget rows."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    from hf_unlearn import forget
    from hf_unlearn.data import QACollator, load_tofu, tokenize_qa
    from hf_unlearn.methods.baselines import GradAscentConfig, GradAscentTrainer
    from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer
    from hf_unlearn.trace import TraceRecordingTrainer

    out = tmp_path_factory.mktemp("robustness")
    rows = load_tofu("full", TOFU_DIR).select(range(N_ROWS))
    tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
    data = tokenize_qa(rows, tok, max_length=MAX_LENGTH)
    args = TrainingArguments(output_dir=str(out / "ft"), per_device_train_batch_size=10, num_train_epochs=12,
                             learning_rate=1e-2, warmup_steps=5, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, disable_tqdm=True, logging_strategy="no")
    recorder = TraceRecordingTrainer(model=build_tiny_model("llama", tok, hidden_size=64, num_layers=2, num_heads=4,
                                                            seed=0),
                                     args=args, train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
                                     trace_checkpoint_steps=10)
    recorder.train()
    finetuned = recorder.model.eval()
    receipt = forget(out / "ft" / "trace", FORGET_IDS, out / "exact", tokenizer=tok, progress=False, log=lambda m: None)
    assert receipt.ok
    exact = AutoModelForCausalLM.from_pretrained(out / "exact" / "model").eval()
    config = GradAscentConfig(output_dir=str(out / "ga"), max_steps=6, learning_rate=1e-3,
                              per_device_train_batch_size=8, report_to=[], save_strategy="no", use_cpu=True,
                              disable_tqdm=True, logging_strategy="no")
    ascent = GradAscentTrainer(model=copy.deepcopy(finetuned), args=config,
                               forget_dataset=data.filter(lambda r: r["id"] in FORGET_IDS), processing_class=tok)
    ascent.train()
    return tok, finetuned, ascent.model.eval(), exact


@pytest.fixture(scope="module")
def rows():
    return tofu_robustness_rows("forget01", TOFU_DIR, forget_ids=FORGET_IDS, retain_ids=range(20))


def _relearn(models, rows, **kw):
    tok, finetuned, ascent, exact = models
    return evaluate_robustness(ascent, tok, rows["forget"], original=finetuned, reference=exact, reference_name="exact",
                               steps=(0, 5, 10), learning_rate=1e-3, attacks=["relearning"], max_length=MAX_LENGTH,
                               progress=False, **kw)


def test_relearning_recovers_gradient_ascent_far_more_than_exact_deletion(models, rows):
    result = _relearn(models, rows)
    curves = result.curves()
    assert curves["model"][0] == 0.0 and curves["exact"][0] == 0.0
    # ascent: the answers of rows it never relearned come back; exact deletion never had them to bring back
    assert curves["model"][-1] > 0.25
    assert curves["model"][-1] > 5 * max(curves["exact"][-1], 0.01)
    halves = result.summary["models"]
    assert halves["original"]["evaluated_half"]["probability"] > halves["model"]["relearning"][0]["probability"]
    assert set(result.meta["relearn_ids"]).isdisjoint(result.meta["evaluated_ids"])
    assert sorted(result.meta["relearn_ids"] + result.meta["evaluated_ids"]) == FORGET_IDS


@pytest.mark.slow  # every attack three times (~1 min): the default suite keeps the other robustness tests
def test_attacks_never_modify_the_models_and_are_deterministic(models, rows, tmp_path):
    tok, finetuned, ascent, exact = models
    before = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in
              (("ascent", ascent), ("exact", exact))}
    rng = torch.random.get_rng_state()
    kw = dict(original=finetuned, reference=exact, reference_name="exact", holdout_rows=rows["holdout"], probe_rows=rows["retain"], steps=(0, 3), learning_rate=1e-3,
              bits=(4, 8), max_length=MAX_LENGTH, progress=False, seed=1)
    first = evaluate_robustness(ascent, tok, rows["forget"], **kw)
    second = evaluate_robustness(ascent, tok, rows["forget"], **kw)
    assert json.dumps(first.to_dict()) == json.dumps(second.to_dict())
    assert torch.equal(torch.random.get_rng_state(), rng)  # the caller's RNG is left as it was
    for name, m in (("ascent", ascent), ("exact", exact)):
        assert all(torch.equal(v, before[name][k]) for k, v in m.state_dict().items()), name
        assert not m.training
    other = evaluate_robustness(ascent, tok, rows["forget"], **{**kw, "seed": 2, "bits": (), "attacks": ["relearning"]})
    assert other.meta["relearn_ids"] != first.meta["relearn_ids"]

    s = first.summary["models"]
    for name in ("model", "exact"):
        assert set(s[name]["quantization"]) == {"4", "8"}
        assert 0 <= s[name]["quantization"]["4"]["probability"] <= 1
        assert s[name]["paraphrase"]["probability"] > 0  # TOFU's paraphrased questions (retain_perturbed ids)
        assert len(s[name]["probe"]["by_layer"]) == 3 and s[name]["probe"]["chance"] == 0.5
        assert len(s[name]["truth_probe"]["by_layer"]) == 3 and 0 <= s[name]["truth_probe"]["max"] <= 1
    md = first.to_markdown()
    assert "4-bit quantisation" in md and "paraphrased questions" in md and "linear probe" in md
    assert "truth probe" in md
    path = first.to_json(tmp_path / "r.json")
    from hf_unlearn.eval.plots import plot_recovery_curves
    from hf_unlearn.eval.robustness import RobustnessResult

    assert RobustnessResult.from_json(path).curves() == first.curves()
    assert plot_recovery_curves({"ascent": path}, tmp_path / "recovery.png").stat().st_size > 0


def test_relearn_rows_named_and_bad_input():
    rows = [{"id": i, "question": "q", "answer": "a"} for i in range(6)]
    relearn, evaluated = split_relearn_rows(rows, [0, 1])
    assert [r["id"] for r in relearn] == [0, 1] and [r["id"] for r in evaluated] == [2, 3, 4, 5]
    assert [len(x) for x in split_relearn_rows(rows, seed=3)] == [3, 3]
    with pytest.raises(UnlearnError, match="not forget rows"):
        split_relearn_rows(rows, [99])
    with pytest.raises(UnlearnError, match="leave at least one"):
        split_relearn_rows(rows, range(6))
    with pytest.raises(UnlearnError, match="at least 2"):
        split_relearn_rows(rows[:1])
    with pytest.raises(UnlearnError, match="unknown robustness attack"):
        evaluate_robustness(None, None, rows, attacks=["jailbreak"])
    with pytest.raises(UnlearnError, match="steps must be >= 0"):  # before any model is touched
        evaluate_robustness(None, None, rows, steps=(-1, 10))


def test_recovery_fraction():
    # below the threshold (unlearning removed less than 0.01): not computed; test_eval_conventions pins the reason
    assert recovery_fraction(0.5, 0.1, 0.9) == pytest.approx(0.5)
    assert recovery_fraction(0.1, 0.1, 0.9) == 0.0
    assert recovery_fraction(0.5, 0.1, None) is None
    assert recovery_fraction(0.5, 0.9, 0.9) is None  # unlearning removed nothing


def test_cli_writes_table_json_and_plot(models, tmp_path, capsys):
    from hf_unlearn.cli import main

    tok, finetuned, ascent, exact = models
    for name, m in (("ascent", ascent), ("ft", finetuned)):
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    out = tmp_path / "out"
    assert main(["eval", "robustness", str(tmp_path / "ascent"), "--original", str(tmp_path / "ft"), "--tofu",
                 str(TOFU_DIR), "--forget-ids", "20-29", "--retain-ids", "0-19", "--relearn-ids", "20-24", "--steps", "0,2", "--lr", "1e-3",
                 "--bits", "none", "--attacks", "relearning,paraphrase", "--max-length", str(MAX_LENGTH), "--quiet",
                 "--out", str(out)]) == 0
    assert "relearning, 2 steps" in capsys.readouterr().out
    data = json.loads((out / "robustness_results.json").read_text())
    assert data["meta"]["relearn_ids"] == [20, 21, 22, 23, 24] and data["meta"]["bits"] == []
    assert (out / "robustness_summary.md").exists() and (out / "recovery.png").exists()
    ascent_after = {k: v for k, v in ascent.state_dict().items()}
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "ascent").state_dict()
    assert all(torch.equal(saved[k], v) for k, v in ascent_after.items())  # the folder's model is untouched


def test_relearning_on_related_rows_and_in_context(models, rows):
    """Relearning on the paraphrases or on the forgotten authors' kept questions measures every forget row; the
    in-context attack's probability is the answer probability with the relearn rows written into the prompt."""
    from hf_unlearn.data.tokenize import encode_qa
    from hf_unlearn.eval.robustness import answer_metrics, in_context_prefix, recovery

    tok, finetuned, ascent, exact = models
    assert [r["id"] for r in rows["kept_same_authors"]] == list(range(30, 40))  # author 1's questions not forgotten
    for relearn_rows, on in (("paraphrased", "paraphrased"), (rows["kept_same_authors"], "given rows")):
        result = _relearn(models, rows, relearn_rows=relearn_rows)
        assert result.meta["relearn_on"] == on and result.meta["evaluated_ids"] == FORGET_IDS
        curve = result.summary["models"]["model"]["relearning"]
        assert curve[0]["probability"] == pytest.approx(result.summary["models"]["model"]["forget"]["probability"])
        assert curve[-1]["probability"] != curve[0]["probability"]
    with pytest.raises(UnlearnError, match="share ids"):
        _relearn(models, rows, relearn_rows=rows["forget"][:2])

    result = evaluate_robustness(ascent, tok, rows["forget"], original=finetuned, attacks=["in_context"], seed=0,
                                 in_context_rows=2, max_length=MAX_LENGTH, progress=False)
    relearned = [r for r in rows["forget"] if r["id"] in result.meta["relearn_ids"]]
    measured = [r for r in rows["forget"] if r["id"] in result.meta["evaluated_ids"]]
    context = in_context_prefix(relearned, 2, seed=0)
    assert context.count("\nAnswer: ") == 2 and context.endswith("\n\nQuestion: ") and context[:9] != "Question:"
    direct = answer_metrics(ascent, tok, [encode_qa(tok, context + r["question"], r["answer"], 512) for r in measured])
    icl = result.summary["models"]["model"]["in_context"]
    assert icl["probability"] == pytest.approx(direct["probability"])
    without = answer_metrics(ascent, tok, [encode_qa(tok, r["question"], r["answer"], MAX_LENGTH) for r in measured])
    before = answer_metrics(finetuned, tok, [encode_qa(tok, r["question"], r["answer"], MAX_LENGTH) for r in measured])
    expected = recovery(direct["probability"], without["probability"], before["probability"])
    assert icl["recovery"] == pytest.approx(expected["recovery"]) and icl["removed"] == pytest.approx(expected["removed"])
    assert result.meta["in_context_excluded_ids"] == []  # the other half: no measured row's answer is shown


def test_in_context_with_paraphrases_does_not_measure_rows_whose_own_answer_is_shown(models, rows):
    """With relearn_rows="paraphrased" the rows shown in the prompt are paraphrases of measured rows: those rows would
    be scored copying their own answer from the prompt. They are left out (and named); the rest are measured as the
    direct computation says, against their own baseline."""
    from hf_unlearn.data.tokenize import encode_qa
    from hf_unlearn.eval.robustness import answer_metrics, in_context_prefix, recovery

    tok, finetuned, ascent, exact = models
    result = evaluate_robustness(ascent, tok, rows["forget"], original=finetuned, attacks=["in_context"], seed=0,
                                 in_context_rows=2, max_length=MAX_LENGTH, relearn_rows="paraphrased", progress=False)
    shown, left_out = result.meta["in_context_shown_ids"], result.meta["in_context_excluded_ids"]
    assert len(shown) == 2 and sorted(left_out) == sorted(shown)  # each shown pair is a measured row's paraphrase
    assert any("own answer is in the prompt" in n for n in result.meta["notes"])
    assert "(2 rows whose own answer is shown not measured)" in result.to_markdown()
    paraphrases = [{**r, "question": r["paraphrased_question"], "answer": r["paraphrased_answer"]}
                   for r in rows["forget"]]
    context = in_context_prefix(paraphrases, 2, seed=0)
    assert all(r["answer"] in context for r in paraphrases if r["id"] in shown)
    measured = [r for r in rows["forget"] if r["id"] not in shown]
    direct = answer_metrics(ascent, tok, [encode_qa(tok, context + r["question"], r["answer"], 512) for r in measured])
    without = answer_metrics(ascent, tok, [encode_qa(tok, r["question"], r["answer"], MAX_LENGTH) for r in measured])
    before = answer_metrics(finetuned, tok, [encode_qa(tok, r["question"], r["answer"], MAX_LENGTH) for r in measured])
    icl = result.summary["models"]["model"]["in_context"]
    assert icl["probability"] == pytest.approx(direct["probability"])
    assert icl["without_context_probability"] == pytest.approx(without["probability"])
    expected = recovery(direct["probability"], without["probability"], before["probability"])
    assert icl["recovery"] == pytest.approx(expected["recovery"])
    # every row shown: nothing left to measure, the attack is skipped with the reason
    everything = evaluate_robustness(ascent, tok, rows["forget"], attacks=["in_context"], seed=0, progress=False,
                                     in_context_rows=len(rows["forget"]), max_length=MAX_LENGTH,
                                     relearn_rows="paraphrased")
    assert "in_context" not in everything.summary["models"]["model"]
    assert any("no row is left" in n for n in everything.meta["notes"])


def test_the_relearning_attack_trains_inside_torch_no_grad(gpt2_tokenizer):
    """An evaluation script often runs under ``torch.no_grad()``: the relearning attack fine-tunes anyway (its curve
    moves; before, its first backward failed), and the caller's mode is left as it was."""
    from datasets import Dataset

    from hf_unlearn.data import tokenize_qa
    from hf_unlearn.eval.robustness import relearning_curve
    from hf_unlearn.models import build_tiny_model

    torch.manual_seed(0)
    model = build_tiny_model(tokenizer=gpt2_tokenizer)
    rows = Dataset.from_list([{"id": i, "question": f"Who wrote book {i}?", "answer": f"Author number {i}."}
                              for i in range(4)])
    encoded = list(tokenize_qa(rows, gpt2_tokenizer, max_length=32))
    with torch.no_grad():
        curve = relearning_curve(model, gpt2_tokenizer, encoded[:2], encoded[2:], steps=(0, 3), learning_rate=1e-2,
                                 batch_size=2, progress=False)
        assert not torch.is_grad_enabled()
    assert curve[0] != curve[1]
