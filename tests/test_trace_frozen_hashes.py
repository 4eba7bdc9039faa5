"""A LoRA recording hashes its frozen base once: the checkpoints hash each model tensor under the plain model's name
(``hashes.json`` ``"tensor_names": "plain"``), so the frozen store takes the hashes the lineage's start root took of
the same tensors. Every check still binds each tensor's bytes to its key: a changed or swapped frozen tensor is
refused at load, and a run recorded before the rule (its tensors hashed under their PEFT names) still loads,
verifies and is deleted VERIFIED, its replay's checkpoints keeping its rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_unlearn.errors import UnlearnError

from .test_trace_common import delete, get_trace_data, ids_at_step, record, tiny

LORA = {"r": 2, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"}


def lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(**LORA))


def hashes_of(d: Path) -> dict:
    return json.loads((d / "hashes.json").read_text())


def steps_of(run: Path) -> list[Path]:
    return sorted((run / "checkpoints").glob("step-*"))


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """A LoRA recording as hf_unlearn wrote one before the plain rule: every hash under the tensor's own (PEFT) name,
    no ``tensor_names`` field (the writer's rule switched off: it is the only thing the rule changes)."""
    from hf_unlearn.trace import checkpoints

    tok, data = get_trace_data()
    work = tmp_path_factory.mktemp("old_rule")
    init = checkpoints.FrozenTensors.__init__

    def old_rule(self, run):
        init(self, run)
        self.plain = False

    mp = pytest.MonkeyPatch()
    mp.setattr(checkpoints.FrozenTensors, "__init__", old_rule)
    try:
        record(tok, data, work / "rec", model=lora(tiny(tok)))
    finally:
        mp.undo()
    return work / "rec" / "trace"


def test_a_lora_recording_hashes_each_frozen_tensor_once(tmp_path, monkeypatch):
    """One SHA-256 pass over each frozen base tensor from construction to the sealed run (the lineage's start root;
    the frozen store and every checkpoint take that hash; the sealed output root too): it was two (the store hashed
    the same bytes again under the PEFT name). The recorded hashes are the plain rule's, bound to the bytes."""
    from hf_unlearn.trace import hashing
    from hf_unlearn.trace.checkpoints import load_checkpoint, verify_checkpoint_files
    from hf_unlearn.trace.peft_names import base_key

    tok, data = get_trace_data()
    model = lora(tiny(tok))
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    by_storage = {p.untyped_storage().data_ptr(): n for n, p in frozen.items()}
    passes: dict[str, int] = {}
    plain = hashing.tensor_hash

    def counted(name, t):
        n = by_storage.get(t.untyped_storage().data_ptr())
        if n is not None:
            passes[n] = passes.get(n, 0) + 1
        return plain(name, t)

    monkeypatch.setattr(hashing, "tensor_hash", counted)
    record(tok, data.select(range(16)), tmp_path, model=model, trainer_kwargs={"trace_self_check": False})
    monkeypatch.setattr(hashing, "tensor_hash", plain)
    run = tmp_path / "trace"
    store = hashes_of(run / "checkpoints" / "frozen")
    hashed = {by_storage[p.untyped_storage().data_ptr()] for p in frozen.values()}  # a tied tensor: once
    assert passes == {n: 1 for n in hashed}, passes
    assert store["tensor_names"] == "plain" and set(store["params"]) == hashed
    for n in hashed:  # the plain rule: the PEFT key, the plain model's name in the hash, the tensor's bytes
        assert base_key(n) != n and store["params"][n] == plain(base_key(n), frozen[n]) != plain(n, frozen[n])
    for step in steps_of(run):
        h = hashes_of(step)
        assert h["tensor_names"] == "plain" and all(h["params"][n] == store["params"][n] for n in hashed)
        verify_checkpoint_files(step)
        assert load_checkpoint(step)["model"]


def test_a_changed_or_swapped_frozen_tensor_is_refused_with_the_plain_rule(tmp_path):
    """The frozen store's file (a model built from a config stores its base in the run): one bit of a frozen tensor
    flipped, or two frozen tensors of the same shape swapped (each the bytes of the other's key), is refused by
    load_checkpoint and by the streaming check, naming the tensor; the store restored loads again."""
    import torch
    from safetensors.torch import load_file, save_file

    from hf_unlearn.trace.checkpoints import load_checkpoint, verify_checkpoint_files

    tok, data = get_trace_data()
    record(tok, data.select(range(16)), tmp_path, model=lora(tiny(tok)), trainer_kwargs={"trace_self_check": False})
    run = tmp_path / "trace"
    store = run / "checkpoints" / "frozen" / "model.safetensors"
    assert hashes_of(run / "checkpoints" / "frozen")["tensor_names"] == "plain"
    original = store.read_bytes()
    tensors = load_file(store)
    a, b = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", \
        "base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight"
    assert tensors[a].shape == tensors[b].shape and not torch.equal(tensors[a], tensors[b])
    step = steps_of(run)[-1]
    flipped = dict(tensors)
    flipped[a] = tensors[a].clone()
    flipped[a].view(-1)[0] = -flipped[a].view(-1)[0]
    for edited, names in ((flipped, [a]), ({**tensors, a: tensors[b], b: tensors[a]}, [a, b])):
        save_file(edited, str(store))
        with pytest.raises(UnlearnError, match="does not match its hashes.json") as e:
            load_checkpoint(step)
        assert all(n in str(e.value) for n in names), e.value
        with pytest.raises(UnlearnError, match="does not match its hashes.json"):
            verify_checkpoint_files(step)
    store.write_bytes(original)
    assert load_checkpoint(step)["model"]


def test_a_lora_run_recorded_before_the_plain_rule_loads_verifies_and_is_deleted_verified(old_run, tmp_path):
    """The old rule's files (no ``tensor_names``; each hash under the PEFT name, as before) load and pass the
    streaming and deep checks; a tampered frozen tensor is still refused; a deletion replays them VERIFIED and its
    output's checkpoints keep the run's rule (they link its frozen store and step-0 checkpoint); `trace verify`
    passes."""
    from hf_unlearn.cli import main
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.checkpoints import check_checkpoints, load_checkpoint, verify_checkpoint_files
    from hf_unlearn.trace.hashing import tensor_hash

    run = old_run
    store = hashes_of(run / "checkpoints" / "frozen")
    assert "tensor_names" not in store
    step = steps_of(run)[-1]
    state = load_checkpoint(step)
    assert all(store["params"][n] == tensor_hash(n, state["model"][n]) for n in store["params"])  # the old rule
    for d in steps_of(run):
        assert "tensor_names" not in hashes_of(d)
        verify_checkpoint_files(d)
    opened = open_run(run)
    _, errors, _ = check_checkpoints(run, opened.header, opened.key, True, opened.total_steps, deep=True)
    assert not errors, errors
    replay, report = delete(run, ids_at_step(run, 6)[:2], tmp_path)
    assert report["verified"], report
    out = tmp_path / "replay"
    assert all("tensor_names" not in hashes_of(d) for d in steps_of(out))
    assert report["roots"]["a"]["params"] == hashes_of(steps_of(out)[-1])["params_root"]  # the card's check
    assert main(["trace", "verify", str(out), str(tmp_path / "oracle")]) == 0


def test_a_resumed_recording_of_a_run_recorded_before_the_plain_rule_keeps_its_rule(old_run, tmp_path):
    """A resumed recording takes over the frozen store with its rule (adopt_matching hashes the model's frozen
    tensors under their own names to match them): the checkpoints it adds hash as the earlier ones did, and check."""
    import shutil

    import torch

    from hf_unlearn.trace.checkpoints import FrozenTensors, check_checkpoint_state, load_checkpoint, save_checkpoint

    run = tmp_path / "trace"
    shutil.copytree(old_run, run)
    state = load_checkpoint(steps_of(run)[-1])
    tok, _ = get_trace_data()
    model = lora(tiny(tok))
    model.load_state_dict({**state["model"], **{a: state["model"][n] for a, n in state["tied"].items()}})
    frozen = FrozenTensors(run)
    frozen.adopt_matching(model)
    assert frozen.plain is False and frozen.exists
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    d = save_checkpoint(run, 99, model, optimizer, frozen=frozen)
    h = hashes_of(d)
    assert "tensor_names" not in h and json.loads((d / "checkpoint.json").read_text())["frozen"]
    assert all(h["params"][n] == frozen.hashes[n] for n in frozen.hashes)
    check_checkpoint_state(d, load_checkpoint(d, verify=False))  # its own hashes.json (the index lists no step 99)
