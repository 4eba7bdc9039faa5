"""Quantised re-evaluation: does forgotten knowledge come back after 4-bit (or 8-bit) weight quantisation?

Zhang et al. (2024, "Does your LLM truly unlearn? An embarrassingly simple approach to recover unlearned knowledge")
found that quantising an unlearned model can restore much of what unlearning removed, because unlearning often moves
weights by less than a quantisation step. We quantise every ``nn.Linear`` except the output head with
**bitsandbytes** (NF4/FP4 4-bit via ``Linear4bit``, LLM.int8 8-bit via ``Linear8bitLt``), the backend behind
``BitsAndBytesConfig(load_in_4bit=True)``, and re-run the same evaluation.

Why bitsandbytes: since 0.46 it ships a CPU backend (torch ops, no CUDA, no compiler), so the same NF4 quantisation
users deploy on GPUs runs on CPU and in CI; it quantises an in-memory model (an unlearned model need not be saved
first, and GGUF-loaded models cannot be re-loaded with a quantisation config). optimum-quanto 0.2.7 also runs here
(qint4 weights), but its first forward JIT-compiles a C++ extension with ninja (over 4 minutes on the shared 2-core
development machine) and needs a compiler; torchao was not tried.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from typing import Any

from ..errors import UnlearnError
from .result import EvalResult, fmt

QUANT_TYPES = {4: ("nf4", "fp4"), 8: ("int8",)}


def _bnb():
    try:
        import bitsandbytes as bnb  # noqa: F401
    except ImportError:
        raise UnlearnError("quantised evaluation needs bitsandbytes>=0.46 (CPU backend): pip install bitsandbytes") from None
    return bnb


def quantize_model(model, bits: int = 4, *, quant_type: str | None = None, skip_modules=("lm_head",),
                   block_size: int = 64):
    """A copy of ``model`` with its linear layers' weights quantised by bitsandbytes (the original is untouched).

    Args:
        bits: 4 (``quant_type`` ``nf4`` default, or ``fp4``) or 8 (LLM.int8 weights).
        skip_modules: module names (last component) left in full precision; the output head by default, as
            transformers' bitsandbytes integration does. 4-bit layers whose input size is not a multiple of
            ``block_size`` also stay in full precision (counted in ``qmodel.hf_unlearn_quantization``).
    """
    import torch

    if bits not in QUANT_TYPES:
        raise UnlearnError(f"bits must be 4 or 8, got {bits}")
    quant_type = quant_type or QUANT_TYPES[bits][0]
    if quant_type not in QUANT_TYPES[bits]:
        raise UnlearnError(f"quant_type {quant_type!r} is not a {bits}-bit type; choose one of {QUANT_TYPES[bits]}")
    bnb = _bnb()
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    qmodel = copy.deepcopy(model)
    replaced, skipped = 0, []
    from transformers.pytorch_utils import Conv1D

    for _, module in list(qmodel.named_modules()):
        for child_name, child in list(module.named_children()):
            if child_name in skip_modules or type(child) not in (torch.nn.Linear, Conv1D):
                continue
            # GPT-2's Conv1D is a linear layer with its weight stored transposed ([in, out])
            w = child.weight.data.t() if isinstance(child, Conv1D) else child.weight.data
            out_features, in_features = w.shape
            if bits == 4 and in_features % block_size:
                skipped.append(child_name)  # bitsandbytes' 4-bit CPU kernels need whole blocks per row
                continue
            bias = child.bias is not None
            if bits == 4:
                q = bnb.nn.Linear4bit(in_features, out_features, bias=bias, compute_dtype=dtype,
                                      quant_type=quant_type, device="meta")
                q.weight = bnb.nn.Params4bit(w.to("cpu").clone(), requires_grad=False, quant_type=quant_type,
                                             blocksize=block_size)
            else:
                q = bnb.nn.Linear8bitLt(in_features, out_features, bias=bias, has_fp16_weights=False,
                                        device="meta")
                q.weight = bnb.nn.Int8Params(w.to("cpu").clone(), requires_grad=False, has_fp16_weights=False)
            if bias:
                q.bias = torch.nn.Parameter(child.bias.data.clone(), requires_grad=False)
            q = q.to(device)  # bitsandbytes quantises on the move to a device
            setattr(module, child_name, q)
            replaced += 1
    if replaced == 0:
        why = f" (input sizes not multiples of block_size={block_size})" if skipped else ""
        raise UnlearnError(f"{type(model).__name__} has no linear layers bitsandbytes can quantise{why}")
    qmodel.hf_unlearn_quantization = {"bits": bits, "quant_type": quant_type, "quantized_layers": replaced,
                                      "skipped_layers": len(skipped)}
    qmodel.eval()
    return qmodel


@contextlib.contextmanager
def quiet_int8():
    """Silence bitsandbytes' per-call "inputs will be cast" notice of its int8 matmul (a warning or a log record,
    depending on the version)."""
    import logging

    log = logging.getLogger("bitsandbytes.autograd._functions")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*inputs will be cast from.*")
            yield
    finally:
        log.setLevel(level)


class QuantizedComparison(EvalResult):
    """``summary``: ``{metric: {"before", "after", "delta"}}`` for every numeric metric of the two results."""

    kind = "quantized"

    @classmethod
    def from_results(cls, before: EvalResult, after: EvalResult, meta: dict[str, Any]) -> QuantizedComparison:
        summary = {}
        for key, b in before.summary.items():
            a = after.summary.get(key)
            if isinstance(b, (int, float)) and isinstance(a, (int, float)):
                summary[key] = {"before": b, "after": a, "delta": a - b}
            else:
                summary[key] = {"before": b, "after": a, "delta": None}
        per_item = [{"stage": "before", **r} for r in before.per_item] + [{"stage": "after", **r} for r in after.per_item]
        return cls(summary=summary, per_item=per_item, meta={**meta, "before": before.meta, "after": after.meta})

    def to_markdown(self) -> str:
        m = self.meta
        lines = [f"## Quantised re-evaluation ({m.get('benchmark')}, {m.get('bits')}-bit {m.get('quant_type')}, "
                 f"bitsandbytes)", "", "| metric | before | after | delta |", "|---|---|---|---|"]
        for key, v in self.summary.items():
            lines.append(f"| {key} | {fmt(v['before'])} | {fmt(v['after'])} | {fmt(v['delta'])} |")
        return "\n".join(lines) + "\n"


def evaluate_quantized(model, tokenizer, *, bits: int = 4, quant_type: str | None = None, benchmark: str = "tofu",
                       before: EvalResult | None = None, **eval_kwargs) -> QuantizedComparison:
    """Run the same evaluation on ``model`` and on its bitsandbytes-quantised copy; return both side by side.

    Args:
        benchmark: ``tofu`` (:func:`evaluate_tofu`) or ``muse_news`` (:func:`evaluate_muse_news`).
        before: a result already computed for ``model`` with the same ``eval_kwargs`` (skips that run).
        eval_kwargs: passed to the evaluation function unchanged, for both runs, except that the quantised run skips
            the gradient-norm attack: bitsandbytes registers no backward for its 4-bit matrix-vector kernel, so
            gradients through it are not reliable (``mia_gradnorm_auc`` is None in the ``after`` column).
    """
    if benchmark == "tofu":
        from .tofu import evaluate_tofu as evaluate
    elif benchmark == "muse_news":
        from .muse import evaluate_muse_news as evaluate
    else:
        raise UnlearnError(f"unknown benchmark {benchmark!r}; choose tofu or muse_news")
    qmodel = quantize_model(model, bits, quant_type=quant_type)
    if before is None:
        before = evaluate(model, tokenizer, **eval_kwargs)
    with quiet_int8():
        from .metrics import check_mia_attacks

        attacks = [a for a in check_mia_attacks(eval_kwargs.get("mia_attacks")) if a != "gradnorm"]
        after = evaluate(qmodel, tokenizer, **{**eval_kwargs, "mia_attacks": attacks})
    meta = {"benchmark": benchmark, **qmodel.hf_unlearn_quantization, "backend": f"bitsandbytes {_bnb().__version__}"}
    return QuantizedComparison.from_results(before, after, meta)
