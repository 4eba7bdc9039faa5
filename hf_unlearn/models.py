"""Model and tokenizer loading: Hub ids, local folders, GGUF files, and tiny test models.

GGUF checkpoints load de-quantised into an ordinary, saveable ``PreTrainedModel`` (transformers refuses to
``save_pretrained`` a GGUF-loaded model, so we rebuild the same class from a clean config).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import UnlearnError

TINY_FAMILIES = ("llama", "gpt_neox", "gpt2")
GGUF_MARK = "_hf_unlearn_gguf_source"  # set on a model by load_model(...gguf): a GGUFOrigin


def _split_gguf(name_or_path: str | os.PathLike, gguf_file: str | None) -> tuple[str, str | None]:
    """Accept ``dir + gguf_file``, a path to a ``.gguf`` file, or a dir holding one ``.gguf`` and no config."""
    p = Path(name_or_path)
    if gguf_file is not None:
        return str(name_or_path), gguf_file
    if p.suffix == ".gguf":
        if not p.is_file():
            raise UnlearnError(f"GGUF file {p} does not exist")
        return str(p.parent), p.name
    if p.is_dir() and not (p / "config.json").exists():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(p), ggufs[0].name
        if len(ggufs) > 1:
            raise UnlearnError(f"{p} holds several GGUF files ({', '.join(g.name for g in ggufs)}); pass gguf_file=")
    return str(name_or_path), None


def _check_source(name_or_path, gguf_file: str | None, what: str, kwargs: dict) -> None:
    """Fail in one line before transformers retries the Hub for a path that does not exist (see ``validation``)."""
    from .validation import check_model_source

    if gguf_file is not None:
        if not (Path(name_or_path) / gguf_file).is_file():
            raise UnlearnError(f"GGUF file {Path(name_or_path) / gguf_file} does not exist")
        return
    for key, value in check_model_source(name_or_path, what).load_kwargs().items():
        kwargs.setdefault(key, value)


def load_tokenizer(name_or_path: str | os.PathLike, gguf_file: str | None = None, **kwargs):
    """Load a tokenizer; if it has no pad token, use its EOS token for padding (as trl does)."""
    from transformers import AutoTokenizer

    _check_source(name_or_path, gguf_file, "tokenizer", kwargs)
    name, gguf = _split_gguf(name_or_path, gguf_file)
    from .validation import TOKENIZER_FILES, adapter_base

    if gguf is None and _is_adapter_folder(name) and not any((Path(name) / f).is_file() for f in TOKENIZER_FILES):
        return load_tokenizer(adapter_base(name), **kwargs)  # an adapter saved without its tokenizer: the base's
    if gguf is None and Path(name).is_dir() and not any((Path(name) / f).is_file() for f in (
            *TOKENIZER_FILES, "vocab.txt", "merges.txt", "spiece.model", "sentencepiece.bpe.model")):
        # transformers builds an empty tokenizer of the config's class from such a folder: every text encodes to
        # no token at all (generation then failed deep inside with an IndexError)
        raise UnlearnError(f"{str(name_or_path)!r} holds no tokenizer files (a model saved without its tokenizer): "
                           "save the tokenizer there (tokenizer.save_pretrained) or pass the tokenizer's folder")
    try:
        tok = AutoTokenizer.from_pretrained(name, gguf_file=gguf, **kwargs) if gguf else AutoTokenizer.from_pretrained(
            name, **kwargs
        )
    except OSError as e:
        raise UnlearnError(f"cannot load a tokenizer from {str(name_or_path)!r}: {str(e).splitlines()[0]}") from None
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(name_or_path: str | os.PathLike, gguf_file: str | None = None, dtype=None, **kwargs):
    """Load a causal LM by Hub id, local folder, or GGUF file into a plain, saveable ``PreTrainedModel``.

    Args:
        gguf_file: the GGUF file name inside ``name_or_path`` (also inferred from a ``.gguf`` path).
        dtype: torch dtype; defaults to float32 (GGUF weights are de-quantised to it).
    """
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    _check_source(name_or_path, gguf_file, "model", kwargs)
    name, gguf = _split_gguf(name_or_path, gguf_file)
    try:
        if gguf:
            model = _plain_copy(AutoModelForCausalLM.from_pretrained(name, gguf_file=gguf, dtype=dtype, **kwargs))
            mark_gguf(model, Path(name) / gguf, dtype)  # a LoRA recording references these tensors in the file
            return model
        if _is_adapter_folder(name):
            return _merged_adapter(name, dtype, kwargs)
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
    except (ValueError, KeyError) as e:
        what = f"GGUF file {gguf}" if gguf else repr(str(name_or_path))
        raise UnlearnError(f"{what} is not a causal language model transformers can load: {str(e).splitlines()[0]}") from None
    except OSError as e:
        raise UnlearnError(f"cannot load a model from {str(name_or_path)!r}: {str(e).splitlines()[0]}") from None


class GGUFOrigin:
    """Attached to a model :func:`hf_unlearn.load_model` de-quantised from a GGUF file: the file, the dtype, and the
    parameters as loading produced them (the tensor objects and their in-place versions). ``copy.deepcopy`` of the
    model carries it over to the copy's parameters (dropping any changed in place before the copy)."""

    def __init__(self, path: str, dtype: str, params: dict):
        self.path, self.dtype, self.params = path, dtype, params  # name -> (tensor, _version)

    def unchanged(self, key: str, tensor) -> bool:
        held = self.params.get(key)
        return held is not None and held[0] is tensor and tensor._version == held[1]

    def __deepcopy__(self, memo):
        import copy

        params = {}
        for key, (t, version) in self.params.items():
            if t._version != version:
                continue
            twin = copy.deepcopy(t, memo)  # the copied model's own parameter (memo: one copy per tensor)
            params[key] = (twin, twin._version)
        return GGUFOrigin(self.path, self.dtype, params)


def mark_gguf(model, path: str | os.PathLike, dtype) -> None:
    """Remember that ``model`` was de-quantised from the GGUF file ``path`` (and its parameters as loaded)."""
    setattr(model, GGUF_MARK, GGUFOrigin(str(Path(path).resolve()), str(dtype).replace("torch.", ""),
                                         {n: (p, p._version) for n, p in model.named_parameters(remove_duplicate=False)}))


def _is_adapter_folder(name: str) -> bool:
    path = Path(name).expanduser()
    return (path / "adapter_config.json").is_file() and not (path / "config.json").is_file()


def _merged_adapter(name: str, dtype, kwargs: dict):
    """A PEFT adapter folder: its base model with the adapter merged in, as a plain model.

    (``AutoModelForCausalLM`` would attach the adapter frozen, in inference mode, so training it fails with
    "element 0 of tensors does not require grad".)
    """
    import warnings

    from peft import AutoPeftModelForCausalLM

    with warnings.catch_warnings():  # peft asks the base model a deprecated transformers attribute
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        model = AutoPeftModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs).merge_and_unload()
    model.requires_grad_(True)  # peft froze the base weights; a loaded model is trainable, as from_pretrained's are
    return model


def _plain_copy(model):
    """Rebuild a GGUF-loaded model as the same class without ``quantization_config`` (so it can be saved)."""
    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    plain.to(next(model.parameters()).dtype)
    plain.generation_config = model.generation_config
    plain.eval()
    return plain


def build_tiny_model(
    family: str = "llama",
    tokenizer=None,
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_key_value_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    dropout: float = 0.0,
    seed: int = 0,
):
    """A small randomly initialised causal LM of the Llama, GPT-NeoX or GPT-2 family, sized to a tokenizer.

    Used by the tests and the demo: real architectures, seconds per training step on a CPU. A Llama has grouped-query
    attention as every real one does (``num_key_value_heads``: by default half of ``num_heads``, one when that is odd;
    pass ``num_heads`` for multi-head attention); GPT-NeoX and GPT-2 have none.
    """
    import torch
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
    )

    if family not in TINY_FAMILIES:
        raise UnlearnError(f"unknown model family {family!r}; choose one of {', '.join(TINY_FAMILIES)}")
    if vocab_size is None:
        if tokenizer is None:
            raise UnlearnError("build_tiny_model needs a tokenizer or vocab_size")
        vocab_size = len(tokenizer)
    special = {}
    if tokenizer is not None:
        special = {
            "bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        }
    inter = intermediate_size or 4 * hidden_size
    if family != "llama" and num_key_value_heads not in (None, num_heads):
        raise UnlearnError(f"{family} has no grouped-query attention: leave num_key_value_heads unset")
    if num_key_value_heads is None:
        num_key_value_heads = num_heads // 2 if num_heads % 2 == 0 else 1
    if num_key_value_heads < 1 or num_heads % num_key_value_heads:
        raise UnlearnError(f"num_key_value_heads={num_key_value_heads} must divide num_heads={num_heads}")
    if family == "llama":
        config = LlamaConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=inter, num_hidden_layers=num_layers,
            num_attention_heads=num_heads, num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
            attention_dropout=dropout, tie_word_embeddings=True, **special,
        )
        cls = LlamaForCausalLM
    elif family == "gpt_neox":
        config = GPTNeoXConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=inter, num_hidden_layers=num_layers,
            num_attention_heads=num_heads, max_position_embeddings=max_position_embeddings,
            attention_dropout=dropout, hidden_dropout=dropout, tie_word_embeddings=False, **special,
        )
        cls = GPTNeoXForCausalLM
    else:
        config = GPT2Config(
            vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=num_heads, n_inner=inter,
            n_positions=max_position_embeddings, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **special,
        )
        cls = GPT2LMHeadModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model


def build_tiny_tokenizer(texts, vocab_size: int = 2048):
    """A byte-level BPE tokenizer trained on ``texts`` in about a second, for the offline demo.

    Deterministic for the same texts and size. It has ``<|bos|>``, ``<|eos|>`` and ``<|pad|>`` and no chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
