"""Attacks on the FSDP2 verdicts (issue #36): configurations a replay cannot reproduce must be refused before any
compute, naming what differs, and a replay that runs must be the counterfactual.

Each launch runs ``tests/trace_fsdp_attacks.py`` under ``torchrun --nproc_per_node 2`` on CPU (gloo, the test-only CPU
stand-in ``tests/fsdp_cpu.py``), batching several attacks. The construction-time refusals (about 20 s) run in the
default suite; the attacks on a recorded run are slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ATTACKS = Path(__file__).resolve().parent / "trace_fsdp_attacks.py"


def launch(tmp_path, mode: str) -> dict:
    from .trace_fsdp import launch as run

    return run(tmp_path, "llama", True, "no", steps=mode, script=ATTACKS)


@pytest.mark.slow  # 20-30 s on 2 cores: the default suite stays under 15 minutes
def test_fsdp_settings_only_accelerates_environment_makes_are_refused_at_construction(tmp_path):
    """What ``accelerate launch --config_file`` exports fills the FSDP plugin's fields the TrainingArguments leave
    unset: CPU offload, activation checkpointing, ignored modules (parameters left unsharded, their gradients never
    reduced across processes), the wrapped classes; or turns FSDP on with no ``fsdp=`` at all. The run records and a
    replay rebuilds only the TrainingArguments' fsdp_config, so each is refused, naming the field and the variable;
    the same variables at their defaults are accepted. FSDP1, built for real, is refused with what a replay needs; so
    are processes given different TrainingArguments (seed=rank: the header holds the main process's seed, from which
    every process's microbatch seeds are replayed), another model config (dropout), another thread count, or a buffer edited on process 1
    only (FSDP2 never synchronises buffers; the header and the checkpoints hold the main process's), and
    average_tokens_across_devices=False (each process its own loss normaliser; the plan records one per step)."""
    result = launch(tmp_path, "construction")
    for field, variable in (("cpu_offload", "FSDP_OFFLOAD_PARAMS"),
                            ("activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING"),
                            ("ignored_modules", "FSDP_IGNORED_MODULES"),
                            ("transformer_cls_names_to_wrap", "FSDP_TRANSFORMER_CLS_TO_WRAP")):
        message = next(v for k, v in result.items() if variable in v)
        assert message.startswith("refused:") and field in message and "fsdp_config" in message, message
    assert result["fsdp_from_environment_only"].startswith("refused: FSDP is turned on by accelerate's environment")
    assert "TrainingArguments(fsdp=True" in result["fsdp_from_environment_only"]
    assert result["seed_per_process"].startswith("refused: the processes were given different TrainingArguments (seed)")
    assert result["threads_per_process"].startswith("refused: the processes were given different numeric stack (threads)")
    assert result["normaliser_per_process"].startswith("refused: average_tokens_across_devices=False")
    assert result["model_config_per_process"].startswith("refused: the processes were given different model config (")
    assert "attention_dropout" in result["model_config_per_process"]
    assert result["buffer_per_process"].startswith(
        "refused: the processes were given different buffers (model.rotary_emb.inv_freq)")
    assert result["fsdp1"].startswith("refused: exact deletion cannot replay an FSDP1 run")
    assert result["environment_at_defaults"] == "accepted" and result["clean"] == "accepted"


@pytest.mark.slow
def test_replays_of_a_recorded_fsdp2_run_that_cannot_reproduce_it_are_refused(tmp_path):
    """A clean FSDP2 run, then: its replay and oracle launched with FSDP_IGNORED_MODULES=lm_head (lm_head unsharded,
    its gradient not reduced: not the recorded arithmetic; before: accepted, then crashed in the optimizer step) or
    with ACCELERATE_MIXED_PRECISION=bf16 are refused at construction; a copy of the run given another run's
    checkpoints (same shapes, their hashes files with them) is refused; an oracle whose process 1 alone is given
    another id to forget is refused at construction (before: not checked; each process masks its own list);
    ``forget --repo`` under the launch is refused,
    naming the push command; ``forget`` in one process is refused, naming torchrun."""
    from hf_unlearn.deletion import forget
    from hf_unlearn.errors import UnlearnError

    result = launch(tmp_path, "replay")
    ignored = result["ignored_modules_at_replay"]
    assert all(c != 0 for c in ignored["codes"]) and ignored["replay"].startswith("refused:"), ignored
    assert "ignored_modules ('lm_head', from FSDP_IGNORED_MODULES" in ignored["replay"]
    assert "ACCELERATE_MIXED_PRECISION='bf16'" in result["bf16_from_environment_at_replay"]
    assert result["another_runs_checkpoints"].startswith("refused:"), result
    assert "is not this run's" in result["another_runs_checkpoints"]
    assert result["forget_ids_per_process"].startswith("refused: the processes of this replay were given different ids")
    assert result["forget_repo_under_launch"].startswith("refused: forget publishes from one process")
    # and `forget` on the FSDP2 run in one process (no torchrun): refused, naming the launch
    with pytest.raises(UnlearnError, match=r"recorded by 2 processes.*torchrun --nproc_per_node 2"):
        forget(str(tmp_path / "trace"), ["x"], tmp_path / "forget-one", oracle=True, progress=False,
               log=lambda line: None)


@pytest.mark.parametrize("variable,value,match", [
    ("ACCELERATE_MIXED_PRECISION", "bf16", r"accelerate runs mixed precision 'bf16' .* TrainingArguments say 'no'"),
    ("ACCELERATE_DYNAMO_BACKEND", "inductor", r"accelerate compiles the model with INDUCTOR .*--dynamo_backend no")])
def test_precision_or_compilation_only_the_launch_sets_is_refused(tmp_path, monkeypatch, variable, value, match):
    """``accelerate launch --mixed_precision bf16`` (or ``--dynamo_backend``, or a config file saying so) exports a
    variable accelerate obeys when the TrainingArguments say nothing; the run records, and a replay rebuilds, only
    the TrainingArguments. Before: a fp32 run's early deletion replayed and oracled under ACCELERATE_MIXED_PRECISION=
    bf16 (one process, no torchrun) was VERIFIED, its oracle not the fp32 one. Now the recording and the replay and
    oracle are refused at construction, naming the variable."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import OracleReplayTrainer, ReplayTrainer, TraceRecordingTrainer

    from .test_trace_common import get_recorded, get_trace_data, ids_at_step, tiny, train_args

    run = get_recorded()  # fp32, no compilation
    tok, data = get_trace_data()
    monkeypatch.setenv(variable, value)
    with pytest.raises(UnlearnError, match=match) as refused:
        TraceRecordingTrainer(model=tiny(tok), args=train_args(tmp_path / "ft"), train_dataset=data,
                              data_collator=QACollator.from_tokenizer(tok), trace_dir=tmp_path / "trace")
    assert f"{variable}={value!r}" in str(refused.value)
    with pytest.raises(UnlearnError, match=match):
        ReplayTrainer(run, start="full")
    with pytest.raises(UnlearnError, match=match):
        OracleReplayTrainer(run, ids_at_step(run, 0)[:1], out_dir=tmp_path / "oracle")


def test_torch_compile_is_refused_when_the_recording_is_built(tmp_path):
    """``torch_compile=True`` recorded for the whole training, then every deletion was refused ("code class
    LlamaForCausalLM ... changed at optimizer step 0": compilation replaces the model's code when training starts),
    and the launch check's message even advised setting it. Refused at construction now, in one line."""
    from hf_unlearn.data import QACollator
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import TraceRecordingTrainer

    from .test_trace_common import get_trace_data, tiny, train_args

    tok, data = get_trace_data()
    with pytest.raises(UnlearnError) as refused:
        TraceRecordingTrainer(model=tiny(tok), args=train_args(tmp_path / "ft", torch_compile=True), train_dataset=data,
                              data_collator=QACollator.from_tokenizer(tok), trace_dir=tmp_path / "trace")
    text = str(refused.value)
    assert "\n" not in text and text.startswith("torch_compile=True (inductor)") and "torch_compile=False" in text
    assert not (tmp_path / "trace" / "header.json").exists()


def test_a_model_compiled_by_the_script_is_refused_when_the_recording_is_built(tmp_path):
    """``torch.compile(model)`` passed as the model (``remove_unused_columns=False``, as a plain Trainer needs for a
    compiled model) trained every step, then crashed in the recording's proof (``type object 'OptimizedModule' has
    no attribute '_from_config'``). Refused at construction now, in one line, as ``torch_compile=True`` is."""
    import torch

    from hf_unlearn.data import QACollator
    from hf_unlearn.errors import UnlearnError
    from hf_unlearn.trace import TraceRecordingTrainer

    from .test_trace_common import get_trace_data, tiny, train_args

    tok, data = get_trace_data()
    with pytest.raises(UnlearnError) as refused:
        TraceRecordingTrainer(model=torch.compile(tiny(tok), backend="eager"),
                              args=train_args(tmp_path / "ft", remove_unused_columns=False), train_dataset=data,
                              data_collator=QACollator.from_tokenizer(tok), trace_dir=tmp_path / "trace")
    text = str(refused.value)
    assert "\n" not in text and text.startswith("the model is compiled (torch.compile(model))"), text
    assert not (tmp_path / "trace" / "header.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("attack,refusal", [
    ("buffer", "refused: the processes were given different buffers"),
    ("callback", "refused: process(es) [1] would take optimizer step 1 with other optimizer settings than the main "
                 "process (lr)")])
def test_a_process_that_trains_otherwise_cannot_reach_a_verified_deletion(tmp_path, attack, refusal):
    """Before these checks, an FSDP2 run whose process 1 alone trained otherwise (its rotary buffer edited; a callback
    halving its learning rate each step) recorded, and its step-0 deletion (every replayed step affected: no
    fingerprint left to compare) was VERIFIED while a full replay of the run was refused at step 0 (buffer; the
    oracle also differed from the counterfactual with the same rank-local edit, labels -100) or step 1 (callback;
    the learning rate is 0 at step 0). Now the recording is refused: at construction, or before that optimizer step on
    every process."""
    result = launch(tmp_path, f"rank_local:{attack}")
    assert result == {"recording": result["recording"]}, result  # nothing replayed, nothing VERIFIED
    assert result["recording"].startswith(refusal), result


@pytest.mark.slow
def test_a_buffer_edited_on_one_process_after_the_self_check_steps_is_a_change(tmp_path):
    """Issue #41: a callback that edits a buffer on process 1 only, after step 1 (past the default self-check's steps;
    the guards ran on the main process only), was not seen, and a step-0 deletion was VERIFIED with every tensor off.
    Now every process digests its whole program and the tensors it holds whole after each optimizer step and the
    main process compares them: the edit is recorded as a change of that step, and every deletion is refused."""
    result = launch(tmp_path, "rank_local:late_buffer")
    assert result["recording"] == "accepted", result
    assert "verified" not in result and result["codes"] != [0, 0], result
    assert "process 1's tensors held whole" in result["full_replay_without_deletion"], result


@pytest.mark.slow
def test_a_value_conditional_gradient_edit_on_one_process_is_refused(tmp_path):
    """Issue #41, wave 5: a callback replays do not run that, on process 1 only, reads its gradient shard and halves it
    when the total is not the one it met before (a no-op on every recorded step: nothing changed, nothing for the
    processes' digests to differ in). The recording's other processes now run watched callbacks' events under the
    value-read monitor too (hf_unlearn.trace.value_reads), and process 1's reads differ from process 0's: a change
    of that step, and every deletion is refused before any compute."""
    result = launch(tmp_path, "rank_local:rank_read")
    assert result["recording"] == "accepted", result
    assert "verified" not in result and 0 not in result["codes"], result
    assert "reads of tensor values" in result["full_replay_without_deletion"], result
