"""Run by every process of ``accelerate launch --multi_gpu --num_processes 2`` (CPU, gloo) in the DPO attack tests.

    accelerate launch --multi_gpu --num_processes 2 tests/trace_dpo_distributed.py OUT

Records a data-parallel trl.DPOTrainer run (ref_model=None), deletes a pair with the redacted replay and the oracle
(both under the same launch), and trains a plain data-parallel DPOTrainer whose deleted pair has no completion token
(the engine-free counterfactual). Process 0 writes what happened to OUT/result.json for the test to check.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def main(out: Path) -> None:
    import torch
    from accelerate import PartialState
    from trl import DPOTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf_unlearn.trace import OracleReplayTrainer, RedactedReplayTrainer, open_run, redact_store, trace_recording
    from hf_unlearn.trace.verification import compare_states, load_state, verify
    from tests.test_trace_dpo import MaskedPairs, dpo_config, pairs, saved_model
    from tests.test_trace_sft import state_of

    torch.set_num_threads(1)
    state = PartialState(cpu=True)
    tok, data = pairs(n=8)
    base = out / "base"
    if state.is_main_process:
        saved_model(base, tok)
    state.wait_for_everyone()
    kw = dict(max_steps=2, gradient_accumulation_steps=1)
    trace_recording(DPOTrainer)(model=saved_model(base, tok), args=dpo_config(out / "rec", **kw), train_dataset=data,
                                processing_class=tok, trace_dir=out / "trace", trace_checkpoint_steps=2).train()
    state.wait_for_everyone()
    run = open_run(out / "trace")
    forget = run.ids_at_steps([0])[:1]
    if state.is_main_process:
        redact_store(run.store_path, forget, out / "store", run.key)
    state.wait_for_everyone()
    RedactedReplayTrainer(run, out / "store", forget, out / "replay").train()
    OracleReplayTrainer(run, forget, out_dir=out / "oracle").train()
    state.wait_for_everyone()

    class KeepIds(DPOTrainer):
        def _set_signature_columns_if_needed(self):
            super()._set_signature_columns_if_needed()
            self._signature_columns = [*self._signature_columns, "id"]

    plain = KeepIds(model=saved_model(base, tok), args=dpo_config(out / "cf", **kw), train_dataset=data,
                    processing_class=tok)
    plain.data_collator = MaskedPairs(plain.data_collator, forget)
    plain.train()
    cf = state_of(plain)
    state.wait_for_everyone()
    if state.is_main_process:
        report = verify(out / "replay", out / "oracle")
        result = {"verified": report["verified"], "world_size": run.header.get("world_size"),
                  "reference": run.header["reference_model"]["kind"],
                  "forward_sha256": bool(run.header["reference_model"].get("forward_sha256")),
                  "oracle_equals_counterfactual": compare_states(cf, load_state(out / "oracle"))["identical"]}
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
