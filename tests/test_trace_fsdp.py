"""FSDP2-sharded runs (issue #36): recorded, replayed and verified at their world size.

Every launch runs ``tests/trace_fsdp.py`` under ``torchrun --nproc_per_node 2`` on CPU (gloo), with the test-only CPU
stand-in (``tests/fsdp_cpu.py``) that lets accelerate take its FSDP branch there: the script asserts that every
parameter is a DTensor shard at every optimizer step. One configuration runs in the default suite; the others
(``reshard_after_forward=False``, bf16 mixed precision, GPT-2 and Qwen2) are slow.
"""

from __future__ import annotations

import types

import pytest

from hf_unlearn.errors import UnlearnError


def launch(tmp_path, arch: str, reshard: bool, precision: str) -> dict:
    from .trace_fsdp import launch as run

    return run(tmp_path, arch, reshard, precision)


def check(result: dict, reshard: bool, precision: str) -> None:
    # sharded for real: every parameter a DTensor shard at every optimizer step (asserted in the processes)
    assert result["sharded_params_per_step"] and all(n > 0 for n in result["sharded_params_per_step"])
    sharding = result["sharding"]
    assert result["header_world_size"] == 2 and sharding["world_size"] == 2 and sharding["engine"] == "fsdp2"
    assert sharding["reshard_after_forward"] is reshard and sharding["mixed_precision"] == precision
    # the final checkpoint's parameter root is the root of the full state torch.distributed.checkpoint gathers
    assert result["root_is_unsharded_root"]
    assert result["lineage"] == {"start_is_unsharded_root": True, "output_is_final_root": True}
    # sharded on disk: every process wrote its own files, about half the state each (never the full tensors)
    for cp in result["checkpoint_files"].values():  # each loaded on one process: its hashes recomputed unsharded
        assert {"model-rank0-of-2.safetensors", "model-rank1-of-2.safetensors", "optimizer-rank0-of-2.safetensors",
                "optimizer-rank1-of-2.safetensors", "checkpoint.json", "hashes.json"} <= set(cp["files"]), cp
        assert "model.safetensors" not in cp["files"] and set(cp["written"]) == {"0", "1"}
        assert all(w < 0.6 * cp["full"] for w in cp["written"].values()), cp  # process 0 also writes the buffers
        assert sum(cp["written"].values()) >= cp["full"]
    # a flipped byte in process 1's shard file: refused by a full load, process 1's own load and the deep check
    assert result["refused"]["tampered_shard"] and "model-rank1-of-2.safetensors" in result["refused"]["tampered_shard"]
    # the end-of-recording self-check ran on both processes (FSDP2 replay of steps 0..N) and reproduced the run
    assert result["self_check"]["checked"] and result["self_check"]["reproduced"], result["self_check"]
    assert result["self_check"]["steps"][0] == 0 and result["self_check"]["steps"][1] > 0
    assert not result["model_class"].startswith("FSDP")  # the model class, not FSDP2's subclass of it
    # geometric retention (K=1 of 4 steps): step 0, the end and what the bound 2 (T - s) + K needs
    assert result["retention"]["mode"] == "geometric" and result["kept"] == result["retention"]["kept"]
    assert 0 in result["kept"] and 4 in result["kept"] and len(result["kept"]) < 5
    early, late = result["deletions"]
    assert early["start_step"] == 0 and late["start_step"] > 0  # the late one replays from a sharded-run checkpoint
    for d in (early, late):
        assert d["codes"] == [0, 0] and d["verified"] and d["elements"] > 0
        assert d["counterfactual_equals_oracle"]  # a plain FSDP2 Trainer, labels -100, the recorded normalisers
        assert d["oracle_differs_from_recording"]  # the deletion changed the state
        assert d["replay_sharding"] == sharding
        assert d["replay_checkpoints_sharded"]  # the output run's checkpoints: every process's shard files
        assert d["saved_model_is_replay"]  # `trace replay --save-model`: one save_pretrained folder, full tensors
    assert "reshard_after_forward" in result["refused"]["other_sharding"]
    # forget under the launch: the main process wrote a VERIFIED receipt and one save_pretrained folder
    assert result["forget"] == {"ok": True, "verified": True, "model_is_oracle": True, "step0_verified": True}


@pytest.mark.slow  # (the default suite stays under 15 minutes on 2 cores; `make test-slow`)
def test_fsdp2_record_forget_verified_at_world_size_2(tmp_path):
    """The representative launch: Llama, full sharding, reshard_after_forward=True, fp32; an early and a late
    deletion replayed and verified bit for bit, equal to the engine-free counterfactual; another sharding and one
    process are refused before any compute."""
    from hf_unlearn.trace import ReplayTrainer

    check(launch(tmp_path, "llama", True, "no"), True, "no")
    with pytest.raises(UnlearnError, match=r"recorded with 2 process\(es\) \(FSDP2\) and this replay has 1.*torchrun "
                                           r"--nproc_per_node 2"):
        ReplayTrainer(tmp_path / "trace", start="full")


@pytest.mark.slow
@pytest.mark.parametrize("arch,reshard,precision", [("llama", False, "no"), ("llama", True, "bf16"),
                                                    ("gpt2", True, "no"), ("qwen2", False, "bf16")])
def test_fsdp2_configurations(tmp_path, arch, reshard, precision):
    check(launch(tmp_path, arch, reshard, precision), reshard, precision)


@pytest.mark.slow
def test_an_edit_on_another_process_changes_the_gathered_step_digest(tmp_path):
    """The per-step digest covers every process's shards: a hook on process 1 only (unseen by the main process's
    guard) that edits its shard after step 1 makes the recording's self-check (both processes replaying steps 0..2)
    say not reproduced at step 1, and every process of a later replay refuse before any compute."""
    from .trace_fsdp import launch as run

    result = run(tmp_path, "llama", True, "no", steps="attack")
    refused = result["refused"]
    assert len(refused) == 2 and all(r and "optimizer step 1" in r for r in refused), refused
    # the recording's own self-check (both processes replaying steps 0..N) does not reproduce it either
    assert result["self_check"]["checked"] and not result["self_check"]["reproduced"], result["self_check"]
    assert "optimizer step 1" in result["self_check"]["why"]


def _trainer(fsdp_version=None, deepspeed=False, world=2):
    """What hf_unlearn.trace.sharding reads of a Trainer (FSDP1 and DeepSpeed do not build on CPU)."""
    args = types.SimpleNamespace(fsdp_plugin_args=None if fsdp_version is None else {"fsdp_version": fsdp_version},
                                 fsdp_config={"version": fsdp_version})
    state = types.SimpleNamespace(fsdp_plugin=types.SimpleNamespace(fsdp_version=fsdp_version), mixed_precision="no")
    return types.SimpleNamespace(is_fsdp_enabled=fsdp_version is not None, is_deepspeed_enabled=deepspeed, args=args,
                                 accelerator=types.SimpleNamespace(state=state, num_processes=world))


def test_fsdp1_and_deepspeed_are_refused_with_what_a_replay_would_need():
    from hf_unlearn.trace.sharding import check_replay, engine_spec, refusal

    assert "FSDP1" in refusal(_trainer(1)) and "flat-parameter layout" in refusal(_trainer(1))
    assert "DeepSpeed" in refusal(_trainer(deepspeed=True)) and "bucketing" in refusal(_trainer(deepspeed=True))
    assert refusal(_trainer(2)) is None and refusal(_trainer()) is None
    header = {"sharding": engine_spec(_trainer(2))}
    with pytest.raises(UnlearnError, match=r"world_size \(4 vs recorded 2\)"):
        check_replay(header, _trainer(2, world=4))
    with pytest.raises(UnlearnError, match=r"engine \('fsdp1' vs recorded 'fsdp2'\)"):
        check_replay(header, _trainer(1))
    with pytest.raises(UnlearnError, match="an FSDP2 run and this replay runs without FSDP"):
        check_replay(header, _trainer())
    with pytest.raises(UnlearnError, match="an unsharded run and this replay runs with fsdp2"):
        check_replay({"sharding": None}, _trainer(2))
