"""The recording's cheaper checks keep their meaning: each shortcut taken to cut the recording overhead (issue #41's
benchmark) is compared here with the slow computation it replaces, on inputs built to fool it."""

from __future__ import annotations

import json

import pytest
import torch

from .test_trace_common import get_recorded, get_trace_data, record, tiny


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_all_finite_agrees_with_the_elementwise_check(dtype):
    """One read (a sum) instead of a boolean tensor as large as the weights: a NaN, an infinity of either sign, or
    both infinities (whose sum is NaN) anywhere are found; finite values whose sum overflows are not taken for one."""
    from hf_unlearn.trace.guards import all_finite

    g = torch.Generator().manual_seed(0)
    base = torch.randn(4099, generator=g).to(dtype)
    biggest = torch.full((4099,), torch.finfo(dtype).max, dtype=dtype)
    cases = [base, biggest, -biggest, base[:0], base[::3]]  # empty, strided
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 2048, 4098):
            for t in (base, biggest):
                u = t.clone()
                u[where] = bad
                cases.append(u)
    both = base.clone()
    both[5], both[9] = float("inf"), float("-inf")
    cases.append(both)
    for t in cases:
        assert all_finite(t) == bool(torch.isfinite(t).all()), (t.dtype, t.numel())


def test_a_weight_edited_to_nan_is_still_named_by_the_recording(tmp_path):
    """first_non_finite (the checkpoint's NaN check) reads each weight once; it names the same parameter."""
    from hf_unlearn.trace.recording import first_non_finite

    tok, _ = get_trace_data()
    model = tiny(tok)
    assert first_non_finite(model) is None
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        dict(model.named_parameters())[names[3]].view(-1)[7] = float("inf")
        dict(model.named_parameters())[names[5]].view(-1)[0] = float("nan")
    assert first_non_finite(model) == names[3]


def test_the_sealed_output_root_read_from_the_final_checkpoint_is_the_models(tmp_path):
    """A plain run's lineage output root is read from the final checkpoint written as training ends (not hashed a
    second time): it equals the root of the trained model's weights computed from memory, and the root
    lineage.output_root recomputes from the checkpoint."""
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.lineage import output_root, weights_root

    tok, data = get_trace_data()
    trainer = record(tok, data.select(range(16)), tmp_path, every=1)
    header = json.loads((tmp_path / "trace" / "header.json").read_text())
    live = weights_root(trainer.accelerator.unwrap_model(trainer.model).state_dict())
    assert header["lineage"]["output_root"] == live == output_root(open_run(tmp_path / "trace"))


def test_the_recorded_run_still_names_its_output_root():
    header = json.loads((get_recorded() / "header.json").read_text())
    assert len(header["lineage"]["output_root"]) == 64


def test_a_function_changed_in_place_changes_the_program_digest():
    """A function's code, defaults or closure replaced in place (the function, its class and its module stay the same
    objects) is a change of the program the digest sees, at every snapshot (no cache keyed by identities hides it)."""
    from transformers.models.llama import modeling_llama as ml

    from hf_unlearn.trace.digests import describe_difference, program_state

    tok, _ = get_trace_data()
    model = tiny(tok)
    before = program_state(model)

    def negated(x):
        return -x

    def identity(self, x):
        return x

    edits = [(ml.rotate_half, "__code__", negated.__code__), (ml.LlamaMLP.forward, "__code__", identity.__code__),
             (ml.eager_attention_forward, "__defaults__", (0.5,))]
    for fn, attr, value in edits:
        saved = getattr(fn, attr)
        try:
            setattr(fn, attr, value)
            assert describe_difference(before, program_state(model)), (fn, attr)
        finally:
            setattr(fn, attr, saved)
        assert describe_difference(before, program_state(model)) is None
