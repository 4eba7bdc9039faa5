"""evaluate_tofu on a tiny Llama and small TOFU subsets: sets, batching, references, bad input."""

import json
import shutil

import pytest

from hf_unlearn.errors import UnlearnError
from hf_unlearn.eval.tofu import TofuResult, evaluate_tofu, tofu_sets

from .conftest import TOFU_DIR

FAST = dict(max_items=3, max_new_tokens=4, batch_size=8, progress=False, tofu_path=TOFU_DIR)


@pytest.fixture(scope="module")
def model_and_tok():
    from hf_unlearn.models import build_tiny_model, load_tokenizer

    from .conftest import TOKENIZERS

    tok = load_tokenizer(TOKENIZERS / "gpt2")
    return build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2), tok


@pytest.fixture(scope="module")
def result(model_and_tok):
    return evaluate_tofu(*model_and_tok, **FAST)


def test_summary_has_the_contract_keys_and_sane_values(result):
    s = result.summary
    for key in ("forget_probability", "forget_rouge_l", "forget_truth_ratio", "forget_quality", "model_utility",
                "retain_probability", "real_authors_truth_ratio", "world_facts_rouge_l", "mia_min_k_auc"):
        assert key in s
    assert s["forget_quality"] is None and s["privleak"] is None  # no reference given
    assert 0 < s["forget_probability"] < 1 and 0 < s["forget_truth_ratio"] <= 1
    assert 0 <= s["model_utility"] <= 1 and 0 <= s["mia_loss_auc"] <= 1
    assert result.meta["items"] == {"forget": 3, "retain": 3, "real_authors": 3, "world_facts": 3, "holdout": 3}
    assert result.meta["forget_ids"] == [3600, 3601, 3602] and result.meta["forget_split"] == "forget10"
    forget = [r for r in result.per_item if r["set"] == "forget"]
    assert len(forget) == 3 and all(len(r["perturbed_nlls"]) == 5 and r["truth_ratio"] > 0 for r in forget)


def test_model_compared_with_itself_has_forget_quality_one_and_no_privleak(model_and_tok, result):
    again = evaluate_tofu(*model_and_tok, reference=result, **FAST)
    assert again.summary["forget_quality"] == pytest.approx(1.0)
    assert again.summary["privleak"] == pytest.approx(0.0)
    assert again.summary["forget_probability"] == pytest.approx(result.summary["forget_probability"], rel=1e-5)


@pytest.mark.slow  # a second evaluation of the same model (~15 s)
def test_reference_added_after_the_fact_equals_one_given_up_front(model_and_tok, result, tmp_path):
    other = evaluate_tofu(*model_and_tok, **{**FAST, "max_new_tokens": 2})  # a second, unrelated-looking result
    later = TofuResult.from_json(other.to_json(tmp_path / "model.json")).with_reference(result.to_json(tmp_path / "r"))
    upfront = evaluate_tofu(*model_and_tok, reference=result, **{**FAST, "max_new_tokens": 2})
    assert later.summary["forget_quality"] == pytest.approx(upfront.summary["forget_quality"])
    assert later.summary["privleak"] == pytest.approx(upfront.summary["privleak"])
    assert later.summary["forget_probability"] == pytest.approx(other.summary["forget_probability"])
    assert other.summary["forget_quality"] is None  # the original is not changed
    with pytest.raises(UnlearnError, match="forget items"):
        TofuResult.from_json(tmp_path / "model.json").with_reference(
            evaluate_tofu(*model_and_tok, **{**FAST, "max_items": 2}))


def test_max_items_per_set_caps_only_the_named_sets():
    sets = tofu_sets("forget10", TOFU_DIR, forget_ids=range(360, 400), max_items={"retain": 4, "real_authors": 2})
    assert len(sets["forget"]) == 40 and len(sets["holdout"]) == 40
    assert len(sets["retain"]) == 4 and len(sets["real_authors"]) == 2 and len(sets["world_facts"]) > 100
    with pytest.raises(UnlearnError, match="unknown TOFU sets.*'retian'"):
        tofu_sets("forget10", TOFU_DIR, max_items={"retian": 4})
    with pytest.raises(UnlearnError, match=">= 1"):
        tofu_sets("forget10", TOFU_DIR, max_items={"forget": 0})


def test_json_round_trip_and_markdown(result, tmp_path):
    path = result.to_json(tmp_path / "r.json")
    data = json.loads(path.read_text())
    assert data["kind"] == "tofu" and data["meta"]["tokenizer_fingerprint"] == result.meta["tokenizer_fingerprint"]
    back = TofuResult.from_json(path)
    assert back.summary.keys() == result.summary.keys()
    for key, value in result.summary.items():
        assert back.summary[key] == (None if value is None else pytest.approx(value))
    assert back.forget_truth_ratios() == pytest.approx(result.forget_truth_ratios())
    md = back.to_markdown()
    assert "| forget | 3 |" in md and "min_k_plus_plus" in md


def test_batching_does_not_change_scores(model_and_tok):
    from hf_unlearn.data.tokenize import encode_qa
    from hf_unlearn.eval.runner import generate_texts, score_sequences
    from hf_unlearn.eval.tofu import prompt_ids

    model, tok = model_and_tok
    qa = [("Who?", "A short answer."), ("What is the longest question of them all here?", "Yes."), ("Why?", "No")]
    enc = [encode_qa(tok, q, a, 64, False) for q, a in qa]
    one = score_sequences(model, enc, pad_id=tok.pad_token_id, batch_size=1, progress=False)
    many = score_sequences(model, enc, pad_id=tok.pad_token_id, batch_size=3, progress=False)
    for a, b in zip(one, many):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    prompts = [prompt_ids(tok, q, False) for q, _ in qa]
    assert generate_texts(model, tok, prompts, max_new_tokens=5, batch_size=3, progress=False) == \
        generate_texts(model, tok, prompts, max_new_tokens=5, batch_size=1, progress=False)


def test_forget_ids_without_perturbed_rows_are_reported(model_and_tok):
    # ids 400-402 are in full but in neither forget10_perturbed (3600+) nor retain_perturbed (0-399)
    with pytest.warns(UserWarning, match="no paraphrased/perturbed"):
        res = evaluate_tofu(*model_and_tok, forget_ids=[398, 399, 400, 401], **FAST)
    assert res.meta["forget_ids"] == [398, 399, 400]
    assert res.meta["truth_ratio_items"]["forget"] == "2/3"
    assert [r["truth_ratio"] is None for r in res.per_item if r["set"] == "forget"] == [False, False, True]
    assert res.meta["retain_ids"] == [0, 1, 2]  # retain_perturbed minus the forget ids


def test_default_retain_excludes_forget_ids():
    sets = tofu_sets("forget10", TOFU_DIR, forget_ids=[0, 1], max_items=None)
    assert [it["id"] for it in sets["retain"][:2]] == [2, 3] and len(sets["retain"]) == 398
    assert len(sets["holdout"]) == 2
    with pytest.raises(UnlearnError, match="overlap"):
        tofu_sets("forget10", TOFU_DIR, forget_ids=[0, 1], retain_ids=[1, 2])


def test_missing_perturbed_file_is_a_clear_error(model_and_tok, tmp_path):
    for f in TOFU_DIR.glob("*.jsonl"):
        if f.name != "forget10_perturbed.jsonl":
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(UnlearnError, match="forget10_perturbed.*truth ratio"):
        evaluate_tofu(*model_and_tok, **{**FAST, "tofu_path": tmp_path})


def test_reference_on_another_split_or_tokenizer_is_refused(model_and_tok, result, tmp_path):
    other_split = TofuResult(result.summary, result.per_item, {**result.meta, "forget_split": "forget05"})
    with pytest.raises(UnlearnError, match="forget05"):
        evaluate_tofu(*model_and_tok, reference=other_split, **FAST)
    other_tok = TofuResult(result.summary, result.per_item, {**result.meta, "tokenizer_fingerprint": "0" * 16})
    path = other_tok.to_json(tmp_path / "ref.json")
    with pytest.raises(UnlearnError, match="another tokenizer"):
        evaluate_tofu(*model_and_tok, reference=str(path), **FAST)
    with pytest.raises(UnlearnError, match="forget items"):
        evaluate_tofu(*model_and_tok, reference=result, **{**FAST, "max_items": 2})


def test_chat_template_asked_for_but_missing(model_and_tok):
    with pytest.raises(UnlearnError, match="no chat template|has none"):
        evaluate_tofu(*model_and_tok, use_chat_template=True, **FAST)


def test_unknown_forget_split(model_and_tok):
    with pytest.raises(UnlearnError, match="forget01, forget05, forget10"):
        evaluate_tofu(*model_and_tok, forget_split="forget20", **FAST)


def test_truth_ratio_plot_and_tradeoff_plot(result, tmp_path):
    from hf_unlearn.eval.plots import plot_tradeoff, plot_truth_ratio_histogram

    hist = plot_truth_ratio_histogram(result, result, tmp_path / "tr.png")
    assert hist.read_bytes()[:4] == b"\x89PNG"
    ref = result.to_json(tmp_path / "a.json")
    trade = plot_tradeoff({"step 0": result, "step 1": ref}, tmp_path / "t.png")
    assert trade.stat().st_size > 1000
    with pytest.raises(UnlearnError, match="forget_quality"):
        plot_tradeoff([result], tmp_path / "x.png", x="forget_quality")


@pytest.mark.slow
def test_smollm2_knows_real_authors_better_than_chance_and_survives_4bit():
    pytest.importorskip("bitsandbytes")
    from hf_unlearn.eval.quantized import evaluate_quantized
    from hf_unlearn.models import load_model, load_tokenizer

    from .conftest import SMOLLM2_DIR

    model, tok = load_model(SMOLLM2_DIR), load_tokenizer(SMOLLM2_DIR)
    cmp = evaluate_quantized(model, tok, bits=4, tofu_path=TOFU_DIR, max_items=6, max_new_tokens=24, progress=False)
    before = cmp.meta["before"]
    assert before["chat_template"] is True  # SmolLM2-Instruct has one, and auto uses it
    ra = cmp.summary["real_authors_probability"]
    assert ra["before"] > 0.4 and ra["after"] > 0.3  # 4 choices: chance is 0.25
    assert cmp.summary["real_authors_rouge_l"]["before"] > 0.2
