"""Membership-inference attacks (gradient norm, reference model) and EOS-free answer scoring, on cases whose answer
is known: a tiny Llama that memorised the forget rows, its untrained twin, and hand-built statistics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_unlearn.errors import UnlearnError
from hf_unlearn.eval import metrics as M

from .conftest import TOFU_DIR
from .methods_helpers import FORGET_IDS, memorised_model, tiny_data


def _stats(correct, logprobs=None):
    n = len(correct)
    lp = np.asarray(logprobs if logprobs is not None else [-0.1] * n, float)
    return M.TokenStats(lp, np.asarray(correct, bool), lp.copy())


# ---------------------------------------------------------------------------------------------- EOS-free scoring


def test_an_answer_is_scored_without_its_final_eos():
    eos = 7
    stats = _stats([True, True, True, False])  # the whole answer right, the EOS after it not predicted
    labels = [-100, -100, 4, 5, 6, eos]
    body = M.drop_final_eos(stats, labels, eos)
    assert M.extraction_strength(stats.correct) == 0.0 and M.extraction_strength(body.correct) == 1.0
    assert M.exact_memorization(stats.correct) == 0.75 and M.exact_memorization(body.correct) == 1.0
    assert M.labels_without_final_eos(labels, eos) == [-100, -100, 4, 5, 6, -100]
    # no EOS at the end (an answer cut by max_length), or EOS the only token: nothing is dropped
    assert M.drop_final_eos(stats, [-100, 4, 5, 6, 9], eos) is stats
    assert M.drop_final_eos(_stats([False]), [-100, eos], eos).correct.size == 1
    assert M.drop_final_eos(stats, labels, None) is stats
    assert M.labels_without_final_eos([-100, eos], eos) == [-100, eos]


def test_min_k_scores_the_body_loss_and_zlib_the_whole_answer():
    stats = _stats([True] * 3, logprobs=[-1.0, -2.0, -9.0])  # the last token (EOS) is the unlikely one
    body = stats.without_last()
    sc = M.mia_scores(stats, "text", k=0.5, body=body)
    assert sc["min_k"] == pytest.approx(2.0) and sc["min_k_plus_plus"] == pytest.approx(2.0)
    assert sc["loss"] == pytest.approx(4.0)
    assert M.mia_scores(stats, "text", k=0.5)["min_k"] == pytest.approx(9.0)


@pytest.mark.slow  # the default suite's time budget (`make test-slow` runs it)
def test_eos_never_predicted_no_longer_zeroes_extraction_strength():
    """A model that never emits EOS scored 0 extraction strength on every answer when EOS was scored."""
    from hf_unlearn.eval.tofu import evaluate_tofu

    tok = tiny_data()[0]
    model = memorised_model()
    kw = dict(forget_ids=FORGET_IDS, retain_ids=range(4), max_items=4, max_new_tokens=1, progress=False,
              tofu_path=TOFU_DIR, mia_attacks=["loss"])
    plain = evaluate_tofu(model, tok, **kw).summary
    model.lm_head.register_forward_hook(lambda m, i, out: out.index_add(-1, torch.tensor([tok.eos_token_id]),
                                                                        torch.full((*out.shape[:2], 1), -60.0)))
    no_eos = evaluate_tofu(model, tok, **kw).summary
    assert plain["forget_extraction_strength"] > 0.9
    assert no_eos["forget_extraction_strength"] == pytest.approx(plain["forget_extraction_strength"])
    assert no_eos["forget_exact_memorization"] == pytest.approx(plain["forget_exact_memorization"])
    assert no_eos["forget_probability"] < 0.3 * plain["forget_probability"]  # probability still counts the EOS


# ---------------------------------------------------------------------------------------------- attacks on numbers


def test_reference_attack_orientation():
    # members: the model's loss fell far below the reference's; non-members: about the reference's
    forget = [M.reference_attack_score(loss, ref) for loss, ref in [(0.1, 3.0), (0.2, 2.5), (0.1, 4.0)]]
    holdout = [M.reference_attack_score(loss, ref) for loss, ref in [(3.1, 3.0), (2.4, 2.5), (4.2, 4.0)]]
    assert M.mia_auc(forget, holdout) == 1.0
    assert M.mia_auc(holdout, forget) == 0.0
    assert M.mia_auc([0.0] * 3, [0.0] * 3) == 0.5  # the reference against itself
    assert M.privleak(0.5, 0.5) == 0.0 and M.privleak(1.0, 0.5) == -100.0


def test_attack_names_are_checked():
    assert M.check_mia_attacks(None) == M.MIA_ATTACKS
    assert M.check_mia_attacks(["reference", "loss"]) == ("loss", "reference")
    with pytest.raises(UnlearnError, match="unknown membership-inference attack 'recall'"):
        M.check_mia_attacks(["loss", "recall"])


def test_gradient_norm_is_the_mean_per_tensor_norm_and_leaves_the_model_as_it_was():
    from hf_unlearn.eval.runner import gradient_norms
    from hf_unlearn.losses import nll_loss

    tok, forget, _ = tiny_data()
    model = memorised_model()
    model.train()
    model.model.embed_tokens.weight.requires_grad_(False)
    enc = {"input_ids": forget[0]["input_ids"], "labels": forget[0]["labels"]}
    (norm,) = gradient_norms(model, [enc], progress=False)
    assert model.training and not model.model.embed_tokens.weight.requires_grad
    assert all(p.grad is None for p in model.parameters())
    # by hand: every floating-point tensor (the frozen embedding too), eval mode
    model.eval()
    model.requires_grad_(True)
    loss = nll_loss(model(input_ids=torch.tensor([enc["input_ids"]])).logits, torch.tensor([enc["labels"]]))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert norm == pytest.approx(float(torch.stack([g.norm() for g in grads]).mean()), rel=1e-5)


# ---------------------------------------------------------------------------------------------- TOFU and MUSE


@pytest.fixture(scope="module")
def memorised_and_untrained():
    """The memorised tiny Llama and an untrained twin as the 'reference' that never saw the forget rows."""
    from hf_unlearn.models import build_tiny_model

    tok = tiny_data()[0]
    return memorised_model(), build_tiny_model("llama", tok, hidden_size=64, num_layers=2, num_heads=4, seed=1), tok


@pytest.mark.slow  # a fine-tune and TOFU attacks (~15 s)
def test_tofu_attacks_recognise_memorised_rows_and_not_the_reference_itself(memorised_and_untrained):
    from hf_unlearn.eval.tofu import evaluate_tofu

    model, untrained, tok = memorised_and_untrained
    kw = dict(forget_ids=FORGET_IDS, retain_ids=range(4), max_items=4, max_new_tokens=1, progress=False,
              tofu_path=TOFU_DIR)
    ref = evaluate_tofu(untrained, tok, **kw)
    assert ref.summary["mia_reference_auc"] is None and ref.summary["mia_gradnorm_auc"] is not None
    res = evaluate_tofu(model, tok, reference=ref, **kw)
    s = res.summary
    # the memorised rows: low loss (vs the reference's), small gradients; holdout rows: neither
    assert s["mia_loss_auc"] == 1.0 and s["mia_gradnorm_auc"] == 1.0 and s["mia_reference_auc"] == 1.0
    assert s["privleak_reference"] == pytest.approx(-100.0)
    forget = [r for r in res.per_item if r["set"] == "forget"]
    assert all({"gradnorm", "loss", "min_k"} <= set(r["mia"]) for r in forget)
    assert res.meta["mia_attacks"] == list(M.MIA_ATTACKS)
    # the reference compared with itself: every reference score is 0, AUC 0.5, privleak 0
    itself = evaluate_tofu(untrained, tok, reference=ref, **kw).summary
    assert itself["mia_reference_auc"] == 0.5 and itself["privleak_reference"] == 0.0
    assert itself["privleak_gradnorm"] == pytest.approx(0.0, abs=1e-6)
    # added after the fact: the same numbers
    later = evaluate_tofu(model, tok, **kw).with_reference(ref).summary
    assert later["mia_reference_auc"] == 1.0 and later["privleak_reference"] == pytest.approx(-100.0)
    # only the attacks asked for; a reference evaluated on other holdout items gives a note, not a wrong number
    cheap = evaluate_tofu(model, tok, reference=ref, **{**kw, "mia_attacks": ["loss", "reference"]})
    assert cheap.summary["mia_gradnorm_auc"] is None and cheap.summary["mia_reference_auc"] == 1.0
    assert all("gradnorm" not in r["mia"] for r in cheap.per_item if "mia" in r)
    short = evaluate_tofu(untrained, tok, **{**kw, "max_items": {"holdout": 2}})
    partial = evaluate_tofu(model, tok, **kw).with_reference(short)
    assert partial.summary["mia_reference_auc"] is None
    assert any("reference attack skipped" in n for n in partial.meta["notes"])


def test_muse_attacks_and_self_reference(memorised_and_untrained, tmp_path):
    from hf_unlearn.eval.muse import MuseResult, evaluate_muse_news

    from .conftest import MUSE_DIR

    _, untrained, tok = memorised_and_untrained
    kw = dict(muse_path=MUSE_DIR, max_items=3, max_length=32, max_prompt_tokens=32, verbmem_max_new_tokens=2,
              knowmem_max_new_tokens=2, progress=False)
    ref = evaluate_muse_news(untrained, tok, **kw)
    assert ref.summary["mia_gradnorm_auc"] is not None and ref.summary["mia_reference_auc"] is None
    again = evaluate_muse_news(untrained, tok, reference=str(ref.to_json(tmp_path / "ref.json")), **kw).summary
    assert again["mia_reference_auc"] == 0.5 and again["privleak_reference"] == 0.0
    assert again["privleak_gradnorm"] == pytest.approx(0.0, abs=1e-6)
    assert evaluate_muse_news(untrained, tok, reference=ref.summary["mia_min_k_auc"], **kw).summary[
        "mia_reference_auc"] is None  # a bare AUC has no per-text losses
    short = MuseResult(ref.summary, [r for r in ref.per_item if r["id"] != 2], ref.meta)
    with pytest.raises(UnlearnError, match="no privleak loss"):
        evaluate_muse_news(untrained, tok, reference=short, **kw)


def test_knowmem_few_shot_prompts_and_answer_cut(memorised_and_untrained, tmp_path, monkeypatch):
    import json
    import shutil

    import hf_unlearn.eval.runner as runner
    from hf_unlearn.eval.muse import cut_knowmem_answer, evaluate_muse_news

    from .conftest import MUSE_DIR

    assert cut_knowmem_answer("Paris\nis nice", few_shot=False) == "Paris"
    assert cut_knowmem_answer("Paris is nice\n\nQuestion: x", few_shot=True) == "Paris is nice"
    assert cut_knowmem_answer("1472 Question: when", few_shot=True) == "1472"
    assert cut_knowmem_answer("in 1472\nand then", few_shot=True) == "in 1472\nand then"

    _, untrained, tok = memorised_and_untrained
    prompts = []
    original = runner.generate_texts

    def spy(model, tokenizer, ids, **kw):
        if kw.get("desc") == "MUSE knowmem":
            prompts.extend(tokenizer.decode(p, skip_special_tokens=True) for p in ids)
        return original(model, tokenizer, ids, **kw)

    monkeypatch.setattr(runner, "generate_texts", spy)
    kw = dict(max_items=2, max_length=32, max_prompt_tokens=32, verbmem_max_new_tokens=2, knowmem_max_new_tokens=2,
              progress=False, mia_attacks=["loss"])
    shots = [{"question": "Who wrote Hamlet?", "answer": "Shakespeare"}]
    res = evaluate_muse_news(untrained, tok, muse_path=MUSE_DIR, knowmem_examples=shots, **kw)
    assert len(prompts) == 4 and all(p.startswith("Question: Who wrote Hamlet?\nAnswer: Shakespeare\n\nQuestion: ")
                                      for p in prompts)
    assert res.meta["knowmem_shots"] == {"forget": 1, "retain": 1}
    # MUSE's own in-context splits, from a MUSE folder that has them
    muse = tmp_path / "muse_news"
    shutil.copytree(MUSE_DIR, muse)
    (muse / "knowmem" / "forget_qa_icl.json").write_text(json.dumps([{"question": "F?", "answer": "f"}] * 2))
    (muse / "knowmem" / "retain_qa_icl.json").write_text(json.dumps([{"question": "R?", "answer": "r"}]))
    prompts.clear()
    res = evaluate_muse_news(untrained, tok, muse_path=muse, knowmem_examples="muse", **kw)
    assert res.meta["knowmem_shots"] == {"forget": 2, "retain": 1}
    assert prompts[0].startswith("Question: F?\nAnswer: f\n\nQuestion: F?\nAnswer: f\n\nQuestion: ")
    assert prompts[-1].startswith("Question: R?\nAnswer: r\n\nQuestion: ")
    with pytest.raises(UnlearnError, match="has no knowmem/forget_qa_icl.json"):
        evaluate_muse_news(untrained, tok, muse_path=MUSE_DIR, knowmem_examples="muse", **kw)
    with pytest.raises(UnlearnError, match="needs a 'question' and an 'answer'"):
        evaluate_muse_news(untrained, tok, muse_path=MUSE_DIR, knowmem_examples=[{"q": 1}], **kw)


def test_probability_forms_stay_finite_for_very_unlikely_answers():
    import math

    # P(true)/(P(true)+sum P(false)) with every probability below float range: a softmax over -NLL
    expected = 1 / (1 + math.exp(-1) + math.exp(-2))
    assert M.normalized_probability(1000.0, [1001.0, 1002.0]) == pytest.approx(expected)
    tr = M.truth_ratio(900.0, [1.0, 2.0])  # the paraphrase is astronomically less likely than the perturbations
    assert tr == math.inf
    assert M.truth_ratio_forget_score([tr]) == 0.0 and M.truth_ratio_retain_score([tr]) == 0.0


@pytest.mark.slow  # the attacks' CLI (~12 s); the attacks themselves are tested in the default suite
def test_cli_attack_subset_and_few_shot_knowmem(tiny_llama_dir, tmp_path, capsys):
    import json

    from hf_unlearn.cli import main

    from .conftest import MUSE_DIR

    tofu = ["--tofu", str(TOFU_DIR), "--max-items", "2", "--max-new-tokens", "1", "--quiet"]
    ref = tmp_path / "ref"
    assert main(["eval", "tofu", str(tiny_llama_dir), "--out", str(ref), "--mia-attacks", "loss", *tofu]) == 0
    out = tmp_path / "model"
    assert main(["eval", "tofu", str(tiny_llama_dir), "--out", str(out), "--reference", str(ref / "tofu_results.json"),
                 "--mia-attacks", "loss,reference", *tofu]) == 0
    s = json.loads((out / "tofu_results.json").read_text())["summary"]
    assert s["mia_reference_auc"] == 0.5 and s["privleak_reference"] == 0.0 and s["mia_gradnorm_auc"] is None
    assert "| reference | 0.5 | 0 |" in capsys.readouterr().out
    assert main(["eval", "tofu", str(tiny_llama_dir), "--out", str(out), "--mia-attacks", "loss,ratio", *tofu]) == 1
    assert capsys.readouterr().err.strip() == ("hf-unlearn: error: unknown membership-inference attack 'ratio'; choose "
                                               "from loss, zlib, min_k, min_k_plus_plus, gradnorm, reference")
    shots = tmp_path / "shots.json"
    shots.write_text(json.dumps([{"question": "Who wrote Hamlet?", "answer": "Shakespeare"}]))
    muse = tmp_path / "muse"
    assert main(["eval", "muse-news", str(tiny_llama_dir), "--out", str(muse), "--muse", str(MUSE_DIR), "--max-items", "2",
                 "--max-length", "32", "--max-prompt-tokens", "32", "--verbmem-max-new-tokens", "2",
                 "--knowmem-max-new-tokens", "2", "--knowmem-examples", str(shots), "--quiet"]) == 0
    meta = json.loads((muse / "muse_results.json").read_text())["meta"]
    assert meta["knowmem_shots"] == {"forget": 1, "retain": 1} and "gradnorm" in meta["mia_attacks"]
