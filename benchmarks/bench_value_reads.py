"""Recording with a watched logging callback: the value-read monitor (hf_unlearn.trace.value_reads) on vs off, arms
alternating in one process, 7 pairs of a 16-step tiny GQA Llama recording; prints the ratio of the medians.

Run from the repository root: ``python benchmarks/bench_value_reads.py`` (needs the TOFU rows the tests read)."""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import TrainerCallback  # noqa: E402

import hf_unlearn.trace.guards as guards  # noqa: E402
from hf_unlearn.trace.recorder import program  # noqa: E402
from tests.test_trace_common import config_model, get_trace_data, record  # noqa: E402


class Off(contextlib.nullcontext):
    """The monitor switched off: notes nothing."""

    first = None

    def __enter__(self):
        return self


class Logs(TrainerCallback):
    """A script's logging callback (watched: replays do not run on_log); it can reach the model."""

    def on_step_end(self, args, state, control, model=None, **kw):
        self.n = state.global_step

    def on_log(self, args, state, control, logs=None, model=None, **kw):
        self.last = dict(logs or {})


def main(pairs: int = 7) -> None:
    tok, data = get_trace_data()
    data = data.select(range(64))
    saved = (guards.ValueReads, program.ValueReads, program.mark_logged)
    times: dict[str, list[float]] = {"monitor": [], "off": []}
    for rep in range(pairs):
        for arm in ("monitor", "off"):
            if arm == "off":
                guards.ValueReads = program.ValueReads = Off
                program.mark_logged = lambda *a, **k: []
            out = Path(f"/tmp/hfu_bench_value_reads/{arm}{rep}")
            shutil.rmtree(out, ignore_errors=True)
            t = time.perf_counter()
            record(tok, data, out, model=config_model("llama", tok), every=4, gradient_accumulation_steps=1,
                   max_steps=16, logging_steps=1, trainer_kwargs={"callbacks": [Logs()], "trace_self_check": False})
            times[arm].append(time.perf_counter() - t)
            guards.ValueReads, program.ValueReads, program.mark_logged = saved
    for k, v in times.items():
        print(k, [round(x, 2) for x in v])
    mid = pairs // 2
    print("ratio monitor/off (medians):", round(sorted(times["monitor"])[mid] / sorted(times["off"])[mid], 3))


if __name__ == "__main__":
    main()
