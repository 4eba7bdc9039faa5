"""Attacks on a VERIFIED through configurations users train with (grouped-query attention, MoE, LoRA, resumed runs,
callbacks that reconfigure the run).

Each test records a tiny run, deletes the way a user would (``hf_unlearn.forget`` with the oracle), and asserts that
the deletion is EITHER refused before any compute with a one-line message naming the cause, OR VERIFIED and equal,
bit for bit, to an engine-free counterfactual the test builds itself (a plain ``Trainer`` of the same program with the
deleted rows' labels -100 and the recorded loss normalisers).
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from hf_unlearn.errors import UnlearnError

from .test_trace_common import config_model, get_trace_data, record
from .test_trace_fidelity import independent_counterfactual

KW = dict(gradient_accumulation_steps=1, max_steps=6)
AT = 3


def _forget_outcome(run, ids, out):
    from hf_unlearn import forget

    try:
        receipt = forget(run, ids, out, oracle=True, progress=False)
    except UnlearnError as e:
        return "refused", str(e)
    return ("verified" if receipt.evidence["verified"] is True else "not verified"), receipt


def _oracle_off_counterfactual(tok, data, make_model, run, ids, out, callbacks=(), **kw):
    """The names of the oracle's tensors that differ from a plain Trainer's with the deleted rows' labels -100."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    oracle = load_checkpoint(open_run(out / "oracle").final_checkpoint())["model"]
    plain = independent_counterfactual(tok, data, make_model(), run, ids, out / "plain", callbacks=callbacks,
                                       **{**KW, **kw})
    return [n for n, t in oracle.items() if not torch.equal(t, plain[n])]


def _assert_refused_or_equal(tok, data, make_model, run, ids, out, needle, callbacks=(), **kw):
    kind, what = _forget_outcome(run, ids, out)
    print("OUTCOME", kind, what if kind == "refused" else what.evidence.get("verified"))
    if kind == "verified":
        off = _oracle_off_counterfactual(tok, data, make_model, run, ids, out, callbacks, **kw)
        assert not off, f"WRONG VERIFIED: {len(off)} tensors off the counterfactual, e.g. {off[:3]}"
        return "verified"
    assert kind == "refused", (kind, what.evidence)
    assert "\n" not in what and needle in what, what
    assert not out.exists()  # before any compute
    return "refused"


# ---- a MoE model whose load-balancing loss runs over every token of the microbatch ---------------------------------
def _mixtral(tok, warm: bool = True):
    """A tiny Mixtral with grouped-query attention (one key/value head) and its router's load-balancing loss on."""
    import transformers

    from .test_trace_common import tiny_config_kwargs

    torch.manual_seed(0)
    config = transformers.MixtralConfig(**tiny_config_kwargs(tok), num_key_value_heads=1, num_local_experts=4,
                                        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)
    model = transformers.MixtralForCausalLM(config)
    if warm:  # a forward first installs transformers' output-capturing hooks (as a user's sanity check does)
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]))
    return model


def test_a_moe_router_load_balancing_loss_under_a_plain_trainer_is_refused_or_counterfactual(tmp_path):
    """Mixtral's ``output_router_logits=True`` adds ``router_aux_loss_coef`` times a load-balancing loss computed over
    every unmasked token of the microbatch, a deleted row's included (its labels do not matter): the counterfactual
    (labels -100) still routes the deleted row's tokens into that loss, a replay's dummy routes pad tokens. DPO refused
    this already; a plain ``Trainer`` must too (or be equal)."""
    tok, data = get_trace_data()
    data = data.select(range(24))
    try:
        record(tok, data, tmp_path / "rec", model=_mixtral(tok), every=2, **KW)
    except UnlearnError as e:  # refused when the recording is built: the right outcome
        print("OUTCOME refused at construction:", e)
        assert "\n" not in str(e) and "router_aux_loss_coef" in str(e), e
        return
    from hf_unlearn.trace import open_run

    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([AT])[:1]
    _assert_refused_or_equal(tok, data, lambda: _mixtral(tok), run, ids, tmp_path / "del", "router")
