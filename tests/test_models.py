import pytest
import torch

from hf_unlearn.errors import UnlearnError
from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer, load_model, load_tokenizer

from .conftest import SMOLLM2_DIR


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "gpt2"])
def test_tiny_models_run_and_are_seeded(family, gpt2_tokenizer):
    a = build_tiny_model(family, gpt2_tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=3)
    b = build_tiny_model(family, gpt2_tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=3)
    ids = torch.tensor([gpt2_tokenizer("hello world")["input_ids"]])
    out = a(input_ids=ids, labels=ids)
    assert out.logits.shape[-1] == len(gpt2_tokenizer) and torch.isfinite(out.loss)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_tiny_llama_has_grouped_query_attention_as_real_ones_do(gpt2_tokenizer):
    """The default tiny Llama (the tests', the demo's) has fewer key/value heads than query heads, as SmolLM2, Llama 3
    and Qwen2 do; multi-head attention is asked for by name; a head count that cannot be grouped is one line."""
    assert build_tiny_model("llama", gpt2_tokenizer, num_heads=4).config.num_key_value_heads == 2
    assert build_tiny_model("llama", gpt2_tokenizer, hidden_size=32, num_heads=2).config.num_key_value_heads == 1
    assert build_tiny_model("llama", gpt2_tokenizer, num_heads=4, num_key_value_heads=4).config.num_key_value_heads == 4
    with pytest.raises(UnlearnError, match="num_key_value_heads=3 must divide num_heads=4"):
        build_tiny_model("llama", gpt2_tokenizer, num_heads=4, num_key_value_heads=3)
    with pytest.raises(UnlearnError, match="gpt2 has no grouped-query attention"):
        build_tiny_model("gpt2", gpt2_tokenizer, num_heads=4, num_key_value_heads=2)


def test_tiny_model_save_and_load_round_trip(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path)
    again = load_model(tmp_path)
    assert all(torch.equal(x, y) for x, y in zip(tiny_llama.state_dict().values(), again.state_dict().values()))


def test_a_model_folder_without_tokenizer_files_is_refused_for_its_tokenizer(tmp_path, tiny_llama):
    """transformers builds an empty tokenizer of the config's class from a model folder saved without its tokenizer
    (every text: no token); `forget ADAPTER --method ...` on an adapter whose base folder held none then failed deep
    inside generation (IndexError). It is one line naming the folder."""
    from hf_unlearn.models import load_tokenizer

    tiny_llama.save_pretrained(tmp_path)
    with pytest.raises(UnlearnError, match="holds no tokenizer files"):
        load_tokenizer(tmp_path)


def test_unknown_family():
    with pytest.raises(UnlearnError, match="unknown model family"):
        build_tiny_model("mamba", vocab_size=10)


def test_tiny_tokenizer_is_deterministic():
    texts = ["Jaime Vasquez was born in Santiago.", "The author writes true crime."] * 20
    a, b = build_tiny_tokenizer(texts, 300), build_tiny_tokenizer(texts, 300)
    assert a("Jaime writes")["input_ids"] == b("Jaime writes")["input_ids"]
    assert a.pad_token_id is not None and a.eos_token_id is not None


def test_missing_model_path_is_one_line_error(tmp_path):
    with pytest.raises(UnlearnError, match="does not exist: no such local folder"):  # named before any Hub retry
        load_model(tmp_path / "nope")


def test_gguf_that_is_not_a_causal_lm(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(UnlearnError, match="broken.gguf"):
        load_model(bad)


@pytest.mark.slow
def test_smollm2_gguf_loads_into_a_saveable_model(tmp_path):
    tok = load_tokenizer(SMOLLM2_DIR)
    model = load_model(SMOLLM2_DIR)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not hasattr(model.config, "quantization_config")
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 135e6
    model.save_pretrained(tmp_path)
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**ids).logits).all()
