"""Exact deletion at scale: the real SmolLM2-135M, dropout on, 30 optimizer steps of 4 microbatches (slow).

    pytest -m slow tests/test_trace_scale.py      # about 10-20 minutes on 2 CPU cores, ~15 GB of checkpoints
"""

from __future__ import annotations

import shutil

import pytest

from .conftest import SMOLLM2_DIR, TOFU_DIR

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not (SMOLLM2_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf").exists(), reason="SmolLM2 GGUF not present")
def test_smollm2_late_deletion_by_suffix_replay_equals_the_oracle(tmp_path):
    import torch
    from transformers import TrainingArguments

    from hf_unlearn import (
        OracleReplayTrainer,
        QACollator,
        RedactedReplayTrainer,
        TraceRecordingTrainer,
        load_model,
        load_tofu,
        load_tokenizer,
        redact_store,
        replay_cost,
        tokenize_qa,
    )
    from hf_unlearn.trace import compare_states, open_run
    from hf_unlearn.trace.run import load_checkpoint

    torch.set_num_threads(1)  # a shared 2-core machine: more threads only spin
    tok = load_tokenizer(SMOLLM2_DIR)
    model = load_model(SMOLLM2_DIR)
    model.config.attention_dropout = 0.1  # dropout on: the config (what replays rebuild) and the live modules
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.1
    data = tokenize_qa(load_tofu("full", TOFU_DIR).select(range(120)), tok, max_length=64, use_chat_template=False)
    args = TrainingArguments(output_dir=str(tmp_path / "ft"), per_device_train_batch_size=1, gradient_accumulation_steps=4,
                             num_train_epochs=1, learning_rate=2e-5, warmup_steps=3, max_grad_norm=1.0,
                             lr_scheduler_type="cosine", weight_decay=0.01, report_to=[], save_strategy="no",
                             use_cpu=True, seed=0, disable_tqdm=True, logging_strategy="no")
    TraceRecordingTrainer(model=model, args=args, train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
                          trace_dir=tmp_path / "trace", trace_checkpoint_steps=5,
                          trace_checkpoint_retention="even").train()  # every checkpoint kept: the test names them
    run = open_run(tmp_path / "trace")
    assert run.total_steps == 30 and sorted(run.checkpoints()) == [0, 5, 10, 15, 20, 25, 30]
    assert run.header["determinism"]["dropout"]["attention_dropout"] == 0.1
    forget = run.ids_at_steps([28])[:2]
    cost = replay_cost(run, forget)
    assert cost["start_checkpoint"] == 25 and cost["steps_to_replay"] == 5

    redact_store(run.store_path, forget, tmp_path / "store", run.key)
    replay = RedactedReplayTrainer(run, tmp_path / "store", forget, tmp_path / "replay")
    replayed = replay.train()
    assert replay.replay_stats["segments_replayed"] == 5
    oracle = OracleReplayTrainer(run, forget).train()  # out_dir=None: the full replay's state, nothing written
    report = compare_states(replayed, oracle)
    p, o = report["params"], report["optimizer"]
    print(f"SmolLM2-135M, 30 steps x 4 microbatches, dropout 0.1, late deletion of {len(forget)} rows: suffix replay "
          f"of {cost['steps_to_replay']} steps; {p['mismatched_elements']} of {p['elements']:,} parameter and "
          f"{o['mismatched_elements']} of {o['elements']:,} optimizer elements differ from the oracle")
    assert report["identical"] and p["mismatched_elements"] == o["mismatched_elements"] == 0
    assert p["elements"] == run.header["model"]["num_parameters"]  # the tied embedding counted once
    assert not compare_states(oracle, load_checkpoint(run.final_checkpoint()))["identical"]  # the deletion mattered
    shutil.rmtree(tmp_path, ignore_errors=True)
