"""The guards' one walk of the module tree gives what torch's iterators give, and is shared only inside a check."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from hf_unlearn.trace import module_tree


def _gqa_llama(tied: bool = True):
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


class _Shared(nn.Module):
    """A module held twice (two names), a None child, a parameter held by two modules, a None parameter."""

    def __init__(self):
        super().__init__()
        inner = nn.Linear(3, 3)
        self.a = nn.Sequential(inner, nn.ReLU())
        self.b = self.a
        self.c = nn.Linear(3, 3)
        self.c.weight = inner.weight
        self.register_module("empty", None)
        self.register_parameter("nothing", None)
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("temp", torch.zeros(1), persistent=False)


def _as_ids(pairs):
    return [(n, id(x)) for n, x in pairs]


@pytest.mark.parametrize("build", ["llama", "llama_untied", "lora", "shared"])
def test_the_walk_names_what_torch_names_in_its_order(build):
    if build == "shared":
        model = _Shared()
    else:
        model = _gqa_llama(tied=build != "llama_untied")
        if build == "lora":
            model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                                                     task_type="CAUSAL_LM"))
    tree = module_tree.walk(model)
    assert _as_ids(tree.modules) == _as_ids(model.named_modules())
    assert _as_ids(tree.parameters) == _as_ids(model.named_parameters())
    assert _as_ids(tree.buffers) == _as_ids(model.named_buffers())
    every = list(model.named_modules(remove_duplicate=False))
    assert [(n, id(m)) for n, m, _ in tree.every] == _as_ids(every)
    firsts = [(n, id(m)) for n, m, first in tree.every if first]
    assert firsts == _as_ids(model.named_modules())


def test_a_class_that_overrides_named_modules_is_walked_by_torch_with_its_side_effect():
    calls = []

    class Restoring(nn.Linear):
        def named_modules(self, *args, **kwargs):  # as PEFT's parameter wrapper does (restores its weights)
            calls.append(1)
            return super().named_modules(*args, **kwargs)

    model = nn.Sequential(nn.Linear(2, 2), Restoring(2, 2))
    tree = module_tree.walk(model)
    assert calls, "torch's own named_modules (with the override) must run"
    assert _as_ids(tree.parameters) == _as_ids(model.named_parameters())


def test_the_walk_is_shared_inside_a_check_and_taken_again_after_it():
    model = _gqa_llama()
    with module_tree.held(model):
        first = module_tree.walk(model)
        assert module_tree.walk(model) is first
        with module_tree.held(model):  # nested: still the outer one
            assert module_tree.walk(model) is first
    model.model.extra = nn.Linear(2, 2)  # a module added between checks is seen at the next one
    again = module_tree.walk(model)
    assert again is not first
    assert "model.extra" in dict(again.modules)
    other = _gqa_llama()
    with module_tree.held(model):  # another model is never given this one's walk
        assert _as_ids(module_tree.walk(other).parameters) == _as_ids(other.named_parameters())
