"""Run by every process of ``torchrun --nproc_per_node 2`` (CPU, gloo) in the LoRA data-parallel test.

    torchrun --nproc_per_node 2 tests/trace_lora_distributed.py OUT
    (or launch(OUT) from Python: tests/test_real_configs.py)

Records a data-parallel (DDP) ``Trainer`` run of a PEFT LoRA model (GQA Llama over a 1k-token tokenizer, LoRA on
q/v), honours a late deletion with ``forget(..., oracle=True)`` under the same launch (the main process writes the
merged model and the receipt), and trains the engine-free counterfactual under the same launch: a plain DDP
``Trainer`` of the same LoRA model with the deleted row's labels -100 and the recorded normalisers and seeds.
Process 0 writes what happened to OUT/result.json for the test to check.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
DUMP_AFTER_S = 600


def launch(out: Path, timeout: int = 900) -> dict:
    """Run this script under ``torchrun --nproc_per_node 2`` (a free port) and return its result.json."""
    import os
    import socket
    import subprocess

    root = Path(__file__).resolve().parents[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           str(Path(__file__).resolve()), str(out)]
    proc = subprocess.run(cmd, cwd=str(root), env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((Path(out) / "result.json").read_text())


def lora_model(tok):
    from peft import LoraConfig, get_peft_model

    from tests.test_trace_common import config_model

    model = config_model("llama", tok, num_attention_heads=4, num_key_value_heads=2)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            task_type="CAUSAL_LM"))


def main(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from hf_unlearn.data import QACollator
    from hf_unlearn.deletion import forget
    from hf_unlearn.demo import _DropIds
    from hf_unlearn.runtime import init_processes
    from hf_unlearn.trace import TraceRecordingTrainer, compare_states, open_run
    from hf_unlearn.trace.verification import load_state
    from tests.test_trace_common import get_trace_data, labels_masked, recorded_normalisers_trainer, train_args
    from tests.test_trace_sft import state_of

    faulthandler.dump_traceback_later(DUMP_AFTER_S, exit=True)  # a hung collective says where, then the test fails
    torch.set_num_threads(1)
    state = init_processes(announce=False)
    tok, data = get_trace_data()
    data = data.select(range(32))
    trace = out / "trace"
    kw = dict(per_device_train_batch_size=2, max_steps=4)
    TraceRecordingTrainer(model=lora_model(tok), args=train_args(out / "ft", **kw), train_dataset=data,
                          data_collator=QACollator.from_tokenizer(tok), trace_dir=trace,
                          trace_checkpoint_steps=2, trace_checkpoint_retention="even").train()
    state.wait_for_everyone()
    run = open_run(trace)
    ids = run.ids_at_steps([3])[:1]  # a late deletion: replayed from checkpoint 2 on both processes
    receipt = forget(str(trace), ids, out / "forget", oracle=True, progress=False, log=lambda line: None)
    cf = recorded_normalisers_trainer(trace)(model=lora_model(tok), args=train_args(out / "cf", **kw),
                                             train_dataset=labels_masked(data, ids),
                                             data_collator=_DropIds(QACollator.from_tokenizer(tok)))
    cf.train()
    want = state_of(cf)
    state.wait_for_everyone()
    if not state.is_main_process:
        assert receipt is None  # the main process writes and returns the receipt
        return
    merged = cf.accelerator.unwrap_model(cf.model).merge_and_unload().state_dict()
    saved = AutoModelForCausalLM.from_pretrained(out / "forget" / "model").state_dict()
    result = {
        "world_size": run.header["world_size"], "peft": bool(run.header["model"].get("peft")),
        "ranks": [e.ranks for e in run.plan], "ok": receipt.ok, "verified": receipt.evidence.get("verified"),
        "start_checkpoint": receipt.evidence["cost"]["start_checkpoint"],
        "output": (receipt.evidence.get("output") or {}).get("kind"),
        "oracle_is_counterfactual": compare_states(want, load_state(out / "forget" / "oracle"))["identical"],
        "published_is_counterfactual": sorted(merged) == sorted(saved) and all(
            torch.equal(merged[n], saved[n]) for n in merged),
        "differs_from_recording": not compare_states(want, load_state(trace))["identical"],
    }
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
