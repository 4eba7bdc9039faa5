"""What the deleting process's code check adds to a deletion (hf_unlearn/trace/program_code.py).

Records a tiny grouped-query Llama run (TOFU rows, one microbatch a step), then, in a fresh process as
``hf-unlearn forget`` would be, with the modules a deletion imports already imported and the run's model rebuilt:
the check's first call (it imports what the sealed entries name and nothing has imported yet) and the median of
``--repeats`` more; and one whole ``hf-unlearn forget --oracle`` of a step-0 row in a subprocess (which runs the check
three times: before its probe, and as the replay and the oracle are built). Prints the check's share of that
deletion's wall time.

    PYTHONPATH=. python benchmarks/bench_code_check.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

SHARED = Path(os.environ.get("HF_UNLEARN_SHARED", "/work/shared"))
os.environ.setdefault("HF_UNLEARN_DATA_DIR", str(SHARED / "data"))


def record(out: Path, steps: int) -> Path:
    from transformers import TrainingArguments

    from hf_unlearn.data import QACollator, load_tofu, tokenize_qa
    from hf_unlearn.models import build_tiny_model, build_tiny_tokenizer
    from hf_unlearn.trace import TraceRecordingTrainer

    rows = load_tofu("full", os.environ["HF_UNLEARN_DATA_DIR"] + "/tofu").select(range(4 * steps))
    tok = build_tiny_tokenizer([r["question"] + " " + r["answer"] for r in rows], vocab_size=1024)
    data = tokenize_qa(rows, tok, max_length=128)
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=steps, report_to=[],
                             save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True, learning_rate=3e-3)
    TraceRecordingTrainer(model=build_tiny_model("llama", tok, hidden_size=32, num_layers=2, num_heads=2), args=args,
                          train_dataset=data, data_collator=QACollator.from_tokenizer(tok),
                          trace_checkpoint_steps=4).train()
    return out / "trace"


def measure(run: str, repeats: int) -> dict:
    import hf_unlearn.deletion  # noqa: F401 - what forget imports before its checks
    import hf_unlearn.trace.replay  # noqa: F401
    from hf_unlearn.trace import open_run
    from hf_unlearn.trace.program_code import code_checked
    from hf_unlearn.trace.run_model import model_from_run

    opened = open_run(run)
    model_from_run(opened)  # the replay's model: its modules imported, as a replay has them before the check
    t = time.perf_counter()
    out = code_checked(opened)
    first = time.perf_counter() - t
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        code_checked(opened)
        times.append(time.perf_counter() - t)
    return {"entries": out["compared"], "first_s": first, "median_s": statistics.median(times)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # the fresh process's part
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.measure:
        print(json.dumps(measure(args.measure, args.repeats)))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="bench-code-check-"))
    env = {**os.environ, "HF_UNLEARN_KEY_FILE": str(tmp / "id_tag.key")}
    os.environ.update(env)
    run = record(tmp / "rec", args.steps)
    check = json.loads(subprocess.run([sys.executable, __file__, "--measure", str(run), "--repeats",
                                       str(args.repeats)], capture_output=True, text=True, env=env,
                                      check=True).stdout.splitlines()[-1])
    from hf_unlearn.trace import open_run

    (tmp / "ids.jsonl").write_text(json.dumps(open_run(run).ids_at_steps([0])[0]) + "\n")
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hf_unlearn", "forget", str(run), "--ids", str(tmp / "ids.jsonl"),
                           "--out", str(tmp / "del"), "--no-progress", "--oracle"], capture_output=True, text=True,
                          env=env)
    whole = time.perf_counter() - t
    shutil.rmtree(tmp, ignore_errors=True)
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
        return 1
    paid = check["first_s"] + 2 * check["median_s"]  # before the probe, then as the replay and the oracle are built
    print(f"code entries compared: {check['entries']}; check: first call {check['first_s'] * 1e3:.1f} ms, then "
          f"{check['median_s'] * 1e3:.1f} ms (median of {args.repeats}); forget --oracle of a step-0 row: {whole:.2f} s "
          f"wall; the check's share: {paid / whole:.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
