"""EAP-IG attribution graphs and per-sample circuits of transformers causal LMs, built with PyTorch hooks.

The graph follows Hanna et al. (2024, "Have Faith in Faithfulness"): upstream nodes are the input embedding, every
attention head and every MLP; downstream targets are each head's query, key and value inputs (three separate
targets), each MLP's input and the logits. Every component reads the residual stream, which is the sum of the outputs
of the components before it, so the edge ``u -> v`` is ``u``'s output as ``v`` reads it. Its score is

    score(u -> v) = (z_u(clean) - z_u(baseline)) . (1/m) sum_k dM/dx_v at alpha_k = k/m,  k = 1..m

with ``M`` the sample's answer-token loss (mean NLL), ``x_v`` the residual as read by ``v`` alone (one head's query,
key or value projection, one MLP, the final norm) and the gradients taken while the input embeddings move from the
baseline to the clean ones (EAP-IG over inputs). ``score ~ M(clean) - M(clean with only that edge patched to its
baseline value)``: positive edges raise the answer loss, negative edges carry the answer.

Two baselines: ``"corrupted"`` (the paper's setting: activations from a corrupted input, here the sample's question
tokens shuffled with a seed; rows tokenised without their ``question`` column shuffle every non-special prompt token;
or your own ``corrupted_input_ids`` column) and ``"zero"`` (every upstream activation
patched to zero; the path scales the input embeddings from 0, which is exactly the all-zero state for models without
biases in their projections, such as Llama, and approximately so for GPT-2-style models with biases).

Why hooks rather than TransformerLens: TransformerLens converts weights from its own list of Hub names, which does not
cover every local or GGUF-loaded checkpoint and needs a second copy of the weights; hooks read the Hugging Face model
as it is. Grouped-query attention: the key and value targets are the key/value heads (``a3.kv1<k>``), which several
query heads share.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any, Sequence

from ..errors import UnlearnError
from ..utils import weights_follow_umask

# model_type -> the module layout it shares
SUPPORTED_FAMILIES: dict[str, str] = {
    "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "gemma": "llama",
    "gpt2": "gpt2", "gpt_neox": "gpt_neox",
}
FORMAT = "hf_unlearn.circuits.v1"
BASELINES = ("corrupted", "zero")
SELECTIONS = ("greedy", "top")
SIMILARITIES = ("cosine", "jaccard", "hamming")


# ----------------------------------------------------------------------------------------------------------------
# configuration


@dataclass
class CircuitConfig:
    """How EAP-IG scores edges and how a circuit is cut from the scores."""

    ig_steps: int = field(default=5, metadata={"help": "Integrated-gradient steps m (1 = plain EAP at the clean input)."})
    baseline: str = field(default="corrupted", metadata={
        "help": "'corrupted' (activations of the sample with its question tokens shuffled; the paper's setting) or "
                "'zero' (zero-activation patching).", "choices": list(BASELINES)})
    top_edges: int = field(default=75, metadata={"help": "Edges per circuit (75 in the CUD paper)."})
    selection: str = field(default="greedy", metadata={
        "help": "'greedy' (grow from the logits, always adding the highest-|score| edge into a node already in the "
                "circuit, as the paper does) or 'top' (the n highest-|score| edges anywhere).",
        "choices": list(SELECTIONS)})
    batch_size: int = field(default=4, metadata={"help": "Samples per batch."})
    max_length: int = field(default=256, metadata={"help": "Tokens per QA pair when raw rows are tokenised."})
    seed: int = field(default=0, metadata={"help": "Seed of the question-token shuffle (corrupted baseline)."})
    use_chat_template: bool | None = field(default=None, metadata={
        "help": "Prompt format of raw rows: None = the tokenizer's chat template when it has one (as training)."})
    id_column: str = field(default="id", metadata={"help": "Column holding each row's stable sample id."})

    def __post_init__(self):
        if self.ig_steps < 1:
            raise UnlearnError(f"ig_steps must be >= 1, got {self.ig_steps}")
        if self.baseline not in BASELINES:
            raise UnlearnError(f"baseline must be one of {', '.join(BASELINES)}, got {self.baseline!r}")
        if self.selection not in SELECTIONS:
            raise UnlearnError(f"selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if self.top_edges < 1:
            raise UnlearnError(f"top_edges must be >= 1, got {self.top_edges}")
        if self.batch_size < 1:
            raise UnlearnError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def passes_per_sample(self) -> int:
        """Forward(/backward) passes per sample: m interpolation steps + the clean run (+ the corrupted run)."""
        return self.ig_steps + (2 if self.baseline == "corrupted" else 1)


# ----------------------------------------------------------------------------------------------------------------
# the graph


@dataclass(frozen=True)
class GraphSpec:
    """The EAP graph of a model: nodes, targets and the edge order every score vector uses.

    Upstream nodes, in forward order: ``input``, then per layer ``a{l}.h{h}`` (heads) and ``m{l}`` (MLP). Targets per
    layer: ``a{l}.h{h}<q>``, ``a{l}.kv{g}<k>``, ``a{l}.kv{g}<v>``, ``m{l}``; then ``logits``. Edges are laid out per
    layer (attention targets, each over its upstream nodes; then the MLP) and finally the logits.
    """

    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    parallel: bool = False  # attention and MLP read the same residual (GPT-NeoX's parallel residual)

    # sizes ------------------------------------------------------------------------------------------------------
    @property
    def n_upstream(self) -> int:
        return 1 + self.n_layers * (self.n_heads + 1)

    @property
    def attn_targets(self) -> int:
        return self.n_heads + 2 * self.n_kv_heads

    def head_index(self, layer: int, head: int) -> int:
        return 1 + layer * (self.n_heads + 1) + head

    def mlp_index(self, layer: int) -> int:
        return 1 + layer * (self.n_heads + 1) + self.n_heads

    def upstream_of_attention(self, layer: int) -> int:
        """Upstream nodes whose outputs reach layer ``layer``'s attention input: the first U of the node order."""
        return 1 + layer * (self.n_heads + 1)

    def upstream_of_mlp(self, layer: int) -> int:
        return self.upstream_of_attention(layer) + (0 if self.parallel else self.n_heads)

    @cached_property
    def _layout(self) -> dict[str, Any]:
        import numpy as np

        parents, children, offsets = [], [], []
        t_attn = self.attn_targets
        pos = 0
        for layer in range(self.n_layers):
            u = self.upstream_of_attention(layer)
            offsets.append(pos)
            for t in range(t_attn):
                parents.append(np.arange(u))
                children.append(np.full(u, layer * (t_attn + 1) + t))
            pos += u * t_attn
            um = self.upstream_of_mlp(layer)
            offsets.append(pos)
            parents.append(np.arange(um))
            children.append(np.full(um, layer * (t_attn + 1) + t_attn))
            pos += um
        offsets.append(pos)
        parents.append(np.arange(self.n_upstream))
        children.append(np.full(self.n_upstream, self.n_layers * (t_attn + 1)))
        parent = np.concatenate(parents).astype(np.int64)
        child = np.concatenate(children).astype(np.int64)
        return {"parent": parent, "target": child, "offsets": offsets}

    @property
    def num_edges(self) -> int:
        return int(self._layout["parent"].size)

    @property
    def edge_parent(self):
        """Upstream node index of every edge (numpy int64 [E])."""
        return self._layout["parent"]

    @property
    def edge_target(self):
        """Target index of every edge (numpy int64 [E]); targets are numbered per layer as in the class docstring."""
        return self._layout["target"]

    @property
    def n_targets(self) -> int:
        return self.n_layers * (self.attn_targets + 1) + 1

    # names ------------------------------------------------------------------------------------------------------
    def node_name(self, index: int) -> str:
        if index == 0:
            return "input"
        layer, rest = divmod(index - 1, self.n_heads + 1)
        return f"m{layer}" if rest == self.n_heads else f"a{layer}.h{rest}"

    def target_name(self, index: int) -> str:
        if index == self.n_layers * (self.attn_targets + 1):
            return "logits"
        layer, t = divmod(index, self.attn_targets + 1)
        if t == self.attn_targets:
            return f"m{layer}"
        if t < self.n_heads:
            return f"a{layer}.h{t}<q>"
        t -= self.n_heads
        kind, g = ("k", t) if t < self.n_kv_heads else ("v", t - self.n_kv_heads)
        return f"a{layer}.kv{g}<{kind}>"

    def edge_name(self, index: int) -> str:
        return f"{self.node_name(int(self.edge_parent[index]))}->{self.target_name(int(self.edge_target[index]))}"

    def edge_names(self) -> list[str]:
        return [self.edge_name(i) for i in range(self.num_edges)]

    def edge_index(self, name: str) -> int:
        """The position of an edge given by name (``"a0.h1->m1"``)."""
        lookup = self.__dict__.get("_name_lookup")
        if lookup is None:
            lookup = {n: i for i, n in enumerate(self.edge_names())}
            object.__setattr__(self, "_name_lookup", lookup)
        try:
            return lookup[name]
        except KeyError:
            raise UnlearnError(f"no edge named {name!r} in this graph") from None

    # structure used by circuits and statistics ----------------------------------------------------------------
    def target_node(self, target: int) -> int:
        """The node a target belongs to: a query head, the first query head of a key/value group, an MLP; logits = -1."""
        if target == self.n_layers * (self.attn_targets + 1):
            return -1
        layer, t = divmod(target, self.attn_targets + 1)
        if t == self.attn_targets:
            return self.mlp_index(layer)
        if t < self.n_heads:
            return self.head_index(layer, t)
        g = (t - self.n_heads) % self.n_kv_heads
        return self.head_index(layer, g * (self.n_heads // self.n_kv_heads))

    def node_targets(self, node: int) -> list[int]:
        """Targets read by ``node``: its query, its group's key and value (shared under GQA), or its MLP input."""
        if node <= 0:
            return []
        layer, rest = divmod(node - 1, self.n_heads + 1)
        base = layer * (self.attn_targets + 1)
        if rest == self.n_heads:
            return [base + self.attn_targets]
        g = rest // (self.n_heads // self.n_kv_heads)
        return [base + rest, base + self.n_heads + g, base + self.n_heads + self.n_kv_heads + g]

    def target_edges(self, target: int) -> range:
        """The (contiguous) edge positions into ``target``."""
        offsets = self._layout["offsets"]
        if target == self.n_layers * (self.attn_targets + 1):
            return range(offsets[-1], self.num_edges)
        layer, t = divmod(target, self.attn_targets + 1)
        if t == self.attn_targets:
            start = offsets[2 * layer + 1]
            return range(start, start + self.upstream_of_mlp(layer))
        u = self.upstream_of_attention(layer)
        start = offsets[2 * layer] + t * u
        return range(start, start + u)

    def node_layer(self, node: int) -> int:
        """Layer of a node; the input is -1 and the logits (node -1) are ``n_layers``."""
        if node == -1:
            return self.n_layers
        return -1 if node == 0 else (node - 1) // (self.n_heads + 1)

    def node_depth(self, node: int) -> float:
        """Position in [0, 1]: input 0, layer l's components (l+1)/(L+1), logits 1."""
        return (self.node_layer(node) + 1) / (self.n_layers + 1)

    def is_mlp(self, node: int) -> bool:
        return node > 0 and (node - 1) % (self.n_heads + 1) == self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": self.model_type, "n_layers": self.n_layers, "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads, "parallel": self.parallel, "num_edges": self.num_edges}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GraphSpec:
        spec = cls(data["model_type"], int(data["n_layers"]), int(data["n_heads"]), int(data["n_kv_heads"]),
                   bool(data.get("parallel", False)))
        if "num_edges" in data and int(data["num_edges"]) != spec.num_edges:
            raise UnlearnError(f"graph description says {data['num_edges']} edges but its sizes give {spec.num_edges}")
        return spec


# ----------------------------------------------------------------------------------------------------------------
# model layouts (where the hooks go)


@dataclass
class _Proj:
    """A projection module whose output columns ``index [T, head_dim]`` feed T targets."""

    module: Any
    weight: Any  # [out, in] orientation
    bias: Any
    index: Any  # LongTensor [T, head_dim]


@dataclass
class _Layer:
    attn_norm: Any
    mlp_norm: Any
    mlp: Any
    out_proj: Any
    out_weight: Any  # [d, H * head_dim]
    qkv: list[_Proj]


class _Arch:
    """Module accessors of a supported family; raises a clear error for anything else."""

    def __init__(self, model):
        import torch

        self.model = _unwrap(model)
        config = self.model.config
        model_type = getattr(config, "model_type", type(self.model).__name__)
        family = SUPPORTED_FAMILIES.get(model_type)
        if family is None:
            raise UnlearnError(
                f"EAP-IG graphs support the {', '.join(sorted(SUPPORTED_FAMILIES))} model families; "
                f"{type(self.model).__name__} has model_type {model_type!r}"
            )
        base = self.model.base_model
        layers: list[_Layer] = []
        if family == "llama":
            heads = config.num_attention_heads
            kv = getattr(config, "num_key_value_heads", None) or heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
            for block in base.layers:
                if any(hasattr(block, n) for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")):
                    raise UnlearnError(f"{model_type} layers with sandwich norms (Gemma 2/3) are not supported: "
                                       "a head's output passes through a norm before it joins the residual stream")
                attn = block.self_attn
                qkv = []
                for proj, n in ((attn.q_proj, heads), (attn.k_proj, kv), (attn.v_proj, kv)):
                    qkv.append(_Proj(proj, proj.weight, proj.bias,
                                     torch.arange(n * head_dim).view(n, head_dim)))
                layers.append(_Layer(block.input_layernorm, block.post_attention_layernorm, block.mlp,
                                     attn.o_proj, attn.o_proj.weight, qkv))
            self.final_norm = base.norm
            parallel = False
        elif family == "gpt2":
            heads = kv = config.n_head
            head_dim = config.n_embd // heads
            d = config.n_embd
            for block in base.h:
                c_attn = block.attn.c_attn  # Conv1D: y = x @ W + b, W [in, out]; columns [q | k | v], head-major
                index = torch.arange(3 * d).view(3 * heads, head_dim)
                qkv = [_Proj(c_attn, c_attn.weight.T, c_attn.bias, index)]
                layers.append(_Layer(block.ln_1, block.ln_2, block.mlp, block.attn.c_proj,
                                     block.attn.c_proj.weight.T, qkv))
            self.final_norm = base.ln_f
            parallel = False
        else:  # gpt_neox: fused query_key_value, columns [head][q|k|v][head_dim]
            heads = kv = config.num_attention_heads
            head_dim = config.hidden_size // heads
            for block in base.layers:
                fused = block.attention.query_key_value
                index = torch.arange(3 * config.hidden_size).view(heads, 3, head_dim).transpose(0, 1).reshape(
                    3 * heads, head_dim)
                qkv = [_Proj(fused, fused.weight, fused.bias, index)]
                layers.append(_Layer(block.input_layernorm, block.post_attention_layernorm, block.mlp,
                                     block.attention.dense, block.attention.dense.weight, qkv))
            self.final_norm = base.final_layer_norm
            parallel = bool(getattr(config, "use_parallel_residual", True))
        if heads % kv:
            raise UnlearnError(f"{heads} attention heads do not split into {kv} key/value groups")
        self.layers = layers
        self.blocks = list(base.layers if family != "gpt2" else base.h)
        self.head_dim = head_dim
        self.graph = GraphSpec(model_type, len(layers), heads, kv, parallel)

    # derived weights, per layer (detached, float32) ------------------------------------------------------------
    def qkv_weights(self, layer: int):
        """[T, head_dim, d]: the rows of the q/k/v projections that feed each attention target."""
        import torch

        parts = [p.weight.detach().float()[p.index.reshape(-1)].view(p.index.shape[0], p.index.shape[1], -1)
                 for p in self.layers[layer].qkv]
        return torch.cat(parts)

    def out_weights(self, layer: int):
        """[H, head_dim, d]: each head's slice of the output projection (head output = o_in_h @ W_h)."""
        w = self.layers[layer].out_weight.detach().float()  # [d, H * head_dim]
        return w.view(w.shape[0], self.graph.n_heads, self.head_dim).permute(1, 2, 0)


def _unwrap(model):
    """A PeftModel becomes a merged copy (its effective weights); anything else is used as is."""
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return model
    if isinstance(model, PeftModel):
        import copy

        return copy.deepcopy(model).merge_and_unload()
    return model


def build_graph(model) -> GraphSpec:
    """The EAP graph of ``model``; an unsupported architecture raises an error naming the supported families."""
    return _Arch(model).graph


# ----------------------------------------------------------------------------------------------------------------
# rows: tokenisation, answer tokens, corrupted inputs


def _question_positions(tokenizer, question: str, prompt_ids: list[int], chat: bool) -> list[int]:
    """Token positions of the question inside the prompt (offsets of a fast tokenizer); [] when the prompt cannot be
    rebuilt token for token (then every non-special prompt token is shuffle-able)."""
    from ..data.tokenize import format_prompt

    prompt = format_prompt(tokenizer, question, chat)
    start = prompt.rfind(question)
    if start < 0 or not getattr(tokenizer, "is_fast", False):
        return []
    enc = tokenizer(prompt, add_special_tokens=not chat, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(prompt_ids):
        return []
    end = start + len(question)
    return [i for i, (a, b) in enumerate(enc["offset_mapping"]) if b > a and b > start and a < end]  # overlaps


def _prepare_rows(dataset, tokenizer, config: CircuitConfig) -> list[dict[str, Any]]:
    """Token ids, labels and shuffle-able positions of every row; refuses rows without answer tokens up front."""
    from ..data.tokenize import IGNORE_INDEX, encode_qa, has_chat_template

    if dataset is None or len(dataset) == 0:
        raise UnlearnError("no samples to score: the dataset is empty")
    columns = dataset.column_names
    idc = config.id_column
    if idc not in columns:
        raise UnlearnError(f"the dataset has no id column {idc!r} (columns: {columns}); add stable ids or set id_column=")
    raw = "input_ids" not in columns
    if raw and not {"question", "answer"} <= set(columns):
        raise UnlearnError(f"rows must be tokenised (input_ids/labels) or raw QA (question/answer); got {columns}")
    if not raw and "labels" not in columns:
        raise UnlearnError("tokenised rows need labels (-100 on the prompt); tokenise them with hf_unlearn.tokenize_qa")
    chat = has_chat_template(tokenizer) if config.use_chat_template is None else config.use_chat_template
    rows, seen = [], set()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    for row in dataset:
        sid = row[idc]
        if sid in seen:
            raise UnlearnError(f"sample id {sid!r} appears twice; circuits are keyed by id")
        seen.add(sid)
        if raw:
            try:
                enc = encode_qa(tokenizer, row["question"], row["answer"], config.max_length, chat)
            except UnlearnError as e:
                raise UnlearnError(f"sample id {sid!r} has no answer tokens: {e}") from None
            ids, labels = enc["input_ids"], enc["labels"]
        else:
            ids, labels = list(row["input_ids"]), list(row["labels"])
        n_prompt = 0
        while n_prompt < len(labels) and labels[n_prompt] == IGNORE_INDEX:
            n_prompt += 1
        # the question's own tokens (raw rows, or tokenised rows that kept a "question" column)
        positions = _question_positions(tokenizer, row["question"], ids[:n_prompt], chat) if "question" in row else []
        if not any(t != IGNORE_INDEX for t in labels[1:]):
            raise UnlearnError(f"sample id {sid!r} has no answer tokens (labels are all -100 after the first "
                               "position); drop it or raise max_length")
        if not positions:
            positions = [i for i in range(n_prompt) if ids[i] not in special]
        out = {"id": sid, "input_ids": list(ids), "labels": list(labels), "positions": positions}
        if "corrupted_input_ids" in columns and row["corrupted_input_ids"] is not None:
            corrupted = list(row["corrupted_input_ids"])
            if len(corrupted) != len(ids):
                raise UnlearnError(f"sample id {sid!r}: corrupted_input_ids has {len(corrupted)} tokens, the sample "
                                   f"{len(ids)}; the corrupted input must align position by position")
            out["corrupted"] = corrupted
        rows.append(out)
    return rows


def _seed_for(seed: int, sample_id) -> int:
    digest = hashlib.sha256(f"{seed}|{type(sample_id).__name__}|{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def corrupt_input(input_ids: Sequence[int], positions: Sequence[int], seed: int, sample_id) -> list[int]:
    """The sample with the tokens at ``positions`` (its question) shuffled; the same result for the same id and seed."""
    import torch

    ids = list(input_ids)
    gen = torch.Generator().manual_seed(_seed_for(seed, sample_id))
    tokens = [ids[p] for p in positions]
    for _ in range(20):
        perm = torch.randperm(len(tokens), generator=gen).tolist()
        if any(tokens[a] != tokens[b] for a, b in zip(perm, range(len(tokens)))):
            for p, k in zip(positions, perm):
                ids[p] = tokens[k]
            return ids
    raise UnlearnError(f"sample id {sample_id!r}: shuffling its {len(tokens)} question token(s) cannot change the "
                       "input; use baseline='zero' or pass corrupted_input_ids")


# ----------------------------------------------------------------------------------------------------------------
# hooks


class _Hooks(contextlib.ExitStack):
    """Registers forward (pre-)hooks and removes them on exit."""

    def pre(self, module, fn):
        self.callback(module.register_forward_pre_hook(fn, with_kwargs=True).remove)

    def post(self, module, fn):
        self.callback(module.register_forward_hook(fn).remove)


def _first_arg(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _replace_first(args, kwargs, value):
    if args:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": value}


def _answer_loss(logits, labels):
    """Per-sample mean answer-token NLL [B] (the EAP-IG metric)."""
    from ..losses import sequence_logprob

    return -sequence_logprob(logits, labels, average=True)


@contextlib.contextmanager
def _eval_frozen(model):
    """Eval mode, no parameter gradients (only the activation path is differentiated), restored afterwards."""
    was_training = model.training
    flags = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        model.train(was_training)


def _capture_run(arch: _Arch, input_ids, mask, labels):
    """One no-grad forward: the input node's output, each layer's o_proj input and MLP output, and the loss."""
    import torch

    cap: dict[str, Any] = {"o_in": [None] * len(arch.layers), "mlp": [None] * len(arch.layers)}
    with _Hooks() as hooks, torch.no_grad():
        def take_input(module, args, kwargs):
            cap["input"] = _first_arg(args, kwargs).detach()

        hooks.pre(arch.blocks[0], take_input)
        for layer, parts in enumerate(arch.layers):
            def take_o(module, args, kwargs, layer=layer):
                cap["o_in"][layer] = _first_arg(args, kwargs).detach()

            def take_mlp(module, args, output, layer=layer):
                cap["mlp"][layer] = (output[0] if isinstance(output, tuple) else output).detach()

            hooks.pre(parts.out_proj, take_o)
            hooks.post(parts.mlp, take_mlp)
        logits = arch.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
        cap["loss"] = _answer_loss(logits, labels)
    return cap


def _node_outputs(arch: _Arch, cap: dict[str, Any]):
    """Every upstream node's output [n_up, B, S, d] (float32) from a captured run."""
    import torch

    graph = arch.graph
    outs = [cap["input"].float()]
    for layer in range(graph.n_layers):
        o_in = cap["o_in"][layer].float()
        b, s, _ = o_in.shape
        heads = torch.einsum("bshk,hkd->hbsd", o_in.view(b, s, graph.n_heads, arch.head_dim), arch.out_weights(layer))
        outs.extend(heads.unbind(0))
        outs.append(cap["mlp"][layer].float())
    return torch.stack(outs)


def _ig_step(arch: _Arch, input_ids, mask, labels, start, delta, alpha):
    """One interpolation step: forward with the input node at ``start + alpha * delta``, backward of the summed loss.

    Returns per layer the attention-norm input and the gradients at the q/k/v projection outputs and at the MLP
    input (read through the MLP's norm only), and the gradient at the final norm's input.
    """
    import torch

    n = len(arch.layers)
    got: dict[str, Any] = {"x": [None] * n, "qkv": [[None] * len(p.qkv) for p in arch.layers],
                           "mlp": [None] * n}
    leaf = (start + alpha * delta).detach().requires_grad_(True)

    def grad_into(slot, key):
        def store(grad):
            slot[key] = grad.detach()
        return store

    with _Hooks() as hooks, torch.enable_grad():
        hooks.pre(arch.blocks[0], lambda m, a, k: _replace_first(a, k, leaf.to(_first_arg(a, k).dtype)))
        for layer, parts in enumerate(arch.layers):
            def take_x(module, args, kwargs, layer=layer):
                got["x"][layer] = _first_arg(args, kwargs).detach()

            hooks.pre(parts.attn_norm, take_x)
            for j, proj in enumerate(parts.qkv):
                def take_qkv(module, args, output, layer=layer, j=j):
                    output.register_hook(grad_into(got["qkv"][layer], j))

                hooks.post(proj.module, take_qkv)

            def split_mlp(module, args, kwargs, layer=layer):
                view = _first_arg(args, kwargs).view_as(_first_arg(args, kwargs))
                view.register_hook(grad_into(got["mlp"], layer))
                return _replace_first(args, kwargs, view)

            hooks.pre(parts.mlp_norm, split_mlp)

        def split_final(module, args, kwargs):
            view = _first_arg(args, kwargs).view_as(_first_arg(args, kwargs))
            view.register_hook(grad_into(got, "final"))
            return _replace_first(args, kwargs, view)

        hooks.pre(arch.final_norm, split_final)
        logits = arch.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
        loss = _answer_loss(logits, labels)
        torch.autograd.grad(loss.sum(), leaf)
    return got


def _attention_input_grads(arch: _Arch, layer: int, got, qkv_weight):
    """dM/dx for each attention target of ``layer`` [T, B, S, d]: back through its projection rows and the norm."""
    import torch

    parts = arch.layers[layer]
    deltas = []
    for j, proj in enumerate(parts.qkv):
        g = got["qkv"][layer][j]
        if g is None:  # the projection did not reach the loss (cannot happen in a causal LM; keep shapes right)
            g = torch.zeros(*got["x"][layer].shape[:2], proj.weight.shape[0], dtype=torch.float32)
        picked = g.float()[..., proj.index.reshape(-1).to(g.device)]
        deltas.append(picked.view(*g.shape[:2], proj.index.shape[0], proj.index.shape[1]))
    delta = torch.cat(deltas, dim=2)  # [B, S, T, head_dim]
    cot = torch.einsum("bstk,tkd->tbsd", delta, qkv_weight)
    x = got["x"][layer]
    norm = parts.attn_norm
    _, vjp = torch.func.vjp(lambda h: norm(h), x)
    (grads,) = torch.func.vmap(vjp)(cot.to(x.dtype))
    return grads.float()


def _batch_tensors(rows, pad_id, device, corrupted: bool):
    import torch

    length = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    bad = torch.full((len(rows), length), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
        mask[i, :n] = 1
        if corrupted:
            bad[i, :n] = torch.tensor(r["corrupted"])
    return ids.to(device), bad.to(device), labels.to(device), mask.to(device)


def _attribute_batch(arch: _Arch, rows, config: CircuitConfig, pad_id: int, weights):
    """Edge scores [B, E] and the clean and baseline losses of one batch (m + 2 passes, m + 1 for 'zero')."""
    import torch

    graph = arch.graph
    device = next(arch.model.parameters()).device
    corrupted = config.baseline == "corrupted"
    ids, bad, labels, mask = _batch_tensors(rows, pad_id, device, corrupted)
    clean = _capture_run(arch, ids, mask, labels)
    z_clean = _node_outputs(arch, clean)
    if corrupted:
        base = _capture_run(arch, bad, mask, labels)
        dz = z_clean - _node_outputs(arch, base)
        start = base["input"]
        base_loss = base["loss"]
    else:
        dz = z_clean
        start = torch.zeros_like(clean["input"])
        base_loss = torch.full_like(clean["loss"], float("nan"))
    del z_clean
    keep = mask.unsqueeze(-1).float()
    b, s, d = clean["input"].shape
    # [B, n_up, S*d], contiguous once: every block below is one batched matmul against a slice of it
    dzb = (dz * keep).permute(1, 0, 2, 3).reshape(b, graph.n_upstream, s * d).contiguous()
    del dz
    delta_in = clean["input"] - start
    # the score is linear in the gradient, so the m steps' gradients are summed first and met with the activation
    # differences once: one batched matmul per block instead of m
    g_attn = [None] * graph.n_layers
    g_mlp = [None] * graph.n_layers
    g_final = None
    for k in range(1, config.ig_steps + 1):
        got = _ig_step(arch, ids, mask, labels, start, delta_in, k / config.ig_steps)
        for layer in range(graph.n_layers):
            g = _attention_input_grads(arch, layer, got, weights[layer]).permute(1, 2, 3, 0).reshape(b, s * d, -1)
            gm = got["mlp"][layer].float().reshape(b, s * d, 1)
            g_attn[layer] = g if g_attn[layer] is None else g_attn[layer].add_(g)
            g_mlp[layer] = gm if g_mlp[layer] is None else g_mlp[layer].add_(gm)
        gf = got["final"].float().reshape(b, s * d, 1)
        g_final = gf if g_final is None else g_final.add_(gf)
        del got
    scores = torch.zeros(b, graph.num_edges, dtype=torch.float32, device=device)
    offsets = graph._layout["offsets"]
    for layer in range(graph.n_layers):
        u, um = graph.upstream_of_attention(layer), graph.upstream_of_mlp(layer)
        block = torch.bmm(dzb[:, :u], g_attn[layer]).transpose(1, 2).reshape(b, -1)  # target-major, as the layout
        scores[:, offsets[2 * layer]:offsets[2 * layer] + block.shape[1]] = block
        scores[:, offsets[2 * layer + 1]:offsets[2 * layer + 1] + um] = torch.bmm(dzb[:, :um], g_mlp[layer])[..., 0]
        g_attn[layer] = g_mlp[layer] = None
    scores[:, offsets[-1]:] = torch.bmm(dzb, g_final)[..., 0]
    scores /= config.ig_steps
    return scores.cpu(), clean["loss"].float().cpu(), base_loss.float().cpu()


def model_fingerprint(model) -> str:
    """The params root of the library's state hash (the same hash trace verification and Hub cards use)."""
    from ..trace.hashing import state_hashes

    return state_hashes(_unwrap(model)).params_root


# ----------------------------------------------------------------------------------------------------------------
# circuits


@dataclass(frozen=True)
class Circuit:
    """A set of edges of a graph with their EAP-IG scores, ordered as selected (highest |score| first for 'top')."""

    edges: Any  # numpy int64 [n]
    scores: Any  # numpy float32 [n]
    num_edges: int  # size of the graph's edge list

    def binary(self):
        """The circuit as a 0/1 vector over all edges of the graph."""
        import numpy as np

        v = np.zeros(self.num_edges, dtype=np.float32)
        v[self.edges] = 1.0
        return v

    def weighted(self):
        """|score| on the circuit's edges, 0 elsewhere."""
        import numpy as np

        v = np.zeros(self.num_edges, dtype=np.float32)
        v[self.edges] = np.abs(self.scores)
        return v

    def edge_names(self, graph: GraphSpec) -> list[str]:
        return [graph.edge_name(int(e)) for e in self.edges]


def extract_circuit(scores, graph: GraphSpec, top_edges: int = 75, selection: str = "greedy") -> Circuit:
    """The ``top_edges`` edges of a score vector [E].

    ``greedy`` (the paper): start from the logits; repeatedly add the highest-|score| edge whose target belongs to a
    node already in the circuit (the logits, or the upstream end of an edge already taken), so the circuit is a
    connected graph into the logits. ``top``: the highest-|score| edges anywhere. Ties go to the lower edge index.
    """
    import numpy as np

    scores = np.asarray(scores, dtype=np.float32).reshape(-1)
    if scores.size != graph.num_edges:
        raise UnlearnError(f"a score vector has {scores.size} entries but the graph has {graph.num_edges} edges")
    if selection not in SELECTIONS:
        raise UnlearnError(f"selection must be one of {', '.join(SELECTIONS)}, got {selection!r}")
    mag = np.abs(scores)
    n = min(int(top_edges), graph.num_edges)
    if selection == "top":
        chosen = np.lexsort((np.arange(mag.size), -mag))[:n]
    else:
        heap: list[tuple[float, int]] = []
        opened: set[int] = set()

        def open_target(t: int) -> None:
            if t not in opened:
                opened.add(t)
                r = graph.target_edges(t)
                for e in range(r.start, r.stop):
                    heap.append((-float(mag[e]), e))

        open_target(graph.n_targets - 1)
        heapq.heapify(heap)
        in_circuit: set[int] = set()
        taken: list[int] = []
        while heap and len(taken) < n:
            _, e = heapq.heappop(heap)
            taken.append(e)
            node = int(graph.edge_parent[e])
            if node not in in_circuit:
                in_circuit.add(node)
                for t in graph.node_targets(node):
                    if t not in opened:
                        opened.add(t)
                        r = graph.target_edges(t)
                        for e2 in range(r.start, r.stop):
                            heapq.heappush(heap, (-float(mag[e2]), e2))
        chosen = np.asarray(taken, dtype=np.int64)
    chosen = np.asarray(chosen, dtype=np.int64)
    return Circuit(edges=chosen, scores=scores[chosen], num_edges=graph.num_edges)


def circuit_similarity(a: Circuit, b: Circuit, metric: str = "cosine", weighted: bool = False) -> float:
    """Similarity of two circuits of the same graph, in [0, 1].

    ``cosine``: of the binary vectors (``weighted=True``: of the |score| vectors); ``jaccard``: |A & B| / |A | B|;
    ``hamming``: 1 - (edges in exactly one circuit) / (edges in the graph).
    """
    import numpy as np

    if metric not in SIMILARITIES:
        raise UnlearnError(f"similarity must be one of {', '.join(SIMILARITIES)}, got {metric!r}")
    if a.num_edges != b.num_edges:
        raise UnlearnError(f"circuits of different graphs ({a.num_edges} vs {b.num_edges} edges) cannot be compared")
    if metric == "cosine":
        va, vb = (a.weighted(), b.weighted()) if weighted else (a.binary(), b.binary())
        den = float(np.linalg.norm(va) * np.linalg.norm(vb))
        return float(va @ vb) / den if den > 0 else 0.0
    sa, sb = set(a.edges.tolist()), set(b.edges.tolist())
    if metric == "jaccard":
        union = len(sa | sb)
        return len(sa & sb) / union if union else 1.0
    return 1.0 - len(sa ^ sb) / a.num_edges


def circuit_statistics(circuit: Circuit, graph: GraphSpec) -> dict[str, float]:
    """Where a circuit computes: depth, path length, MLP vs attention, early vs late layers.

    ``mean_edge_depth``: mean over edges of the average depth of its two ends (input 0, layer l (l+1)/(L+1), logits
    1); ``mean_edge_span``: mean depth difference (how many layers an edge skips, as a fraction); ``longest_path``:
    edges on the longest chain of circuit edges ending at the logits; ``mlp_share``/``attention_share``: of the
    component nodes (heads and MLPs) the circuit touches; ``early_share``/``late_share``: of those nodes, the share in
    the first / second half of the layers; ``n_nodes``: component nodes touched.
    """
    import numpy as np

    edges = circuit.edges.tolist()
    if not edges:
        return {k: float("nan") for k in ("mean_edge_depth", "mean_edge_span", "longest_path", "mlp_share",
                                          "attention_share", "early_share", "late_share", "n_nodes")}
    parents = [int(graph.edge_parent[e]) for e in edges]
    children = [graph.target_node(int(graph.edge_target[e])) for e in edges]
    dp = np.array([graph.node_depth(p) for p in parents])
    dc = np.array([graph.node_depth(c) for c in children])
    nodes = {n for n in parents + children if n > 0}
    mlp = sum(graph.is_mlp(n) for n in nodes)
    early = sum(graph.node_layer(n) < graph.n_layers / 2 for n in nodes)
    # longest chain: parents always precede children in the node order (logits = after every node)
    order = sorted(zip(parents, children), key=lambda pc: graph.n_upstream if pc[1] == -1 else pc[1])
    depth: dict[int, int] = {}
    for p, c in order:
        depth[c] = max(depth.get(c, 0), depth.get(p, 0) + 1)
    n = len(nodes)
    return {
        "mean_edge_depth": float(((dp + dc) / 2).mean()),
        "mean_edge_span": float((dc - dp).mean()),
        "longest_path": float(depth.get(-1, 0)),
        "mlp_share": mlp / n if n else float("nan"),
        "attention_share": (n - mlp) / n if n else float("nan"),
        "early_share": early / n if n else float("nan"),
        "late_share": (n - early) / n if n else float("nan"),
        "n_nodes": float(n),
    }


# ----------------------------------------------------------------------------------------------------------------
# the result of scoring a set of samples


@dataclass
class CircuitSet:
    """EAP-IG edge scores of a set of samples and their circuits, with what is needed to trust a comparison later.

    ``scores`` is a float32 tensor [N, E] in the graph's edge order; ``ids`` are the samples' ids (ints or strings,
    kept apart); the model and tokenizer fingerprints say which model the scores describe.
    """

    graph: GraphSpec
    ids: list
    scores: Any
    clean_loss: list[float]
    baseline_loss: list[float]
    config: CircuitConfig
    model_fingerprint: str
    tokenizer_fingerprint: str
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if tuple(self.scores.shape) != (len(self.ids), self.graph.num_edges):
            raise UnlearnError(f"scores have shape {tuple(self.scores.shape)}, expected ({len(self.ids)}, "
                               f"{self.graph.num_edges}) for {len(self.ids)} samples of this graph")
        self._pos = {i: k for k, i in enumerate(self.ids)}
        if len(self._pos) != len(self.ids):
            raise UnlearnError("a circuit set holds the same sample id twice")

    def __len__(self) -> int:
        return len(self.ids)

    def index(self, sample_id) -> int:
        try:
            return self._pos[sample_id]
        except KeyError:
            raise UnlearnError(f"sample id {sample_id!r} is not in this circuit set") from None

    def circuit(self, sample_id, top_edges: int | None = None, selection: str | None = None) -> Circuit:
        return extract_circuit(self.scores[self.index(sample_id)].numpy(), self.graph,
                               top_edges or self.config.top_edges, selection or self.config.selection)

    @cached_property
    def circuits(self) -> list[Circuit]:
        """Each sample's circuit with the configured size and selection, in ``ids`` order."""
        return [self.circuit(i) for i in self.ids]

    def statistics(self) -> list[dict[str, float]]:
        return [circuit_statistics(c, self.graph) for c in self.circuits]

    # persistence ---------------------------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "graph": self.graph.to_dict(), "config": asdict(self.config), "ids": list(self.ids),
            "clean_loss": [float(x) for x in self.clean_loss], "baseline_loss": [_num(x) for x in self.baseline_loss],
            "model_fingerprint": self.model_fingerprint, "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "seconds": self.seconds, "passes_per_sample": self.config.passes_per_sample, "extra": self.extra,
        }

    def save(self, out: str | Path) -> Path:
        """Write ``circuits.json`` (meta), ``scores.safetensors`` and ``circuits.jsonl`` (one readable line a sample).

        The folder is written whole or not at all (a temporary folder renamed into place).
        """
        from safetensors.torch import save_file

        meta = self.meta()
        with atomic_folder(out, marker="circuits.json") as tmp:
            save_file({"scores": self.scores.contiguous()}, str(tmp / "scores.safetensors"))
            weights_follow_umask(tmp / "scores.safetensors")
            meta["scores_sha256"] = _sha256_file(tmp / "scores.safetensors")
            lines = []
            for sid, circuit, stats, loss in zip(self.ids, self.circuits, self.statistics(), self.clean_loss):
                lines.append(json.dumps({"id": sid, "answer_loss": float(loss), "stats": stats,
                                         "edges": circuit.edge_names(self.graph),
                                         "scores": [float(s) for s in circuit.scores]}))
            (tmp / "circuits.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
            (tmp / "circuits.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        return Path(out)

    @classmethod
    def load(cls, path: str | Path) -> CircuitSet:
        """Read a folder written by :meth:`save`; refuses a foreign, incomplete or altered one."""
        from safetensors.torch import load_file

        folder = Path(path)
        meta_file, scores_file = folder / "circuits.json", folder / "scores.safetensors"
        if not meta_file.is_file() or not scores_file.is_file():
            raise UnlearnError(f"{folder} is not a circuit folder (needs circuits.json and scores.safetensors; "
                               "write one with `hf-unlearn analyze circuit`)")
        meta = read_json(meta_file)
        if meta.get("format") != FORMAT:
            raise UnlearnError(f"{meta_file} has format {meta.get('format')!r}, expected {FORMAT!r}")
        if meta.get("scores_sha256") != _sha256_file(scores_file):
            raise UnlearnError(f"{scores_file} does not match the hash recorded in circuits.json (altered or from "
                               "another run)")
        known = {f.name for f in fields(CircuitConfig)}
        config = CircuitConfig(**{k: v for k, v in meta["config"].items() if k in known})
        return cls(graph=GraphSpec.from_dict(meta["graph"]), ids=list(meta["ids"]),
                   scores=load_file(str(scores_file))["scores"], clean_loss=list(meta["clean_loss"]),
                   baseline_loss=[float("nan") if x is None else x for x in meta["baseline_loss"]], config=config,
                   model_fingerprint=meta["model_fingerprint"], tokenizer_fingerprint=meta["tokenizer_fingerprint"],
                   seconds=float(meta.get("seconds", 0.0)), extra=dict(meta.get("extra", {})))


def read_json(file: Path):
    """A JSON file this module or :mod:`.cud` wrote; unreadable JSON is a one-line :class:`UnlearnError`."""
    try:
        return json.loads(Path(file).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UnlearnError(f"{file} is not valid JSON ({e.msg})") from None


@contextlib.contextmanager
def atomic_folder(out: str | Path, marker: str):
    """Build a folder in a temporary sibling, then move it into place: readers see the old folder or the whole new
    one, and a failure leaves nothing behind. An existing folder is replaced only if it is empty or one of ours (it
    holds ``marker``), so ``--out .`` cannot sweep away unrelated files."""
    import os
    import shutil
    import tempfile

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UnlearnError(f"{out} exists and is not a folder; choose another output path")
    if out.is_dir() and any(out.iterdir()) and not (out / marker).exists():
        raise UnlearnError(f"{out} exists, is not empty and was not written by hf_unlearn (no {marker}); choose "
                           "another output folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        yield tmp
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
            os.replace(out, old / "previous")
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _num(x: float):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def _sha256_file(path: Path) -> str:
    from ..trace.run import file_sha256

    return file_sha256(path)


# ----------------------------------------------------------------------------------------------------------------
# public entry points


def _prepared(model, tokenizer, dataset, config: CircuitConfig):
    from ..eval.runner import pad_token_id

    arch = _Arch(model)  # architecture first: an unknown model fails before tokenisation
    rows = _prepare_rows(dataset, tokenizer, config)
    if config.baseline == "corrupted":
        for r in rows:
            if "corrupted" not in r:
                r["corrupted"] = corrupt_input(r["input_ids"], r["positions"], config.seed, r["id"])
    return arch, rows, pad_token_id(tokenizer)


def compute_circuits(model, tokenizer, dataset, config: CircuitConfig | None = None, *,
                     progress: bool = True) -> CircuitSet:
    """EAP-IG edge scores and circuits of every sample of ``dataset`` (raw QA rows or ``tokenize_qa`` output).

    Batched (``config.batch_size``) with a progress bar; per batch ``config.passes_per_sample`` passes (m
    interpolation steps with a backward each, the clean run and, for the corrupted baseline, the corrupted run).
    """
    import torch
    from tqdm.auto import tqdm

    from ..eval.runner import tokenizer_fingerprint

    config = config or CircuitConfig()
    arch, rows, pad_id = _prepared(model, tokenizer, dataset, config)
    fingerprint = model_fingerprint(arch.model)
    weights = [arch.qkv_weights(layer) for layer in range(arch.graph.n_layers)]
    all_scores, clean, base = [], [], []
    start = time.perf_counter()
    with _eval_frozen(arch.model), tqdm(total=len(rows), desc="EAP-IG", disable=not progress) as bar:
        for i in range(0, len(rows), config.batch_size):
            chunk = rows[i:i + config.batch_size]
            scores, lc, lb = _attribute_batch(arch, chunk, config, pad_id, weights)
            all_scores.append(scores)
            clean.extend(lc.tolist())
            base.extend(lb.tolist())
            bar.update(len(chunk))
    seconds = time.perf_counter() - start
    return CircuitSet(graph=arch.graph, ids=[r["id"] for r in rows], scores=torch.cat(all_scores),
                      clean_loss=clean, baseline_loss=base, config=config, model_fingerprint=fingerprint,
                      tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), seconds=seconds,
                      extra={"seconds_per_sample": seconds / len(rows), "tokens": sum(len(r["input_ids"]) for r in rows)})


def edge_patching_effects(model, tokenizer, dataset, edges: Sequence[int] | Sequence[str],
                          config: CircuitConfig | None = None, *, batch_size: int = 16, progress: bool = False):
    """The effect of actually patching each edge, one at a time: ``M(clean) - M(edge patched to its baseline)``.

    Returns a float32 tensor [N, K] (samples x edges), the quantity EAP-IG approximates. An edge is patched by
    feeding its target ``x_v - z_u(clean) + z_u(baseline)`` (one head's q, k or v projection recomputed from that
    input, or the MLP's or the final norm's input) while everything else runs clean. One forward per edge (batched).
    """
    import torch
    from tqdm.auto import tqdm

    config = config or CircuitConfig()
    arch, rows, pad_id = _prepared(model, tokenizer, dataset, config)
    graph = arch.graph
    edge_ids = [graph.edge_index(e) if isinstance(e, str) else int(e) for e in edges]
    for e in edge_ids:
        if not 0 <= e < graph.num_edges:
            raise UnlearnError(f"edge {e} is outside this graph's {graph.num_edges} edges")
    out = torch.zeros(len(rows), len(edge_ids), dtype=torch.float32)
    device = next(arch.model.parameters()).device
    with _eval_frozen(arch.model):
        for r, row in enumerate(tqdm(rows, desc="patching", disable=not progress)):
            ids, bad, labels, mask = _batch_tensors([row], pad_id, device, config.baseline == "corrupted")
            clean = _capture_run(arch, ids, mask, labels)
            dz = _node_outputs(arch, clean)
            if config.baseline == "corrupted":
                dz = dz - _node_outputs(arch, _capture_run(arch, bad, mask, labels))
            m_clean = float(clean["loss"][0])
            for k in range(0, len(edge_ids), batch_size):
                chunk = edge_ids[k:k + batch_size]
                losses = _patched_losses(arch, ids, mask, labels, dz[:, 0], chunk)
                out[r, k:k + len(chunk)] = m_clean - losses
    return out


def _patched_losses(arch: _Arch, ids, mask, labels, dz, edge_ids):
    """Answer losses of one sample with one edge patched per batch row."""
    import torch

    graph = arch.graph
    n = len(edge_ids)
    ids, mask, labels = ids.expand(n, -1), mask.expand(n, -1), labels.expand(n, -1)
    by_place: dict[tuple, list[tuple[int, int, int]]] = {}
    t_attn = graph.attn_targets
    for row, e in enumerate(edge_ids):
        u, t = int(graph.edge_parent[e]), int(graph.edge_target[e])
        if t == graph.n_targets - 1:
            by_place.setdefault(("final",), []).append((row, u, -1))
        else:
            layer, tt = divmod(t, t_attn + 1)
            by_place.setdefault(("mlp", layer) if tt == t_attn else ("attn", layer), []).append((row, u, tt))
    x_in: dict[int, Any] = {}
    with _Hooks() as hooks, torch.no_grad():
        def shift(entries):
            def hook(module, args, kwargs):
                x = _first_arg(args, kwargs).clone()
                for row, u, _ in entries:
                    x[row] -= dz[u].to(x.dtype)
                return _replace_first(args, kwargs, x)
            return hook

        for place, entries in by_place.items():
            if place[0] == "final":
                hooks.pre(arch.final_norm, shift(entries))
            elif place[0] == "mlp":
                hooks.pre(arch.layers[place[1]].mlp_norm, shift(entries))
            else:
                layer = place[1]
                parts = arch.layers[layer]

                def take_x(module, args, kwargs, layer=layer):
                    x_in[layer] = _first_arg(args, kwargs)

                hooks.pre(parts.attn_norm, take_x)
                # which projection module and columns each attention target lives in
                owners = []
                for j, proj in enumerate(parts.qkv):
                    owners.extend((j, r) for r in range(proj.index.shape[0]))
                for j, proj in enumerate(parts.qkv):
                    mine = [(row, u, owners[tt][1]) for row, u, tt in entries if owners[tt][0] == j]
                    if not mine:
                        continue

                    def patch(module, args, output, proj=proj, mine=mine, layer=layer, parts=parts):
                        output = output.clone()
                        for row, u, local in mine:
                            cols = proj.index[local].to(output.device)
                            h = parts.attn_norm.forward(x_in[layer][row] - dz[u].to(output.dtype))  # no hooks
                            new = h @ proj.weight[cols].T
                            if proj.bias is not None:
                                new = new + proj.bias[cols]
                            output[row, :, cols] = new
                        return output

                    hooks.post(proj.module, patch)
        logits = arch.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return _answer_loss(logits, labels).float().cpu()
