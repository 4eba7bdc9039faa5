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


def test_fsdp_settings_only_accelerates_environment_makes_are_refused_at_construction(tmp_path):
    """What ``accelerate launch --config_file`` exports fills the FSDP plugin's fields the TrainingArguments leave
    unset: CPU offload, activation checkpointing, ignored modules (parameters left unsharded, their gradients never
    reduced across processes), the wrapped classes; or turns FSDP on with no ``fsdp=`` at all. The run records and a
    replay rebuilds only the TrainingArguments' fsdp_config, so each is refused, naming the field and the variable;
    the same variables at their defaults are accepted. FSDP1, built for real, is refused with what a replay needs; so
    are processes given different TrainingArguments (seed=rank: the header holds the main process's seed, from which
    every process's microbatch seeds are replayed)."""
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
    assert result["fsdp1"].startswith("refused: exact deletion cannot replay an FSDP1 run")
    assert result["environment_at_defaults"] == "accepted" and result["clean"] == "accepted"


@pytest.mark.slow
def test_replays_of_a_recorded_fsdp2_run_that_cannot_reproduce_it_are_refused(tmp_path):
    """A clean FSDP2 run, then: its replay and oracle launched with FSDP_IGNORED_MODULES=lm_head (lm_head unsharded,
    its gradient not reduced: not the recorded arithmetic) are refused, not VERIFIED; a copy of the run given another
    run's checkpoints (same shapes, their hashes files with them) is refused; ``forget --repo`` under the launch is
    refused, naming the push command."""
    result = launch(tmp_path, "replay")
    assert result["ignored_modules_at_replay"]["codes"] == [2, 2] or all(
        c != 0 for c in result["ignored_modules_at_replay"]["codes"]), result
    assert "verified" not in result["ignored_modules_at_replay"]
    assert result["another_runs_checkpoints"].startswith("refused:"), result
    assert result["forget_repo_under_launch"].startswith("refused: forget publishes from one process")
