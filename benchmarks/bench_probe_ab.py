"""The environment probe with the run's longest microbatch (step 0, the kept-checkpoint step with the longest
microbatch, and the run's longest microbatch alone from the step-0 checkpoint: hf_unlearn.trace.longest_microbatch)
against the probe without it (the two steps), CPU time, arms alternating in one process on one recorded run (a Llama of hidden 256 and 4
layers, 16 steps of 4 TOFU rows of <= 128 tokens, a checkpoint every 8).

    PYTHONPATH=. python benchmarks/bench_probe_ab.py [--repeats 3]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_unlearn.models import build_tiny_model  # noqa: E402
from hf_unlearn.trace import longest_microbatch, open_run, proof  # noqa: E402
from tests.test_trace_common import get_trace_data, record  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    tok, data = get_trace_data()
    d = Path(tempfile.mkdtemp(prefix="bench_probe_ab_"))
    model = build_tiny_model("llama", tok, hidden_size=256, num_layers=4, num_heads=4, seed=0)
    record(tok, data.select(range(64)), d, model=model, every=8, gradient_accumulation_steps=1, max_steps=16,
           trainer_kwargs={"trace_self_check": 1})
    run = open_run(d / "trace")
    real = longest_microbatch.applies
    times = {"with the longest microbatch": [], "without it (two steps)": []}
    for i in range(a.repeats):
        for arm in (list(times) if i % 2 == 0 else list(times)[::-1]):
            longest_microbatch.applies = real if arm.startswith("with") else (lambda r: False)
            t = time.process_time()
            out = proof.probe_environment(run.path)
            times[arm].append(time.process_time() - t)
            print(f"repeat {i} {arm}: {times[arm][-1]:.3f} s CPU, steps {out['steps']}"
                  + (f", longest microbatch of step {out['longest_microbatch']['step']}"
                     if out.get("longest_microbatch") else ""), flush=True)
    longest_microbatch.applies = real
    for arm, ts in times.items():
        print(f"{arm}: min {min(ts):.3f} s, median {sorted(ts)[len(ts) // 2]:.3f} s CPU")


if __name__ == "__main__":
    main()
