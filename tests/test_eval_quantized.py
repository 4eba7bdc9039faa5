"""Quantised re-evaluation with bitsandbytes' CPU backend."""

import pytest
import torch

pytest.importorskip("bitsandbytes")

from hf_unlearn.errors import UnlearnError  # noqa: E402
from hf_unlearn.eval.quantized import evaluate_quantized, quantize_model  # noqa: E402

from .conftest import TOFU_DIR  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_quantize_model_replaces_linears_and_stays_close(gpt2_tokenizer, family):
    import bitsandbytes as bnb

    from hf_unlearn.models import build_tiny_model

    model = build_tiny_model(family, gpt2_tokenizer, hidden_size=64, num_layers=2, num_heads=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    q = quantize_model(model, bits=4)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in q.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the original is untouched
    x = torch.tensor([[1, 2, 3, 4, 5]])
    ref, out = model(x).logits, q(x).logits
    err = (out - ref).abs().max().item()
    assert 0 < err < 0.5 * ref.abs().max().item()  # really quantised (changed), still the same function roughly


def test_quantize_rejects_bad_bits_and_unquantisable_models(tiny_llama):
    with pytest.raises(UnlearnError, match="4 or 8"):
        quantize_model(tiny_llama, bits=3)
    with pytest.raises(UnlearnError, match="not a 4-bit type"):
        quantize_model(tiny_llama, bits=4, quant_type="int8")
    from hf_unlearn.models import build_tiny_model

    odd = build_tiny_model("llama", vocab_size=100, hidden_size=16, intermediate_size=48, num_heads=2)
    with pytest.raises(UnlearnError, match="block_size=64"):
        quantize_model(odd, bits=4)  # input sizes 16 and 48: no layer has whole 64-value blocks


@pytest.mark.slow  # the default suite's time budget (`make test-slow` runs it)
def test_evaluate_quantized_reports_before_and_after(gpt2_tokenizer):
    from hf_unlearn.models import build_tiny_model

    model = build_tiny_model("llama", gpt2_tokenizer, hidden_size=64, num_layers=1, num_heads=2)
    cmp = evaluate_quantized(model, gpt2_tokenizer, bits=4, tofu_path=TOFU_DIR, max_items=2,
                             max_new_tokens=3, progress=False)
    row = cmp.summary["forget_probability"]
    assert row["before"] != row["after"] and row["delta"] == pytest.approx(row["after"] - row["before"])
    assert cmp.meta["bits"] == 4 and cmp.meta["quant_type"] == "nf4" and "bitsandbytes" in cmp.meta["backend"]
    assert cmp.meta["quantized_layers"] == 7 and cmp.meta["skipped_layers"] == 0  # q, k, v, o, gate, up, down
    assert "| forget_probability |" in cmp.to_markdown()
