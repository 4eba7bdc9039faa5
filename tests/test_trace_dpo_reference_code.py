"""The DPO reference model's code is sealed with the run's (hf_unlearn/trace/program_code.py).

Every DPO step runs the reference model's forward. A reference of another architecture than the policy (here a tiny
GPT-NeoX reference for a tiny GQA Llama policy) runs classes the policy does not, and the code seal held only the
policy's: a training script that patched such a class, in a way that acts only on rows of a step the environment probe
does not re-run, left every check equal in a deleting process without the patch.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from .test_trace_dpo import counterfactual, pairs, record_dpo, saved_model

pytest.importorskip("trl")
warnings.filterwarnings("ignore", message=".*not sealed.*")
warnings.filterwarnings("ignore", category=FutureWarning)

NEOX = "class transformers.models.gpt_neox.modeling_gpt_neox:GPTNeoXModel"


class _ReferencePatch:
    """The training script's patch of the reference's backbone: its hidden states scaled on a microbatch holding one
    of ``trigger``'s tokens (the tokens of step 1's pairs only: the probe re-runs step 0)."""

    def __init__(self):
        from transformers.models.gpt_neox import modeling_gpt_neox

        self.cls, self.original, self.trigger = modeling_gpt_neox.GPTNeoXModel, \
            modeling_gpt_neox.GPTNeoXModel.forward, set()

    def __enter__(self):
        original, trigger = self.original, self.trigger

        def forward(self, input_ids=None, *args, **kwargs):
            out = original(self, input_ids, *args, **kwargs)
            if input_ids is not None and trigger & set(input_ids.unique().tolist()):
                out.last_hidden_state = out.last_hidden_state * 1.25
            return out

        self.cls.forward = forward
        return self

    def __exit__(self, *exc):
        self.cls.forward = self.original


def _reference(tmp, tok):
    from transformers import AutoModelForCausalLM

    saved_model(tmp / "reference", tok, "gpt_neox", seed=1)
    return AutoModelForCausalLM.from_pretrained(tmp / "reference")


@pytest.fixture(scope="module")
def patched_dpo(tmp_path_factory):
    """A DPO run (Llama policy, GPT-NeoX reference given as ref_model=) recorded with the patch in place; the trigger
    is learnt from a first recording's plan (the sampler's order is the seed's)."""
    from hf_unlearn.trace import open_run

    tmp = tmp_path_factory.mktemp("dpo_ref")
    tok, data = pairs(n=8)
    patch = _ReferencePatch()
    with patch:
        record_dpo(tmp / "order", tok, data, tmp / "base", ref_model=_reference(tmp, tok), max_steps=2)
        order = open_run(tmp / "order" / "trace")
        steps = [order.ids_at_steps([s]) for s in (0, 1)]
        rows = dict(zip(data["id"], data))
        tokens = [{t for i in ids for k in ("prompt", "chosen", "rejected") for t in tok(rows[i][k])["input_ids"]}
                  for ids in steps]
        patch.trigger |= tokens[1] - tokens[0]
        record_dpo(tmp / "rec", tok, data, tmp / "base", ref_model=_reference(tmp, tok), max_steps=2)
    run = open_run(tmp / "rec" / "trace")
    assert run.ids_at_steps([1]) == steps[1]
    return tmp, tok, data, run, patch


def test_a_patch_of_the_reference_models_class_is_refused_without_it_and_verified_with_it(patched_dpo, tmp_path):
    """Before: a step-0 deletion in a process without the patch was VERIFIED (replay == oracle, bit for bit) while
    the oracle differed from a plain DPOTrainer running the patched reference with the deleted pair's completion
    masked (20 of 20 tensors). Now: the reference's classes are sealed, so it is refused before any compute naming the
    class; with the patch in place the deletion is VERIFIED and equals that counterfactual."""
    from hf_unlearn import forget
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.run import load_checkpoint

    tmp, tok, data, run, patch = patched_dpo
    code = run.header["fidelity"]["guards"]["code"]
    assert NEOX in code and "module transformers.models.gpt_neox.modeling_gpt_neox" in code
    ids = run.ids_at_steps([0])[:1]
    with pytest.raises(UnlearnError, match=r"other code than the recorded run did: class transformers\.models\."
                                           r"gpt_neox\.modeling_gpt_neox\.GPTNeoXModel;") as e:
        forget(run.path, ids, tmp_path / "without", oracle=True, progress=False)
    assert "\n" not in str(e.value) and not (tmp_path / "without").exists()

    with patch:
        evidence = forget(run.path, ids, tmp_path / "with", oracle=True, progress=False).evidence
        plain = counterfactual(tmp_path, tok, data, tmp / "base", ids, ref_model=_reference(tmp, tok), max_steps=2)
    assert evidence["verified"] is True
    oracle = load_checkpoint(open_run(tmp_path / "with" / "oracle").final_checkpoint())["model"]
    assert not [n for n, t in oracle.items() if not torch.equal(t, plain["model"][n])]


def test_a_function_set_on_the_reference_instance_is_refused_when_training_starts(tmp_path):
    """Attack: the same patch set on the reference instance (``ref.gpt_neox.forward = ...``) rather than its class:
    no class's code changes, and a replay loads the reference from its files without it. Refused when the recording
    is built, naming the function (a forward hook is refused too)."""
    from hf_unlearn.errors import UnlearnError

    from .test_trace_dpo_attacks import recorder

    tok, data = pairs(n=4)
    saved_model(tmp_path / "base", tok)
    ref = _reference(tmp_path, tok)
    backbone = ref.gpt_neox
    original = backbone.forward
    backbone.forward = lambda *a, **k: original(*a, **k)
    with pytest.raises(UnlearnError, match=r"the reference model carries a hook or function a replay does not run "
                                           r"\(gpt_neox\.forward: tests\.test_trace_dpo_reference_code:"):
        recorder(tmp_path / "rec", tok, data, tmp_path / "base", ref_model=ref)
