"""What a per-step fingerprint reads exactly (hf_unlearn.trace.checksums.step_state_tensors): the trainable
parameters and the buffers every step; frozen weights and optimizer moments through the next step that reads them
and, every byte, the SHA-256 of every kept checkpoint (the final one included).

Each test hides a change where only that coverage can find it: a watched callback's edit is recorded as a program
change, but the proof is the guarantee, so the tests check the proof names the right step and side of
``optimizer.step()`` and that no deletion is VERIFIED."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from hf_unlearn.errors import UnlearnError

from .test_trace_common import config_model, get_trace_data, record, rsqrt_other_bits

KW = dict(gradient_accumulation_steps=1, max_steps=6)


def test_the_step_scope_is_the_trainable_tensors_and_old_runs_keep_theirs():
    from hf_unlearn.trace.checksums import STEP_SCOPE, state_digest, state_tensors, step_state_tensors
    from hf_unlearn.trace.guards import fingerprint_scope, step_fingerprint

    tok, _ = get_trace_data()
    model = config_model("qwen2", tok)
    for p in model.model.layers[0].mlp.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(input_ids=torch.tensor([[5, 6, 7, 8]]), labels=torch.tensor([[5, 6, 7, 8]])).loss.backward()
    opt.step()
    names = {n for n, _ in step_state_tensors(model)}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == trainable | {n for n, _ in model.named_buffers()}
    assert not any("layers.0.mlp" in n for n in names)
    assert {n for n, _ in step_state_tensors(model, opt, "all")} == {n for n, _ in state_tensors(model, opt)}
    # a frozen weight or a moment is outside the per-step digest (the checkpoints bind them), inside the old one
    before = state_digest(model, opt), state_digest(model, opt, "all")
    model.model.layers[0].mlp.up_proj.weight.data.view(-1)[0] += 1.0
    assert state_digest(model, opt) == before[0] and state_digest(model, opt, "all") != before[1]
    # fingerprints say their scope; a run recorded before it ("s" without "k") is read with the old one
    controls = {"groups": [{"lr": 1e-3}]}
    assert step_fingerprint(controls, "x", [1e-3])["k"] == STEP_SCOPE
    assert "k" not in step_fingerprint(controls, "x", [1e-3], "all")
    assert fingerprint_scope({0: {"c": "a", "s": "b"}}) == "all"
    assert fingerprint_scope({0: {"none": "no step"}, 1: {"c": "a", "s": "b", "k": STEP_SCOPE}}) == STEP_SCOPE


def _edit_at(what: str, at: int):
    """A callback defined inside a function (watched, never replayed: a replay cannot import it) that edits a tensor
    through ``.data`` (no version counter) at the end of optimizer step ``at``: an Adam moment or a frozen weight.
    (Defined at module level it would be a recorded callback, and replays would make the same edit.)"""

    class EditAt(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            if state.global_step != at + 1:
                return
            if what == "moment":
                inner = getattr(optimizer, "optimizer", optimizer)  # the final norm's: every gradient reaches it
                inner.state[model.model.norm.weight]["exp_avg"].data.view(-1)[0] += 0.1
            else:
                model.model.layers[0].mlp.up_proj.weight.data.view(-1)[3] += 0.25

    return EditAt()


def _freeze_first_mlp(model):
    for p in model.model.layers[0].mlp.parameters():
        p.requires_grad_(False)
    return model


@pytest.mark.parametrize("what, at, step, side", [
    ("moment", 2, 3, "are the recording's"),  # the next update reads it: same gradients, another update
    ("frozen", 2, 3, "already differ"),  # the next forward reads it: other gradients
])
def test_an_unseen_edit_outside_the_step_digest_is_caught_at_the_next_step(tmp_path, what, at, step, side):
    from hf_unlearn import forget
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.proof import prove

    tok, data = get_trace_data()
    data = data.select(range(24))
    model = _freeze_first_mlp(config_model("qwen2", tok))  # GQA, a frozen block as in an adapter run
    with pytest.warns(UserWarning):  # the watched callback's edit is named at recording time too
        record(tok, data, tmp_path / "rec", model=model, every=4,
               trainer_kwargs={"trace_self_check": 1, "callbacks": [_edit_at(what, at)]}, **KW)
    run = tmp_path / "rec" / "trace"
    proof = prove(run, progress=False)
    assert not proof["proven"] and proof["diverged"]["step"] == step, proof
    assert side in proof["diverged"]["why"] and "trainable parameters" in proof["diverged"]["why"]
    ids = open_run(run).ids_at_steps([0])[:1]
    with pytest.raises(UnlearnError):  # unproven (ProofError), or the named program change: before any compute
        forget(run, ids, tmp_path / "refused", oracle=True, progress=False)
    assert not (tmp_path / "refused").exists()


def test_a_moment_edit_no_later_step_reads_is_caught_by_the_final_checkpoint(tmp_path):
    """An edit inside the last ``optimizer.step()`` (a user's optimizer hook, registered before the recorder's):
    no later step reads the moment and the per-step digest does not, the final checkpoint's SHA-256 does."""
    from hf_unlearn.trace.proof import prove

    class HookAtLastStep(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            inner = getattr(optimizer, "optimizer", optimizer)

            norm = kwargs["model"].model.norm.weight

            def edit(opt, *a):
                if state.global_step == state.max_steps - 1:
                    opt.state[norm]["exp_avg"].data.view(-1)[0] += 0.1

            inner.register_step_post_hook(edit)

    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=config_model("qwen2", tok), every=3,
           trainer_kwargs={"trace_self_check": 1, "callbacks": [HookAtLastStep()]}, **KW)
    proof = prove(tmp_path / "rec" / "trace", progress=False)
    assert not proof["proven"], proof
    assert proof["steps"] == [0, 4] and proof["diverged"]["step"] == 5, proof  # steps 0..4 hold, the last does not
    assert "checkpoint step 6" in proof["diverged"]["why"] and "model.norm.weight.exp_avg" in proof["diverged"]["why"]


def test_a_step_with_learning_rate_zero_is_still_probed_through_its_gradients(tmp_path, monkeypatch):
    """A warmup's first step has learning rate 0: it writes only the moments, which the step digest reads one step
    later. A function replaced in the deleting process (other bits of ``torch.rsqrt``) must still be caught at step 0, by
    the gradients' digest, before any deleted row trains: the deletion of a step-1 row is refused, never VERIFIED."""
    from hf_unlearn import forget
    from hf_unlearn.trace import open_run

    tok, data = get_trace_data()
    data = data.select(range(24))
    record(tok, data, tmp_path / "rec", model=config_model("qwen2", tok), every=4,
           trainer_kwargs={"trace_self_check": "all"}, warmup_steps=2, **KW)  # step 0 trains at lr 0
    run = tmp_path / "rec" / "trace"
    header = open_run(run).header
    assert header["fidelity"]["proof"]["proven"]
    ids = open_run(run).ids_at_steps([1])[:1]
    from hf_unlearn.trace import longest_microbatch

    monkeypatch.setattr(torch, "rsqrt", rsqrt_other_bits(monkeypatch))  # the same maths, other bits
    with pytest.raises(UnlearnError) as e:  # the probe's longest microbatch (a first step at lr 0 too) sees it first
        forget(run, ids, tmp_path / "patched", oracle=True, progress=False)
    assert "longest microbatch" in str(e.value) and "gradients" in str(e.value), str(e.value)
    monkeypatch.setattr(longest_microbatch, "check", lambda *a, **k: None)  # without it: the replay's step 0
    with pytest.raises(UnlearnError) as e:
        forget(run, ids, tmp_path / "patched", oracle=True, progress=False)
    assert "optimizer step 0" in str(e.value) and "gradients" in str(e.value), str(e.value)
    assert not (tmp_path / "patched").exists()
    monkeypatch.undo()
    receipt = forget(run, ids, tmp_path / "clean", oracle=True, progress=False)
    assert receipt.evidence["verified"]
