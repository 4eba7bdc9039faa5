"""The checks to run on the first GPU lent (issue #22 item 6), in one command of under 10 minutes on one GPU.

    PYTHONPATH=. python benchmarks/device_suite.py            # CUDA: SmolLM2-135M, 30 steps, fp32 and bf16 autocast
    PYTHONPATH=. python benchmarks/device_suite.py --tiny     # CPU: a tiny Llama, 4 steps (the slow tests run this)
    PYTHONPATH=. python benchmarks/device_suite.py --fsdp     # FSDP2 under torchrun, world size = the GPUs lent

1. **Exact deletion on the device**, per precision (fp32; ``bf16=True`` autocast on an fp32 model): record
   ``--steps`` optimizer steps with ``TraceRecordingTrainer`` at the default checkpoint cadence (it turns on
   deterministic algorithms and the cuBLAS workspace setting itself, and ends with its self-check), then delete one
   row of step 0 (a full replay) and one row of the last step (a suffix replay) and verify each replay against the
   oracle. Printed per precision: VERIFIED or not, the recording's fidelity evidence, and the end-of-recording
   self-check as a fraction of the recording's wall and CPU time.
2. **The issue-#16 MASC fair benchmark** on the same model (``benchmarks/bench_methods.py``, one learning rate, one
   seed, MASC against grad_diff; ``--skip-masc`` leaves it out).

3. **FSDP2** (``--fsdp``, issue #36), instead of 1 and 2: ``tests/trace_fsdp.py`` under ``torchrun`` with one process
   per GPU (more than one GPU: world size N; one GPU: world size 1, FSDP2's code path with a single shard, said as
   such), per precision (fp32; bf16 mixed precision): a tiny Llama's FSDP2 run recorded, one row of the first and one
   of the last step deleted, each replay verified against the oracle and the oracle against the engine-free FSDP2
   counterfactual (labels -100, the recorded normalisers), the final root against the unsharded root, another
   sharding refused. ``--fsdp --tiny`` runs it on 2 CPU processes (gloo, the tests' CPU stand-in).

Exit status 0 iff every self-check reproduced its interval and every deletion was VERIFIED. ``--out`` keeps the runs and the MASC table (default: a temporary
folder, removed).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared"
SMOLLM2 = SHARED / "models" / "SmolLM2-135M-Instruct"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny Llama on CPU (checks the script, not a device)")
    p.add_argument("--model", default=str(SMOLLM2))
    p.add_argument("--steps", type=int, default=None, help="optimizer steps recorded (default 30; --tiny 4)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda, or cpu with --tiny")
    p.add_argument("--precisions", default="fp32,bf16", help="fp32 and/or bf16 (autocast, TrainingArguments bf16)")
    p.add_argument("--skip-masc", action="store_true")
    p.add_argument("--record-only", action="store_true", help="record only (measure the self-check), no deletions")
    p.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    p.add_argument("--fsdp", action="store_true", help="the FSDP2 check under torchrun (one process per GPU; --tiny: "
                                                       "2 CPU processes)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def fsdp_suite(a, tmp: Path) -> bool:
    """The FSDP2 check (issue #36) per precision; prints one line each, True iff everything held."""
    import torch

    sys.path.insert(0, str(HERE.parent))
    from tests.trace_fsdp import launch

    processes = 2 if a.device == "cpu" else torch.cuda.device_count()
    where = (f"world size {processes} on {processes} {torch.cuda.get_device_name(0)} GPUs" if a.device == "cuda"
             and processes > 1 else f"world size 1 on one {torch.cuda.get_device_name(0)} (FSDP2's code path, a "
             "single shard: not a sharded run)" if a.device == "cuda" else "world size 2 on CPU processes (gloo, the "
             "tests' CPU stand-in)")
    ok = True
    for precision in a.precisions.split(","):
        r = launch(tmp / f"fsdp-{precision}", "llama", True, "bf16" if precision == "bf16" else "no",
                   processes=processes, device=a.device)
        good = r["root_is_unsharded_root"] and all(d["verified"] and d["counterfactual_equals_oracle"]
                                                   for d in r["deletions"]) and "other_sharding" in r["refused"]
        ok = ok and good
        print(f"FSDP2 {precision}, {where}: " + "; ".join(
            f"step {d['step']} {'VERIFIED' if d['verified'] else 'NOT VERIFIED'}, counterfactual "
            f"{'equal' if d['counterfactual_equals_oracle'] else 'DIFFERS'}" for d in r["deletions"])
            + f"; root {'= unsharded root' if r['root_is_unsharded_root'] else 'DIFFERS from the unsharded root'}",
            flush=True)
    return ok


def load(a):
    from hf_unlearn import load_model, load_tofu, load_tokenizer, tokenize_qa

    rows = load_tofu("full").select(range(8 * a.steps))
    if a.tiny:
        from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer

        tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=512)
        model = build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2)
    else:
        tok, model = load_tokenizer(a.model), load_model(a.model)
    return tok, model, tokenize_qa(rows, tok, max_length=64 if a.tiny else 128)


def exact_deletion(a, precision: str, tok, base, data, tmp: Path) -> dict:
    """Record, then an early and a late deletion, each verified against the oracle."""
    from transformers import TrainingArguments

    from hf_unlearn import (
        OracleReplayTrainer,
        QACollator,
        RedactedReplayTrainer,
        TraceRecordingTrainer,
        redact_store,
        verify_replay,
    )
    from hf_unlearn.trace import open_run

    out = tmp / precision
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=a.steps, learning_rate=3e-3 if a.tiny else 2e-5, warmup_steps=1,
                             max_grad_norm=1.0, bf16=precision == "bf16", use_cpu=a.device == "cpu", seed=0,
                             report_to=[], disable_tqdm=True, logging_strategy="no", save_strategy="no")
    trainer = TraceRecordingTrainer(model=copy.deepcopy(base), args=args, train_dataset=data,
                                    data_collator=QACollator.from_tokenizer(tok), trace_dir=out / "trace")
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    run = open_run(out / "trace")
    fid = run.header["fidelity"]["recording"]
    result = {"precision": precision, "device": run.header["determinism"]["device_info"], "steps": run.total_steps,
              "checkpoints": len(run.checkpoints()), "record_wall_s": wall, "record_cpu_s": cpu,
              "fidelity": fid, "deletions": {}}
    if fid.get("cpu_seconds") is not None:
        result["self_check_fraction_cpu"] = fid["cpu_seconds"] / (cpu - fid["cpu_seconds"])
        result["self_check_fraction_wall"] = fid["wall_seconds"] / (wall - fid["wall_seconds"])
    for when, step in () if a.record_only else (("early", 0), ("late", run.total_steps - 1)):
        forget = run.ids_at_steps([step])[:1]
        d = out / when
        redact_store(run.store_path, forget, d / "store", run.key)
        t = time.perf_counter()
        RedactedReplayTrainer(run, d / "store", forget, d / "replay").train()
        replay_s = time.perf_counter() - t
        OracleReplayTrainer(run, forget, out_dir=d / "oracle").train()
        report = verify_replay(d / "replay", d / "oracle")
        result["deletions"][when] = {"step": step, "verified": bool(report["verified"]), "replay_s": replay_s,
                                     "mismatched_params": report["params"]["mismatched_elements"],
                                     "problems": report["provenance"]["problems"]}
    return result


def masc_benchmark(a, out: Path) -> int:
    """The issue-#16 fair comparison, cut to one lr and one seed (MASC against grad_diff)."""
    sys.path.insert(0, str(HERE))
    import bench_methods

    common = ["--out", str(out), "--methods", "masc,grad_diff", "--seeds", "1", "--threads", str(a.threads)]
    if a.tiny:
        common += ["--authors", "2", "--finetune-epochs", "2", "--lrs", "3e-3", "--epochs", "1", "--eval-items", "2",
                   "--eval-max-new-tokens", "4", "--utility", "retain_utility"]
    else:
        common += ["--model", a.model, "--authors", "4", "--finetune-epochs", "3", "--finetune-lr", "1e-4",
                   "--lrs", "3e-5", "--epochs", "5", "--eval-items", "8", "--eval-max-new-tokens", "32"]
    return bench_methods.main(common + ["--phase", "all"])


def main(argv=None) -> int:
    a = parse_args(argv)
    a.steps = a.steps or (4 if a.tiny else 30)
    a.device = a.device or ("cpu" if a.tiny else "cuda")
    warnings.filterwarnings("ignore")
    import datasets
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    torch.set_num_threads(a.threads)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("device_suite: no CUDA device here; run it on a GPU, or pass --tiny to check the script on CPU")
        return 2
    tmp = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="device_suite_"))
    tmp.mkdir(parents=True, exist_ok=True)
    ok = True
    try:
        if a.fsdp:
            return 0 if fsdp_suite(a, tmp) else 1
        tok, base, data = load(a)
        results = []
        for precision in a.precisions.split(","):
            r = exact_deletion(a, precision, tok, base, data, tmp)
            results.append(r)
            verdicts = "; ".join(f"{w} (step {d['step']}) {'VERIFIED' if d['verified'] else 'NOT VERIFIED'}"
                                 for w, d in r["deletions"].items())
            ok = ok and all(d["verified"] for d in r["deletions"].values()) and r["fidelity"].get("reproduced", False)
            fraction = (f"self-check {100 * r['self_check_fraction_cpu']:.1f}% of the recording's CPU time, "
                        f"{100 * r['self_check_fraction_wall']:.1f}% of its wall time"
                        if "self_check_fraction_cpu" in r else f"self-check did not run: {r['fidelity'].get('why')}")
            print(f"{precision} on {r['device'].get('name', r['device']['type'])}: {r['steps']} steps, "
                  f"{r['checkpoints']} checkpoints; {verdicts}; {fraction}", flush=True)
        (tmp / "device_suite.json").write_text(json.dumps(results, indent=1))
        if not a.skip_masc:
            t = time.perf_counter()
            masc_benchmark(a, tmp / "masc")
            print(f"MASC fair benchmark: {time.perf_counter() - t:.0f} s, table in {tmp / 'masc'}")
    finally:
        if not a.out:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
