"""Recording with a watched logging callback: the value-read monitor (hf_unlearn.trace.value_reads) on vs off, arms
alternating in one process, 7 pairs of a 16-step tiny GQA Llama recording; prints the ratio of the medians.
``--per-event``: one watched event of a callback that counts and lists its parameters (a 30-layer model, 60
tensors) under the monitor with its escape hooks (hf_unlearn.trace.mode_escapes), without them, and with no monitor.

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


def per_event(reps: int = 7, events: int = 300) -> None:
    import torch

    from hf_unlearn.trace import mode_escapes
    from hf_unlearn.trace.value_reads import ValueReads

    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(30)])

    def on_log(logs):  # a logging callback's event: parameter count and shapes
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return {**logs, "n": n, "shapes": [tuple(p.shape) for p in model.parameters()]}

    start = mode_escapes.EscapeWatch.start
    times: dict[str, list[float]] = {"hooks": [], "no hooks": [], "no monitor": []}
    for _ in range(reps):
        for arm in times:
            mode_escapes.EscapeWatch.start = (lambda self: None) if arm == "no hooks" else start
            t = time.perf_counter()
            for _ in range(events):
                with contextlib.nullcontext() if arm == "no monitor" else ValueReads() as reads:
                    on_log({"loss": 1.0})
                assert reads is None or reads.first is None, reads.first
            times[arm].append((time.perf_counter() - t) / events * 1e6)
    mode_escapes.EscapeWatch.start = start
    mid = {k: sorted(v)[reps // 2] for k, v in times.items()}
    print("us per event (medians):", {k: round(v, 1) for k, v in mid.items()})
    print("ratio hooks/no hooks:", round(mid["hooks"] / mid["no hooks"], 2), "extra us per parameter visited:",
          round((mid["hooks"] - mid["no hooks"]) / 120, 1))


if __name__ == "__main__":
    per_event() if "--per-event" in sys.argv else main()
