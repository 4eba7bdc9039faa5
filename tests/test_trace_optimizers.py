"""The optimizers users pick with ``TrainingArguments(optim=...)`` record and delete exactly.

bitsandbytes' optimizers (``adamw_bnb_8bit``, ``paged_adamw_32bit``: QLoRA's, ``lion_32bit``) keep part of their state
in a nested dict (``__bnb_optimizer_quant_state__``), which the state hashes took for a number: every recording with
one crashed with a ``TypeError`` at its first reference checkpoint. Each optimizer here: a tiny GQA Llama recorded,
a mid-run row deleted with ``forget`` and its oracle, VERIFIED and equal to a plain ``Trainer`` counterfactual (the
row's labels -100, the recorded normalisers), optimizer moments bound by the checkpoint hashes.
"""

from __future__ import annotations

import pytest
import torch

from .test_trace_common import get_trace_data, record, tiny
from .test_trace_fidelity import independent_counterfactual
from .test_trace_neutral_attacks import _forget_outcome

KW = dict(gradient_accumulation_steps=1, max_steps=6)
OPTIMIZERS = ["adamw_bnb_8bit", *[pytest.param(o, marks=pytest.mark.slow) for o in
                                  ("paged_adamw_8bit", "paged_adamw_32bit", "lion_32bit", "adafactor", "adamw_torch_fused", "sgd",
                                   "rmsprop", "adagrad")]]


@pytest.mark.parametrize("optim", OPTIMIZERS)
def test_an_optimizer_chosen_by_name_deletes_exactly(tmp_path, optim):
    if "bnb" in optim or optim.startswith(("paged", "lion")):
        pytest.importorskip("bitsandbytes", reason="bitsandbytes optimizers (the eval extra)")
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.hashing import optimizer_tensors
    from hf_unlearn.trace.run import load_checkpoint

    tok, data = get_trace_data()
    data = data.select(range(16))
    torch.manual_seed(0)
    record(tok, data, tmp_path / "rec", model=tiny(tok), every=2, optim=optim, **KW)
    run = tmp_path / "rec" / "trace"
    ids = open_run(run).ids_at_steps([3])[:1]
    kind, receipt = _forget_outcome(run, ids, tmp_path / "del")
    assert kind == "verified", receipt
    oracle = load_checkpoint(open_run(tmp_path / "del" / "oracle").final_checkpoint())
    torch.manual_seed(0)
    plain = independent_counterfactual(tok, data, tiny(tok), run, ids, tmp_path / "plain", optim=optim, **KW)
    assert [n for n, t in oracle["model"].items() if not torch.equal(t, plain[n])] == []
    moments = optimizer_tensors(oracle["optimizer"])
    assert (moments or optim == "sgd") and all(torch.is_tensor(t) for t in moments.values())  # SGD: no state
    if "bnb" in optim or optim.startswith(("paged", "lion")):
        assert any("__bnb_optimizer_quant_state__" in n for n in moments) or any("state1" in n for n in moments)


def test_optimizer_state_with_an_object_the_hashes_cannot_read_is_named():
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace.hashing import optimizer_tensors

    state = {"state": {0: {"step": 3, "nested": {"m": torch.ones(2), "tag": "x"}, "handle": object()}},
             "param_groups": [{"params": [0]}]}
    with pytest.raises(UnlearnError, match=r"optimizer state w\.handle holds a object object"):
        optimizer_tensors(state, ["w"])
    state["state"][0].pop("handle")
    flat = optimizer_tensors(state, ["w"])
    assert sorted(flat) == ["w.nested.m", "w.nested.tag", "w.step"] and flat["w.step"].item() == 3.0
