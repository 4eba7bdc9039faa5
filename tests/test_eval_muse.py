"""evaluate_muse_news on a tiny Llama and a few MUSE-News items."""

import pytest

from hf_unlearn.errors import UnlearnError
from hf_unlearn.eval.muse import MuseResult, evaluate_muse_news

from .conftest import MUSE_DIR

FAST = dict(muse_path=MUSE_DIR, max_items=3, max_length=48, max_prompt_tokens=48, verbmem_max_new_tokens=6,
            knowmem_max_new_tokens=4, progress=False)


@pytest.fixture(scope="module")
def model_and_tok():
    from hf_unlearn.models import build_tiny_model, load_tokenizer

    from .conftest import TOKENIZERS

    tok = load_tokenizer(TOKENIZERS / "gpt2")
    return build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2), tok


def test_muse_news_metrics_self_reference_and_round_trip(model_and_tok, tmp_path):
    res = evaluate_muse_news(*model_and_tok, **FAST)
    s = res.summary
    for key in ("verbmem_rouge_l_f1", "knowmem_forget_rouge_l_f1", "knowmem_retain_rouge_l_f1", "mia_min_k_auc"):
        assert s[key] is not None and 0 <= s[key] <= 1
    assert s["privleak"] is None
    assert res.meta["items"] == {"verbmem": 3, "knowmem_forget": 3, "knowmem_retain2": 3, "privleak_forget": 3,
                                 "privleak_holdout": 3}
    assert sum(r["set"] == "verbmem" for r in res.per_item) == 3
    path = res.to_json(tmp_path / "muse.json")
    again = evaluate_muse_news(*model_and_tok, reference=str(path), **FAST)
    assert again.summary["privleak"] == pytest.approx(0.0)
    assert MuseResult.from_json(path).summary["mia_min_k_auc"] == pytest.approx(s["mia_min_k_auc"])


def test_muse_reference_with_other_settings_is_refused(model_and_tok):
    res = MuseResult({"mia_min_k_auc": 0.5}, [], {"tokenizer_fingerprint": "x", "max_length": 48, "mia_k": 0.4})
    with pytest.raises(UnlearnError, match="another tokenizer"):
        evaluate_muse_news(*model_and_tok, reference=res, **FAST)


def test_a_tofu_result_is_not_a_muse_reference(tmp_path):
    from hf_unlearn.eval.tofu import TofuResult

    path = TofuResult({}, [], {}).to_json(tmp_path / "t.json")
    with pytest.raises(UnlearnError, match="'tofu' result"):
        MuseResult.from_json(path)
